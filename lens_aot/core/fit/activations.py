"""MLP activations as sums of neuron heads: the *shifted-logistic* form of Theorem 3.

A neuron head of internal dimension 1 that attends to itself (score 0) and to a bias key (score ``-(b·z + d)``)
puts weight ``σ(b·z + d)`` on itself; with value ``α·z + β`` on itself and 0 on the bias key it writes
``(α·z + β)·σ(b·z + d)`` (Huben & Morris 2023, Theorem 3). An activation is therefore implemented by a list of
such terms, one head each:

* SiLU is one term ``(1, 0, 1, 0)``: exact.
* ReLU is one term ``(1, 0, a, 0)`` with a large sharpness ``a``: ``|z·σ(a·z) − relu(z)| ≤ 0.2785/a`` for all z.
* GELU (erf), gelu_new and gelu_fast are minimax fits with K terms (``fits_table.json``, made by
  ``scripts/fit_activations.py``); the table stores each fit's measured sup-norm error over ℝ.
* Squared ReLU (``relu2``: Nemotron, Arcee, Jais 2) is ``relu(z)·z``: a gated neuron whose gate and linear branch are
  the same projection, built from a ReLU gate head and two product heads (:func:`lens_aot.core.fit.gating.gated_fit`),
  not
  from a sum of logistics alone (:data:`PRODUCT_ACTIVATIONS`).
* xIELU (Apertus) has learned per-layer scalars: direct heads, a ReLU gate head and product heads per neuron
  (:func:`lens_aot.core.fit.xielu.xielu_fit`), with its certified bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from lens_aot.errors import UnsupportedActivationError

SUPPORTED_ACTIVATIONS = ("silu", "relu", "gelu", "gelu_new", "gelu_fast", "relu2", "xielu")
# Activations with learned scalars, built from the layer's own values (lens_aot.core.fit.xielu), not from a name alone.
PARAMETRISED_ACTIVATIONS = ("xielu",)
# Activations that are a product of the neuron's pre-activation with a gate of it: relu2(z) = relu(z)·z.
PRODUCT_ACTIVATIONS = {"relu2": "relu"}
FITTED_ACTIVATIONS = ("gelu", "gelu_new", "gelu_fast")
DEFAULT_MAX_NEURON_ERROR = {"relu": 1e-6, "gelu": 1e-4, "gelu_new": 1e-4, "gelu_fast": 1e-4}
# max over u > 0 of u·σ(−u), attained at u ≈ 1.27846: the ReLU error of z·σ(a·z) is at most this / a.
RELU_ERROR_CONSTANT = 0.2784645427610738

_ALIASES = {"swish": "silu", "gelu_pytorch_tanh": "gelu_new", "gelu_python": "gelu", "relu_2": "relu2",
            "relu_squared": "relu2"}  # fmt: skip


@dataclass(frozen=True)
class ActivationFit:
    """An activation written as ``Σ_k (α_k·z + β_k)·σ(b_k·z + d_k)``, one neuron head per term.

    ``max_error`` bounds ``|fit(z) − act(z)|`` over all real z (0.0 where the construction is exact).
    """

    act_fn: str
    alpha: tuple[float, ...]
    beta: tuple[float, ...]
    b: tuple[float, ...]
    d: tuple[float, ...]
    max_error: float

    @property
    def n_terms(self) -> int:
        return len(self.alpha)

    def __call__(self, z: Float[Tensor, "*shape"]) -> Float[Tensor, "*shape"]:
        """Evaluate the fit (as the neuron heads compute it, summed over a neuron's heads)."""
        out = torch.zeros_like(z)
        for alpha, beta, b, d in zip(self.alpha, self.beta, self.b, self.d, strict=True):
            out = out + (alpha * z + beta) * torch.sigmoid(b * z + d)
        return out


def canonical_activation(act_fn: str | None) -> str:
    """Return the canonical name of a supported activation, or raise a clear error."""
    name = _ALIASES.get(str(act_fn), str(act_fn))
    if name in SUPPORTED_ACTIVATIONS:
        return name
    if name.startswith("solu"):
        raise UnsupportedActivationError(
            f"activation {act_fn!r} (SoLU) normalises across neurons (x·softmax(x) over the MLP width), so one "
            f"neuron is not a function of its own pre-activation and has no neuron-head construction. "
            f"Supported activations: {', '.join(SUPPORTED_ACTIVATIONS)}."
        )
    raise UnsupportedActivationError(
        f"activation {act_fn!r} has no neuron-head construction. Supported activations: "
        f"{', '.join(SUPPORTED_ACTIVATIONS)} (SiLU exact, ReLU by a sharp logistic, GELU variants by a multi-head "
        f"shifted-logistic fit)."
    )


def reference_activation(act_fn: str, z: Float[Tensor, "*shape"]) -> Float[Tensor, "*shape"]:
    """The activation as TransformerLens computes it, for measuring fits."""
    name = canonical_activation(act_fn)
    if name in PARAMETRISED_ACTIVATIONS:
        raise ValueError(
            f"{name} has learned scalars: evaluate it with lens_aot.core.fit.xielu.xielu (the layer's values)"
        )
    if name == "silu":
        return F.silu(z)
    if name == "relu":
        return F.relu(z)
    if name == "relu2":
        return torch.square(F.relu(z))
    if name == "gelu":
        return F.gelu(z)
    if name == "gelu_new":
        return 0.5 * z * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * torch.pow(z, 3.0))))
    return 0.5 * z * (1.0 + torch.tanh(z * 0.7978845608 * (1.0 + 0.044715 * z * z)))


def available_fits(act_fn: str) -> list[tuple[int, float]]:
    """``(heads per neuron, sup-norm error)`` for each stored fit of a GELU-family activation."""
    from lens_aot.core.fit.fits_table import FITS

    return [(k + 1, err) for k, (err, _) in enumerate(FITS[canonical_activation(act_fn)])]


def activation_fit(
    act_fn: str,
    max_neuron_error: float | None = None,
    heads_per_neuron: int | None = None,
) -> ActivationFit:
    """Choose the neuron-head construction for ``act_fn``.

    Args:
        act_fn: the MLP activation (``silu``, ``relu``, ``gelu``, ``gelu_new``, ``gelu_fast``).
        max_neuron_error: bound on ``|fit(z) − act(z)|`` over all z. For ReLU it sets the sharpness
            ``a = 0.2785 / max_neuron_error``; for GELU variants the fewest heads that meet it are used.
            Defaults: ReLU 1e-6, GELU variants 1e-4. Ignored for SiLU, which is exact.
        heads_per_neuron: GELU variants only: use exactly this many heads per neuron (1 gives the best single-head
            fit). Overrides ``max_neuron_error``.
    """
    name = canonical_activation(act_fn)
    if name in PARAMETRISED_ACTIVATIONS:
        raise ValueError(
            f"{name} has learned per-layer scalars: its neurons are built by lens_aot.core.fit.xielu.xielu_fit "
            f"from the layer's spec (an XIELUSpec), not from its name."
        )
    if name in PRODUCT_ACTIVATIONS:
        raise ValueError(
            f"{name} is a product of the pre-activation with a {PRODUCT_ACTIVATIONS[name]} gate of it: its neurons "
            f"are built by lens_aot.core.fit.gating.gated_fit (gate heads and product heads), not by a sum of "
            f"logistics."
        )
    if name == "silu":
        if heads_per_neuron not in (None, 1):
            raise ValueError(f"SiLU is exact with one head per neuron; got heads_per_neuron={heads_per_neuron}.")
        return ActivationFit(name, (1.0,), (0.0,), (1.0,), (0.0,), 0.0)
    if name == "relu":
        if heads_per_neuron not in (None, 1):
            raise ValueError(f"ReLU uses one sharp head per neuron; got heads_per_neuron={heads_per_neuron}.")
        eps = DEFAULT_MAX_NEURON_ERROR["relu"] if max_neuron_error is None else max_neuron_error
        if not eps > 0:
            raise ValueError(f"max_neuron_error must be > 0 for ReLU (it sets the sharpness); got {eps}.")
        sharpness = RELU_ERROR_CONSTANT / eps
        return ActivationFit(name, (1.0,), (0.0,), (sharpness,), (0.0,), eps)

    from lens_aot.core.fit.fits_table import FITS

    table = FITS[name]
    if heads_per_neuron is not None:
        if not 1 <= heads_per_neuron <= len(table):
            raise ValueError(
                f"heads_per_neuron for {name} must be between 1 and {len(table)} (the stored fits); "
                f"got {heads_per_neuron}."
            )
        err, terms = table[heads_per_neuron - 1]
    else:
        eps = DEFAULT_MAX_NEURON_ERROR[name] if max_neuron_error is None else max_neuron_error
        chosen = next(((e, t) for e, t in table if e <= eps), None)
        if chosen is None:
            raise ValueError(
                f"no stored {name} fit reaches max_neuron_error={eps:g}; the best uses {len(table)} heads per "
                f"neuron with error {table[-1][0]:.2g}. Pass a larger max_neuron_error or heads_per_neuron."
            )
        err, terms = chosen
    alpha, beta, b, d = (tuple(float(t[i]) for t in terms) for i in range(4))
    return ActivationFit(name, alpha, beta, b, d, float(err))
