"""Checking a bridge reading against the source's own recorded forward (:mod:`lens_aot.tl.reading.probe`): each
layer's pieces (:func:`verify_layer`: norms, attention, MLP) and what lies around the blocks (:func:`verify_model`:
embeddings, block chaining, final norm, logits), and naming the piece whose forward is not finite
(:func:`refuse_non_finite`). A piece lens_aot reads wrongly is refused naming the layer and the piece, never converted.
The pieces' outputs are the components' (:mod:`lens_aot.core.check.pieces`), built over the spec's tensors (no copy of
the layer's weights) and dropped at once.
"""

from __future__ import annotations

from typing import Any

import torch

from lens_aot.core.check.pieces import mlp_output, norm_output, prediction_head_output
from lens_aot.core.read import check_finite
from lens_aot.core.spec.model_spec import LayerSpec, ModelSpec, scaled
from lens_aot.errors import InvalidWeightsError
from lens_aot.tl.attention.shared_kv import checked_attention
from lens_aot.tl.reading.probe import Call, check_piece, close, inexact_piece, refuse_piece

__all__ = ["refuse_non_finite", "verify_layer", "verify_model"]


def verify_layer(
    layer: int, spec: LayerSpec, rotary: Any, causal: bool, calls: dict[tuple[int, str], Call], layers: list[LayerSpec]
) -> None:
    """Check each piece's reading against its recorded output (:mod:`lens_aot.tl.reading.probe`): each piece's
    output is its component's on the recorded input (:mod:`lens_aot.core.check.pieces`)."""
    with torch.no_grad():
        norms = (("ln1", spec.ln1), ("ln2", spec.ln2), ("ln1_post", spec.ln1_post), ("ln2_post", spec.ln2_post))
        for piece, norm in norms:
            call = calls.get((layer, piece))
            if norm is not None and call is not None:
                check_piece(layer, piece, norm_output(norm, call.input), call, f"the {norm.kind} reading")
        call = calls.get((layer, "attn"))
        if call is not None:
            got = checked_attention(layer, spec.attn, causal, rotary, calls, layers)  # read_shared_kv
            check_piece(layer, "attn", got, call, "the attention reading (scale, rotary, softmax)")
        call = calls.get((layer, "mlp"))
        if spec.mlp is not None and call is not None:
            got = mlp_output(spec.mlp, call.input)
            got = got.reshape(call.output.shape) if got.numel() == call.output.numel() else got  # Llama 4: flat
            check_piece(layer, "mlp", got, call, f"the {'gated ' if spec.mlp.gated else ''}{spec.mlp.act_fn} MLP")


def verify_model(
    spec: ModelSpec, calls: dict[tuple[int, str], Call], n_layers: int, embed_multiplier: float | None = None
) -> None:
    """Check what lies around the blocks against the recorded forward: the embeddings feed the first block, each
    block feeds the next, the final norm feeds the unembedding, and the logits are the unembedding's output."""
    logits, embed = calls.get((-1, "logits")), calls.get((-1, "embed"))
    if logits is None or embed is None or (0, "block") not in calls:
        raise refuse_piece(None, "model", "a forward pass whose embedding, blocks or logits could not be recorded")
    tokens, dtype = logits.input, logits.output.dtype
    with torch.no_grad():
        embedded = spec.embedded(tokens)  # W_E[tokens], times Gemma's embedding scale
        if not close(embedded, scaled(embed.output, embed_multiplier)):
            raise inexact_piece(dtype, None, "embed", "a token embedding that is not a table lookup (times a constant)")
        first = embedded if spec.W_pos is None else embedded + spec.W_pos[: tokens.shape[1]]
        if spec.embed_ln is not None:  # BLOOM's word_embeddings_layernorm
            first = norm_output(spec.embed_ln, first)
        if not close(first, calls[(0, "block")].input):
            raise inexact_piece(
                dtype,
                None,
                "embed",
                "a first block input that is not token + position embedding (an embedding multiplier "
                "or a post-embedding norm)",
            )
        for layer in range(1, n_layers):
            if not close(calls[(layer - 1, "block")].output, calls[(layer, "block")].input):
                raise inexact_piece(dtype, layer - 1, "block", "an output that is not the next block's input")
        final = calls[(n_layers - 1, "block")].output
        ln_final = calls.get((-1, "ln_final"))
        normed = norm_output(spec.ln_final, final)
        if ln_final is not None and not (close(ln_final.input, final) and close(normed, ln_final.output)):
            raise inexact_piece(
                dtype, None, "ln_final", "a final norm that is not read exactly or not fed by the last block"
            )
        if spec.prediction_head is not None:
            normed = prediction_head_output(spec.prediction_head, normed)
        out = normed @ spec.W_U + spec.b_U
        if spec.logits_scale is not None:
            out = out * spec.logits_scale
        if spec.logits_soft_cap is not None:
            out = spec.logits_soft_cap * torch.tanh(out / spec.logits_soft_cap)
        if not close(out, logits.output):
            raise inexact_piece(
                dtype,
                None,
                "unembed",
                "logits that are not unembed(ln_final(resid)) (e.g. a logit multiplier or final-logit soft-capping)",
            )


def refuse_non_finite(spec: ModelSpec, calls: dict[tuple[int, str], Call]) -> None:
    """The probe forward produced NaN / inf: name the non-finite weight (``check_finite``), or else the first piece
    whose output is not finite. Either way nothing is converted (the block layout could not be read)."""
    check_finite(spec)
    layer, piece = min(k for k, c in calls.items() if not bool(c.output.isfinite().all()))
    raise InvalidWeightsError(
        f"layer {layer} {piece}: the source's forward produces NaN or infinite activations on a probe input with "
        "finite weights; lens_aot cannot read how the block combines its pieces. Check the weights' scale first."
    )
