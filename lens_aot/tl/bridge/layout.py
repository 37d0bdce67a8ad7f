"""How a block combines its pieces, read from its recorded forward (:func:`block_layout`: sequential, parallel with
two norms, parallel with one shared norm; sandwich norms, residual multipliers), and pieces of a decoder layout that a
TransformerBridge adapter leaves outside its component mapping, read from the source and checked against its recorded
forward (OPT; :mod:`lens_aot.tl.bridge.read` calls these).

* **A containerless MLP** (OPT: ``fc1``/``fc2`` sit directly on the decoder layer, so the ``mlp`` bridge never
  runs as a module): :func:`containerless_mlp_hooks` records its ``in`` projection's input and its
  ``out`` projection's output during the probe forward, and :func:`merge_containerless` turns them into the ``mlp``
  piece's call. OPT runs ``ln2`` and the MLP on ``[batch·pos, d_model]``; those calls are reshaped to the block's
  ``[batch, pos, d_model]``.
* **Learned positions with an offset** (OPT's ``OPTLearnedPositionalEmbedding``: row ``position + offset``, the
  module's public ``offset``, 2): :func:`position_table`; **positions the mapping omits** (XGLM's sinusoidal table,
  a buffer): :func:`unmapped_position_table`.
* **An embedding projection** (OPT's ``project_in`` / ``project_out``): refused by name
  (:func:`check_embedding_projection`).

A prediction head between the final norm and the unembedding (ModernBERT-decoder's ``lm_head``, the bridge's
``prediction_head``) is read by :mod:`lens_aot.tl.blocks.prediction_head`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from jaxtyping import Float
from torch import Tensor, nn

from lens_aot.core.spec.model_spec import scaled
from lens_aot.tl.blocks.post_norm import post_norm_mismatch
from lens_aot.tl.reading.pieces import detached_copy, subcomponent, wrapped_module
from lens_aot.tl.reading.probe import Call, close, inexact_piece, refuse_piece

__all__ = [
    "block_layout",
    "check_embedding_projection",
    "containerless_mlp_hooks",
    "merge_containerless",
    "position_table",
    "unmapped_position_table",
]


@contextmanager
def containerless_mlp_hooks(blocks: list[Any]) -> Iterator[dict[tuple[int, str], Call]]:
    """While open, record ``(layer, "mlp_in")`` / ``(layer, "mlp_out")``: the ``mlp`` bridge's ``in`` projection's
    input and ``out`` projection's output (used only where the ``mlp`` bridge itself does not run; the hooks are
    removed on exit, whatever happens)."""
    calls: dict[tuple[int, str], Call] = {}
    handles = []

    def hook(key: tuple[int, str]) -> Any:
        def fn(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if args and isinstance(args[0], Tensor) and isinstance(output, Tensor):
                calls[key] = Call(args[0].detach().clone(), output.detach().clone())

        return fn

    try:
        for layer, block in enumerate(blocks):
            mlp = subcomponent(block, "mlp")
            if mlp is None:
                continue
            for piece in ("in", "out"):
                projection = subcomponent(mlp, piece)
                module = getattr(projection, "original_component", None)  # the nn.Linear (a bridge component's
                if isinstance(module, nn.Module):  # own register_forward_hook attaches to its hook points)
                    handles.append(module.register_forward_hook(hook((layer, f"mlp_{piece}"))))
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def merge_containerless(calls: dict[tuple[int, str], Call], extra: dict[tuple[int, str], Call], n_layers: int) -> None:
    """Add each containerless MLP's call (input of ``in``, output of ``out``) to ``calls``, and reshape flattened
    ``[batch·pos, d]`` ``ln2`` / MLP calls to the block's ``[batch, pos, d]``."""
    for layer in range(n_layers):
        block = calls.get((layer, "block"))
        if block is None:
            continue
        shape = block.input.shape
        if (layer, "mlp") not in calls and (layer, "mlp_in") in extra and (layer, "mlp_out") in extra:
            calls[(layer, "mlp")] = Call(extra[(layer, "mlp_in")].input, extra[(layer, "mlp_out")].output)
        for piece in ("ln2", "mlp"):
            call = calls.get((layer, piece))
            if call is not None and call.input.ndim == 2 and call.input.shape[0] == shape[0] * shape[1]:
                calls[(layer, piece)] = Call(call.input.reshape(*shape[:2], -1), call.output.reshape(*shape[:2], -1))


def _lookup_offset(module: nn.Module | None) -> int | None:
    """The public integer ``offset`` of an ``nn.Embedding`` subclass that looks positions up at ``position +
    offset`` (OPT's 2), or None for any other module."""
    offset = getattr(module, "offset", None)
    return offset if isinstance(module, nn.Embedding) and isinstance(offset, int) and offset >= 0 else None


def position_table(module: nn.Module, n_ctx: int) -> Float[Tensor, "n_ctx d_model"] | None:
    """Rows ``offset … offset + n_ctx`` of a position table looked up at ``position + offset``
    (:func:`_lookup_offset`), or None for any other module."""
    offset = _lookup_offset(module)
    if offset is None:
        return None
    table = module.weight
    if table.shape[0] < offset + n_ctx:
        raise refuse_piece(None, "pos_embed", f"a position table of {table.shape[0] - offset} rows for n_ctx={n_ctx}")
    return detached_copy(table[offset : offset + n_ctx])


def unread_position_rows(bridge: Any) -> Float[Tensor, "offset d_model"] | None:
    """The rows before the offset of a position table looked up at ``position + offset`` (OPT's 2), which no forward
    reads, or None."""
    component = subcomponent(bridge, "pos_embed")
    module = None if component is None else wrapped_module(component)
    offset = _lookup_offset(module)
    return None if not offset else detached_copy(module.weight[:offset])


def check_embedding_projection(hf_config: Any) -> None:
    """Refuse, naming the piece, a projection between the embedding width and the residual width (OPT's
    ``project_in`` / ``project_out`` when ``word_embed_proj_dim`` differs from ``hidden_size``)."""
    width, hidden = getattr(hf_config, "word_embed_proj_dim", None), getattr(hf_config, "hidden_size", None)
    if isinstance(width, int) and isinstance(hidden, int) and width != hidden:
        raise refuse_piece(
            None,
            "embed",
            f"projections between the embedding width {width} and the residual width {hidden} (project_in / "
            "project_out, word_embed_proj_dim != hidden_size)",
        )


def unmapped_position_table(bridge: Any, model: nn.Module, n_ctx: int) -> Float[Tensor, "n_ctx d_model"] | None:
    """The position table of a source module the adapter does not map (XGLM's sinusoidal
    ``XGLMSinusoidalPositionalEmbedding``: rows ``position + offset`` of its public ``weights`` buffer), or None
    when the source has no such module outside its blocks. The caller checks the first block's input against
    token + position embedding, so a table read wrongly is refused."""
    wrapped = {id(getattr(m, "original_component", None)) for m in bridge.modules()}
    blocks = subcomponent(bridge, "blocks")
    inside = {id(m) for block in (blocks or []) for m in getattr(block, "original_component", block).modules()}
    d_model = int(bridge.cfg.d_model)
    found = []
    for module in model.modules():
        if id(module) in wrapped or id(module) in inside or isinstance(module, nn.Embedding):
            continue
        offset, table = getattr(module, "offset", None), getattr(module, "weights", None)
        if isinstance(offset, int) and isinstance(table, Tensor) and table.ndim == 2 and table.shape[1] == d_model:
            found.append((offset, table))
    if len(found) != 1:
        return None
    offset, table = found[0]
    if table.shape[0] < offset + n_ctx:
        raise refuse_piece(None, "pos_embed", f"a position table of {table.shape[0] - offset} rows for n_ctx={n_ctx}")
    return detached_copy(table[offset : offset + n_ctx])


def block_layout(
    layer: int,
    calls: dict[tuple[int, str], Call],
    has: set[str],
    multiplier: float | None = None,
    finish: Callable[[Tensor], Tensor] = lambda out: out,
) -> tuple[bool, bool]:
    """``(parallel, shared_ln)`` of layer ``layer`` from its recorded forward, or a refusal naming what it is not.

    ``has``: the block's pieces among ln1, ln2, ln1_post, ln2_post, mlp. Sublayer outputs pass through the sandwich
    norms ``ln1_post`` / ``ln2_post`` if any (Gemma 2/3, OLMo-2), then the residual ``multiplier`` (Granite); ``finish``
    acts on the sum (Gemma 4's per-layer-input sublayer and layer scalar, lens_aot.tl.blocks.per_layer_inputs).
    """
    block, attn = calls.get((layer, "block")), calls.get((layer, "attn"))
    ln1, ln2 = calls.get((layer, "ln1")), calls.get((layer, "ln2"))
    if block is None or attn is None:
        raise refuse_piece(layer, "block", "pieces that did not run in a forward pass (cannot read how they combine)")
    x, dtype = block.input, block.output.dtype
    if not close(attn.input, ln1.output if ln1 is not None else x):
        if (post_norm := post_norm_mismatch(layer, calls, has)) is not None:  # (lens_aot.tl.blocks.post_norm)
            raise inexact_piece(
                dtype, layer, *post_norm, "Post-norm blocks are read as m = x + ln1(attn(x)), m + ln2(mlp(m))."
            )
        raise inexact_piece(
            dtype,
            layer,
            "attn",
            "an input that is not ln1's output: post-LN blocks (BERT-style: resid = ln(resid + sublayer(resid)))",
            "Only pre-norm blocks (resid += sublayer(ln(resid))) are supported.",
        )
    a_out = scaled(_post_norm_output(layer, "ln1_post", attn.output, calls, has), multiplier)
    if "mlp" not in has:
        if not close(block.output, x + a_out):
            raise inexact_piece(
                dtype, layer, "block", "an output that is not input + attention (a residual multiplier?)"
            )
        return False, False
    mlp = calls.get((layer, "mlp"))
    if mlp is None or ("ln2" in has and ln2 is None):
        raise refuse_piece(layer, "mlp", "a piece that did not run in a forward pass")
    if "ln2" not in has and "ln1" in has:
        if ln1 is None or not close(mlp.input, ln1.output):
            raise inexact_piece(dtype, layer, "mlp", "an input that is neither ln2's output nor the shared ln1's")
        parallel, shared = True, True
    else:
        if ln2 is not None and not close(mlp.input, ln2.output):
            raise inexact_piece(dtype, layer, "mlp", "an input that is not ln2's output")
        mlp_in = ln2.input if ln2 is not None else mlp.input
        sequential, parallel = close(mlp_in, x + a_out), close(mlp_in, x)
        if sequential == parallel:
            raise inexact_piece(
                dtype, layer, "mlp", "an input that is neither from the block input (parallel) nor input + attention"
            )
        shared = False
    out = x + a_out + scaled(_post_norm_output(layer, "ln2_post", mlp.output, calls, has), multiplier)
    if not close(block.output, finish(out)):
        raise inexact_piece(
            dtype,
            layer,
            "block",
            "an output that is not input + attention + MLP (e.g. unseen norms or a residual multiplier)",
        )
    return parallel, shared


def _post_norm_output(layer: int, piece: str, out: Tensor, calls: dict[tuple[int, str], Call], has: set[str]) -> Tensor:
    """A sublayer's output after its post norm ``piece`` when the block has one (which must read that output)."""
    if piece not in has:
        return out
    call = calls.get((layer, piece))
    if call is None or not close(call.input, out):
        raise refuse_piece(layer, piece, "a post norm that does not normalise its sublayer's output")
    return call.output
