"""Looking at heads: attention patterns with circuitsvis, neuron heads ranked by an activation statistic, and the
Fourier tools that read the modular-addition mechanism (Nanda et al. 2023) off neuron heads.

* :func:`head_patterns` / :func:`attention_patterns`: the patterns of any heads, neuron heads included, from a cache,
  as ``[head, query, key]`` or rendered by circuitsvis (``attention_heads`` / ``attention_patterns``), optionally
  with the neuron heads' **bias slot** shown as an extra first key (the weight each query gives it is
  ``1 − pattern.sum(-1)``). circuitsvis is imported only when rendering (``pip install circuitsvis``).
* :func:`head_statistic` / :func:`top_neuron_heads`: a statistic of every neuron head's activation (``hook_z`` by
  default: for a one-head neuron, the neuron's activation, ``cache["post", l]``) over a dataset, at a position or
  over all, and the top heads with their ``HeadOrigin``.
* :func:`fourier_basis`, :func:`frequency_norms`, :func:`frequency_shares_2d`: the Fourier basis over ``Z_p`` and
  the share of a vector's (or an ``(a, b)`` grid's) energy in each frequency.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformer_lens import ActivationCache

from lens_aot.analysis.checks import converted_only
from lens_aot.analysis.circuits.names import (
    HeadLike,
    SublayerLike,
    as_head_ref,
    head_hook,
    head_label,
    head_module,
    head_origin,
    neuron_sublayers,
    sublayer,
)
from lens_aot.core.components import Attention
from lens_aot.core.runtime.cache import LazyCacheDict
from lens_aot.core.runtime.model import AttentionOnlyTransformer, HeadOrigin, HeadRef, Sublayer
from lens_aot.errors import InputError

__all__ = [
    "HeadStat",
    "attention_patterns",
    "fourier_basis",
    "frequency_norms",
    "frequency_shares_2d",
    "head_patterns",
    "head_statistic",
    "neuron_sublayers",
    "top_neuron_heads",
]

SLOT_TOKEN = "[bias slot]"
Stat = Literal["max_abs", "max", "min", "mean", "mean_abs", "var", "std"]
_STATS: dict[str, Callable[[Tensor], Tensor]] = {
    "max_abs": lambda x: x.abs().amax(0),
    "max": lambda x: x.amax(0),
    "min": lambda x: x.amin(0),
    "mean": lambda x: x.mean(0),
    "mean_abs": lambda x: x.abs().mean(0),
    "var": lambda x: x.var(0, unbiased=False),
    "std": lambda x: x.std(0, unbiased=False),
}


# ---------------------------------------------------------------------------------------------------- patterns
def _is_derived(cache: Any, key: str) -> bool:
    """Whether ``key`` is computed on access in a compact cache (``lens_aot.core.runtime.cache``) rather than stored."""
    store = getattr(cache, "cache_dict", cache)
    return isinstance(store, LazyCacheDict) and key in store and all(k != key for k, _ in store.stored())


def _slot_heads(attn: Any) -> bool:
    """Heads that attend only to themselves and a memory slot (neuron, gate and product heads)."""
    return not isinstance(attn, Attention) and hasattr(attn, "k_bias")


def _pattern(aot: AttentionOnlyTransformer, cache: Any, ref: HeadRef, batch: int) -> Float[Tensor, "query key"]:
    """One head's ``hook_pattern`` for one batch element. A compact cache derives every head of a neuron-head module
    when ``hook_pattern`` is read, so for those the pattern is built for this head alone from ``hook_q``/``hook_k``:
    each query sees itself (score ``q·k/scale``) and the slot (``q·k_bias/scale``)."""
    attn = head_module(aot, sublayer(aot, ref.name))
    key = head_hook(ref, "hook_pattern")
    if not (_slot_heads(attn) and _is_derived(cache, key)):
        return cache[key][batch, ref.head]
    q = cache[head_hook(ref, "hook_q")][batch, :, ref.head]  # [pos, 1]
    k = cache[head_hook(ref, "hook_k")][batch, :, ref.head]
    scale = float(attn.attn_scale)
    scores = torch.stack([(q * k).sum(-1), q @ attn.k_bias[ref.head].to(q.dtype)], dim=-1) / scale
    return torch.diag_embed(torch.softmax(scores, dim=-1)[..., 0])


@converted_only
def head_patterns(
    aot: AttentionOnlyTransformer,
    cache: Any,
    heads: Sequence[HeadLike],
    *,
    batch: int = 0,
    bias_slot: bool = False,
) -> Float[Tensor, "head query key"]:
    """Attention patterns of ``heads`` (any sub-layers, neuron heads included) for batch element ``batch`` of ``cache``,
    stacked as ``[head, query, key]``. ``bias_slot`` prepends the bias slot as key 0 (weight ``1 − row sum``; 0 for
    heads without one) and as query 0 (attending to itself), so a neuron head's rows sum to 1 like any head's."""
    if len(heads) == 0:
        raise InputError("no heads given; pass e.g. aot.neuron_heads(layer, n), ['L0H3', 'L1N17.0'] or HeadRefs")
    refs = [as_head_ref(aot, h) for h in heads]
    if isinstance(cache, ActivationCache) and cache.has_batch_dim:  # derive compact entries for this element only
        cache = cache.apply_slice_to_batch_dim(slice(batch, batch + 1 or None))
        batch = 0
    with torch.no_grad():
        patterns = torch.stack([_pattern(aot, cache, ref, batch) for ref in refs])
    if not bias_slot:
        return patterns
    n, pos, _ = patterns.shape
    out = patterns.new_zeros(n, pos + 1, pos + 1)
    out[:, 0, 0] = 1.0
    out[:, 1:, 1:] = patterns
    has_slot = torch.tensor([_slot_heads(head_module(aot, sublayer(aot, r.name))) for r in refs])
    out[has_slot, 1:, 0] = (1.0 - patterns[has_slot].sum(-1)).clamp_min(0.0)
    return out


def _as_str_tokens(aot: AttentionOnlyTransformer, tokens: Any, pos: int) -> list[str]:
    if isinstance(tokens, Tensor):
        ids = tokens.flatten().tolist()
        tokens = aot.to_str_tokens(tokens.flatten()) if aot.tokenizer is not None else [str(i) for i in ids]
    tokens = [str(t) for t in tokens]
    if len(tokens) != pos:
        raise InputError(f"{len(tokens)} tokens given for a pattern over {pos} positions; pass one label per position")
    return tokens


@converted_only
def attention_patterns(
    aot: AttentionOnlyTransformer,
    cache: Any,
    heads: Sequence[HeadLike],
    tokens: Sequence[str] | Int[Tensor, " pos"] | Int[Tensor, "batch pos"],
    *,
    batch: int = 0,
    bias_slot: bool = True,
    kind: Literal["heads", "patterns"] = "heads",
    **kwargs: Any,
) -> Any:
    """Render the patterns of ``heads`` with circuitsvis, from a cache, labelled ``"L0N17.0"`` / ``"L1H3"``.

    ``tokens``: one label per position (strings, or the token ids of batch element ``batch``, decoded with the
    model's tokenizer when it has one), or the run's ``[batch, pos]`` tokens (row ``batch`` is used).
    ``bias_slot`` (default) shows the neuron heads' bias slot as a first token, so their rows sum to 1.
    ``kind="heads"``: ``circuitsvis.attention.attention_heads`` (one panel per head, head names shown; ``kwargs``
    go to it); ``"patterns"``: ``attention_patterns``. Returns circuitsvis's
    ``RenderedHTML`` (``str(...)`` is the HTML; it displays itself in Jupyter).
    """
    try:
        import circuitsvis.attention as cv_attention
    except ImportError as err:  # circuitsvis is an optional (test) extra
        raise ImportError(
            "attention_patterns needs circuitsvis: pip install circuitsvis (or lens-aot[test]); "
            "head_patterns(...) gives the same patterns as a tensor without it."
        ) from err
    patterns = head_patterns(aot, cache, heads, batch=batch, bias_slot=bias_slot)
    pos = patterns.shape[-1] - int(bias_slot)
    if isinstance(tokens, Tensor) and tokens.ndim == 2:  # the run's [batch, pos] tokens: batch element `batch`'s
        tokens = tokens[batch]
    labels = _as_str_tokens(aot, tokens, pos)
    if bias_slot:
        labels = [SLOT_TOKEN, *labels]
    names = [head_label(aot, h) for h in heads]
    attention = patterns.detach().float().cpu()
    if kind == "heads":
        return cv_attention.attention_heads(attention=attention, tokens=labels, attention_head_names=names, **kwargs)
    if kind == "patterns":
        return cv_attention.attention_patterns(tokens=labels, attention=attention, **kwargs)
    raise InputError(f"kind must be 'heads' or 'patterns'; got {kind!r}")


# ---------------------------------------------------------------------------------------------------- statistics
class HeadStat(NamedTuple):
    """A head, what it was in the source, its label, and the value of the statistic it was ranked by."""

    ref: HeadRef
    origin: HeadOrigin
    label: str
    value: float


@converted_only
def head_statistic(
    aot: AttentionOnlyTransformer,
    cache: Any,
    sub: SublayerLike,
    stat: Stat | Callable[[Float[Tensor, "sample head"]], Float[Tensor, " head"]] = "max_abs",
    *,
    pos: int | None = None,
    hook: Literal["hook_z", "hook_q", "hook_v"] = "hook_z",
) -> Float[Tensor, " head"]:
    """A statistic of every head of sub-layer ``sub``'s (an index into ``aot.sublayers()`` or a head-module name
    like ``"blocks.0.mlp.heads"``) ``hook`` activation over the cache's batch (and positions, unless
    ``pos`` picks one; e.g. ``-1``): ``"max_abs"``, ``"max"``, ``"min"``, ``"mean"``, ``"mean_abs"``, ``"var"``,
    ``"std"``, or a function of the ``[sample, head]`` values. ``hook_z`` is the head's output before ``W_O``
    (for a neuron head, its term of the neuron's activation); heads of internal dimension > 1 use the norm of it."""
    if isinstance(stat, str) and stat not in _STATS:
        raise InputError(f"stat must be one of {sorted(_STATS)} or a function of [sample, head] values; got {stat!r}")
    if hook not in ("hook_z", "hook_q", "hook_v"):
        raise InputError(
            f"hook must be 'hook_z', 'hook_q' or 'hook_v' (per-head [batch, pos, head, d] hooks); got {hook!r}"
        )
    name = head_hook(sublayer(aot, sub), hook)
    if name not in cache:
        raise InputError(
            f"{name} is not in the cache; run aot.run_with_cache(tokens) without a names_filter that drops it"
        )
    with torch.no_grad():
        values = cache[name]  # [batch, pos, head, d]
        if values.ndim != 4:
            raise InputError(
                f"{name} has shape {tuple(values.shape)}; expected [batch, pos, head, d] (keep the batch dim)"
            )
        values = values[..., 0] if values.shape[-1] == 1 else values.norm(dim=-1)
        if pos is not None:
            values = values[:, pos]
        values = values.reshape(-1, values.shape[-1])
        return (_STATS[stat] if isinstance(stat, str) else stat)(values)


@converted_only
def top_neuron_heads(
    aot: AttentionOnlyTransformer,
    cache: Any,
    k: int = 10,
    stat: Stat | Callable[[Float[Tensor, "sample head"]], Float[Tensor, " head"]] = "max_abs",
    *,
    pos: int | None = None,
    hook: Literal["hook_z", "hook_q", "hook_v"] = "hook_z",
    sublayers: Sequence[SublayerLike] | None = None,
    largest: bool = True,
) -> list[HeadStat]:
    """The ``k`` neuron heads with the largest (``largest=False``: smallest) value of ``stat`` (see
    :func:`head_statistic`) over the cache, from every neuron-head sub-layer or from ``sublayers``, best first, each
    as a :class:`HeadStat` ``(ref, origin, label, value)``: ``origin`` names the source layer and neuron."""
    subs: list[Sublayer] = neuron_sublayers(aot) if sublayers is None else [sublayer(aot, s) for s in sublayers]
    if not subs:
        raise InputError("this model has no neuron heads (its source had no MLPs)")
    refs: list[HeadRef] = []
    values = []
    for sub in subs:
        if sub.kind == "attention":
            raise InputError(
                f"{sub.name} holds attention heads, not neuron heads; neuron-head sub-layers: "
                f"{[s.name for s in neuron_sublayers(aot)]}"
            )
        values.append(head_statistic(aot, cache, sub, stat, pos=pos, hook=hook))
        refs += [HeadRef(sub.name, h) for h in range(values[-1].shape[0])]
    flat = torch.cat(values)
    top = flat.topk(min(k, flat.numel()), largest=largest)
    out = []
    for value, i in zip(top.values.tolist(), top.indices.tolist(), strict=True):
        ref = refs[i]
        out.append(HeadStat(ref, head_origin(aot, ref), head_label(aot, ref), value))
    return out


# ---------------------------------------------------------------------------------------------------- Fourier
def fourier_basis(p: int, dtype: torch.dtype = torch.float64) -> Float[Tensor, "p p"]:
    """Orthonormal Fourier basis over ``Z_p``, one vector per row: ``1``, then ``cos(2πkx/p)``, ``sin(2πkx/p)`` for
    ``k = 1..p//2`` (Nanda et al. 2023; row ``2k − 1`` is cos k, row ``2k`` is sin k)."""
    if p < 3 or p % 2 == 0:
        raise InputError(f"p must be an odd number ≥ 3 (the modulus); got {p}")
    x = torch.arange(p, dtype=torch.float64)
    rows = [torch.ones(p, dtype=torch.float64)]
    for k in range(1, p // 2 + 1):
        rows += [torch.cos(2 * math.pi * k * x / p), torch.sin(2 * math.pi * k * x / p)]
    basis = torch.stack(rows)
    return (basis / basis.norm(dim=1, keepdim=True)).to(dtype)


def frequency_norms(x: Float[Tensor, "p ..."], per_column: bool = False) -> Float[Tensor, "n_freq ..."]:
    """Share of ``‖x‖²`` in each frequency of ``Z_p`` along the first axis: index 0 the constant, index ``k`` the
    cos/sin pair of frequency ``k`` (e.g. ``x = W_E[:p]`` gives the embedding's key frequencies). ``per_column``:
    one share vector per column of ``x`` (``[n_freq, *rest]``), e.g. for each head's logit weights over the answer."""
    p = x.shape[0]
    coeffs = fourier_basis(p) @ x.detach().double().reshape(p, -1)
    per_basis = coeffs.pow(2) if per_column else coeffs.pow(2).sum(-1, keepdim=True)
    per_freq = torch.cat([per_basis[:1], per_basis[1::2] + per_basis[2::2]])
    shares = per_freq / per_basis.sum(0).clamp_min(torch.finfo(torch.float64).tiny)
    return shares.reshape(-1, *x.shape[1:]) if per_column else shares[:, 0]


def frequency_shares_2d(grid: Float[Tensor, "p p n"]) -> Float[Tensor, "n n_freq"]:
    """For each of ``n`` functions on the ``(a, b)`` grid, the share of its variance in the 2D-Fourier terms of each
    frequency ``k`` (``{1, cos ka, sin ka} ⊗ {1, cos kb, sin kb}`` minus the constant; index 0 is 0), as in
    Nanda et al.'s neuron analysis. A neuron head of frequency ``k`` has most of its variance at index ``k``."""
    p = grid.shape[0]
    if grid.ndim != 3 or grid.shape[1] != p:
        raise InputError(f"grid must be [p, p, n] (a, b, unit); got {tuple(grid.shape)}")
    basis = fourier_basis(p)
    x = grid.detach().double() - grid.detach().double().mean(dim=(0, 1))
    coeffs = torch.einsum("ia,abn,jb->nij", basis, x, basis).pow(2)  # [n, basis_a, basis_b]
    total = coeffs.sum(dim=(1, 2)).clamp_min(torch.finfo(torch.float64).tiny)
    shares = [torch.zeros_like(total)]
    for k in range(1, p // 2 + 1):
        idx = torch.tensor([0, 2 * k - 1, 2 * k])
        shares.append(coeffs[:, idx][:, :, idx].sum(dim=(1, 2)))
    return torch.stack(shares, dim=1) / total[:, None]
