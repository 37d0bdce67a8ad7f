"""Pieces of a decoder layout that a TransformerBridge adapter leaves outside its component mapping, read from the
source and checked against its recorded forward (OPT; :mod:`lens_aot.tl.bridge.read` calls these).

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

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from jaxtyping import Float
from torch import Tensor, nn

from lens_aot.tl.bridge.components import _component, _copy, _original
from lens_aot.tl.bridge.probe import Call, refuse_piece

__all__ = [
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
            mlp = _component(block, "mlp")
            if mlp is None:
                continue
            for piece in ("in", "out"):
                projection = _component(mlp, piece)
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
    return _copy(table[offset : offset + n_ctx])


def unread_position_rows(bridge: Any) -> Float[Tensor, "offset d_model"] | None:
    """The rows before the offset of a position table looked up at ``position + offset`` (OPT's 2), which no forward
    reads, or None."""
    component = _component(bridge, "pos_embed")
    module = None if component is None else _original(component)
    offset = _lookup_offset(module)
    return None if not offset else _copy(module.weight[:offset])


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
    blocks = _component(bridge, "blocks")
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
    return _copy(table[offset : offset + n_ctx])
