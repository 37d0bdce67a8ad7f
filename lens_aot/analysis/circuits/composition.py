"""Composition scores (Q, K, V; Elhage et al. 2021) between heads of two sub-layers (the paper's flat order,
``aot.sublayers()``), neuron heads included, from the heads' low-rank factors. Definitions in
:mod:`lens_aot.analysis.circuits`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor

from lens_aot.analysis.checks import converted_only
from lens_aot.analysis.circuits import names
from lens_aot.analysis.circuits.weights import _fold_norm, _has_neuron_layout, _neuron_out_rows, _pad_cols
from lens_aot.core.components.residual.writes import scaled, write_scale
from lens_aot.core.placement import tensors_to
from lens_aot.core.runtime.model import AttentionOnlyTransformer, HeadOrigin, HeadRef, Sublayer
from lens_aot.errors import InputError, UnsupportedArchitectureError

Mode = Literal["Q", "K", "V"]
_MODES = ("Q", "K", "V")
_CHUNK = 1 << 22  # elements of the per-chunk [senders, receivers, r_A, r_B] product in composition_scores


@dataclass
class _Factors:
    """Low-rank factors of a set of heads' circuits, one entry per *group* of heads whose circuits are scalar
    multiples of each other (each neuron's heads; each source head alone). Composition scores are invariant to
    such scalars, so they are computed once per group; ``ov_zero`` / ``qk_zero`` mark heads whose scalar is 0."""

    V: Float[Tensor, "g d_in r"]
    W_O: Float[Tensor, "g r d_out"]
    Q: Float[Tensor, "g d_in r"]
    K: Float[Tensor, "g d_in r"]
    K_slot: Float[Tensor, "g s r"]
    group: Int[Tensor, " n"]  # group of each selected head
    ov_zero: torch.Tensor  # bool [n]
    qk_zero: torch.Tensor  # bool [n]


def _sublayer_factors(aot: AttentionOnlyTransformer, sub: Sublayer, heads: Tensor, fold_ln: bool) -> _Factors:
    """Factors of the selected ``heads`` of sub-layer ``sub`` over what they read and write (reading weights folded
    with the sub-layer's norm when ``fold_ln``)."""
    attn = names.head_module(aot, sub)
    norm = names.head_norm(aot, sub) if fold_ln else None
    d_model = aot.cfg.d_model
    with torch.no_grad():
        if _has_neuron_layout(attn):
            k = attn.heads_per_neuron
            neurons, group = torch.unique(heads // k, return_inverse=True)
            w_in = attn.W_in.detach()[:, neurons].T[:, :, None]  # [g, d_model, 1]: what value and query both read
            w_in = _fold_norm(norm, w_in, None, d_model)[0]
            term = heads % k
            slot = attn.k_bias.detach()[heads].reshape(len(heads), -1)
            return _Factors(
                V=w_in,
                W_O=_neuron_out_rows(attn, neurons)[:, None, :],
                Q=w_in,
                K=torch.zeros_like(w_in),
                K_slot=torch.ones_like(w_in[:, :1, :]),
                group=group,
                ov_zero=attn.term_alpha[term] == 0,
                qk_zero=(attn.term_b[term] == 0) | (slot == 0).all(-1),
            )
        kv = heads // (attn.W_Q.shape[0] // attn.W_K.shape[0])
        W_Q, W_K, W_V = (
            _fold_norm(norm, w.detach()[idx], None, d_model)[0]
            for w, idx in ((attn.W_Q, heads), (attn.W_K, kv), (attn.W_V, kv))
        )
        k_bias = getattr(attn, "k_bias", None)
        r = W_Q.shape[-1]
        K_slot = (
            W_Q.new_zeros(len(heads), 0, r) if k_bias is None else k_bias.detach()[heads].reshape(len(heads), -1, r)
        )
        none = torch.zeros(len(heads), dtype=torch.bool, device=W_Q.device)
        return _Factors(
            V=W_V,
            W_O=scaled(attn.W_O.detach()[heads], write_scale(attn)),  # what they write (half Granite: times m)
            Q=W_Q,
            K=W_K,
            K_slot=K_slot,
            group=torch.arange(len(heads), device=W_Q.device),
            ov_zero=none,
            qk_zero=none,
        )


def _gram(a: Float[Tensor, "g n r"]) -> Float[Tensor, "g r r"]:
    return a.transpose(-1, -2) @ a


def _safe_ratio(num: Tensor, den: Tensor) -> Tensor:
    return torch.where(den > 0, num / den.clamp_min(torch.finfo(den.dtype).tiny), torch.zeros_like(num))


def _select_heads(aot: AttentionOnlyTransformer, sub: Sublayer, heads: Any, role: str) -> list[int]:
    count = names.n_heads(aot, sub)
    if heads is None:
        return list(range(count))
    if isinstance(heads, Tensor):
        heads = heads.tolist()
    out = []
    for h in heads:
        if isinstance(h, (tuple, str)):
            ref = names.as_head_ref(aot, h)
            if ref.name != sub.name:
                raise InputError(
                    f"{role} {h!r} is not in sub-layer {sub.name}; pass heads of that sub-layer (or their indices)"
                )
            out.append(ref.head)
        else:
            out.append(names.as_head_ref(aot, (sub.index, h)).head)
    if not out:
        raise InputError(f"no {role} heads selected; pass None for all heads of {sub.name}")
    return out


def _check_pair(sender: Sublayer, receiver: Sublayer, mode: str) -> None:
    if mode not in _MODES:
        raise InputError(f"mode must be one of {_MODES} (Q-, K- or V-composition); got {mode!r}")
    if not sender.index < receiver.index:
        raise InputError(
            f"composition needs the sender in an earlier sub-layer than the receiver (it reads the sender's output); "
            f"got sender {sender.name} (sub-layer {sender.index}), receiver {receiver.name} (sub-layer "
            f"{receiver.index}). Swap them if you meant the other direction."
        )


def _align_sender(
    aot: AttentionOnlyTransformer, sender: Sublayer, receiver: Sublayer, send: _Factors, width: int
) -> _Factors:
    """The sender's output in the receiver's input coordinates (``width`` channels: ``d_model``, then for product
    heads the MLP's scratch). Gate heads write only their MLP's scratch, which only that MLP's product heads read (a
    chained gate: its gate heads' ``r`` only its square heads, and the square and direct heads' sum only its product
    heads, :func:`~lens_aot.analysis.circuits.names.scratch_reader`); every other head writes the residual stream
    (the first ``d_model`` channels)."""
    W_O = send.W_O
    if names.writes_scratch(sender):
        d_model = aot.cfg.d_model
        if names.reads_scratch(receiver) and receiver.layer == sender.layer:
            mlp = aot.get_submodule(sender.name.rpartition(".")[0])
            if sender.kind == "gate" and receiver.kind == "product" and not getattr(mlp, "linear_scratch", True):
                raise UnsupportedArchitectureError(
                    f"{sender.name}: in a gated relu2 / xIELU MLP the gate heads' output r ≈ relu(g) reaches the "
                    f"product heads through the square heads (s ≈ relu(g)·g), a product, so gate → product "
                    f"composition is not a bilinear score of their weights. Score the other pairs."
                )
            if receiver.name != names.scratch_reader(aot, sender):  # the MLP's other scratch: not read
                W_O = W_O.new_zeros(*W_O.shape[:-1], width)
            else:
                W_O = torch.nn.functional.pad(W_O, (d_model, width - d_model - W_O.shape[-1]))
        else:
            W_O = W_O.new_zeros(*W_O.shape[:-1], width)
    else:
        W_O = _pad_cols(W_O, width)
    return _Factors(send.V, W_O, send.Q, send.K, send.K_slot, send.group, send.ov_zero, send.qk_zero)


def _hide_normalized_channels(recv: _Factors, d_model: int) -> _Factors:
    """The receiver's reads as the sender's output reaches them in a parallel layer: the normalized channels (the
    first ``d_model``) come from the layer's input, which the layer's attention output is not part of."""

    def hide(W: Tensor) -> Tensor:
        W = W.clone()
        W[:, :d_model] = 0
        return W

    return _Factors(
        hide(recv.V), recv.W_O, hide(recv.Q), hide(recv.K), recv.K_slot, recv.group, recv.ov_zero, recv.qk_zero
    )


@dataclass
class CompositionScores:
    """Composition scores of every selected sender head against every selected receiver head.

    ``scores[i, j]`` is the ``mode``-composition of ``senders[i]`` (in sub-layer ``sender_sublayer``) into
    ``receivers[j]`` (in ``receiver_sublayer``); ``sender_origins`` / ``receiver_origins`` say what each head was in
    the source and ``sender_labels`` / ``receiver_labels`` label plot axes (``"L0H3"``, ``"L0N17.0"``).
    """

    scores: Float[Tensor, "sender receiver"]
    mode: str
    sender_sublayer: Sublayer
    receiver_sublayer: Sublayer
    senders: list[HeadRef]
    receivers: list[HeadRef]
    sender_origins: list[HeadOrigin]
    receiver_origins: list[HeadOrigin]
    sender_labels: list[str]
    receiver_labels: list[str]

    @property
    def shape(self) -> torch.Size:
        return self.scores.shape

    def top(self, k: int = 10) -> list[tuple[HeadRef, HeadRef, float]]:
        """The ``k`` highest-scoring (sender, receiver, score) pairs."""
        flat = self.scores.flatten()
        values, idx = flat.topk(min(k, flat.numel()))
        n = self.scores.shape[1]
        return [
            (self.senders[i // n], self.receivers[i % n], v) for i, v in zip(idx.tolist(), values.tolist(), strict=True)
        ]

    def __repr__(self) -> str:
        return (
            f"CompositionScores(mode={self.mode!r}, {self.sender_sublayer.name} -> {self.receiver_sublayer.name}, "
            f"shape={tuple(self.scores.shape)})"
        )


def _scores(send: _Factors, recv: _Factors, mode: str, seen: _Factors | None = None) -> Float[Tensor, "n_send n_recv"]:
    """Composition scores between the selected heads from the groups' low-rank factors (see module docstring).

    With ``W_OV^A = V_A O_A`` and the receiver's matrix ``X_B Y_Bᵀ`` (Q: ``X = W_Q, Y = W̃_K``; K: ``X = W_K`` (residual
    part), ``Y = W_Q``; V: ``X = W_V, Y = W_Oᵀ``), ``‖W_OV^A X_B Y_Bᵀ‖² = tr(G_A M H_B Mᵀ)`` with ``M = O_A X_B``
    ``[r_A, r_B]``, ``G_A = V_Aᵀ V_A`` and ``H_B = Y_Bᵀ Y_B``: only rank-sized matrices per pair. ``seen``: the
    receiver's reads as far as they see the sender's output (numerator), where that differs from ``recv``.
    """
    seen = recv if seen is None else seen
    G_A = _gram(send.V)
    ov_norm_A = (G_A * (send.W_O @ send.W_O.transpose(-1, -2))).sum((-1, -2)).clamp_min(0).sqrt()
    K_full = torch.cat([recv.K, recv.K_slot], dim=-2)
    qk_norm_B = (_gram(recv.Q) * _gram(K_full)).sum((-1, -2)).clamp_min(0).sqrt()
    if mode == "Q":
        X, H, den_B = seen.Q, _gram(K_full), qk_norm_B
    elif mode == "K":
        X, H, den_B = seen.K, _gram(recv.Q), qk_norm_B
    else:
        H = recv.W_O @ recv.W_O.transpose(-1, -2)
        X, den_B = seen.V, (_gram(recv.V) * H).sum((-1, -2)).clamp_min(0).sqrt()
    gb, ra, rb = X.shape[0], send.W_O.shape[1], X.shape[2]
    step = max(1, _CHUNK // max(1, gb * ra * rb))
    num = []
    for start in range(0, send.V.shape[0], step):
        M = torch.einsum("aid,bdj->abij", send.W_O[start : start + step], X)  # [a, b, r_A, r_B]
        GM = torch.einsum("aik,abkj->abij", G_A[start : start + step], M)
        MH = torch.einsum("abik,bkj->abij", M, H)
        num.append((GM * MH).sum((-1, -2)).clamp_min(0).sqrt())
    groups = _safe_ratio(torch.cat(num), ov_norm_A[:, None] * den_B[None, :])
    zero_B = recv.ov_zero if mode == "V" else recv.qk_zero
    scores = groups[send.group][:, recv.group]
    return scores.masked_fill(send.ov_zero[:, None] | zero_B[None, :], 0.0)


@converted_only
def composition_scores(
    aot: AttentionOnlyTransformer,
    sender: names.SublayerLike,
    receiver: names.SublayerLike,
    mode: Mode,
    *,
    senders: Sequence[int | names.HeadLike] | Tensor | None = None,
    receivers: Sequence[int | names.HeadLike] | Tensor | None = None,
    fold_ln: bool = True,
) -> CompositionScores:
    """``mode``-composition scores (``"Q"``, ``"K"`` or ``"V"``; Elhage et al. 2021) of every head of sub-layer
    ``sender`` into every head of a later sub-layer ``receiver`` (each an index into ``aot.sublayers()`` or a
    head-module name like ``"blocks.0.attn"`` / ``"blocks.1.mlp.heads"``), neuron heads included (definitions in
    :mod:`lens_aot.analysis.circuits`; for source heads this is TransformerLens's ``all_composition_scores``).

    ``senders`` / ``receivers`` restrict the heads (indices in their sub-layer, HeadRefs or labels), e.g. one head per
    neuron with ``range(0, n_heads, K)``: the cost is one rank-sized product per pair of *groups* (a neuron's K heads
    form one group), and the output is ``[len(senders), len(receivers)]``. Returns a :class:`CompositionScores`.

    Parallel layers (GPT-J, GPT-NeoX): a layer's neuron heads read the layer's input, not its attention heads'
    output, so those pairs score 0 (the receiver's matrix still sets the normalization). Gate heads write only their
    MLP's scratch: they compose with that MLP's product heads alone.
    """
    ss, rs = names.sublayer(aot, sender), names.sublayer(aot, receiver)
    _check_pair(ss, rs, mode)
    send_heads = _select_heads(aot, ss, senders, "sender")
    recv_heads = _select_heads(aot, rs, receivers, "receiver")
    # head indices on the CPU (valid on every device); factors on their layer's device, the sender's then moved to
    # the receiver's (a split model)
    recv = _sublayer_factors(aot, rs, torch.tensor(recv_heads), fold_ln)
    send = tensors_to(_sublayer_factors(aot, ss, torch.tensor(send_heads), fold_ln), aot.placement.layers[rs.layer])
    send = _align_sender(aot, ss, rs, send, recv.Q.shape[-2])
    parallel = getattr(aot.blocks[rs.layer], "parallel", False)
    hidden = parallel and ss.layer == rs.layer and ss.kind == "attention" and rs.kind != "attention"
    seen = _hide_normalized_channels(recv, aot.cfg.d_model) if hidden else None
    with torch.no_grad():
        scores = _scores(send, recv, mode, seen)
    send_refs = [HeadRef(ss.name, h) for h in send_heads]
    recv_refs = [HeadRef(rs.name, h) for h in recv_heads]
    return CompositionScores(
        scores=scores,
        mode=mode,
        sender_sublayer=ss,
        receiver_sublayer=rs,
        senders=send_refs,
        receivers=recv_refs,
        sender_origins=[names.head_origin(aot, r) for r in send_refs],
        receiver_origins=[names.head_origin(aot, r) for r in recv_refs],
        sender_labels=[names.head_label(aot, r) for r in send_refs],
        receiver_labels=[names.head_label(aot, r) for r in recv_refs],
    )


@converted_only
def composition_score(
    aot: AttentionOnlyTransformer, sender: names.HeadLike, receiver: names.HeadLike, mode: Mode, *, fold_ln: bool = True
) -> float:
    """The ``mode``-composition score (``"Q"``, ``"K"``, ``"V"``) of one sender head into one receiver head in a later
    sub-layer: a number in [0, 1] (definitions in :mod:`lens_aot.analysis.circuits`)."""
    s, r = names.as_head_ref(aot, sender), names.as_head_ref(aot, receiver)
    table = composition_scores(aot, s.name, r.name, mode, senders=[s.head], receivers=[r.head], fold_ln=fold_ln)
    return float(table.scores[0, 0])
