"""Gated MLPs (SwiGLU, GeGLU, ReGLU) with attention heads only: the choice of construction and its error bound.

A gated neuron computes ``post = act(g)·u (+ b_post)`` with ``g = LN(x)·W_gate + b_gate`` and ``u = LN(x)·W_in + b_in``.
lens_aot builds it from two layers of heads (beyond the paper, which covers plain MLPs only):

* **gate heads** (Theorem 3, :class:`~lens_aot.core.components.NeuronAttention` in scratch mode) write
  ``h = fit(g) ≈ act(g)`` to a scratch residual channel that no normalization reads;
* **product heads** (:class:`~lens_aot.core.components.ProductAttention`), two per neuron, turn ``h`` and ``u`` into
  ``(2/ε)·h·tanh(ε·u/2)`` and clear the scratch channel.

Error bound, for every input (``|(2/ε)·tanh(εu/2) − u| ≤ ε²|u|³/12`` and ``|act(g)| ≤ |g|`` for SiLU, GELU, ReLU):

    |post − post_source| ≤ |u|·δ + (|g| + δ)·ε²·|u|³/12

with ``δ`` the gate fit's error (0 for SiLU). After LayerNorm or RMSNorm the normalized input has norm at most
``sqrt(d_model)``, so ``|u| ≤ U_n`` and ``|g| ≤ G_n`` with per-neuron constants read off the weights
(:func:`normalized_input_bound`). :func:`gated_fit` picks the gate fit and a per-neuron ``ε_n`` so the bound is at most
``max_neuron_error`` over *all* inputs: half the budget for the fit (none for SiLU), the rest for the product.

Squared ReLU (``relu2(z) = relu(z)·z``) is the gated neuron whose gate and linear branch are one projection
(``W_gate = W_in``) with a ReLU gate: the same construction and bound with ``g = u``. A *gated* squared ReLU,
``relu(g)²·u``, chains the two: the squared-ReLU construction writes ``relu(g)²`` to the scratch and a second
product pair multiplies it by ``u`` (:func:`chained_gated_fit`, :class:`ChainedGatedFit`).

**No normalization before the MLP** (OLMo-2/3, FlexOLMo, EXAONE 4: post-norm blocks). The input is then the raw
residual, whose norm no normalization bounds. :class:`RangedInput` stands for the missing norm with a certified
radius ``‖x‖ ≤ R`` of the MLP's input (:func:`lens_aot.core.check.residual_bound.mlp_input_radii`, or the caller's
``max_residual_norm``), so ``|u_n| ≤ R·‖W_in[:, n]‖ + |b_in[n]| = U_n`` and likewise ``G_n``, and the bound above holds
for every input in that range. The fit then records ``U_n`` and ``H_n = G_n + δ`` (:attr:`GatedFit.u_range`,
:attr:`GatedFit.h_range`): the product heads check at run time that ``|u_n| ≤ U_n`` and ``|h_n| ≤ H_n`` and raise
:class:`~lens_aot.errors.InputRangeError` otherwise, so no output beyond the stated bound is returned silently.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor

from lens_aot.core.fit.activations import PRODUCT_ACTIVATIONS, ActivationFit, activation_fit, canonical_activation
from lens_aot.core.spec.model_spec import MLPSpec, NormSpec
from lens_aot.errors import UnsupportedArchitectureError

DEFAULT_MAX_GATED_NEURON_ERROR = 1e-4
# The smallest product scale ε_n built (float32's normal range ends near 1.2e-38; u·ε/2 must stay far above it).
MIN_PRODUCT_SCALE = 1e-24

# Gated-MLP spec types with a fit of their own, which :func:`gated_fit` uses for them: spec type ->
# fit(mlp, norm, max_neuron_error, heads_per_neuron). A variant's descriptor adds its row
# (:func:`lens_aot.core.variants.register_variant`; GPT-OSS's clamped SwiGLU), so this module imports no variant.
GATED_FITS: dict[type, Callable[..., GatedFit]] = {}


@dataclass(frozen=True)
class GatedFit:
    """How one gated MLP layer is built: the gate's activation fit and each neuron's product scale ``ε_n``.

    ``max_error`` bounds ``|post − post_source|`` per neuron over all inputs (module docstring). A neuron has
    ``gate.n_terms`` gate heads and 2 product heads.
    """

    act_fn: str
    gate: ActivationFit
    scales: tuple[float, ...]
    max_error: float
    # Without a norm before the MLP (RangedInput): the certified input range per neuron, |u_n| ≤ u_range[n] and
    # |h_n| ≤ h_range[n], which the product heads check at run time; the source layer and the residual radius R
    # it came from (for the error message). None: the bound holds for every input (a norm bounds it).
    u_range: tuple[float, ...] | None = None
    h_range: tuple[float, ...] | None = None
    layer: int | None = None
    radius: float | None = None

    @property
    def n_terms(self) -> int:
        return self.gate.n_terms + 2


@dataclass
class RangedInput(NormSpec):
    """No normalization before the MLP (``kind`` None), but an input of norm at most ``radius`` (``‖x‖₂`` of each
    position's residual as the MLP reads it): certified from the weights, or the caller's ``max_residual_norm``.
    ``layer`` is the source layer, for messages."""

    radius: float = math.inf
    layer: int | None = None


def require_norm(norm: NormSpec, refusal: str, supported: str) -> None:
    """Refuse an MLP whose product heads' error grows with its input when it has no normalization before it
    (``norm`` of kind None, or a :class:`RangedInput`): ``refusal`` says what it is and how its error grows, then
    what is ``supported``."""
    if isinstance(norm, RangedInput) or norm.kind is None:
        raise UnsupportedArchitectureError(
            f"{refusal}, so it needs the bounded input a LayerNorm / RMSNorm gives. Supported: {supported}."
        )


def gated_tolerance(max_neuron_error: float | None) -> float:
    """A gated MLP's per-neuron bound: ``max_neuron_error``, default :data:`DEFAULT_MAX_GATED_NEURON_ERROR`; refused
    unless positive (it sets the product scale)."""
    tol = DEFAULT_MAX_GATED_NEURON_ERROR if max_neuron_error is None else float(max_neuron_error)
    if not tol > 0:
        raise ValueError(f"max_neuron_error must be > 0 for gated MLPs (it sets the product scale); got {tol}.")
    return tol


def gate_and_input_bounds(
    norm: NormSpec, mlp: MLPSpec
) -> tuple[Float[Tensor, " d_mlp"], Float[Tensor, " d_mlp"], float]:
    """A gated MLP's per-neuron bounds after ``norm`` (:func:`normalized_input_bound`): ``|g_n| ≤ G_n`` on its gate
    projection, ``|u_n| ≤ U_n`` on its input projection, and ``max U`` (at least 1e-30)."""
    assert mlp.W_gate is not None
    g_bound = normalized_input_bound(norm, mlp.W_gate, mlp.b_gate)
    u_bound = normalized_input_bound(norm, mlp.W_in, mlp.b_in)
    return g_bound, u_bound, max(float(u_bound.max()) if u_bound.numel() else 0.0, 1e-30)


BOUND_BLOCK_BYTES = 8 << 20  # float64 bytes of one block of neurons in normalized_input_bound


def normalized_input_bound(
    norm: NormSpec, W: Float[Tensor, "d_model d_mlp"], b: Float[Tensor, " d_mlp"] | None
) -> Float[Tensor, " d_mlp"]:
    """``max |norm(x)·W[:, n] + b[n]|`` over all residuals ``x``, per neuron (float64).

    ``norm(x) = x̂·w + b_norm`` where ``x̂`` (centred for LayerNorm) has ``‖x̂‖ ≤ sqrt(d_model)``; by Cauchy–Schwarz
    the bound is ``sqrt(d_model)·‖w ⊙ W[:, n]‖ + |b_norm·W[:, n] + b[n]|`` (for LayerNorm ``x̂ ⊥ 1``, so the mean of
    ``w ⊙ W[:, n]`` is removed first).

    Computed in blocks of neurons (:data:`BOUND_BLOCK_BYTES` of float64 per block): each neuron's bound is its own
    column's, bitwise the same as over the whole matrix, and the float64 temporaries stay a few MB instead of four
    times ``W``'s float32 bytes (convert's peak memory).
    """
    step = max(1, BOUND_BLOCK_BYTES // (8 * max(1, W.shape[0])))
    if W.shape[1] > step:
        return torch.cat(
            [
                normalized_input_bound(norm, W[:, i : i + step], None if b is None else b[i : i + step])
                for i in range(0, W.shape[1], step)
            ]
        )
    if isinstance(norm, RangedInput) and math.isfinite(norm.radius):
        W64 = W.detach().to(torch.float64)
        bias = W64.new_zeros(W64.shape[1]) if b is None else b.detach().to(torch.float64).abs()
        return norm.radius * W64.norm(dim=0) + bias
    if norm.kind is None:
        raise UnsupportedArchitectureError(
            "a gated MLP without a normalization layer before it has unbounded inputs, so its product heads have no "
            "error bound. Supported: gated MLPs after LayerNorm or RMSNorm (LN, LNPre, RMS, RMSPre); plain MLPs "
            "with any normalization or none."
        )
    W64 = W.detach().to(torch.float64)
    scaled = W64 * norm.w.detach().to(torch.float64)[:, None] if norm.w is not None else W64
    if norm.kind in ("LN", "LNPre"):
        scaled = scaled - scaled.mean(0, keepdim=True)
    offset = torch.zeros(W64.shape[1], dtype=torch.float64, device=W64.device)
    if norm.b is not None:
        offset = offset + norm.b.detach().to(torch.float64) @ W64
    if b is not None:
        offset = offset + b.detach().to(torch.float64)
    return math.sqrt(W64.shape[0]) * scaled.norm(dim=0) + offset.abs()


def gated_fit(
    mlp: MLPSpec, norm: NormSpec, max_neuron_error: float | None = None, heads_per_neuron: int | None = None
) -> GatedFit:
    """Choose the gate fit and product scales for a gated MLP so each neuron's error is ≤ ``max_neuron_error``.

    Args:
        mlp: the gated MLP (``mlp.W_gate`` set).
        norm: the normalization before it (bounds its inputs).
        max_neuron_error: bound on ``|post − post_source|`` per neuron, over all inputs (default 1e-4).
        heads_per_neuron: GELU gates: use exactly this many gate heads per neuron.
    """
    own_fit = next((fit for kind, fit in GATED_FITS.items() if isinstance(mlp, kind)), None)
    if own_fit is not None:  # e.g. GPT-OSS: exact gate head, clamped inputs (lens_aot.core.fit.clamped_swiglu)
        return own_fit(mlp, norm, max_neuron_error, heads_per_neuron)
    source_act = canonical_activation(mlp.act_fn)
    if source_act in PRODUCT_ACTIVATIONS:
        if mlp.gated:  # relu(g)²·u: a chained product (ChainedGatedFit)
            return chained_gated_fit(mlp, norm, max_neuron_error, heads_per_neuron)
        # relu2(z) = relu(z)·z: a gated neuron whose gate and linear branch are the same projection
        mlp = MLPSpec(mlp.W_in, mlp.b_in, mlp.W_out, mlp.b_out, PRODUCT_ACTIVATIONS[source_act], mlp.W_in, mlp.b_in)
    assert mlp.W_gate is not None
    tol = gated_tolerance(max_neuron_error)
    g_bound, u_bound, _ = gate_and_input_bounds(norm, mlp)
    return bounded_gated_fit(mlp.act_fn, g_bound, u_bound, norm, tol, heads_per_neuron, source_act=source_act)


def bounded_gated_fit(
    act_fn: str,
    g_bound: Float[Tensor, " d_mlp"],
    u_bound: Float[Tensor, " d_mlp"],
    norm: NormSpec,
    tol: float,
    heads_per_neuron: int | None = None,
    piece: str = "mlp",
    source_act: str | None = None,
) -> GatedFit:
    """:func:`gated_fit` given each neuron's certified bounds ``|g_n| ≤ G_n`` (``g_bound``) and ``|u_n| ≤ U_n``
    (``u_bound``, float64): the gate fit (error δ ≤ ``tol``/(2·max U)) and the scales ``ε_n`` that keep
    ``U_n·δ + (G_n + δ)·ε_n²·U_n³/12 ≤ tol`` (module docstring). Also used where ``u`` is no projection of the
    residual (Gemma 4's per-layer inputs, :mod:`lens_aot.core.fit.per_layer`); ``piece`` names it in errors;
    ``source_act``: the activation the fit records (squared ReLU's, default ``act_fn``)."""
    act = canonical_activation(act_fn)
    u_max = float(u_bound.max()) if u_bound.numel() else 0.0
    if act == "silu":
        gate = activation_fit("silu", heads_per_neuron=heads_per_neuron)
    else:
        target = tol / (2 * max(u_max, 1e-30))
        try:
            gate = activation_fit(act, max_neuron_error=target, heads_per_neuron=heads_per_neuron)
        except ValueError as err:
            if isinstance(norm, RangedInput):
                raise UnsupportedArchitectureError(
                    f"layer {norm.layer} {piece}: a gated {act} MLP without a normalization layer before it reads "
                    f"residuals of norm up to {norm.radius:.3g} (certified from the weights, or max_residual_norm), so "
                    f"|u| ≤ {u_max:.3g} and its gate's fit error δ must be ≤ {target:.2g}: {err} Pass a smaller "
                    f"lens_aot.convert(model, max_residual_norm=...) (inputs beyond it are refused at run time)."
                ) from None
            raise ValueError(
                f"gated {act}: the gate's fit error δ is multiplied by |u| ≤ {u_max:.3g} (this layer's linear-branch "
                f"bound), so max_neuron_error={tol:g} needs δ ≤ {target:.2g}: {err}"
            ) from None
        if gate.max_error * u_max > tol / 2 * (1 + 1e-12):
            raise ValueError(
                f"gated {act}: heads_per_neuron={heads_per_neuron} gives gate error {gate.max_error:.2g}, times "
                f"|u| ≤ {u_max:.3g} that exceeds max_neuron_error={tol:g}; use more heads or a larger bound."
            )
    delta = gate.max_error
    budget = (tol - u_bound * delta).clamp_min(tol / 2)
    h_bound = g_bound + delta
    denominator = (h_bound * u_bound.pow(3)).clamp_min(1e-300)
    scales = torch.sqrt(12.0 * budget / denominator).clamp(max=1.0)
    ranges: dict[str, object] = {}
    if isinstance(norm, RangedInput) and float(scales.min()) < MIN_PRODUCT_SCALE:
        raise UnsupportedArchitectureError(
            f"layer {norm.layer} {piece}: a gated MLP without a normalization layer before it reads residuals of norm "
            f"up to {norm.radius:.3g} (certified from the weights), so its product heads would need a scale ε "
            f"{float(scales.min()):.2g} below {MIN_PRODUCT_SCALE:g}, which float arithmetic cannot carry. Pass the "
            f"residual norm you need as lens_aot.convert(model, max_residual_norm=...) (inputs beyond it are refused "
            f"at run time)."
        )
    if isinstance(norm, RangedInput):
        ranges = dict(
            u_range=tuple(float(v) for v in u_bound.cpu()),
            h_range=tuple(float(v) for v in h_bound.cpu()),
            layer=norm.layer,
            radius=float(norm.radius),
        )
    return GatedFit(source_act or act, gate, tuple(float(s) for s in scales), tol, **ranges)  # type: ignore[arg-type]


@dataclass(frozen=True)
class ChainedGatedFit(GatedFit):
    """A gated squared-ReLU layer, ``post = relu(g)²·u (+ b_post)``: a chained product (module docstring of
    :func:`chained_gated_fit`). ``gate`` is the ReLU gate head's fit (error δ), ``square_scales`` the per-neuron
    ``ε'_n`` of the first product pair (``s ≈ relu(g)·g``, written to the scratch) and ``scales`` the ``ε_n`` of the
    second (``s·u``, written to the residual). A neuron has ``gate.n_terms`` gate heads, 2 square heads and 2 product
    heads."""

    square_scales: tuple[float, ...] = ()

    @property
    def n_terms(self) -> int:
        """Heads per neuron: the gate heads, the square pair and the product pair."""
        return self.gate.n_terms + 4


def chained_gated_fit(
    mlp: MLPSpec, norm: NormSpec, max_neuron_error: float | None = None, heads_per_neuron: int | None = None
) -> ChainedGatedFit:
    """The construction of a gated squared-ReLU MLP, ``post = relu(g)²·u``, and its certified per-neuron bound.

    ``relu(g)²`` is itself a product (``relu(g)·g``), so it is built by the ungated squared-ReLU construction with its
    output sent to the MLP's scratch instead of the residual, and a second product pair multiplies it by ``u``:

    1. a ReLU gate head writes ``r = g·σ(a·g)``, ``|r − relu(g)| ≤ δ = 0.2785/a``;
    2. the *square* pair (query ``±ε'·g``, value ``r``) writes ``s = (2/ε')·r·tanh(ε'g/2)`` to the scratch; with the
       gated bound (:func:`bounded_gated_fit` with ``u = g``) ``|s − relu(g)²| ≤ |g|·δ + (|g| + δ)·ε'²|g|³/12 ≤ Δ``;
    3. the product pair (query ``±ε·u``, value ``s``) writes ``(2/ε)·s·tanh(εu/2)``, so with
       ``|(2/ε)·tanh(εu/2) − u| ≤ ε²|u|³/12`` and ``|s| ≤ G² + Δ``::

           |post − relu(g)²·u| ≤ |u|·Δ + (G_n² + Δ)·ε_n²·U_n³/12.

    Half of ``max_neuron_error`` goes to each term: steps 1–2 are fitted to ``Δ = tol/(2·max U)`` and
    ``ε_n = sqrt(6·tol / ((G_n² + Δ)·U_n³))`` (at most 1). ``|g| ≤ G_n`` and ``|u| ≤ U_n`` after the norm
    (:func:`normalized_input_bound`); without a norm (:class:`RangedInput`) refused, as for the other squared-ReLU
    layers' growth in ``|g|⁴·|u|``.
    """
    assert mlp.W_gate is not None
    tol = gated_tolerance(max_neuron_error)
    require_norm(
        norm,
        f"a gated {mlp.act_fn} MLP (relu(g)²·u) without a normalization layer before it: its chained product's "
        f"error grows as |g|⁴·|u|",
        "gated squared-ReLU MLPs after LN, LNPre, RMS or RMSPre",
    )
    g_bound, u_bound, u_max = gate_and_input_bounds(norm, mlp)
    square_tol = tol / (2 * u_max)
    inner = bounded_gated_fit("relu", g_bound, g_bound, norm, square_tol, heads_per_neuron)
    s_bound = g_bound.pow(2) + square_tol
    denominator = (s_bound * u_bound.pow(3)).clamp_min(1e-300)
    scales = torch.sqrt(12.0 * (tol / 2) / denominator).clamp(max=1.0)
    return ChainedGatedFit(
        canonical_activation(mlp.act_fn),
        inner.gate,
        tuple(float(s) for s in scales),
        tol,
        square_scales=inner.scales,
    )


def chained_bound(
    fit: ChainedGatedFit, g_bound: Float[Tensor, " d_mlp"], u_bound: Float[Tensor, " d_mlp"]
) -> Float[Tensor, " d_mlp"]:
    """The per-neuron bound of :func:`chained_gated_fit`'s construction with the scales ``fit`` holds (float64), for
    ``|g_n| ≤ G_n`` (``g_bound``) and ``|u_n| ≤ U_n`` (``u_bound``): ``U·Δ + (G² + Δ)·ε²·U³/12`` with
    ``Δ = G·δ + (G + δ)·ε'²·G³/12``."""
    delta = fit.gate.max_error
    square = torch.tensor(fit.square_scales, dtype=torch.float64)
    scales = torch.tensor(fit.scales, dtype=torch.float64)
    g, u = g_bound.to(torch.float64), u_bound.to(torch.float64)
    inner = g * delta + (g + delta) * square.pow(2) * g.pow(3) / 12
    return u * inner + (g.pow(2) + inner) * scales.pow(2) * u.pow(3) / 12


def input_ranges(fit: GatedFit, like: Tensor) -> tuple[tuple[Tensor, Tensor] | None, str]:
    """``(U_n, H_n)`` of a fit with a certified input range (as tensors like ``like``; None without one) and a
    description of the range for :class:`~lens_aot.errors.InputRangeError`."""
    if fit.u_range is None or fit.h_range is None:
        return None, ""
    ranges = tuple(torch.tensor(r, dtype=like.dtype, device=like.device) for r in (fit.u_range, fit.h_range))
    layer = "" if fit.layer is None else f"layer {fit.layer} "
    where = f"{layer}mlp (residual norm ≤ {fit.radius:.4g})"
    return (ranges[0], ranges[1]), where
