"""In-place writes into any hook's output act as on the source (issue 23, item 1): one head's slice changes that head
only. Third-party libraries (EAP-IG, TL's own patching) write ``act[:, :, head] = ...`` into ``hook_q_input``,
``hook_k_input``, ``hook_v_input``, ``hook_attn_in``, ``hook_mlp_in``, ``hook_result``, ``hook_z``, ``hook_q/k/v``:
each write runs on the source and on the converted model and the logits must agree within the conversion's bound
(:meth:`interop.pairs.Pair.bound_for`). A write through an expanded (stride-0) view would reach every head (Δlogit
~1, far outside the bound), and every tensor a hook receives is checked to have no zero stride."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from interop.pairs import Pair, assert_close

# hook (under blocks.0) -> the switch that makes it fire, and whether it has a head axis at dim 2
HOOKS: dict[str, tuple[str | None, bool]] = {
    "hook_q_input": ("set_use_split_qkv_input", True),
    "hook_k_input": ("set_use_split_qkv_input", True),
    "hook_v_input": ("set_use_split_qkv_input", True),
    "hook_attn_in": ("set_use_attn_in", True),
    "hook_mlp_in": ("set_use_hook_mlp_in", False),
    "attn.hook_result": ("set_use_attn_result", True),
    "attn.hook_z": (None, True),
    "attn.hook_q": (None, True),
    "attn.hook_k": (None, True),
    "attn.hook_v": (None, True),
}


def _write(head: bool) -> Callable[[Tensor, Any], None]:
    """Add to head 1's slice (or, without a head axis, every position but the first) a rolled copy of itself, in
    place (not a rescaling, which a following norm would undo); return nothing, as libraries do."""

    def hook(act: Tensor, hook: Any) -> None:
        assert 0 not in act.stride(), f"{hook.name}: a hook receives an expanded (stride-0) view {act.stride()}"
        if head:
            act[:, :, 1] += 0.7 * act[:, :, 1].roll(1, dims=-1)
        else:
            act[:, 1:] += 0.7 * act[:, 1:].roll(1, dims=-1)

    return hook


def _switch(model: Any, setter: str | None, on: bool) -> None:
    if setter is not None:
        getattr(model, setter)(on)


def _applies(pair: Pair, hook: str, setter: str | None) -> str | None:
    """Why ``hook`` cannot be written on this family's source, or None."""
    if hook == "hook_mlp_in" and not pair.has_mlp:
        return "no MLP"
    if hook == "hook_mlp_in" and type(pair.source).__name__ == "TransformerBridge":
        # A bridge's hook_mlp_in is the residual stream itself (returning a new tensor also replaces the skip
        # connection, an in-place write reaches the attention output too); the converted model's is
        # HookedTransformer's: a copy that feeds the MLP only (checked on the HookedTransformer families).
        return "a TransformerBridge's hook_mlp_in is not HookedTransformer's MLP-only copy"
    if setter == "set_use_attn_in" and pair.aot.cfg.n_key_value_heads is not None:
        return "TransformerLens refuses use_attn_in with grouped-query attention"
    if setter is not None:
        try:
            getattr(pair.source, setter)(True)
        except NotImplementedError as e:  # a bridge whose attention has no such hook
            return f"the source cannot: {e}"
        finally:
            try:
                getattr(pair.source, setter)(False)
            except NotImplementedError:
                pass
    return None


@pytest.mark.parametrize("hook", list(HOOKS))
def test_inplace_write_changes_one_head(pair: Pair, hook: str) -> None:
    setter, head = HOOKS[hook]
    why = _applies(pair, hook, setter)
    if why is not None:
        pytest.skip(why)
    name = f"blocks.0.{hook}"
    if name not in pair.source.hook_dict and name.replace("blocks.0.", "blocks.0.attn.") not in pair.source.hook_dict:
        pytest.skip(f"the source ({type(pair.source).__name__}) has no {name}")
    src_name = name if name in pair.source.hook_dict else name.replace("blocks.0.", "blocks.0.attn.")

    def logits(model: Any, fwd_hooks: list[tuple[str, Any]]) -> Tensor:
        hook_name = name if model is not pair.source else src_name
        _switch(model, setter, True)
        try:
            with torch.no_grad(), model.hooks(fwd_hooks=[*fwd_hooks, (hook_name, _write(head))]):
                return model(pair.tokens)
        finally:
            _switch(model, setter, False)

    with torch.no_grad():
        plain = pair.source(pair.tokens)
    want, got = logits(pair.source, []), logits(pair.model, [])
    assert (want - plain).abs().max() > 1e-3, "the write must change the source's logits"
    assert_close(got, want, pair.bound_for(logits), f"in-place write to head 1 at {name}")


def test_inplace_write_to_neuron_heads(pair: Pair) -> None:
    """Zeroing, in place, the ``hook_z`` of every head of neuron 3 (``aot.neuron_heads(0, 3)``) is the source's
    ``mlp.hook_post[..., 3] = 0``; the other neurons' heads are untouched (plain MLPs: a neuron's activation is the
    sum of its heads' ``z``)."""
    if not pair.has_mlp or pair.aot.blocks[0].mlp.gated:
        pytest.skip("plain MLPs: a gated neuron's product heads do not sum to its activation")
    heads = [h.head for h in pair.aot.neuron_heads(0, 3)]

    def zero_heads(act: Tensor, hook: Any) -> None:
        assert 0 not in act.stride()
        act[:, :, heads] = 0.0

    def zero_post(act: Tensor, hook: Any) -> None:
        act[..., 3] = 0.0

    def logits(model: Any, fwd_hooks: list[tuple[str, Any]]) -> Tensor:
        if model is pair.model and model is not pair.source:
            write = ("blocks.0.mlp.heads.hook_z", zero_heads)
        else:
            write = ("blocks.0.mlp.hook_post", zero_post)
        with torch.no_grad(), model.hooks(fwd_hooks=[*fwd_hooks, write]):
            return model(pair.tokens)

    assert_close(logits(pair.model, []), logits(pair.source, []), pair.bound_for(logits), "neuron 3's heads zeroed")
