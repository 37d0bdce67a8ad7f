"""The neuron heads' packed computation while nothing observes them (``q`` and ``v`` in one buffer, ``z = σ(q)·v`` as
one ``glu``, the buffers lent by the forward's workspace, :mod:`lens_aot.core.components.workspace`): bitwise the
values of the per-head computation it replaces (Theorem 3's heads), layer after layer, and only while no hook, global
module hook or gradient could see the tensors."""

from __future__ import annotations

import pytest
import torch
from factories_spec import random_spec
from torch import Tensor

import lens_aot
from lens_aot.core.components import workspace
from lens_aot.core.components.mlp.neuron_attention import NeuronAttention, SelfAndSlotHeads, attend_self_and_slot
from lens_aot.core.fit.activations import activation_fit
from lens_aot.core.spec.model_spec import MLPSpec

INTERNAL = ("hook_q", "hook_k", "hook_v", "hook_z")


@pytest.fixture(autouse=True)
def packed_at_every_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """The packed path at these tiny sizes too (a model takes it from ``PACKED_MIN_ELEMENTS`` per-head elements)."""
    monkeypatch.setattr(SelfAndSlotHeads, "PACKED_MIN_ELEMENTS", 0)


def per_head_z(heads: SelfAndSlotHeads, q_in: Tensor, v_in: Tensor) -> Tensor:
    """``hook_z`` by the per-head path (queries, values, the closed-form two-key softmax), as before packing."""
    q, v = heads.queries(q_in), heads.values(v_in)
    return attend_self_and_slot(heads, q, q_in.new_zeros(()).expand(*q.shape), v, True, True)[0]


def neuron_heads(act_fn: str, dtype: torch.dtype) -> NeuronAttention:
    g = torch.Generator().manual_seed(0)
    d_model, d_mlp = 16, 24
    w_in, b_in = torch.randn(d_model, d_mlp, generator=g), torch.randn(d_mlp, generator=g)
    w_out, b_out = torch.randn(d_mlp, d_model, generator=g), torch.randn(d_model, generator=g)
    mlp = MLPSpec(*(t.to(dtype) for t in (w_in, b_in, w_out, b_out)), act_fn)
    return NeuronAttention(mlp, activation_fit(act_fn)).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("act_fn", ["gelu", "silu"])  # K = 6 and 8 terms (float32 / float64 bound), and one term
@pytest.mark.parametrize("shape", [(1, 1), (2, 37), (1, 301)])  # vector-length tails of every kind
def test_packed_neuron_heads_equal_the_per_head_path_bitwise(
    dtype: torch.dtype, act_fn: str, shape: tuple[int, int]
) -> None:
    heads = neuron_heads(act_fn, dtype)
    pre = 3 * torch.randn(*shape, heads.d_mlp, generator=torch.Generator().manual_seed(1), dtype=dtype)
    with torch.no_grad():
        assert heads._packable(pre, pre)
        z, standard = heads._attend(pre, pre)
        assert standard and z.shape == (*shape, heads.n_heads, 1)
        assert torch.equal(z, per_head_z(heads, pre, pre))
        # and the neurons' sum is the fit itself, evaluated independently (float64, the fit's own terms)
        post = heads.neuron_output(z).double()
        torch.testing.assert_close(post, heads.fit(pre.double()), rtol=0, atol=64 * torch.finfo(dtype).eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("act_fn", "gated"), [("gelu", True), ("silu", True), ("silu", False)])
def test_packed_gate_and_product_heads_in_a_model_equal_the_per_head_path(
    dtype: torch.dtype, act_fn: str, gated: bool
) -> None:
    """A gated GELU model, and SiLU ones (one term: the activation may be a view of ``hook_z``, never of a lent
    buffer): every layer's ``hook_post`` (hooked; the heads unhooked, so packed and lent the same buffers layer after
    layer) and the logits equal those of the per-head path (a no-op hook on each head's internals), bitwise; the
    second forward reuses the first one's workspace."""
    aot = lens_aot.convert(random_spec(act_fn=act_fn, gated=gated, n_layers=2, d_mlp=40, dtype=dtype)).eval()
    tokens = torch.randint(0, 50, (2, 19), generator=torch.Generator().manual_seed(0))
    posts = [f"blocks.{layer}.mlp.hook_post" for layer in range(2)]
    keep = lambda name: name in posts  # noqa: E731
    with torch.no_grad():
        logits, cache = aot.run_with_cache(tokens, names_filter=keep)
        retained = workspace._RETAINED[0]
        again = aot(tokens)
        assert workspace._RETAINED == [retained]  # taken and given back
        heads = [name for name in aot.hook_dict if "_heads." in name and name.split(".")[-1] in INTERNAL]
        assert (
            not gated
            or any(".gate_heads." in name for name in heads)
            and any(".product_heads." in name for name in heads)
        )
        with aot.hooks(fwd_hooks=[(name, lambda t, hook: t) for name in heads]):
            per_head_logits, per_head = aot.run_with_cache(tokens, names_filter=keep)
    assert torch.equal(logits, per_head_logits) and torch.equal(again, logits)
    for name in posts:
        assert torch.equal(cache[name], per_head[name])


def test_packed_path_only_while_nothing_observes_the_heads() -> None:
    """A hook on any internal hook point, a global module hook, ``use_attn_result`` or a gradient through the inputs
    keeps the per-head path: the tensors a hook sees are then their own, not views of a lent buffer."""
    heads = neuron_heads("gelu", torch.float32)
    pre = torch.randn(2, 5, heads.d_mlp)
    assert heads._packable(pre, pre)
    assert not heads._packable(pre.requires_grad_(), pre)
    pre = pre.detach()
    assert not heads._packable(pre.half(), pre.half())
    for name in INTERNAL + ("hook_attn_scores", "hook_pattern"):
        for register in ("register_forward_hook", "register_forward_pre_hook"):
            handle = getattr(getattr(heads, name), register)(lambda *args: None)
            assert not heads._packable(pre, pre), (name, register)
            handle.remove()
    assert heads._packable(pre, pre)
    seen: list[Tensor] = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, out: seen.append(out))
    try:
        assert not heads._packable(pre, pre)
        with torch.no_grad(), workspace.forward_workspace():
            z = heads.attend(pre)
    finally:
        handle.remove()
    assert len(seen) == 4 and len({t.untyped_storage().data_ptr() for t in seen}) == 4  # q, k, v, z: own storage
    assert torch.equal(z, per_head_z(heads, pre, pre))
    heads.use_attn_result = True
    assert not heads._packable(pre, pre)


def test_workspace_lends_one_buffer_per_slot_and_keeps_only_a_small_one(monkeypatch: pytest.MonkeyPatch) -> None:
    like = torch.zeros(())
    monkeypatch.setattr(workspace, "_RETAINED", [])
    with workspace.forward_workspace():
        a = workspace.scratch("x", (2, 3), like)
        with workspace.forward_workspace():  # nested: the same workspace
            b = workspace.scratch("x", (3, 2), like)
        assert a.data_ptr() == b.data_ptr() and workspace.scratch("y", (2,), like).data_ptr() != a.data_ptr()
    assert len(workspace._RETAINED) == 1 and workspace._RETAINED[0].nbytes == 8 * 4
    assert workspace.scratch("x", (2, 3), like).data_ptr() != a.data_ptr()  # outside: a fresh tensor
    monkeypatch.setattr(workspace, "RETAINED_BYTES", 16)
    monkeypatch.setattr(workspace, "_RETAINED", [])
    with workspace.forward_workspace():
        workspace.scratch("x", (5,), like)
    assert workspace._RETAINED == []  # 20 bytes > 16: dropped when its forward ended


def test_tiny_inputs_take_the_per_head_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SelfAndSlotHeads, "PACKED_MIN_ELEMENTS", 1 << 16)
    heads = neuron_heads("gelu", torch.float32)  # 24 neurons x K heads per position
    small = torch.randn(1, 8, 24)
    large = torch.randn(1, (1 << 16) // heads.n_heads + 1, 24)
    assert not heads._packable(small, small) and heads._packable(large, large)
