"""TransformerLens's ActivationCache stacking, decomposition and labels, unmodified, on source and converted models.

Each test computes a quantity with the TL method on both models' caches and asserts: same labels (the source's unit
names: ``L1H2``, ``L0N17``, ``0_attn_out`` ...), same shape, values within the bound of :meth:`Pair.bound_for`
(the conversion's ``8·S + 4·R`` construction applied to that quantity; residual-space rows have no logit bound of
their own, so the bound is measured on the quantity itself).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from interop.pairs import Pair, answer_pair, assert_close

CacheFn = Callable[[Any], tuple[Tensor, list[str]] | Tensor]


def _run(model: Any, tokens: Tensor, fwd_hooks: list[tuple[str, Any]]) -> Any:
    with torch.no_grad(), model.hooks(fwd_hooks=fwd_hooks):
        _, cache = model.run_with_cache(tokens)
    return cache


def _compare(p: Pair, fn: CacheFn, what: str) -> None:
    """``fn(cache)`` on both models: labels equal, values within the quantity's bound."""

    def value(model: Any, fwd_hooks: list[tuple[str, Any]]) -> Tensor:
        out = fn(_run(model, p.tokens, fwd_hooks))
        return out[0] if isinstance(out, tuple) else out

    want = fn(_run(p.source, p.tokens, []))
    got = fn(_run(p.model, p.tokens, []))
    if isinstance(want, tuple):
        assert isinstance(got, tuple)
        assert list(got[1]) == list(want[1]), f"{what}: labels differ"
        want, got = want[0], got[0]
    assert_close(got, want, p.bound_for(value), what)


def test_accumulated_resid(pair: Pair) -> None:
    _compare(pair, lambda c: c.accumulated_resid(incl_mid=pair.has_resid_mid, return_labels=True), "accumulated_resid")
    _compare(pair, lambda c: c.accumulated_resid(apply_ln=True, pos_slice=-1, return_labels=True), "with ln")


def test_decompose_resid(pair: Pair) -> None:
    _compare(pair, lambda c: c.decompose_resid(return_labels=True), "decompose_resid")
    _compare(pair, lambda c: c.decompose_resid(apply_ln=True, pos_slice=-1, return_labels=True), "with ln")
    if pair.has_mlp and pair.source.cfg.n_layers > 1:
        _compare(pair, lambda c: c.decompose_resid(layer=1, mode="mlp", return_labels=True), "layer 1, mlp")


def test_stack_head_results(pair: Pair) -> None:
    """Every one of the source's heads, labelled ``L{l}H{h}``: n_layers × n_heads rows, no neuron head among them."""
    n_rows = int(pair.source.cfg.n_layers * pair.source.cfg.n_heads)

    def heads(c: Any) -> tuple[Tensor, list[str]]:
        stack, labels = c.stack_head_results(return_labels=True)
        assert stack.shape[0] == len(labels) == n_rows
        return stack, labels

    _compare(pair, heads, "stack_head_results")
    _compare(pair, lambda c: c.stack_head_results(layer=1, pos_slice=-1, apply_ln=True), "layer 1, with ln")


def test_stack_neuron_results(pair: Pair) -> None:
    if not pair.has_mlp:
        pytest.skip("attention-only source: no neurons")  # no family of the matrix is attention-only
    n_rows = int(pair.source.cfg.n_layers * pair.source.cfg.d_mlp)

    def neurons(c: Any) -> tuple[Tensor, list[str]]:
        stack, labels = c.stack_neuron_results(layer=None, return_labels=True)
        assert stack.shape[0] == len(labels) == n_rows
        return stack, labels

    _compare(pair, neurons, "stack_neuron_results")
    _compare(pair, lambda c: c.stack_neuron_results(layer=1, pos_slice=-1, apply_ln=True), "layer 1, with ln")


def test_get_full_resid_decomposition_expand_neurons(pair: Pair) -> None:
    _compare(
        pair,
        lambda c: c.get_full_resid_decomposition(expand_neurons=True, return_labels=True),
        "get_full_resid_decomposition(expand_neurons=True)",
    )
    _compare(
        pair,
        lambda c: c.get_full_resid_decomposition(expand_neurons=False, apply_ln=True, pos_slice=-1, return_labels=True),
        "expand_neurons=False, with ln",
    )


def test_apply_ln_to_stack_and_logit_attrs(pair: Pair) -> None:
    """``logit_attrs`` of the decomposition: logit-space per component (reads ``tokens_to_residual_directions``)."""
    a, b = answer_pair(pair)

    def attrs(c: Any) -> Tensor:
        stack = c.decompose_resid(pos_slice=-1)
        stack = c.apply_ln_to_stack(stack, pos_slice=-1)
        batch = pair.tokens.shape[0]
        return c.logit_attrs(
            stack, tokens=torch.tensor([a] * batch), incorrect_tokens=torch.tensor([b] * batch), pos_slice=-1
        )

    _compare(pair, attrs, "logit_attrs(apply_ln_to_stack(decompose_resid))")


@pytest.mark.parametrize("name", ["resid_pre", "attn_out", "z", "pattern", "post", "mlp_out"])
def test_stack_activation(pair: Pair, name: str) -> None:
    """Source hook names per layer: ``stack_activation`` reads ``blocks.{l}.<hook>`` for l < n_layers."""
    if name in ("post", "mlp_out") and not pair.has_mlp:
        pytest.skip("attention-only source: no MLP hooks")  # no family of the matrix is attention-only

    def stack(c: Any) -> Tensor:
        out = c.stack_activation(name)
        assert out.shape[0] == pair.source.cfg.n_layers
        return out

    _compare(pair, stack, f"stack_activation({name!r})")
