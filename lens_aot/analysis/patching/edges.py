"""Edge attribution (EAP, EAP-IG, with AtP*'s exact recomputation for neuron-head receivers): the estimate of
:func:`lens_aot.patching.path_patch`. See :mod:`lens_aot.analysis.patching.attribution` for the methods."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

import torch
from jaxtyping import Float
from torch import Tensor

from lens_aot.analysis.checks import converted_only
from lens_aot.analysis.patching.attribution import _head_z, _method, _warn_split_pairs
from lens_aot.analysis.patching.module_hooks import (
    _expert_weight,
    _out_scale,
    _resid_scale,
    _weight_hooks,
    _write_map,
)
from lens_aot.analysis.patching.options import Direction, Method, Metric, TokensLike
from lens_aot.analysis.patching.results import PathPatchingResult, _path_result
from lens_aot.analysis.patching.runs import (
    _CHUNK_ELEMENTS,
    _both_runs,
    _direction,
    _progress,
    _Runs,
)
from lens_aot.analysis.patching.units import (
    PatchUnit,
    Receiver,
    UnitLike,
    _final_resid_hook,
    _head_grads,
    _head_module,
    _heads_by_module,
    _input_hook,
    _input_hooks,
    _input_norm,
    _input_of,
    _into_input,
    _order,
    _output_hook,
    _path_inputs,
    _product_module,
    _reads_output_of,
    _resid_in_hook,
    _state_hooks,
    _state_of,
)
from lens_aot.analysis.progress import Progress
from lens_aot.core.components import Attention, ProductAttention
from lens_aot.core.runtime.model import AttentionOnlyTransformer
from lens_aot.errors import InputError

__all__ = ["attribute_edges"]


@converted_only(metric="patching")
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
    progress: Progress = "auto",
) -> PathPatchingResult:
    """Edge attribution (EAP, Syed et al. 2023; EAP-IG, Hanna et al. 2024): the estimate of
    :func:`~lens_aot.patching.path_patch` with the same arguments and result layout, ``values[s, r]`` =
    ``baseline +`` the estimated effect of sender ``s``'s switch reaching the model only through receiver ``r``'s
    ``receiver_input`` (every other head frozen, as in ``path_patch``).

    * Into a source attention head or "logits": ``Σ Δout_s · g_r``, with ``Δout_s`` the sender's change of its module
      output and ``g_r`` the gradient of the metric at the receiver's ``hook_q`` / ``hook_k`` / ``hook_v`` pulled back
      through ``W_Q/K/V`` and the receiver's norm (at the final residual for "logits").
    * Into neuron, gate or product heads (AtP*): for each sender the receiver module's input (its residual; product
      heads: and the MLP's scratch) plus ``Δout_s`` goes through the norm, ``W_in`` and the two-key softmax exactly,
      and the change of the receiver's ``z`` is multiplied by ``∂metric/∂z``. "k" is constant for these heads
      (``W_K = 0``): its edges are 0, as in path_patch.

    Senders are processed in chunks (memory ``O(chunk · batch · pos · width)``, never senders × receivers × pos).
    ``recompute`` (free heads) is not estimated: pass None, or use ``path_patch``. ``batch_size``: senders per chunk
    (default: by memory). Other arguments: as :func:`~lens_aot.patching.path_patch`. A sender holding one product
    head without its pair partner (or such a receiver, through "v") gets a ``UserWarning``: see
    :mod:`~lens_aot.analysis.patching.attribution`; ``head_units`` gives product heads as pairs.
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
    clean_t, corrupted_t, index, inputs, sender_units, receiver_units, _ = _path_inputs(
        aot, clean, corrupted, senders, receivers, receiver_input, "edge attribution"
    )
    _warn_split_pairs(sender_units, "senders")
    if "v" in inputs:  # a lone product head's value is (2/ε)-amplified too; its query is scaled by ε, so "q" is fine
        _warn_split_pairs(receiver_units, "receivers (through 'v')")

    sender_names = sorted({ref.name for u in sender_units for ref in u.heads}, key=_order)
    recv_names = sorted({ref.name for u in receiver_units if not isinstance(u, str) for ref in u.heads}, key=_order)
    attn_recv = [name for name in recv_names if isinstance(_head_module(aot, name), Attention)]
    neuron_recv = [name for name in recv_names if name not in attn_recv]
    final = _final_resid_hook(aot)
    record = [hook for name in sender_names + neuron_recv for hook in _state_hooks(aot, name)]
    record += [hook for name in recv_names for hook in _input_hooks(aot, name)]
    record += [hook for name in sender_names for hook in _weight_hooks(aot, name)]
    grads = [_input_hook(name, x) for name in attn_recv for x in inputs]
    grads += [_output_hook(aot, name) for name in neuron_recv]
    grads += [final] if "logits" in receiver_units else []
    runs = _both_runs(aot, clean_t, corrupted_t, metric, direction, record, grads, method, steps, progress)

    edges = torch.zeros(len(sender_units), len(receiver_units), dtype=torch.float64)
    with torch.no_grad():
        # each sender module's change of head outputs as it reaches the residual: an expert's times its router weight
        dz = {name: _sender_change(aot, name, runs, clean_t.shape[0]) for name in sender_names}
        # receivers read linearly (source attention heads, logits): pull the gradient back to the residual
        for col, unit in enumerate(receiver_units):
            if isinstance(unit, str):
                edges[:, col] += _backward_edges(aot, sender_units, dz, runs.grads[final], None)
        for name in attn_recv:
            cols = [c for c, u in enumerate(receiver_units) if not isinstance(u, str) and _covers(u, name)]
            g = _pulled_back(aot, name, [receiver_units[c] for c in cols], inputs, runs)  # type: ignore[misc]
            for i, col in enumerate(cols):
                edges[:, col] += _backward_edges(aot, sender_units, dz, g[i], name)
        # receivers with a nonlinearity recomputed exactly (neuron, gate, product heads)
        for name in neuron_recv:
            edges += _forward_edges(aot, name, sender_units, receiver_units, inputs, dz, runs, batch_size, progress)
    return _path_result(index, runs.base.metric + edges, sender_units, receiver_units, inputs, direction, runs)


def _sender_change(
    aot: AttentionOnlyTransformer, name: str, runs: _Runs, batch: int
) -> Float[Tensor, "batch pos head d_head"]:
    """Module ``name``'s change of head outputs ``Δz`` (the other run's minus the base run's), times what a mixture of
    experts multiplies the expert's output by in the base run (:func:`~.module_hooks._expert_weight`; path patching
    sets the expert's ``hook_out`` and the base run's router weighs it, 0 where the expert was not chosen)."""
    attn = _head_module(aot, name)
    dz = _head_z(attn, [runs.other.acts[n] for n in _state_hooks(aot, name)])
    dz = dz - _head_z(attn, [runs.base.acts[n] for n in _state_hooks(aot, name)])
    weight = _expert_weight(aot, name, runs.base.acts, batch)
    return dz if weight is None else dz * weight.to(dz.dtype)


def _covers(unit: PatchUnit, name: str) -> bool:
    """Whether ``unit`` has a head in module ``name``."""
    return any(ref.name == name for ref in unit.heads)


def _backward_edges(
    aot: AttentionOnlyTransformer,
    senders: Sequence[PatchUnit],
    dz: dict[str, Tensor],
    grad: Float[Tensor, "batch pos d_resid"],
    receiver: str | None,
) -> Float[Tensor, " sender"]:
    """``Σ_{h ∈ s} Σ_{batch, pos} Δz_h · (grad · W_O[h])`` for every sender ``s``, over the heads whose output is in
    the residual ``receiver`` (None: the logits) reads."""
    per_head = {
        name: torch.einsum(
            "bphe,bphe->h",
            d,
            _head_grads(_head_module(aot, name), grad.to(d.device), _resid_scale(aot, name)).to(d.dtype),
        )
        .to(torch.float64)
        .cpu()  # one transfer per module, not one per head
        for name, d in dz.items()
        if _reads_output_of(aot, receiver, name)
    }
    out = torch.zeros(len(senders), dtype=torch.float64)
    for s, unit in enumerate(senders):
        for ref in unit.heads:
            if ref.name in per_head:
                out[s] += float(per_head[ref.name][ref.head])
    return out


def _pulled_back(
    aot: AttentionOnlyTransformer,
    name: str,
    units: Sequence[PatchUnit],
    inputs: Sequence[str],
    runs: _Runs,
) -> Float[Tensor, "receiver batch pos d_resid"]:
    """Per receiver unit: the metric's gradient at its heads' ``hook_<x>`` (x in ``inputs``) in module ``name``,
    pulled back through ``W_<x>`` and the module's norm to the residual it reads (a vector–Jacobian product, exact for
    the norm's linearisation at the base run)."""
    attn = _head_module(aot, name)
    resid = runs.base.acts[_resid_in_hook(aot, name)]
    d_model = aot.cfg.d_model
    n_q = attn.W_Q.shape[0]
    cots = []
    for unit in units:
        cot = resid.new_zeros(*resid.shape[:2], d_model)
        for x in inputs:
            W = {"q": attn.W_Q, "k": attn.W_K, "v": attn.W_V}[x]
            group = max(1, n_q // W.shape[0])
            heads = {ref.head // (1 if x == "q" else group) for ref in unit.heads if ref.name == name}
            g = runs.grads[_input_hook(name, x)]
            for h in sorted(heads):
                cot = cot + g[:, :, h] @ W[h].T
        cots.append(cot)
    cot_t = torch.stack(cots)
    with torch.enable_grad():
        x = resid.detach()[None].expand(len(units), *resid.shape[:2], d_model).clone()
        x.requires_grad_(True)
        (g,) = torch.autograd.grad(_input_norm(aot, name)(x), x, cot_t.to(x.dtype))
    return g


def _forward_edges(
    aot: AttentionOnlyTransformer,
    name: str,
    senders: Sequence[PatchUnit],
    receivers: Sequence[Receiver],
    inputs: Sequence[str],
    dz: dict[str, Tensor],
    runs: _Runs,
    batch_size: int | None,
    progress: Progress,
) -> Float[Tensor, "sender receiver"]:
    """Edges into a neuron/gate/product module's heads, each sender's effect on the receivers' ``z`` recomputed
    exactly (norm, pre-activation, two-key softmax), times ``∂metric/∂z``."""
    attn = _head_module(aot, name)
    resid = _input_of(aot, name, runs.base.acts)  # the residual (product heads: and the MLP's scratch)
    state = [runs.base.acts[n] for n in _state_hooks(aot, name)]
    cols = [c for c, u in enumerate(receivers) if not isinstance(u, str) and _covers(u, name)]
    pairs = _heads_by_module(receivers, cols, keep=name.__eq__)
    col_of, head_of = pairs.get(name, ([], []))  # (result column index in cols, receiver head) pairs
    heads = sorted(set(head_of))
    head_t = torch.tensor(heads, dtype=torch.long, device=resid.device)
    where = {h: i for i, h in enumerate(heads)}
    pair_head = [where[h] for h in head_of]  # a column sums its heads
    pair_col = [cols[i] for i in col_of]
    z0 = _head_z(attn, state)[..., head_t, 0]
    grad_out = runs.grads[_output_hook(aot, name)]
    product = _product_module(aot, name)
    if "v" in inputs and product is not None and any(_covers(receivers[c], product) for c in cols):  # type: ignore[arg-type]
        # gate heads whose neuron's product heads are receivers too: the product heads' values (the gate's only
        # reader) are patched, so a gate head's change does not reach the metric
        grad_out = torch.zeros_like(grad_out)
    gz = _head_grads(attn, grad_out, _out_scale(aot, name))[..., head_t, 0].to(z0.dtype)
    q0, v0 = _qv(attn, state, head_t)
    upstream = [n for n in dz if _reads_output_of(aot, name, n)]
    W_O = {n: _write_map(aot, n, to_residual=True) for n in upstream}
    out = torch.zeros(len(senders), len(receivers), dtype=torch.float64)
    if "q" not in inputs and "v" not in inputs or not W_O:
        return out
    batch, n_pos, width = resid.shape
    per = batch_size or max(1, _CHUNK_ELEMENTS // (batch * n_pos * max(width, attn.d_mlp, len(heads)) * 4))
    chunks = [range(s, min(len(senders), s + per)) for s in range(0, len(senders), per)]
    for chunk in _progress(chunks, progress, f"edges into {name}"):
        delta = resid.new_zeros(len(chunk), batch, n_pos, width)
        for n, (rows, hs) in _heads_by_module(senders, chunk, keep=W_O.__contains__).items():
            h_t = torch.tensor(hs, dtype=torch.long, device=dz[n].device)  # on the sender layer's device
            contrib = torch.einsum("bpme,med->mbpd", dz[n][:, :, h_t], W_O[n][h_t].to(resid.dtype))
            contrib = _into_input(aot, name, n, contrib.to(resid.device))
            delta.index_add_(0, torch.tensor(rows, dtype=torch.long, device=resid.device), contrib)
        moved = resid[None] + delta
        q1, v1 = _qv(attn, _state_of(aot, name, moved), head_t)
        z1 = torch.sigmoid(q1 if "q" in inputs else q0) * (v1 if "v" in inputs else v0)
        per_head = torch.einsum("cbph,bph->ch", z1 - z0, gz).to(torch.float64)
        out[list(chunk)] = out[list(chunk)].index_add_(1, torch.tensor(pair_col), per_head[:, pair_head].cpu())
    return out


def _qv(
    attn: torch.nn.Module, state: list[Tensor], heads: Tensor
) -> tuple[Float[Tensor, "... head"], Float[Tensor, "... head"]]:
    """The chosen heads' query and value (``[..., batch, pos, head]``) from a module's state, not the other heads'."""
    if isinstance(attn, ProductAttention):
        u, h = state
        n, sign = heads // 2, 1 - 2 * (heads % 2)
        return u[..., n] * attn.scales[n] * sign.to(u.dtype), h[..., n]
    (pre,) = state
    k = attn.heads_per_neuron
    n, term = heads // k, heads % k
    z = pre[..., n]
    return z * attn.term_b[term] + attn.term_d[term], z * attn.term_alpha[term] + attn.term_beta[term]
