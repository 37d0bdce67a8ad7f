"""Post-norm blocks (OLMo-2/3, FlexOLMo, EXAONE 4) recognised from a bridge's recorded forward, whatever the labels.

The Hugging Face layer (``Olmo2DecoderLayer.forward``) has no norm before its sublayers; each sublayer's output is
normalized before it joins the residual stream::

    resid_mid  = x + post_attention_layernorm(self_attn(x))
    resid_post = resid_mid + post_feedforward_layernorm(mlp(resid_mid))

TransformerLens 4.3's adapter maps those two norms to ``ln1_post`` / ``ln2_post`` (no ``ln1`` / ``ln2``), which the
pre-norm reading of :func:`lens_aot.tl.bridge.layout.block_layout` takes as sandwich norms around identity pre-norms.
TransformerLens 3.9's adapter maps them to ``ln1`` / ``ln2`` (and aliases ``hook_attn_out`` to ``ln1.hook_out``),
so a reading by label would take them for pre-norms. This module reads the layout from what each piece was given in
one recorded forward (:mod:`lens_aot.tl.reading.probe`): attention reads the block's input, ``ln1`` the attention's
output, the MLP ``x + ln1``'s output, ``ln2`` the MLP's output, and the block returns ``x + ln1(…) + ln2(…)``. When
every one of those holds the layer is :attr:`LayerSpec.post_norm <lens_aot.core.spec.model_spec.LayerSpec.post_norm>`,
the
placement TransformerLens's own OLMo-2 HookedTransformer uses with the same names, so ``blocks.{l}.ln1`` of the
converted model is the source bridge's ``blocks.{l}.ln1`` (the post-attention norm). The BERT-style post-LN residual
norm (``ln1(x + attn(x))``, :mod:`lens_aot.tl.blocks.post_ln`) differs in what ``ln1`` reads (the sum, not the
attention's output alone), so the two are never confused.
"""

from __future__ import annotations

from lens_aot.tl.blocks.post_ln import norm_block_calls
from lens_aot.tl.reading.probe import Call, close

__all__ = ["is_post_norm", "post_norm_mismatch"]


def is_post_norm(layer: int, calls: dict[tuple[int, str], Call], pieces: set[str]) -> bool:
    """Whether layer ``layer``'s recorded forward is ``m = x + ln1(attn(x))``, ``out = m + ln2(mlp(m))``.

    ``pieces``: the block's pieces among ln1, ln2, ln1_post, ln2_post, mlp (only a block of exactly ln1, ln2 and an
    MLP can be one; TransformerLens 4.3's ``ln1_post`` / ``ln2_post`` mapping is read as sandwich norms instead)."""
    found = norm_block_calls(layer, calls, pieces)
    if found is None:
        return False
    block, attn, ln1, mlp, ln2 = found
    x = block.input
    mid = x + ln1.output
    return (
        close(attn.input, x)
        and not close(attn.input, ln1.output)
        and close(ln1.input, attn.output)
        and close(mlp.input, mid)
        and close(ln2.input, mlp.output)
        and close(block.output, mid + ln2.output)
    )


def post_norm_mismatch(layer: int, calls: dict[tuple[int, str], Call], pieces: set[str]) -> tuple[str, str] | None:
    """``(piece, what)`` naming the first part of a post-norm layout that layer ``layer``'s recorded forward breaks,
    when it starts as one (attention reads the block's input and ``ln1`` the attention's output); None otherwise.

    For a refusal that says what the block is (``layer 0 block: a post-norm block whose output ...``) rather than
    reading it as a pre-norm block whose attention skips ``ln1``."""
    block, attn, ln1 = calls.get((layer, "block")), calls.get((layer, "attn")), calls.get((layer, "ln1"))
    if block is None or attn is None or ln1 is None or not close(attn.input, block.input):
        return None
    if close(attn.input, ln1.output) or not close(ln1.input, attn.output):
        return None
    start = "a post-norm block (ln1 normalises the attention's output, no norm before it)"
    mlp, ln2 = calls.get((layer, "mlp")), calls.get((layer, "ln2"))
    if pieces != {"ln1", "ln2", "mlp"} or mlp is None or ln2 is None:
        return "block", f"{start} with pieces {sorted(pieces)} (only ln1, attention, an MLP and ln2 are read)"
    mid = block.input + ln1.output
    if not close(mlp.input, mid):
        return "mlp", f"{start} whose MLP does not read input + ln1(attention) (e.g. a parallel post-norm layer)"
    if not close(ln2.input, mlp.output):
        return "ln2", f"{start} whose ln2 does not normalise the MLP's output"
    if close(block.output, mid + ln2.output):
        return None
    return "block", f"{start} whose output is not input + ln1(attention) + ln2(MLP) (e.g. a residual multiplier)"
