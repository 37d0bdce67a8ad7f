"""Read an xIELU activation module's learned scalars (transformers' ``XIELUActivation``: Apertus) into an
:class:`~lens_aot.core.fit.xielu.XIELUSpec`.

The module stores ``alpha_p`` and ``alpha_n`` pre-softplus and ``beta`` / ``eps`` as buffers; its Python forward uses
``α_p = softplus(alpha_p)`` and ``α_n = beta + softplus(alpha_n)``, computed in the parameters' dtype. They are read
here by the same operations in that dtype (in float32 for a half module: its float32 check's), so the spec holds
exactly the values the source multiplies by.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lens_aot.core.fit.xielu import XIELUSpec
from lens_aot.core.spec.model_spec import MLPSpec
from lens_aot.errors import UnsupportedArchitectureError

_ACTIVATION_ATTRS = ("act_fn", "act", "activation_fn", "activation")


def xielu_module(module: Any) -> Any:
    """The xIELU activation module held by an MLP module (``act_fn`` / ``act`` / ...), or None."""
    for attr in _ACTIVATION_ATTRS:
        fn = getattr(module, attr, None)
        if all(hasattr(fn, name) for name in ("alpha_p", "alpha_n", "beta", "eps")):
            return fn
    return None


def xielu_scalars(act: Any) -> dict[str, float]:
    """``alpha_p``, ``alpha_n``, ``beta``, ``eps`` as the module's forward computes them (module docstring)."""
    with torch.no_grad():
        # A half module's scalars in float32 (exact), as its forward computes them once cast to float32: the float32
        # check's source (core/check/float32_blocks.py); the half model evaluates its fits in float32 too.
        dtype = torch.promote_types(act.alpha_p.dtype, torch.float32)
        beta = act.beta.detach().to(dtype)
        return {
            "alpha_p": float(F.softplus(act.alpha_p.detach().to(dtype)).reshape(-1)[0]),
            "alpha_n": float((beta + F.softplus(act.alpha_n.detach().to(dtype))).reshape(-1)[0]),
            "beta": float(beta.reshape(-1)[0]),
            "eps": float(act.eps.detach().reshape(-1)[0]),
        }


def read_xielu(spec: MLPSpec, module: Any, layer: int) -> XIELUSpec:
    """``spec`` (an MLP read with activation ``xielu``, plain or gated) with the scalars of ``module``'s xIELU
    activation."""
    act = xielu_module(module)
    if act is None:
        raise UnsupportedArchitectureError(
            f"layer {layer} mlp: activation 'xielu' in an MLP module of type {type(module).__name__} with no xIELU "
            f"module: lens_aot reads xIELU's learned scalars (alpha_p, alpha_n, beta, eps) from the activation module "
            f"of a plain MLP (Apertus's act_fn) only."
        )
    gates = {"W_gate": spec.W_gate, "b_gate": spec.b_gate, "b_post": spec.b_post}  # a gated MLP's (else None)
    return XIELUSpec(spec.W_in, spec.b_in, spec.W_out, spec.b_out, "xielu", **gates, **xielu_scalars(act))
