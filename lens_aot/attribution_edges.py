"""Edge attribution (EAP, EAP-IG, with AtP*'s exact recomputation for neuron-head receivers): the estimate of
:func:`lens_aot.patching.path_patch`. See :mod:`lens_aot.attribution` for the methods."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

import torch
from jaxtyping import Float
from torch import Tensor

from lens_aot.attribution import (
    _CHUNK_ELEMENTS,
    Method,
    _head_grads,
    _head_z,
    _method,
    _progress,
    _Runs,
    _runs,
    _state_hooks,
)
from lens_aot.components import Attention, ProductAttention
from lens_aot.errors import InputError
from lens_aot.model import AttentionOnlyTransformer
from lens_aot.patching import (
    Direction,
    Metric,
    PatchUnit,
    PathPatchingResult,
    TokensLike,
    UnitLike,
    _block_of,
    _direction,
    _Index,
    _pair,
    _path_units,
    _receiver_inputs,
)

__all__ = ["attribute_edges"]


# ==================================================================================================== edges
def _input_block(aot: AttentionOnlyTransformer, block: int) -> int:
    """The block whose ``hook_resid_pre`` a block's heads read: itself, or (parallel layers) the layer's first."""
    while aot.blocks[block].parallel and block > 0:
        block -= 1
    return block


def _rows_for(units: Sequence[PatchUnit], chunk: Sequence[int], before: int) -> dict[int, tuple[list[int], list[int]]]:
    """Per sender block below ``before``: (chunk rows, heads) of the senders in ``chunk``."""
    out: dict[int, tuple[list[int], list[int]]] = {}
    for row, s in enumerate(chunk):
        for ref in units[s].heads:
            b = _block_of(ref.name)
            if b < before:
                rows, heads = out.setdefault(b, ([], []))
                rows.append(row)
                heads.append(ref.head)
    return out


def attribute_edges(
    aot: AttentionOnlyTransformer,
    clean: TokensLike,
    corrupted: TokensLike,
    metric: Metric,
    senders: Sequence[UnitLike] | UnitLike,
    receivers: Sequence[UnitLike | Literal["logits"]] | UnitLike | Literal["logits"] = "logits",
    receiver_input: str | Iterable[str] = "v",
    *,
    method: Method = "atp",
    steps: int = 16,
    direction: Direction = "noise",
    recompute: Iterable[UnitLike] | Literal["neurons"] | None = None,
    batch_size: int | None = None,
    progress: bool = False,
) -> PathPatchingResult:
    """Edge attribution (EAP, Syed et al. 2023; EAP-IG, Hanna et al. 2024): the estimate of
    :func:`~lens_aot.patching.path_patch` with the same arguments and result layout, ``values[s, r]`` =
    ``baseline +`` the estimated effect of sender ``s``'s switch reaching the model only through receiver ``r``'s
    ``receiver_input`` (every other head frozen, as in ``path_patch``).

    * Into a source attention head or "logits": ``Σ Δout_s · g_r``, with ``Δout_s`` the sender's change of its block
      output and ``g_r`` the gradient of the metric at the receiver's ``hook_q`` / ``hook_k`` / ``hook_v`` pulled back
      through ``W_Q/K/V`` and the receiver's norm (at the final residual for "logits").
    * Into neuron, gate or product heads (AtP*): for each sender the receiver block's input residual plus ``Δout_s``
      goes through the norm, ``W_in`` and the two-key softmax exactly, and the change of the receiver's ``z`` is
      multiplied by ``∂metric/∂z``. "k" is constant for these heads (``W_K = 0``): its edges are 0, as in path_patch.

    Senders are processed in chunks (memory ``O(chunk · batch · pos · width)``, never senders × receivers × pos).
    ``recompute`` (free heads) is not estimated: pass None, or use ``path_patch``. ``batch_size``: senders per chunk
    (default: by memory). Other arguments: as :func:`~lens_aot.patching.path_patch`.
    """
    method = _method(method, steps)
    direction = _direction(direction)
    if recompute is not None:
        raise InputError(
            "attribute_edges estimates direct paths only (every other head frozen): recompute must be None; use "
            "path_patch(..., recompute=...) to let heads respond to the sender"
        )
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise InputError(f"batch_size must be a positive int (senders per chunk); got {batch_size!r}")
    clean_t, corrupted_t = _pair(aot, clean, corrupted)
    index = _Index(aot)
    inputs = _receiver_inputs(receiver_input)
    sender_units, receiver_units = _path_units(index, senders, receivers)
    for unit in receiver_units:
        for ref in [] if isinstance(unit, str) else unit.heads:
            for x in inputs:
                if f"{ref.name}.hook_{x}" not in aot.hook_dict:
                    raise InputError(f"{ref.name} has no hook_{x}, so its {x} input cannot be patched")

    n_blocks = len(aot.blocks)
    sender_blocks = sorted({_block_of(ref.name) for u in sender_units for ref in u.heads})
    recv_blocks = sorted({_block_of(ref.name) for u in receiver_units if not isinstance(u, str) for ref in u.heads})
    attn_recv = [b for b in recv_blocks if isinstance(aot.blocks[b].attn, Attention)]
    neuron_recv = [b for b in recv_blocks if b not in attn_recv]
    final = f"blocks.{n_blocks - 1}.hook_resid_post"
    record = [n for b in sender_blocks + neuron_recv for n in _state_hooks(aot, b)]
    record += [f"blocks.{_input_block(aot, b)}.hook_resid_pre" for b in recv_blocks]
    grads = [f"blocks.{b}.attn.hook_{x}" for b in attn_recv for x in inputs]
    grads += [f"blocks.{b}.hook_attn_out" for b in neuron_recv]
    grads += [final] if "logits" in receiver_units else []
    runs = _runs(aot, clean_t, corrupted_t, metric, direction, record, grads, method, steps, progress)

    edges = torch.zeros(len(sender_units), len(receiver_units), dtype=torch.float64)
    with torch.no_grad():
        dz = {
            b: _head_z(aot.blocks[b].attn, [runs.other.acts[n] for n in _state_hooks(aot, b)])
            - _head_z(aot.blocks[b].attn, [runs.base.acts[n] for n in _state_hooks(aot, b)])
            for b in sender_blocks
        }
        # receivers read linearly (source attention heads, logits): pull the gradient back to the residual
        for col, unit in enumerate(receiver_units):
            if isinstance(unit, str):
                edges[:, col] += _backward_edges(aot, sender_units, dz, runs.grads[final], n_blocks)
        for b in attn_recv:
            cols = [c for c, u in enumerate(receiver_units) if not isinstance(u, str) and b in u.blocks]
            g = _pulled_back(aot, b, [receiver_units[c] for c in cols], inputs, runs)  # type: ignore[misc]
            for i, col in enumerate(cols):
                edges[:, col] += _backward_edges(aot, sender_units, dz, g[i], b)
        # receivers with a nonlinearity recomputed exactly (neuron, gate, product heads)
        for b in neuron_recv:
            edges += _forward_edges(aot, b, sender_units, receiver_units, inputs, dz, runs, batch_size, progress)
    return PathPatchingResult(
        values=runs.base.metric + edges,
        senders=sender_units,
        receivers=receiver_units,
        receiver_input=inputs,
        clean_metric=runs.clean_metric,
        corrupted_metric=runs.corrupted_metric,
        direction=direction,
    )


def _backward_edges(
    aot: AttentionOnlyTransformer,
    senders: Sequence[PatchUnit],
    dz: dict[int, Tensor],
    grad: Float[Tensor, "batch pos d_resid"],
    before: int,
) -> Float[Tensor, " sender"]:
    """``Σ_{h ∈ s, block(h) < before} Σ_{batch, pos} Δz_h · (grad · W_O[h])`` for every sender ``s``."""
    per_head = {
        b: torch.einsum("bphe,bphe->h", d, _head_grads(aot.blocks[b].attn, grad).to(d.dtype))
        for b, d in dz.items()
        if b < before
    }
    out = torch.zeros(len(senders), dtype=torch.float64)
    for s, unit in enumerate(senders):
        for ref in unit.heads:
            b = _block_of(ref.name)
            if b in per_head:
                out[s] += float(per_head[b][ref.head])
    return out


def _pulled_back(
    aot: AttentionOnlyTransformer,
    block: int,
    units: Sequence[PatchUnit],
    inputs: Sequence[str],
    runs: _Runs,
) -> Float[Tensor, "receiver batch pos d_resid"]:
    """Per receiver unit: the metric's gradient at its heads' ``hook_<x>`` (x in ``inputs``) in ``block``, pulled back
    through ``W_<x>`` and the block's norm to the residual it reads (a vector–Jacobian product, exact for the norm's
    linearisation at the base run)."""
    attn = aot.blocks[block].attn
    resid = runs.base.acts[f"blocks.{_input_block(aot, block)}.hook_resid_pre"]
    d_model = aot.cfg.d_model
    n_q = attn.W_Q.shape[0]
    cots = []
    for unit in units:
        cot = resid.new_zeros(*resid.shape[:2], d_model)
        for x in inputs:
            W = {"q": attn.W_Q, "k": attn.W_K, "v": attn.W_V}[x]
            group = max(1, n_q // W.shape[0])
            heads = {ref.head // (1 if x == "q" else group) for ref in unit.heads if _block_of(ref.name) == block}
            g = runs.grads[f"blocks.{block}.attn.hook_{x}"]
            for h in sorted(heads):
                cot = cot + g[:, :, h] @ W[h].T
        cots.append(cot)
    cot_t = torch.stack(cots)
    with torch.enable_grad():
        x = resid[..., :d_model].detach()[None].expand(len(units), *resid.shape[:2], d_model).clone()
        x.requires_grad_(True)
        (g,) = torch.autograd.grad(aot.blocks[block].ln1(x), x, cot_t.to(x.dtype))
    return torch.nn.functional.pad(g, (0, resid.shape[-1] - d_model))


def _forward_edges(
    aot: AttentionOnlyTransformer,
    block: int,
    senders: Sequence[PatchUnit],
    receivers: Sequence[PatchUnit | Literal["logits"]],
    inputs: Sequence[str],
    dz: dict[int, Tensor],
    runs: _Runs,
    batch_size: int | None,
    progress: bool,
) -> Float[Tensor, "sender receiver"]:
    """Edges into a neuron/gate/product block's heads, each sender's effect on the receivers' ``z`` recomputed exactly
    (norm, pre-activation, two-key softmax), times ``∂metric/∂z``."""
    attn = aot.blocks[block].attn
    start = _input_block(aot, block)
    resid = runs.base.acts[f"blocks.{start}.hook_resid_pre"]
    state = [runs.base.acts[n] for n in _state_hooks(aot, block)]
    cols = [c for c, u in enumerate(receivers) if not isinstance(u, str) and block in u.blocks]
    heads = sorted({ref.head for c in cols for ref in receivers[c].heads if _block_of(ref.name) == block})  # type: ignore[union-attr]
    head_t = torch.tensor(heads, dtype=torch.long, device=resid.device)
    pair_head: list[int] = []  # (receiver head, result column) pairs: a column sums its heads
    pair_col: list[int] = []
    where = {h: i for i, h in enumerate(heads)}
    for c in cols:
        for ref in receivers[c].heads:  # type: ignore[union-attr]
            if _block_of(ref.name) == block:
                pair_head.append(where[ref.head])
                pair_col.append(c)
    z0 = _head_z(attn, state)[..., head_t, 0]
    grad_out = runs.grads[f"blocks.{block}.hook_attn_out"]
    if "v" in inputs and _gates_patched_products(aot, block, [receivers[c] for c in cols]):  # type: ignore[misc]
        # gate heads whose neuron's product heads are receivers too: their values are patched, so a gate head reaches
        # the metric only past the product block (the scratch channel's residual path)
        grad_out = runs.grads[f"blocks.{block + 1}.hook_attn_out"]
    gz = _head_grads(attn, grad_out)[..., head_t, 0].to(z0.dtype)
    q0, v0 = _qv(attn, state, head_t)
    W_O = {b: aot.blocks[b].attn.W_O.detach() for b in dz if b < start}
    out = torch.zeros(len(senders), len(receivers), dtype=torch.float64)
    if "q" not in inputs and "v" not in inputs or not W_O:
        return out
    batch, n_pos, width = resid.shape
    per = batch_size or max(1, _CHUNK_ELEMENTS // (batch * n_pos * max(width, attn.d_mlp, len(heads)) * 4))
    chunks = [range(s, min(len(senders), s + per)) for s in range(0, len(senders), per)]
    for chunk in _progress(chunks, progress, f"edges into block {block}"):
        delta = resid.new_zeros(len(chunk), batch, n_pos, width)
        for b, (rows, hs) in _rows_for(senders, chunk, start).items():
            h_t = torch.tensor(hs, dtype=torch.long, device=resid.device)
            contrib = torch.einsum("bpme,med->mbpd", dz[b][:, :, h_t], W_O[b][h_t].to(resid.dtype))
            contrib = torch.nn.functional.pad(contrib, (0, width - contrib.shape[-1]))
            delta.index_add_(0, torch.tensor(rows, dtype=torch.long, device=resid.device), contrib)
        moved = resid[None] + delta
        q1, v1 = _qv(attn, _state_of(attn, aot.blocks[block].ln1, moved), head_t)
        z1 = torch.sigmoid(q1 if "q" in inputs else q0) * (v1 if "v" in inputs else v0)
        per_head = torch.einsum("cbph,bph->ch", z1 - z0, gz).to(torch.float64)
        out[list(chunk)] = out[list(chunk)].index_add_(1, torch.tensor(pair_col), per_head[:, pair_head].cpu())
    return out


def _state_of(attn: torch.nn.Module, ln1: torch.nn.Module, resid: Float[Tensor, "... d_resid"]) -> list[Tensor]:
    """A neuron/gate/product block's state (``hook_pre``, or ``u`` and ``h``) for a given input residual."""
    d_model = attn.d_model
    pre = ln1(resid[..., :d_model]) @ attn.W_in + attn.b_in
    if isinstance(attn, ProductAttention):
        return [pre, resid[..., d_model : d_model + attn.d_mlp]]
    return [pre]


def _qv(
    attn: torch.nn.Module, state: list[Tensor], heads: Tensor
) -> tuple[Float[Tensor, "... head"], Float[Tensor, "... head"]]:
    """The chosen heads' query and value (``[..., batch, pos, head]``) from a block's state, not the other heads'."""
    if isinstance(attn, ProductAttention):
        u, h = state
        n, sign = heads // 2, 1 - 2 * (heads % 2)
        return u[..., n] * attn.scales[n] * sign.to(u.dtype), h[..., n]
    (pre,) = state
    k = attn.heads_per_neuron
    n, term = heads // k, heads % k
    z = pre[..., n]
    return z * attn.term_b[term] + attn.term_d[term], z * attn.term_alpha[term] + attn.term_beta[term]


def _gates_patched_products(aot: AttentionOnlyTransformer, block: int, units: Sequence[PatchUnit]) -> bool:
    """Whether ``block`` holds gate heads and the receiver units include product heads of the next block."""
    attn = aot.blocks[block].attn
    if getattr(attn, "scratch", None) is None or block + 1 >= len(aot.blocks):
        return False
    if not isinstance(aot.blocks[block + 1].attn, ProductAttention):
        return False
    return any(_block_of(ref.name) == block + 1 for unit in units for ref in unit.heads)
