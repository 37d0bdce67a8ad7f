"""QK and OV circuits of one head as ``FactoredMatrix`` objects, and the scores its QK circuit gives on a cache.

See :mod:`lens_aot.analysis.circuits` for the conventions (keys augmented with memory slots, ``fold_ln``).
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor
from transformer_lens import FactoredMatrix

from lens_aot.analysis.checks import converted_only
from lens_aot.analysis.circuits.names import (
    HeadLike,
    SublayerLike,
    as_head_ref,
    head_label,
    head_module,
    head_norm,
    input_hook,
    normalized_hook,
    reads_scratch,
    scratch_hook,
    sublayer,
    writes_scratch,
)
from lens_aot.analysis.circuits.weights import HeadWeights, _fold_norm, _pad_cols, head_weights
from lens_aot.core.runtime.model import AttentionOnlyTransformer
from lens_aot.errors import InputError


def _embedding(aot: AttentionOnlyTransformer, width: int) -> Float[Tensor, "d_vocab width"]:
    """The effective embedding (``W_E`` times the Gemma families' embedding scale, ``Embed.scaled_W_E``) as the input
    of a head reading ``width`` channels (zero on the MLP's scratch, which the embedding does not write)."""
    return _pad_cols(aot.embed.scaled_W_E.detach(), width)


def _unembedding(aot: AttentionOnlyTransformer, w: HeadWeights, fold_ln: bool) -> Float[Tensor, "d_model d_vocab_out"]:
    """``W_U`` as a read of the residual stream (the final norm folded when ``fold_ln``)."""
    if writes_scratch(sublayer(aot, w.name)):
        raise InputError(
            f"{w.name} (gate heads, or a chained gate's square / direct heads) writes the MLP's scratch, not the "
            f"residual stream, so it has no direct path to "
            f"the logits; use the product heads of the same MLP (aot.neuron_module(layer)) for unembed/full circuits"
        )
    if hasattr(aot, "prediction_head"):  # ModernBERT-decoder: a dense MLP between ln_final and W_U
        raise InputError(
            "prediction_head: the logits read the residual stream through a prediction head (dense → act → norm), "
            "so no head has a linear path to them; use the circuits without unembed/full, or patch the logits"
        )
    W_U = aot.W_U.detach()
    if fold_ln:
        W_U, _ = _fold_norm(aot.ln_final, W_U, None, aot.cfg.d_model)
    return W_U


@converted_only
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
        W_E = _embedding(aot, q_in.shape[0])
        q_in = W_E @ q_in + (q_bias if biases else 0.0)
        k_res = W_E @ k_res + (k_bias if biases else 0.0)
        rows, cols = [q_in], [k_res]
    else:
        rows = [q_in, q_bias] if biases else [q_in]
        cols = [k_res, k_bias] if biases else [k_res]
    if bias_slot:
        cols.append(w.k_slot)
    return FactoredMatrix(torch.cat(rows), torch.cat(cols).T)


@converted_only
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
        v_in = _embedding(aot, v_in.shape[0]) @ v_in + (w.b_V[None] if biases else 0.0)
    rows = [v_in]
    if biases:
        if not embed:
            rows.append(w.b_V[None])
        rows.append(w.v_slot)
    out = w.W_O
    if unembed:
        out = out @ _unembedding(aot, w, fold_ln)
    return FactoredMatrix(torch.cat(rows), out)


@converted_only
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


@converted_only
def circuit_input(
    aot: AttentionOnlyTransformer, cache: Any, sub: SublayerLike, *, fold_ln: bool = True
) -> Float[Tensor, "... pos d_in"]:
    """The activations a sub-layer's circuits act on, from a cache (``run_with_cache`` with the default names).

    With ``fold_ln``: the normalized residual the sub-layer reads (``blocks.{l}.ln1.hook_normalized`` for attention,
    ``blocks.{l}.ln2.hook_normalized`` for the MLP's heads), or the residual itself where there is no norm
    (``hook_resid_pre``; the MLP's heads: ``hook_resid_mid``, parallel layers ``hook_resid_pre``). Without: the
    norm's output (what the heads read). Product heads: followed by the MLP's scratch (``product_heads.hook_gate``).
    """
    s = sublayer(aot, sub)
    norm = head_norm(aot, s)

    def read(name: str) -> Tensor:
        try:
            return cache[name]
        except KeyError:
            raise InputError(
                f"{name} is not in the cache; run aot.run_with_cache(tokens) with a names_filter that keeps it"
            ) from None

    if getattr(norm, "kind", None) is None:
        main = read(input_hook(aot, s))
    elif fold_ln:
        main = read(normalized_hook(s))
    else:
        with torch.no_grad():
            main = norm(read(input_hook(aot, s)))
    if not reads_scratch(s):
        return main
    scratch = read(scratch_hook(s))
    if scratch.shape[:-1] != main.shape[:-1]:  # a TransformerLens MoE's expert, cached on its routed rows
        raise InputError(
            f"{scratch_hook(s)} holds the expert's routed rows {list(scratch.shape)}, not every position; cache it "
            "within lens_aot.core.components.moe.source_expert_hooks.dense_expert_hooks(aot)"
        )
    return torch.cat([main, scratch], dim=-1)


@converted_only
def circuit_scores(
    aot: AttentionOnlyTransformer, head: HeadLike, x: Float[Tensor, "... pos d_in"], *, fold_ln: bool = True
) -> Float[Tensor, "... query key_and_slots"]:
    """Attention scores of ``head`` computed from its QK circuit (with biases) on inputs ``x`` (see
    :func:`circuit_input`): ``[..., query, key]`` over the real positions, unmasked, followed by one column per memory
    slot. On the allowed keys this is the cached ``hook_attn_scores``; for a neuron head the last column is
    ``−q = −(b_k·z + d_k)`` and the pattern is the softmax over {self, slot}."""
    ref = as_head_ref(aot, head)
    attn = head_module(aot, sublayer(aot, ref.name))
    variants = attn.non_bilinear_score_variants() if hasattr(attn, "non_bilinear_score_variants") else []
    if variants:
        raise InputError(
            f"{head_label(aot, ref)} computes its scores with {', '.join(variants)}, which its QK circuit does not "
            f"include, so circuit_scores cannot reproduce them. Read hook_attn_scores from a cache."
        )
    if getattr(attn, "rotary_dim", 0):
        raise InputError(
            f"{head_label(aot, ref)} uses rotary positions, which are not part of its QK circuit: its scores depend "
            f"on relative position, so circuit_scores cannot reproduce them. Read hook_attn_scores from a cache."
        )
    qk = qk_circuit(aot, ref, fold_ln=fold_ln, biases=True, bias_slot=True)
    width = qk.A.shape[0] - 1
    if x.ndim < 2 or x.shape[-1] != width:
        raise InputError(
            f"x must be [..., pos, {width}] (what {ref.name} reads); got {tuple(x.shape)}. "
            f"Use circuit_input(aot, cache, {ref.name!r}, fold_ln=...) to get it from a cache."
        )
    ones = x.new_ones(*x.shape[:-1], 1)
    q_side = torch.cat([x, ones], dim=-1) @ qk.A  # [..., pos, r]
    k_res = qk.B[:, : width + 1]  # [r, d_in + 1]
    k_slot = qk.B[:, width + 1 :]  # [r, s]
    real = q_side @ (torch.cat([x, ones], dim=-1) @ k_res.T).transpose(-1, -2)
    slots = q_side @ k_slot
    return torch.cat([real, slots], dim=-1) / float(attn.attn_scale)
