"""xIELU (Huang & Schlag 2024; Apertus) as neuron heads, with a certified per-neuron error bound.

transformers' ``XIELUActivation`` computes, with learned per-layer scalars (``α_p = softplus(a_p)``,
``α_n = β + softplus(a_n)``, ``β`` and ``eps`` buffers, all in the module's dtype)::

    xielu(z) = α_p·z² + β·z                          for z > 0
               α_n·(expm1(min(z, eps)) − z) + β·z    for z ≤ 0

lens_aot writes it as three pieces, each built by machinery with its own certified bound (beyond the paper):

* ``β·z``: one neuron head with query slope 0 and shift 0, so its weight on itself is ``σ(0) = 1/2`` exactly and its
  value ``2β·z`` gives ``β·z`` with no error (Theorem 3 with ``b = d = 0``);
* ``α_p·relu(z)·z`` (the squared-ReLU piece, :mod:`lens_aot.core.fit.gating`): a sharp-logistic gate head writes
  ``h = α_p·z·σ(a·z)``, ``|h − α_p·relu(z)| ≤ α_p·0.2785/a =: δ_g``, and two product heads turn ``h`` and ``u = z``
  into ``(2/ε)·h·tanh(ε·z/2)``; the gated bound gives ``|z|·δ_g + (α_p|z| + δ_g)·ε²|z|³/12``;
* ``α_n·N(z)`` with ``N(z) = (expm1(z) − z)·[z ≤ 0]``: K neuron heads ``Σ_k (α_k z + β_k)·σ(b_k z + d_k)`` whose sup
  error over all of ℝ, ``δ_N``, is certified (:data:`NEGATIVE_FITS`, ``xielu_fit.json``, written by
  ``scripts/fit_xielu.py``: grid plus a global second-derivative bound per cell and an analytic tail bound).

The clamp ``min(z, eps)`` differs from ``z`` only for ``eps < z ≤ 0`` (when ``eps < 0``), where
``|expm1(eps) − expm1(z)| ≤ |expm1(eps)|``; it is not built, it is bounded: ``j = |expm1(min(eps, 0))|`` (the source
jumps by ``α_n·expm1(eps)`` at 0, which no continuous construction can follow better than ``j/2``). So every neuron's
``|post − xielu(z)|`` is at most::

    α_n·(δ_N + j) + U_n·δ_g + (α_p·U_n + δ_g)·ε_n²·U_n³/12

with ``U_n`` the certified bound on ``|z_n|`` after the norm (:func:`~lens_aot.core.fit.gating.normalized_input_bound`).
:func:`xielu_fit` picks K, ``a`` and ``ε_n`` so this is at most ``max_neuron_error``: at most 70% of the budget for
``α_n·(δ_N + j)``, 10% for the gate, the rest for the product.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources

import torch
from jaxtyping import Float
from torch import Tensor

from lens_aot.core.fit.activations import RELU_ERROR_CONSTANT, ActivationFit
from lens_aot.core.fit.gating import (
    DEFAULT_MAX_GATED_NEURON_ERROR,
    gate_and_input_bounds,
    normalized_input_bound,
    require_norm,
)
from lens_aot.core.spec.fields import saved
from lens_aot.core.spec.model_spec import MLPSpec, NormSpec

DEFAULT_MAX_XIELU_NEURON_ERROR = DEFAULT_MAX_GATED_NEURON_ERROR
# Shares of max_neuron_error: the negative branch (fit + clamp) and the gate head; the product heads get the rest.
NEGATIVE_SHARE = 0.7
GATE_SHARE = 0.1

Term = tuple[float, float, float, float]


def _load() -> dict[int, tuple[float, tuple[Term, ...]]]:
    doc = json.loads(resources.files(__package__).joinpath("xielu_fit.json").read_text(encoding="utf-8"))
    return {
        int(fit["heads"]): (float(fit["error"]), tuple((a, b, c, d) for a, b, c, d in fit["terms"]))
        for fit in doc["fits"]
    }


# NEGATIVE_FITS[K] = (certified sup_z |Σ_k (α_k z + β_k)·σ(b_k z + d_k) − N(z)|, the K terms),
# N(z) = (expm1(z) − z)·[z ≤ 0]
NEGATIVE_FITS: dict[int, tuple[float, tuple[Term, ...]]] = _load()


@dataclass
class XIELUSpec(MLPSpec):
    """A plain MLP with transformers' xIELU activation: ``post = xielu(x·W_in + b_in)`` (module docstring), its
    effective scalars as the source computes them (``alpha_p = softplus(a_p)``, ``alpha_n = beta + softplus(a_n)``,
    in the source's dtype, kept as the exact floats)."""

    alpha_p: float = saved("float", 0.0)
    alpha_n: float = saved("float", 0.0)
    beta: float = saved("float", 0.0)
    eps: float = saved("float", 0.0)


def xielu(
    z: Float[Tensor, "*shape"], alpha_p: float, alpha_n: float, beta: float, eps: float
) -> Float[Tensor, "*shape"]:
    """transformers' ``XIELUActivation._xielu_python`` with its effective scalars, in ``z``'s dtype."""
    a_p, a_n, b, e = (torch.tensor(v, dtype=z.dtype, device=z.device) for v in (alpha_p, alpha_n, beta, eps))
    return torch.where(z > 0, a_p * z * z + b * z, (torch.expm1(torch.min(z, e)) - z) * a_n + b * z)


@dataclass(frozen=True)
class XIELUFit:
    """How one xIELU layer is built: its scalars, the direct heads (``β·z`` and ``α_n·N(z)``, an
    :class:`ActivationFit`), the ReLU gate head (``≈ α_p·relu(z)``), each neuron's product scale ``ε_n``, and
    ``max_error``, the certified bound on ``|post − xielu(z)|`` per neuron over all inputs (module docstring)."""

    alpha_p: float
    alpha_n: float
    beta: float
    eps: float
    direct: ActivationFit
    gate: ActivationFit
    scales: tuple[float, ...]
    max_error: float
    act_fn: str = "xielu"

    @property
    def n_terms(self) -> int:
        """Heads per neuron: the direct heads, the gate head and the two product heads."""
        return self.direct.n_terms + self.gate.n_terms + 2


@dataclass(frozen=True)
class GatedXIELUFit(XIELUFit):
    """A gated xIELU layer, ``post = xielu(g)·u (+ b_post)`` (:func:`gated_xielu_fit`): the fields of
    :class:`XIELUFit` build ``xielu(g)`` into the MLP's scratch (their ``scales`` are the square pair's ``ε'_n``,
    ``relu(g)·g``), and ``product_scales`` are the ``ε_n`` of the product pair that multiplies it by ``u``."""

    product_scales: tuple[float, ...] = ()

    @property
    def n_terms(self) -> int:
        """Heads per neuron: the direct heads, the gate head, the square pair and the product pair."""
        return self.direct.n_terms + self.gate.n_terms + 4


def gated_xielu_fit(
    mlp: XIELUSpec,
    norm: NormSpec,
    max_neuron_error: float | None = None,
    heads_per_neuron: int | None = None,
    layer: int | None = None,
) -> GatedXIELUFit:
    """The construction of a gated xIELU MLP, ``post = xielu(g)·u``, and its certified per-neuron bound.

    ``xielu(g)`` is built as the ungated xIELU layer builds it (:func:`xielu_fit` on the gate's projection), but
    written to the MLP's scratch: direct heads ``β·g + α_n·N(g)``, a ReLU gate head ``r ≈ α_p·relu(g)`` and a square
    pair ``r·g``; its error is at most ``Δ`` (that fit's ``max_error``). A product pair multiplies the sum ``s`` by
    ``u``; with ``|(2/ε)·tanh(εu/2) − u| ≤ ε²|u|³/12`` and ``|s| ≤ X_n + Δ``, where
    ``|xielu(g)| ≤ X_n = α_p·G_n² + |β|·G_n + α_n·(2·G_n + |eps|)`` (``|expm1(min(g, eps))| ≤ |g| + |eps|``)::

        |post − xielu(g)·u| ≤ |u|·Δ + (X_n + Δ)·ε_n²·U_n³/12.

    Half of ``max_neuron_error`` goes to each term: ``Δ ≤ tol/(2·max U)`` and
    ``ε_n = sqrt(6·tol / ((X_n + Δ)·U_n³))`` (at most 1). Default ``max_neuron_error``: 1e-4, or what the best stored
    negative-branch fit needs (``2·max U·(α_n·δ_N + α_n·|expm1(eps)|) / NEGATIVE_SHARE``), as for :func:`xielu_fit`.
    """
    where = f"layer {layer} mlp" if layer is not None else "mlp"
    assert mlp.W_gate is not None
    require_norm(
        norm,
        f"{where}: a gated xIELU MLP with no normalization before it: its chained product's error grows as |g|⁴·|u|",
        "gated xIELU MLPs after LayerNorm or RMSNorm",
    )
    scalars = dict(alpha_p=mlp.alpha_p, alpha_n=mlp.alpha_n, beta=mlp.beta, eps=mlp.eps)
    b_gate = mlp.W_gate.new_zeros(mlp.W_gate.shape[1]) if mlp.b_gate is None else mlp.b_gate
    gate = XIELUSpec(mlp.W_gate, b_gate, mlp.W_out, mlp.b_out, mlp.act_fn, **scalars)
    g_bound, u_bound, u_max = gate_and_input_bounds(norm, mlp)
    if max_neuron_error is None:
        best = mlp.alpha_n * (NEGATIVE_FITS[max(NEGATIVE_FITS)][0] + clamp_error(mlp.eps))
        tol = max(DEFAULT_MAX_XIELU_NEURON_ERROR, 2 * u_max * best / NEGATIVE_SHARE)
    else:
        tol = float(max_neuron_error)
    if not tol > 0:
        raise ValueError(f"max_neuron_error must be > 0 for gated xIELU MLPs (it sets the product scale); got {tol}.")
    inner = xielu_fit(gate, norm, tol / (2 * u_max), heads_per_neuron, layer)
    delta = inner.max_error
    x_bound = mlp.alpha_p * g_bound.pow(2) + abs(mlp.beta) * g_bound + mlp.alpha_n * (2 * g_bound + abs(mlp.eps))
    denominator = ((x_bound + delta) * u_bound.pow(3)).clamp_min(1e-300)
    scales = torch.sqrt(12.0 * (tol / 2) / denominator).clamp(max=1.0)
    bound = u_bound * delta + (x_bound + delta) * scales.pow(2) * u_bound.pow(3) / 12
    return GatedXIELUFit(
        **scalars,
        direct=inner.direct,
        gate=inner.gate,
        scales=inner.scales,
        max_error=float(bound.max()) if bound.numel() else tol,
        product_scales=tuple(float(s) for s in scales),
    )


def clamp_error(eps: float) -> float:
    """``|expm1(min(eps, 0))|``: the most the clamp ``min(z, eps)`` moves ``expm1`` on ``z ≤ 0``."""
    return abs(math.expm1(min(eps, 0.0)))


def direct_fit(alpha_n: float, beta: float, terms: tuple[Term, ...], error: float) -> ActivationFit:
    """``β·z`` (one exact head: value ``2β·z``, weight ``σ(0) = 1/2``) plus ``α_n·N(z)`` (the stored terms, scaled)."""
    alphas = (2.0 * beta, *(alpha_n * t[0] for t in terms))
    betas = (0.0, *(alpha_n * t[1] for t in terms))
    return ActivationFit(
        "xielu", alphas, betas, (0.0, *(t[2] for t in terms)), (0.0, *(t[3] for t in terms)), abs(alpha_n) * error
    )


def xielu_fit(
    mlp: XIELUSpec,
    norm: NormSpec,
    max_neuron_error: float | None = None,
    heads_per_neuron: int | None = None,
    layer: int | None = None,
) -> XIELUFit:
    """Choose the negative branch's fit, the gate's sharpness and the product scales for an xIELU layer so that each
    neuron's error is at most ``max_neuron_error`` over every input the norm before it can give.

    Args:
        mlp: the layer's MLP with its scalars.
        norm: the normalization before it (bounds ``|z_n| ≤ U_n``).
        max_neuron_error: the per-neuron bound. Default: 1e-4, or (when this layer's ``α_n`` is too large for the best
            stored fit to meet it) ``(α_n·δ_N + α_n·|expm1(eps)|) / NEGATIVE_SHARE`` with the best fit.
        heads_per_neuron: use exactly this many heads for ``N(z)`` (one of the stored fits, ``NEGATIVE_FITS``).
        layer: the source layer, for messages.
    """
    where = f"layer {layer} mlp" if layer is not None else "mlp"
    if isinstance(mlp, XIELUSpec) and mlp.gated:  # xielu(g)·u: a chained product
        return gated_xielu_fit(mlp, norm, max_neuron_error, heads_per_neuron, layer)
    if not isinstance(mlp, XIELUSpec):
        raise TypeError(f"{where}: xielu_fit needs an XIELUSpec (the activation's scalars), got {type(mlp).__name__}")
    require_norm(
        norm,
        f"{where}: an xIELU MLP with no normalization before it: its α_p·relu(z)·z piece is built by product heads "
        f"whose error grows as |z|⁴",
        "xIELU MLPs after LayerNorm or RMSNorm (Apertus)",
    )
    if not (mlp.alpha_p >= 0 and mlp.alpha_n >= 0 and all(map(math.isfinite, (mlp.alpha_p, mlp.alpha_n, mlp.beta)))):
        raise ValueError(
            f"{where}: xIELU scalars alpha_p={mlp.alpha_p}, alpha_n={mlp.alpha_n}, beta={mlp.beta} are not finite "
            f"and non-negative (softplus makes alpha_p ≥ 0 and alpha_n ≥ beta): the source is corrupt."
        )
    jump = mlp.alpha_n * clamp_error(mlp.eps)
    k_best = max(NEGATIVE_FITS)
    if max_neuron_error is None:
        tol = max(DEFAULT_MAX_XIELU_NEURON_ERROR, (mlp.alpha_n * NEGATIVE_FITS[k_best][0] + jump) / NEGATIVE_SHARE)
    else:
        tol = float(max_neuron_error)
    if not tol > 0:
        raise ValueError(f"max_neuron_error must be > 0 for xIELU MLPs (it sets the product scale); got {tol}.")
    if heads_per_neuron is not None:
        if heads_per_neuron not in NEGATIVE_FITS:
            raise ValueError(
                f"heads_per_neuron for xIELU's negative branch must be one of {sorted(NEGATIVE_FITS)} (the stored "
                f"fits); got {heads_per_neuron}."
            )
        k = heads_per_neuron
    else:
        share = tol * NEGATIVE_SHARE
        k = next((k for k in sorted(NEGATIVE_FITS) if mlp.alpha_n * NEGATIVE_FITS[k][0] + jump <= share), k_best)
    err, terms = NEGATIVE_FITS[k]
    negative = mlp.alpha_n * err + jump
    if negative > tol * NEGATIVE_SHARE * (1 + 1e-12):
        raise ValueError(
            f"{where}: xIELU's negative branch α_n·(expm1(min(z, eps)) − z) with α_n={mlp.alpha_n:.4g}, "
            f"eps={mlp.eps:.3g} and {k} heads has error α_n·(δ_N + |expm1(eps)|) = {negative:.2g}, above "
            f"{NEGATIVE_SHARE:g}·max_neuron_error = {tol * NEGATIVE_SHARE:.2g} (the best stored fit has {k_best} "
            f"heads, δ_N = {NEGATIVE_FITS[k_best][0]:.2g}). Pass a larger max_neuron_error, more heads, or neither."
        )
    direct = direct_fit(mlp.alpha_n, mlp.beta, terms, err)
    u_bound = normalized_input_bound(norm, mlp.W_in, mlp.b_in)
    u_max = max(float(u_bound.max()) if u_bound.numel() else 0.0, 1e-30)
    # the gate head α_p·z·σ(a·z): error δ_g = α_p·0.2785/a, times |u| ≤ U: GATE_SHARE of the budget
    gate_error = min(tol * GATE_SHARE / u_max, max(mlp.alpha_p, 1e-30) * 1e-2)
    sharpness = RELU_ERROR_CONSTANT * max(mlp.alpha_p, 1e-30) / gate_error
    gate = ActivationFit("relu", (mlp.alpha_p,), (0.0,), (sharpness,), (0.0,), gate_error)
    budget = (tol - negative - u_bound * gate_error).clamp_min(tol * (1 - NEGATIVE_SHARE - GATE_SHARE))
    denominator = ((mlp.alpha_p * u_bound + gate_error) * u_bound.pow(3)).clamp_min(1e-300)
    scales = torch.sqrt(12.0 * budget / denominator).clamp(max=1.0)
    bound = negative + u_bound * gate_error + (mlp.alpha_p * u_bound + gate_error) * scales.pow(2) * u_bound.pow(3) / 12
    return XIELUFit(
        alpha_p=mlp.alpha_p,
        alpha_n=mlp.alpha_n,
        beta=mlp.beta,
        eps=mlp.eps,
        direct=direct,
        gate=gate,
        scales=tuple(float(s) for s in scales),
        max_error=float(bound.max()) if bound.numel() else negative,
    )
