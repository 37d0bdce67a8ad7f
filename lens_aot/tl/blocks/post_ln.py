"""Post-LN blocks (the original GPT, ``OpenAIGPTLMHeadModel``) recognised from a bridge's recorded forward.

GPT-1's ``Block.forward``: ``n = ln_1(x + attn(x))``, ``h = ln_2(n + mlp(n))``. The bridge maps ``ln_1`` / ``ln_2``
to ``ln1`` / ``ln2`` like a pre-norm block's, so the layout is read from what each piece was given in one recorded
forward (:mod:`lens_aot.tl.reading.probe`): attention reads the block's input, ``ln1`` the block's input plus the
attention's output, the MLP ``ln1``'s output, ``ln2`` that plus the MLP's output, and the block returns ``ln2``'s
output. Every one of those must hold for the block to be read as post-LN (:attr:`LayerSpec.residual_norm
<lens_aot.core.spec.model_spec.LayerSpec.residual_norm>`,
:class:`~lens_aot.core.components.residual.post_ln_block.PostLNBlock`);
anything else falls through to the pre-norm reading, which refuses what it cannot read.
"""

from __future__ import annotations

from lens_aot.tl.reading.probe import Call, close

__all__ = ["is_post_ln", "norm_block_calls"]


def norm_block_calls(
    layer: int, calls: dict[tuple[int, str], Call], pieces: set[str]
) -> tuple[Call, Call, Call, Call, Call] | None:
    """Layer ``layer``'s recorded ``(block, attn, ln1, mlp, ln2)`` calls when its pieces are exactly ln1, ln2 and an
    MLP and all five were recorded (the blocks a post-LN or post-norm layout can describe); None otherwise."""
    if pieces != {"ln1", "ln2", "mlp"}:
        return None
    found = tuple(calls.get((layer, name)) for name in ("block", "attn", "ln1", "mlp", "ln2"))
    return None if any(call is None for call in found) else found  # type: ignore[return-value]


def is_post_ln(layer: int, calls: dict[tuple[int, str], Call], pieces: set[str]) -> bool:
    """Whether layer ``layer``'s recorded forward is ``ln2(n + mlp(n))`` with ``n = ln1(x + attn(x))``.

    ``pieces``: the block's pieces among ln1, ln2, ln1_post, ln2_post, mlp (a block with sandwich norms, or without
    an MLP or either norm, is not one)."""
    found = norm_block_calls(layer, calls, pieces)
    if found is None:
        return False
    block, attn, ln1, mlp, ln2 = found
    x = block.input
    return (
        close(attn.input, x)
        and not close(attn.input, ln1.output)
        and close(ln1.input, x + attn.output)
        and close(mlp.input, ln1.output)
        and close(ln2.input, ln1.output + mlp.output)
        and close(block.output, ln2.output)
    )
