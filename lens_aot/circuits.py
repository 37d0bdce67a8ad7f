"""QK and OV circuits of every head, and composition scores between heads, neuron heads included.

The circuits follow Elhage et al. 2021, "A Mathematical Framework for Transformer Circuits", in TransformerLens's
conventions (row vectors: a query ``x`` and key ``y`` score ``x W_Q W_Kᵀ yᵀ / attn_scale``; a head moves ``y W_V W_O``)
and come back as TransformerLens ``FactoredMatrix`` objects, so ``.AB``, ``.svd()``, ``.norm()``, ``.eigenvalues``
and ``@`` work as on ``HookedTransformer.QK`` / ``.OV``. Any head is addressed the same way: a :class:`HeadRef`
(``aot.neuron_heads(layer, n)`` returns them), ``(block, head)``, or ``("blocks.3.attn", head)``.

**Neuron heads and the bias slot.** A neuron head (Huben & Morris 2023, Theorem 3; see
:mod:`lens_aot.components.neuron_attention`) has key 0 at every real position (``W_K = 0``, ``b_K = 0``) and a
persistent memory key ``k_bias = −1`` (the *bias slot*, value ``v_bias = 0``). Its ``W_Q W_Kᵀ`` is the zero matrix
although the head is far from inert: what it decides is self-versus-slot, with score difference
``q·(k_self − k_bias) = q = b_k·z + d_k``. So every QK circuit here is taken over the keys the head really has: the
key side is the residual stream **augmented with the head's memory slots**, ``W̃_K = [W_K; k_slot]`` and
``QK = W_Q W̃_Kᵀ`` of shape ``[d_model, d_model + n_slots]`` (last column: the slot; ``n_slots`` is 1 for neuron
heads, 0 for the source's own heads, whose circuits are exactly TransformerLens's). For a neuron head the residual
columns are zero and the slot column is ``−W_Q``: the direction the neuron reads (``b_k·W_in[:, n]``). See
:func:`self_vs_slot_direction` for that decision as a direction and an offset.

**LayerNorm.** ``fold_ln=True`` (the default) does what TransformerLens's ``fold_ln`` does to the weights: each
head's reading matrices (``W_Q``, ``W_K``, ``W_V``) absorb its block's norm weight, its biases absorb the norm bias
(``b_Q + b_ln·W_Q``), and for LayerNorm (not RMSNorm) the reading matrices are centred, which is the norm's mean
subtraction. The circuits then act on the *normalized* residual, ``blocks.{i}.ln1.hook_normalized``
(``(x − mean)/scale``; the residual itself where there is no norm), see :func:`circuit_input`; the per-position
division by the norm's scale is the one thing left out, as in TransformerLens. ``fold_ln=False`` uses the stored
weights, which act on the norm's output. Full circuits (``full=True``) go from the token embedding ``W_E`` through
the head to the unembedding ``W_U`` (with the final norm folded the same way), ignoring positions and norm scales,
like TransformerLens's ``W_E @ OV @ W_U``. Rotary position embeddings are not part of any circuit.

**Composition** (:func:`composition_score`, :func:`composition_scores`): for a sender head A in an earlier block and
a receiver head B, with ``W_OV^A = W_V^A W_O^A``,

* Q: ``‖W_OV^A · QK^B‖_F / (‖W_OV^A‖_F ‖QK^B‖_F)`` (A writes into B's queries),
* K: ``‖W_OV^A · (QK^B_res)ᵀ‖_F / (‖W_OV^A‖_F ‖QK^B‖_F)`` (into B's keys; ``QK^B_res`` = the residual columns, since
  nothing in the residual can write into a memory slot),
* V: ``‖W_OV^A · W_OV^B‖_F / (‖W_OV^A‖_F ‖W_OV^B‖_F)``,

which is TransformerLens's ``all_composition_scores`` for heads without slots. Consequences for neuron heads: their
K-composition is exactly 0 (their keys do not read the residual), and their Q- and V-composition are equal (query
and value read the same direction ``W_in[:, n]``, scaled by ``b_k`` and ``α_k``): both are
``‖W_OV^A·w_n‖ / (‖W_OV^A‖·‖w_n‖)``, the share of what A writes that neuron n reads; from neuron head to neuron head
it is ``|cos(W_out[m], W_in[:, n])|``. Scores of a head whose matrix is zero are 0. Biases are not part of the
scores (as in TransformerLens). All pairs are computed from low-rank factors (rank ``d_head`` for source heads, 1 for
neuron heads, once per neuron rather than per head), never forming a ``d_model × d_model`` matrix per pair.

**Gated and parallel models.** Matrices span the whole residual stream, including gated models' scratch channels
(``cfg.d_model + cfg.d_scratch``): gate heads write a scratch channel that product heads read, which shows up as
V-composition. In a parallel layer (GPT-J, GPT-NeoX) the neuron heads read the layer's input, so they do not compose
with that layer's attention heads (score 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformer_lens import FactoredMatrix

from lens_aot.components import NeuronAttention
from lens_aot.errors import InputError
from lens_aot.model import AttentionOnlyTransformer, HeadOrigin, HeadRef

__all__ = [
    "CompositionScores",
    "HeadLike",
    "HeadWeights",
    "as_head_ref",
    "circuit_input",
    "circuit_scores",
    "composition_score",
    "composition_scores",
    "head_label",
    "head_weights",
    "ov_circuit",
    "qk_circuit",
    "self_vs_slot_direction",
]

HeadLike = HeadRef | tuple[int, int] | tuple[str, int]
Mode = Literal["Q", "K", "V"]
_MODES = ("Q", "K", "V")
_CHUNK = 1 << 22  # elements of the per-chunk [senders, receivers, r_A, r_B] product in composition_scores


# ---------------------------------------------------------------------------------------------------- addressing
def _block_index(aot: AttentionOnlyTransformer, block: Any) -> int:
    if isinstance(block, str):
        parts = block.split(".")
        if len(parts) < 2 or parts[0] != "blocks" or not parts[1].isdigit():
            raise InputError(f"expected a block like 3 or 'blocks.3.attn'; got {block!r}")
        block = int(parts[1])
    if isinstance(block, bool) or not isinstance(block, int):
        raise InputError(f"a block is an int (e.g. 3) or a name like 'blocks.3.attn'; got {block!r}")
    n = len(aot.blocks)
    if not -n <= block < n:
        raise InputError(f"block {block} out of range: the model has {n} blocks (aot.cfg.n_layers)")
    return block % n


def as_head_ref(aot: AttentionOnlyTransformer, head: HeadLike) -> HeadRef:
    """Any head address (``HeadRef``, ``(block, head)``, ``("blocks.3.attn", head)``) as a checked ``HeadRef``."""
    if not isinstance(head, tuple) or len(head) != 2:
        raise InputError(
            f"a head is a HeadRef (e.g. aot.neuron_heads(layer, n)[0]), a (block, head) pair or "
            f"('blocks.3.attn', head); got {head!r}"
        )
    block = _block_index(aot, head[0])
    index = head[1]
    if isinstance(index, Tensor) and index.numel() == 1:
        index = int(index)
    if isinstance(index, bool) or not isinstance(index, int):
        raise InputError(f"a head index is an int; got {index!r}")
    n_heads = aot.cfg.n_heads_per_block[block]
    if not 0 <= index < n_heads:
        raise InputError(f"head {index} out of range: block {block} has {n_heads} heads (aot.cfg.n_heads_per_block)")
    return HeadRef(f"blocks.{block}.attn", index)


def _head_index(ref: HeadRef) -> tuple[int, int]:
    return int(ref.name.split(".")[1]), ref.head


def head_label(aot: AttentionOnlyTransformer, head: HeadLike) -> str:
    """A short label in TransformerLens's style: ``"L1H3"`` for head 3 of source layer 1's attention, ``"L1N17"``
    for neuron 17 of source layer 1's MLP (``"L1N17.2"``: its head 2, when a neuron has several heads)."""
    block, index = _head_index(as_head_ref(aot, head))
    origin = aot.head_origin(block, index)
    if origin.kind == "attention":
        return f"L{origin.layer}H{origin.index}"
    if origin.kind == "neuron":
        blocks = aot.neuron_blocks(origin.layer) if hasattr(aot, "neuron_blocks") else [block]
        per_neuron = sum(int(getattr(aot.blocks[b].attn, "heads_per_neuron", 1)) for b in blocks)
        return f"L{origin.layer}N{origin.index}" + (f".{origin.component}" if per_neuron > 1 else "")
    return f"B{block}H{index}"


# ---------------------------------------------------------------------------------------------------- per-head weights
@dataclass
class HeadWeights:
    """One head's weights in TransformerLens layout (``r`` = its internal dimension, ``s`` = its memory slots).

    A query at residual ``x`` scores a real key at ``y`` by ``(x W_Q + b_Q)·(y W_K + b_K) / attn_scale`` and slot
    ``i`` by ``(x W_Q + b_Q)·k_slot[i] / attn_scale``; values are ``y W_V + b_V`` and ``v_slot[i]``; the head writes
    ``z W_O``. With ``fold_ln`` the reading weights act on the normalized residual (see the module docstring).
    """

    block: int
    head: int
    W_Q: Float[Tensor, "d_model r"]
    b_Q: Float[Tensor, " r"]
    W_K: Float[Tensor, "d_model r"]
    b_K: Float[Tensor, " r"]
    W_V: Float[Tensor, "d_model r"]
    b_V: Float[Tensor, " r"]
    W_O: Float[Tensor, "r d_model"]
    k_slot: Float[Tensor, "s r"]
    v_slot: Float[Tensor, "s r"]
    attn_scale: float

    @property
    def n_slots(self) -> int:
        return self.k_slot.shape[0]


def _fold_norm(
    norm: Any, W: Float[Tensor, "... d_in r"], b: Float[Tensor, "... r"] | None
) -> tuple[Tensor, Tensor | None]:
    """TransformerLens's ``fold_ln`` on reading weights: absorb the norm's bias into ``b``, its weight into ``W``, and
    centre ``W`` over the normalized channels for LayerNorm (the mean subtraction). Identity where there is no norm.

    Only the first ``len(norm.w)`` rows of ``W`` (the normalized channels) are touched: gated models' product heads
    also read raw scratch channels after ``d_model``."""
    kind = getattr(norm, "kind", None)
    if norm is None or kind is None:
        return W, b
    ln_w, ln_b = getattr(norm, "w", None), getattr(norm, "b", None)
    width = next((len(t) for t in (ln_w, ln_b) if t is not None), W.shape[-2])
    head, tail = W[..., :width, :], W[..., width:, :]
    if ln_b is not None and b is not None:
        b = b + torch.einsum("d,...dr->...r", ln_b.detach().to(W.dtype), head)
    if ln_w is not None:
        head = head * ln_w.detach().to(W.dtype)[:, None]
    if kind in ("LN", "LNPre"):
        head = head - head.mean(dim=-2, keepdim=True)
    return torch.cat([head, tail], dim=-2), b


def _d_resid(aot: AttentionOnlyTransformer) -> int:
    """Width of the residual stream (``d_model``, plus gated models' scratch channels)."""
    return int(getattr(aot.cfg, "d_resid", aot.cfg.d_model))


def _pad_rows(W: Float[Tensor, "... d_in r"], width: int) -> Float[Tensor, "... width r"]:
    """Reading weights over the first ``d_in`` residual channels, as weights over all ``width`` channels."""
    return torch.nn.functional.pad(W, (0, 0, 0, width - W.shape[-2])) if W.shape[-2] < width else W


def _pad_cols(W: Float[Tensor, "... r d_out"], width: int) -> Float[Tensor, "... r width"]:
    """Writing weights to the first ``d_out`` residual channels (where a block places them), over all channels."""
    return torch.nn.functional.pad(W, (0, width - W.shape[-1])) if W.shape[-1] < width else W


def _kv_index(attn: Any, head: int) -> int:
    """Grouped-query attention: the key/value head that query head ``head`` uses."""
    return head // (attn.W_Q.shape[0] // attn.W_K.shape[0])


def _has_neuron_layout(attn: Any) -> bool:
    """A NeuronAttention with the shared-storage layout (head ``n·K + k`` = term k of neuron n)."""
    return isinstance(attn, NeuronAttention) and all(
        hasattr(attn, name) for name in ("W_in", "b_in", "W_out", "term_alpha", "term_b", "heads_per_neuron")
    )


def _neuron_out_rows(attn: NeuronAttention, neurons: Int[Tensor, " g"]) -> Float[Tensor, "g d_out"]:
    """Output rows of the given neurons: their ``W_out`` rows, or (gated models' gate heads, which write their
    activation to a scratch channel) the one-hot of that channel."""
    if attn.W_out is not None:
        return attn.W_out.detach()[neurons]
    offset, width = attn.scratch
    rows = attn.W_in.new_zeros(len(neurons), width)
    rows[torch.arange(len(neurons), device=rows.device), offset + neurons] = 1.0
    return rows


def _raw_head_weights(attn: Any, h: int) -> dict[str, Tensor]:
    """One head's stored weights; neuron heads are read from the shared ``W_in``/``W_out`` without building all."""
    if _has_neuron_layout(attn):
        n, k = divmod(h, attn.heads_per_neuron)
        w_in, b_in = attn.W_in[:, n], attn.b_in[n]
        alpha, beta, b, d = (getattr(attn, f"term_{c}")[k] for c in ("alpha", "beta", "b", "d"))
        return dict(
            W_Q=(b * w_in)[:, None],
            b_Q=(b * b_in + d)[None],
            W_K=w_in.new_zeros(w_in.shape[0], 1),
            b_K=w_in.new_zeros(1),
            W_V=(alpha * w_in)[:, None],
            b_V=(alpha * b_in + beta)[None],
            W_O=_neuron_out_rows(attn, torch.tensor([n], device=w_in.device)),
            k_slot=attn.k_bias[h][None],
            v_slot=attn.v_bias[h][None],
        )
    kv = _kv_index(attn, h)
    W_Q = attn.W_Q[h]
    r = W_Q.shape[-1]
    k_bias, v_bias = getattr(attn, "k_bias", None), getattr(attn, "v_bias", None)
    return dict(
        W_Q=W_Q,
        b_Q=attn.b_Q[h],
        W_K=attn.W_K[kv],
        b_K=attn.b_K[kv],
        W_V=attn.W_V[kv],
        b_V=attn.b_V[kv],
        W_O=attn.W_O[h],
        k_slot=W_Q.new_zeros(0, r) if k_bias is None else k_bias[h].reshape(-1, r),
        v_slot=W_Q.new_zeros(0, r) if v_bias is None else v_bias[h].reshape(-1, r),
    )


def head_weights(aot: AttentionOnlyTransformer, head: HeadLike, *, fold_ln: bool = True) -> HeadWeights:
    """A head's weights (detached) over the residual stream, with its block's norm folded in when ``fold_ln`` (see
    the module docstring).

    For a neuron head of neuron n, term k: ``W_Q = b_k·W_in[:, n]``, ``W_K = 0``, ``W_V = α_k·W_in[:, n]``,
    ``W_O = W_out[n]``, ``k_slot = [[−1]]``, ``v_slot = [[0]]``. (Gated models: matrices span the residual's
    ``d_model + d_scratch`` channels.)
    """
    ref = as_head_ref(aot, head)
    block, h = _head_index(ref)
    attn = aot.blocks[block].attn
    width = _d_resid(aot)
    with torch.no_grad():
        raw = {k: v.detach() for k, v in _raw_head_weights(attn, h).items()}
        for w, b in (("W_Q", "b_Q"), ("W_K", "b_K"), ("W_V", "b_V")):
            if fold_ln:
                raw[w], raw[b] = _fold_norm(aot.blocks[block].ln1, raw[w], raw[b])
            raw[w] = _pad_rows(raw[w], width)
        raw["W_O"] = _pad_cols(raw["W_O"], width)
    return HeadWeights(block=block, head=h, attn_scale=float(attn.attn_scale), **raw)


# ---------------------------------------------------------------------------------------------------- circuits
def _embedding(aot: AttentionOnlyTransformer) -> Float[Tensor, "d_vocab d_resid"]:
    """``W_E`` as writes to the residual stream (zero on gated models' scratch channels)."""
    return _pad_cols(aot.W_E.detach(), _d_resid(aot))


def _unembedding(aot: AttentionOnlyTransformer, fold_ln: bool) -> Float[Tensor, "d_resid d_vocab_out"]:
    """``W_U`` as a read of the residual stream (the final norm folded when ``fold_ln``; scratch channels unread)."""
    W_U = aot.W_U.detach()
    if fold_ln:
        W_U, _ = _fold_norm(aot.ln_final, W_U, None)
    return _pad_rows(W_U, _d_resid(aot))


def qk_circuit(
    aot: AttentionOnlyTransformer,
    head: HeadLike,
    *,
    fold_ln: bool = True,
    biases: bool = False,
    bias_slot: bool = True,
    full: bool = False,
) -> FactoredMatrix:
    """The head's QK circuit ``W_Q W̃_Kᵀ`` as a ``FactoredMatrix`` (Elhage et al. 2021), keys augmented with the
    head's memory slots.

    Rows index the query side, columns the key side; scores are ``row_input · QK · col_inputᵀ / attn_scale``.

    * rows: the (normalized, see ``fold_ln``) residual ``[d_model]``; with ``biases`` a last constant-1 row (the query
      bias ``b_Q``); with ``full`` the tokens ``[d_vocab]`` (``W_E`` rows, biases then added to every token).
    * columns: the residual ``[d_model]`` (``full``: tokens), then with ``biases`` a constant-1 column (the key bias
      ``b_K`` of real positions; not with ``full``), then with ``bias_slot`` one column per memory slot (neuron heads:
      1, the bias slot; source heads: none).

    For a neuron head the residual columns are zero and the slot column is ``−W_Q``: with ``biases`` the slot column
    gives ``−(b_k·z + d_k)``, minus the gate logit. ``bias_slot=False`` gives TransformerLens's ``QK``
    (``W_Q @ W_K.T``, ``[d_model, d_model]``), which is zero for neuron heads.
    """
    w = head_weights(aot, head, fold_ln=fold_ln)
    q_in, q_bias = w.W_Q, w.b_Q[None]
    k_res, k_bias = w.W_K, w.b_K[None]
    if full:
        W_E = _embedding(aot)
        q_in = W_E @ q_in + (q_bias if biases else 0.0)
        k_res = W_E @ k_res + (k_bias if biases else 0.0)
        rows, cols = [q_in], [k_res]
    else:
        rows = [q_in, q_bias] if biases else [q_in]
        cols = [k_res, k_bias] if biases else [k_res]
    if bias_slot:
        cols.append(w.k_slot)
    return FactoredMatrix(torch.cat(rows), torch.cat(cols).T)


def ov_circuit(
    aot: AttentionOnlyTransformer,
    head: HeadLike,
    *,
    fold_ln: bool = True,
    biases: bool = False,
    embed: bool = False,
    unembed: bool = False,
    full: bool = False,
) -> FactoredMatrix:
    """The head's OV circuit ``W_V W_O`` as a ``FactoredMatrix``: ``[d_model, d_model]``, rank ``d_head`` (1 for a
    neuron head: ``α_k·W_in[:, n] ⊗ W_out[n]``).

    * rows: the (normalized) residual the value reads; ``embed`` (or ``full``): the tokens ``[d_vocab]`` (``W_E``
      rows); with ``biases`` a constant-1 row (the value bias ``b_V``, for neuron heads ``α_k·b_in + β_k``; with
      ``embed`` it is added to every token instead) and then one row per memory slot (its value ``v_slot``, 0 for the
      bias slot).
    * columns: the residual the head writes to; ``unembed`` (or ``full``): the logits ``[d_vocab_out]`` (``W_U``, the
      final norm folded when ``fold_ln``).

    ``full=True`` is TransformerLens's ``W_E @ OV @ W_U``. ``unembed=True`` alone gives the head's direct effect on
    the logits per unit of ``hook_z``: for a neuron head ``.B`` is ``W_out[n] @ W_U`` ``[1, d_vocab_out]``.
    """
    w = head_weights(aot, head, fold_ln=fold_ln)
    embed, unembed = embed or full, unembed or full
    v_in = w.W_V
    if embed:
        v_in = _embedding(aot) @ v_in + (w.b_V[None] if biases else 0.0)
    rows = [v_in]
    if biases:
        if not embed:
            rows.append(w.b_V[None])
        rows.append(w.v_slot)
    out = w.W_O
    if unembed:
        out = out @ _unembedding(aot, fold_ln)
    return FactoredMatrix(torch.cat(rows), out)


def self_vs_slot_direction(
    aot: AttentionOnlyTransformer, head: HeadLike, *, fold_ln: bool = True
) -> tuple[Float[Tensor, " d_model"], float]:
    """For a head whose real keys are constant (a neuron head): ``(u, c)`` with ``score(self) − score(slot) =
    x·u + c`` for the normalized residual ``x`` (``fold_ln``) — the head's softmax over {self, slot} puts ``σ(x·u + c)``
    on itself. For neuron n, term k: ``u = b_k·W_in[:, n]`` (norm folded), ``c = b_k·b_in[n] + d_k``: the gate logit.

    Raises ``InputError`` for heads without a memory slot or whose keys read the residual (use
    :func:`circuit_scores`).
    """
    w = head_weights(aot, head, fold_ln=fold_ln)
    if w.n_slots != 1:
        raise InputError(
            f"{head_label(aot, head)} has {w.n_slots} memory slots; self_vs_slot_direction is for neuron heads, which "
            f"choose between themselves and one bias slot. Use qk_circuit or circuit_scores for other heads."
        )
    if bool(w.W_K.any()):
        raise InputError(
            f"{head_label(aot, head)}'s keys depend on the residual, so self-minus-slot is not linear in it; "
            f"use circuit_scores."
        )
    delta = (w.b_K - w.k_slot[0]) / w.attn_scale  # k_self − k_slot, scaled
    return w.W_Q @ delta, float(w.b_Q @ delta)


def _read_block(aot: AttentionOnlyTransformer, block: int) -> int:
    """The block whose input (``hook_resid_pre``) block ``block``'s norm reads: itself, or in a parallel layer (GPT-J,
    GPT-NeoX) the layer's first block, whose input all the layer's blocks read."""
    while block > 0 and getattr(aot.blocks[block], "parallel", False):
        block -= 1
    return block


def circuit_input(
    aot: AttentionOnlyTransformer, cache: Any, block: int | str, *, fold_ln: bool = True
) -> Float[Tensor, "... pos d_resid"]:
    """The activations a block's circuits act on, from a cache (``run_with_cache`` with the default names).

    With ``fold_ln``: the normalized residual ``blocks.{i}.ln1.hook_normalized``, or the residual the block reads
    where it has no norm. Without: the norm's output (what the attention module reads). Gated models: followed by the
    raw scratch channels of ``hook_resid_pre``.
    """
    b = _block_index(aot, block)
    norm, d_model = aot.blocks[b].ln1, aot.cfg.d_model

    def read(name: str) -> Tensor:
        try:
            return cache[name]
        except KeyError:
            raise InputError(
                f"{name} is not in the cache; run aot.run_with_cache(tokens) with a names_filter that keeps it"
            ) from None

    if getattr(norm, "kind", None) is None:
        main = read(f"blocks.{_read_block(aot, b)}.hook_resid_pre")[..., :d_model]
    elif fold_ln:
        main = read(f"blocks.{b}.ln1.hook_normalized")
    else:
        with torch.no_grad():
            main = norm(read(f"blocks.{_read_block(aot, b)}.hook_resid_pre")[..., :d_model])
    if _d_resid(aot) == main.shape[-1]:
        return main
    return torch.cat([main, read(f"blocks.{b}.hook_resid_pre")[..., main.shape[-1] :]], dim=-1)


def circuit_scores(
    aot: AttentionOnlyTransformer, head: HeadLike, x: Float[Tensor, "... pos d_resid"], *, fold_ln: bool = True
) -> Float[Tensor, "... query key_and_slots"]:
    """Attention scores of ``head`` computed from its QK circuit (with biases) on inputs ``x`` (see
    :func:`circuit_input`): ``[..., query, key]`` over the real positions, unmasked, followed by one column per memory
    slot. On the allowed keys this is the cached ``hook_attn_scores``; for a neuron head the last column is
    ``−q = −(b_k·z + d_k)`` and the pattern is the softmax over {self, slot}."""
    ref = as_head_ref(aot, head)
    attn = aot.blocks[_head_index(ref)[0]].attn
    if getattr(attn, "rotary_dim", 0):
        raise InputError(
            f"{head_label(aot, ref)} uses rotary positions, which are not part of its QK circuit: its scores depend "
            f"on relative position, so circuit_scores cannot reproduce them. Read hook_attn_scores from a cache."
        )
    if x.shape[-1] != _d_resid(aot):
        raise InputError(
            f"x must be [..., pos, {_d_resid(aot)}] (the residual as the block reads it); got {tuple(x.shape)}. "
            f"Use circuit_input(aot, cache, block, fold_ln=...) to get it from a cache."
        )
    qk = qk_circuit(aot, ref, fold_ln=fold_ln, biases=True, bias_slot=True)
    ones = x.new_ones(*x.shape[:-1], 1)
    q_side = torch.cat([x, ones], dim=-1) @ qk.A  # [..., pos, r]
    k_res = qk.B[:, : x.shape[-1] + 1]  # [r, d_model + 1]
    k_slot = qk.B[:, x.shape[-1] + 1 :]  # [r, s]
    real = q_side @ (torch.cat([x, ones], dim=-1) @ k_res.T).transpose(-1, -2)
    slots = q_side @ k_slot
    return torch.cat([real, slots], dim=-1) / float(attn.attn_scale)


# ---------------------------------------------------------------------------------------------------- composition
@dataclass
class _Factors:
    """Low-rank factors of a set of heads' circuits, one entry per *group* of heads whose circuits are scalar
    multiples of each other (each neuron's heads; each source head alone). Composition scores are invariant to
    such scalars, so they are computed once per group; ``ov_zero`` / ``qk_zero`` mark heads whose scalar is 0."""

    V: Float[Tensor, "g d_model r"]
    W_O: Float[Tensor, "g r d_model"]
    Q: Float[Tensor, "g d_model r"]
    K: Float[Tensor, "g d_model r"]
    K_slot: Float[Tensor, "g s r"]
    group: Int[Tensor, " n"]  # group of each selected head
    ov_zero: torch.Tensor  # bool [n]
    qk_zero: torch.Tensor  # bool [n]


def _block_factors(aot: AttentionOnlyTransformer, block: int, heads: Tensor, fold_ln: bool) -> _Factors:
    """Factors of the selected ``heads`` of ``block`` over the residual stream (reading weights folded with the
    block's norm when ``fold_ln``)."""
    attn = aot.blocks[block].attn
    norm = aot.blocks[block].ln1 if fold_ln else None
    width = _d_resid(aot)
    with torch.no_grad():
        if _has_neuron_layout(attn):
            k = attn.heads_per_neuron
            neurons, group = torch.unique(heads // k, return_inverse=True)
            w_in = attn.W_in.detach()[:, neurons].T[:, :, None]  # [g, d_model, 1]: what value and query both read
            w_in = _pad_rows(_fold_norm(norm, w_in, None)[0], width)
            term = heads % k
            slot = attn.k_bias.detach()[heads].reshape(len(heads), -1)
            return _Factors(
                V=w_in,
                W_O=_pad_cols(_neuron_out_rows(attn, neurons)[:, None, :], width),
                Q=w_in,
                K=torch.zeros_like(w_in),
                K_slot=torch.ones_like(w_in[:, :1, :]),
                group=group,
                ov_zero=attn.term_alpha[term] == 0,
                qk_zero=(attn.term_b[term] == 0) | (slot == 0).all(-1),
            )
        kv = heads // (attn.W_Q.shape[0] // attn.W_K.shape[0])
        W_Q, W_K, W_V = (
            _pad_rows(_fold_norm(norm, w.detach()[idx], None)[0], width)
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
            W_O=_pad_cols(attn.W_O.detach()[heads], width),
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


def _select_heads(aot: AttentionOnlyTransformer, block: int, heads: Any, role: str) -> list[int]:
    n_heads = aot.cfg.n_heads_per_block[block]
    if heads is None:
        return list(range(n_heads))
    if isinstance(heads, Tensor):
        heads = heads.tolist()
    out = []
    for h in heads:
        if isinstance(h, tuple):
            ref = as_head_ref(aot, h)
            if _head_index(ref)[0] != block:
                raise InputError(f"{role} {h!r} is not in block {block}; pass heads of that block (or their indices)")
            out.append(ref.head)
        else:
            out.append(_head_index(as_head_ref(aot, (block, h)))[1])
    if not out:
        raise InputError(f"no {role} heads selected; pass None for all heads of block {block}")
    return out


def _check_pair(aot: AttentionOnlyTransformer, sender: int, receiver: int, mode: str) -> None:
    if mode not in _MODES:
        raise InputError(f"mode must be one of {_MODES} (Q-, K- or V-composition); got {mode!r}")
    if not sender < receiver:
        raise InputError(
            f"composition needs the sender in an earlier block than the receiver (it reads the sender's output); "
            f"got sender block {sender}, receiver block {receiver}. Swap them if you meant the other direction."
        )


def _hide_normalized_channels(recv: _Factors, d_model: int) -> _Factors:
    """The receiver's reads as the sender's output reaches them in a parallel layer: the normalized channels (the
    first ``d_model``) come from the layer's input, which the sender's output is not part of; scratch channels
    (gated models) come from the block's own input."""

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

    ``scores[i, j]`` is the ``mode``-composition of ``senders[i]`` (in block ``sender_block``) into ``receivers[j]``
    (in block ``receiver_block``); ``sender_origins`` / ``receiver_origins`` say what each head was in the source and
    ``sender_labels`` / ``receiver_labels`` label plot axes (``"L0H3"``, ``"L0N17"``).
    """

    scores: Float[Tensor, "sender receiver"]
    mode: str
    sender_block: int
    receiver_block: int
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
            f"CompositionScores(mode={self.mode!r}, blocks {self.sender_block} -> {self.receiver_block}, "
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


def composition_scores(
    aot: AttentionOnlyTransformer,
    sender_block: int | str,
    receiver_block: int | str,
    mode: Mode,
    *,
    senders: Sequence[int | HeadLike] | Tensor | None = None,
    receivers: Sequence[int | HeadLike] | Tensor | None = None,
    fold_ln: bool = True,
) -> CompositionScores:
    """``mode``-composition scores (``"Q"``, ``"K"`` or ``"V"``; Elhage et al. 2021) of every head of
    ``sender_block`` into every head of a later ``receiver_block``, neuron heads included (definitions in the module
    docstring; for source heads this is TransformerLens's ``all_composition_scores``).

    ``senders`` / ``receivers`` restrict the heads (indices in their block, or HeadRefs), e.g. one head per neuron
    with ``range(0, n_heads, K)``: the cost is one rank-sized product per pair of *groups* (a neuron's K heads form
    one group), and the output is ``[len(senders), len(receivers)]``. Returns a :class:`CompositionScores`.

    Parallel layers (GPT-J, GPT-NeoX): a layer's neuron heads read the layer's input, not its attention heads'
    output, so those pairs score 0 (the receiver's matrix still sets the normalization).
    """
    sb, rb = _block_index(aot, sender_block), _block_index(aot, receiver_block)
    _check_pair(aot, sb, rb, mode)
    send_heads = _select_heads(aot, sb, senders, "sender")
    recv_heads = _select_heads(aot, rb, receivers, "receiver")
    device = aot.W_E.device
    send = _block_factors(aot, sb, torch.tensor(send_heads, device=device), fold_ln)
    recv = _block_factors(aot, rb, torch.tensor(recv_heads, device=device), fold_ln)
    seen = None if sb < _read_block(aot, rb) else _hide_normalized_channels(recv, aot.cfg.d_model)
    with torch.no_grad():
        scores = _scores(send, recv, mode, seen)
    send_refs = [HeadRef(f"blocks.{sb}.attn", h) for h in send_heads]
    recv_refs = [HeadRef(f"blocks.{rb}.attn", h) for h in recv_heads]
    return CompositionScores(
        scores=scores,
        mode=mode,
        sender_block=sb,
        receiver_block=rb,
        senders=send_refs,
        receivers=recv_refs,
        sender_origins=[aot.head_origin(sb, h) for h in send_heads],
        receiver_origins=[aot.head_origin(rb, h) for h in recv_heads],
        sender_labels=[head_label(aot, r) for r in send_refs],
        receiver_labels=[head_label(aot, r) for r in recv_refs],
    )


def composition_score(
    aot: AttentionOnlyTransformer, sender: HeadLike, receiver: HeadLike, mode: Mode, *, fold_ln: bool = True
) -> float:
    """The ``mode``-composition score (``"Q"``, ``"K"``, ``"V"``) of one sender head into one receiver head in a later
    block: a number in [0, 1] (definitions in the module docstring)."""
    s, r = as_head_ref(aot, sender), as_head_ref(aot, receiver)
    (sb, sh), (rb, rh) = _head_index(s), _head_index(r)
    return float(composition_scores(aot, sb, rb, mode, senders=[sh], receivers=[rh], fold_ln=fold_ln).scores[0, 0])
