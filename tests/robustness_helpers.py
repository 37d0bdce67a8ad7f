"""Shared checks for the robustness tests (properties, error catalogue, hooks, source integrity, determinism).

Nothing here builds models: the factories do (``factories_hooked``, ``factories_bridge``). These helpers state what
"faithful", "clear error", "no hooks left" and "unmodified" mean, once, for HookedTransformer and bridge tests alike.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any
from unittest import mock

import pytest
import torch
from conftest import TOLERANCES
from hypothesis import HealthCheck
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

import lens_aot
from lens_aot.core.check.faithfulness import logit_bound, neuron_sensitivity
from lens_aot.core.components import Attention, NeuronAttention
from lens_aot.core.fit.activations import reference_activation

# Hypothesis settings of every property test: fixed examples (CI-reproducible), no time limit per example.
PROPERTY_SETTINGS: dict[str, Any] = dict(
    deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)

# ---------------------------------------------------------------------------------------------------------------
# Faithfulness.
# ---------------------------------------------------------------------------------------------------------------

# Derived tolerance (random tiny models): lens_aot.core.check.faithfulness's definition, the one convert and `lens-aot
# verify`
# state, ``max(stated, SENSITIVITY_FACTOR · S_ε + ROUNDING_FACTOR · R)``, with the rounding R *measured* here (the
# float32 source against its float64 copy; 0 for float64) rather than convert's derived floor. S_ε is the float64
# source's response to random ±ε per neuron (max over 4 sign patterns). Over 1000 random HookedTransformers (d_model
# 1-24, 1-3 layers, every family, 16 sequences each) the converted models' errors stayed below 0.6 of this tolerance,
# while the stated tolerance alone was exceeded (up to 8x) only by ill-conditioned draws (d_model <= 3 under a norm,
# or no norm with logits of O(50)); 300 random native bridges, 100 each with gated MLPs / the parallel flag and 15
# per factory family at random sizes also stayed within it.


def tolerance(act_fn: str | None, dtype: torch.dtype) -> float:
    """The stated max |Δlogit| for a converted model (``conftest.TOLERANCES``, the docs' support matrix)."""
    return TOLERANCES[(act_fn, dtype)]


def source_logits(model: Any, tokens: Tensor) -> Tensor:
    """The source's logits (HookedTransformer or bridge), without autograd."""
    with torch.no_grad():
        return lens_aot.core.read.run_source(model, tokens)


def perturbation_response(model: Any, tokens: Tensor, eps: dict[int, float], trials: int = 4) -> float:
    """Max |Δlogit| of ``model`` when layer ``l``'s MLP output (``blocks.{l}.mlp.hook_post``) gets random ±``eps[l]``
    at every neuron and position (the worst of ``trials`` sign patterns): ``lens_aot.core.check.faithfulness``'s S."""
    return neuron_sensitivity(model.run_with_hooks, tokens, eps, source_logits(model, tokens), trials=trials)


def derived_tolerance(
    stated: float, source: Any, source64: Any, tokens: Tensor, eps: dict[int, float], expected: Tensor
) -> float:
    """``lens_aot.core.check.faithfulness.logit_bound(stated, S_ε, R)`` with R measured (see the comment above
    ``tolerance``).

    ``source64`` is a float64 copy of ``source`` with the same weights; ``expected`` the source's logits on ``tokens``.
    """
    sensitivity = perturbation_response(source64, tokens, eps)
    rounding = 0.0
    if expected.dtype != torch.float64:
        rounding = float((source_logits(source64, tokens) - expected.to(torch.float64)).abs().max())
    return logit_bound(stated, sensitivity, rounding)


def assert_faithful(expected: Tensor, got: Tensor, tol: float, label: str) -> float:
    """``got`` (converted) is within ``tol`` of ``expected`` (source) everywhere, and picks the same top token
    wherever the source's top-2 logit gap exceeds twice the tolerance (where an error within it cannot flip it).

    Returns the measured max |Δlogit|.
    """
    assert got.shape == expected.shape, f"{label}: logits of shape {tuple(got.shape)} != {tuple(expected.shape)}"
    assert got.dtype == expected.dtype, f"{label}: logits in {got.dtype} != source's {expected.dtype}"
    assert bool(torch.isfinite(got).all()), f"{label}: the converted model produced non-finite logits"
    err = float((got - expected).abs().max()) if got.numel() else 0.0
    if expected.shape[-1] >= 2 and expected.numel():
        top2 = expected.topk(2, dim=-1).values
        decided = (top2[..., 0] - top2[..., 1]) > 2 * tol
        same = got.argmax(-1) == expected.argmax(-1)
        assert bool(same[decided].all()), f"{label}: argmax differs where the source's logit gap exceeds 2·tol"
    assert err <= tol, f"{label}: max |Δlogit| {err:.3g} > tolerance {tol:.3g}"
    return err


def assert_neurons_within_bound(aot: lens_aot.AttentionOnlyTransformer, tokens: Tensor) -> None:
    """Every plain neuron's activation (the sum of its heads' ``hook_z``) is within its fit's documented bound of the
    true activation of its own pre-activation, at every position: the conversion's per-neuron guarantee, which does
    not depend on the model's conditioning. (Rounding slack: 64 ulps of 1 + |z|.)"""
    _, cache = aot.run_with_cache(tokens)
    for layer, fit in aot.cfg.activation_fits.items():
        if not isinstance(fit, lens_aot.ActivationFit):
            continue  # gated layers: their bound is on hook_post and is covered by the logit check
        pre = cache[f"blocks.{layer}.mlp.hook_pre"]
        got = aot.neuron_activations(cache, layer)
        err = (got - reference_activation(fit.act_fn, pre)).abs()
        slack = 64 * torch.finfo(pre.dtype).eps * (1 + pre.abs())
        excess = float((err - fit.max_error * (1 + 1e-6) - slack).max()) if err.numel() else 0.0
        assert excess <= 0, f"layer {layer}: a neuron's error exceeds its bound {fit.max_error:g} by {excess:.3g}"


# ---------------------------------------------------------------------------------------------------------------
# Clear errors.
# ---------------------------------------------------------------------------------------------------------------


def assert_clear_error(error: BaseException, kind: type[BaseException], *phrases: str) -> None:
    """``error`` is a ``kind`` (a :class:`lens_aot.LensAOTError` unless ``kind`` says otherwise) whose message
    contains every regex in ``phrases`` (case-insensitive): the problem and the fix."""
    assert isinstance(error, kind), f"expected {kind.__name__}, got {type(error).__name__}: {error}"
    message = str(error)
    for phrase in phrases:
        assert re.search(phrase, message, flags=re.IGNORECASE | re.DOTALL), f"{phrase!r} not in message: {message}"


# ---------------------------------------------------------------------------------------------------------------
# Hooks.
# ---------------------------------------------------------------------------------------------------------------


def attached_hooks(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every hook torch knows about on every submodule (forward, forward-pre, backward, backward-pre), by module name:
    only modules with at least one hook are listed, with the count of each kind."""
    kinds = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    out = {}
    for name, module in model.named_modules():
        counts = tuple(len(getattr(module, kind, {}) or {}) for kind in kinds)
        if any(counts):
            out[name] = counts
    return out


def assert_no_hooks(model: nn.Module) -> None:
    """No hook of any kind on any module; every HookPoint's own bookkeeping is empty too."""
    assert attached_hooks(model) == {}, f"hooks left attached: {attached_hooks(model)}"
    for name, module in model.named_modules():
        if isinstance(module, HookPoint):
            assert not module._forward_hooks and not module._backward_hooks, name
            assert not getattr(module, "fwd_hooks", []) and not getattr(module, "bwd_hooks", []), name


class SlowPathSpy(AbstractContextManager["SlowPathSpy"]):
    """Counts calls into the per-head (hook-serving) code paths of a converted model's modules.

    On the fast path a neuron (or product) layer never builds per-head queries and a source attention layer uses
    fused attention: with no hook attached, a forward makes no calls to any module's ``queries`` nor to
    ``Attention._dense_z`` (unless the attention computes its softmax in another dtype, which needs the dense path).
    """

    def __init__(self, model: nn.Module) -> None:
        self.calls = 0
        targets = {(Attention, "_dense_z")}
        targets |= {(type(m), "queries") for m in model.modules() if callable(getattr(type(m), "queries", None))}
        assert (NeuronAttention, "queries") in targets or not any(
            isinstance(m, NeuronAttention) for m in model.modules()
        )
        self._patches = [
            mock.patch.object(cls, name, autospec=True, side_effect=self._count(getattr(cls, name)))
            for cls, name in sorted(targets, key=lambda t: (t[0].__name__, t[1]))
        ]

    def _count(self, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return fn(*args, **kwargs)

        return wrapped

    def __enter__(self) -> SlowPathSpy:
        for p in self._patches:
            p.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for p in reversed(self._patches):
            p.stop()


def fast_path_logits(aot: nn.Module, tokens: Tensor) -> Tensor:
    """``aot(tokens)`` with ``set_use_fused_neurons(True)`` (restored after), asserting it took the fast path: no
    per-head tensors built anywhere, so no hook is left attached to any neuron head's internals.

    Only meaningful for models whose attention uses fused softmax when unhooked (no ``softmax_dtype`` upcast).
    """
    fused = aot.cfg.use_fused_neurons
    aot.set_use_fused_neurons(True)  # without it every forward runs the neuron heads' cheap hook points
    try:
        with SlowPathSpy(aot) as spy, torch.no_grad():
            logits = aot(tokens)
    finally:
        aot.set_use_fused_neurons(fused)
    assert spy.calls == 0, f"the forward built per-head tensors {spy.calls} times with no hook attached"
    return logits


def slow_path_calls(aot: nn.Module, tokens: Tensor, fwd_hooks: list[tuple[Any, Any]]) -> int:
    """How many per-head code-path calls ``aot.run_with_hooks(tokens, fwd_hooks)`` makes with fused neurons on (to
    show the spy works: a hook on a neuron head's internals takes the per-head path even then)."""
    fused = aot.cfg.use_fused_neurons
    aot.set_use_fused_neurons(True)
    try:
        with SlowPathSpy(aot) as spy, torch.no_grad():
            aot.run_with_hooks(tokens, fwd_hooks=fwd_hooks)
    finally:
        aot.set_use_fused_neurons(fused)
    return spy.calls


# ---------------------------------------------------------------------------------------------------------------
# Source integrity.
# ---------------------------------------------------------------------------------------------------------------


def bits(t: Tensor) -> Tensor:
    """A tensor's raw bytes (so NaN == NaN and -0.0 != 0.0: bitwise identity)."""
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1).to(torch.uint8)


def bitwise_equal(a: Tensor, b: Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and torch.equal(bits(a), bits(b))


def _describe(value: Any) -> Any:
    """A comparable description of a config value (tensors by bytes, everything else by repr)."""
    if isinstance(value, Tensor):
        return ("tensor", value.dtype, tuple(value.shape), bits(value).tolist())
    return repr(value)


@dataclass
class ModelSnapshot:
    """Everything ``convert`` must leave unchanged on its source."""

    state: dict[str, Tensor]
    buffers: dict[str, Tensor]
    param_ids: dict[str, int]
    requires_grad: dict[str, bool]
    training: dict[str, bool]
    hooks: dict[str, tuple[int, ...]]
    cfg: dict[str, Any]
    flags: dict[str, Any]

    @classmethod
    def take(cls, model: nn.Module) -> ModelSnapshot:
        params = dict(model.named_parameters(remove_duplicate=False))
        cfg = getattr(model, "cfg", None)
        return cls(
            state={k: v.detach().clone() for k, v in model.state_dict(keep_vars=False).items()},
            buffers={k: v.detach().clone() for k, v in model.named_buffers(remove_duplicate=False)},
            param_ids={k: id(p) for k, p in params.items()},
            requires_grad={k: p.requires_grad for k, p in params.items()},
            training={name: m.training for name, m in model.named_modules()},
            hooks=attached_hooks(model),
            cfg={} if cfg is None else {k: _describe(v) for k, v in sorted(vars(cfg).items())},
            flags={"compatibility_mode": getattr(model, "compatibility_mode", None)},
        )

    def assert_unchanged(self, model: nn.Module) -> None:
        after = ModelSnapshot.take(model)
        assert after.state.keys() == self.state.keys(), "state dict keys changed"
        changed = [k for k in self.state if not bitwise_equal(self.state[k], after.state[k])]
        assert not changed, f"state dict entries changed: {changed}"
        assert after.buffers.keys() == self.buffers.keys(), "buffers changed"
        changed = [k for k in self.buffers if not bitwise_equal(self.buffers[k], after.buffers[k])]
        assert not changed, f"buffers changed: {changed}"
        assert after.param_ids == self.param_ids, "parameters were replaced"
        assert after.requires_grad == self.requires_grad, "requires_grad flags changed"
        assert after.training == self.training, "training mode changed"
        assert after.hooks == self.hooks, f"hooks changed: {self.hooks} -> {after.hooks}"
        assert after.cfg == self.cfg, "cfg changed"
        assert after.flags == self.flags, "bridge flags changed"


def freeze_some(model: nn.Module, every: int = 3) -> None:
    """Turn off ``requires_grad`` on every ``every``-th parameter (so the flag check has both values to keep)."""
    for i, p in enumerate(model.parameters()):
        if i % every == 0:
            p.requires_grad_(False)


def report_fields(report: Any) -> dict[str, Any]:
    """A report as a plain dict (for exact comparison of two conversions)."""
    return dict(vars(report))


def state_bits(model: nn.Module) -> dict[str, Tensor]:
    """State dict and all buffers (persistent or not) of ``model``, as raw bytes."""
    out = {f"state:{k}": bits(v) for k, v in model.state_dict().items()}
    out |= {f"buffer:{k}": bits(v) for k, v in model.named_buffers()}
    return out


def assert_same_bits(a: dict[str, Tensor], b: dict[str, Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"differ bitwise: {different}"


def all_hook_points(models: Iterable[nn.Module]) -> list[HookPoint]:
    return [m for model in models for m in model.modules() if isinstance(m, HookPoint)]


# ---------------------------------------------------------------------------------------------------------------
# Exceptions while hooks are attached.
# ---------------------------------------------------------------------------------------------------------------


class Boom(Exception):
    """Raised on purpose by a hook or a metric."""


def boom(*args: Any, **kwargs: Any) -> None:
    raise Boom("raised on purpose")


def record(act: Tensor, hook: Any) -> None:
    """A hook that only looks."""
    assert isinstance(act, Tensor)


def _everywhere(name: str) -> bool:
    return True


Scenario = tuple[Callable[[Any, Tensor], Any], type[BaseException]]


def _neuron(model: Any) -> str:
    """The module of layer 0's neuron heads that write its MLP output."""
    return model.neuron_module(0)


def _attention(model: Any) -> str:
    return "blocks.0.attn"


def _last(model: Any) -> str:
    return f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"


def _in_hooks(fwd: Callable[[Any], list[Any]], bwd: Callable[[Any], list[Any]], run: Callable[..., Any]) -> Any:
    """Run ``run(model, tokens)`` inside ``model.hooks(fwd_hooks=fwd(model), bwd_hooks=bwd(model))``."""

    def action(model: Any, tokens: Tensor) -> Any:
        with model.hooks(fwd_hooks=fwd(model), bwd_hooks=bwd(model)):
            return run(model, tokens)

    return action


def _none(model: Any) -> list[Any]:
    return []


def _record_all(model: Any) -> list[Any]:
    return [(_everywhere, record)]


def _loss_backward(model: Any, tokens: Tensor) -> Any:
    model(tokens, return_type="loss").backward()


def _metric_fails(model: Any, tokens: Tensor) -> Any:
    model(tokens, return_type="loss")
    raise Boom("the metric failed")


def _nested(model: Any, tokens: Tensor) -> Any:
    with model.hooks(fwd_hooks=[(_everywhere, record)]):
        with model.hooks(fwd_hooks=[(f"{_neuron(model)}.hook_z", boom)]):
            model(tokens)


def _hooks_then_metric_fails(model: Any, tokens: Tensor) -> Any:
    model.run_with_hooks(tokens, fwd_hooks=[(_everywhere, record)])
    raise Boom("the metric failed")


def _cache_then_metric_fails(model: Any, tokens: Tensor) -> Any:
    _, cache = model.run_with_cache(tokens)
    assert cache[f"{_neuron(model)}.hook_pattern"].ndim == 4
    raise Boom("the metric failed after reading the cache")


# Ways for an exception to interrupt hooked work on a converted model: name -> (action, the exception it must raise).
# Each attaches hooks through TransformerLens's APIs (``run_with_hooks``, ``hooks()``, ``run_with_cache``) and raises
# while they are attached: in a forward hook, in a backward hook, in the metric after the forward, in a
# ``names_filter``, or at a bad hook name after good ones were attached.
HOOK_SCENARIOS: dict[str, Scenario] = {
    "run_with_hooks/neuron hook_pattern raises": (
        lambda m, t: m.run_with_hooks(t, fwd_hooks=[(f"{_neuron(m)}.hook_pattern", boom)]),
        Boom,
    ),
    "run_with_hooks/neuron hook_z raises": (
        lambda m, t: m.run_with_hooks(t, fwd_hooks=[(f"{_neuron(m)}.hook_z", boom)]),
        Boom,
    ),
    "run_with_hooks/attention hook_attn_scores raises": (
        lambda m, t: m.run_with_hooks(t, fwd_hooks=[(f"{_attention(m)}.hook_attn_scores", boom)]),
        Boom,
    ),
    "run_with_hooks/last hook raises after all others ran": (
        lambda m, t: m.run_with_hooks(t, fwd_hooks=[(_everywhere, record), (_last(m), boom)]),
        Boom,
    ),
    "run_with_hooks/unknown hook name after good ones": (
        lambda m, t: m.run_with_hooks(
            t, fwd_hooks=[(f"{_neuron(m)}.hook_z", record), ("blocks.99.attn.hook_z", record)]
        ),
        KeyError,
    ),
    "run_with_hooks/metric raises after the forward": (_hooks_then_metric_fails, Boom),
    "hooks()/forward hook raises": (
        _in_hooks(lambda m: [(f"{_neuron(m)}.hook_pattern", boom)], _none, lambda m, t: m(t)),
        Boom,
    ),
    "hooks()/nested contexts, inner hook raises": (_nested, Boom),
    "hooks()/metric raises after the forward": (_in_hooks(_record_all, _none, _metric_fails), Boom),
    "hooks()/backward hook raises": (
        _in_hooks(_none, lambda m: [(f"{_neuron(m)}.hook_z", boom)], _loss_backward),
        Boom,
    ),
    "hooks()/metric raises before backward": (_in_hooks(_record_all, _record_all, _metric_fails), Boom),
    "run_with_cache/forward hook raises mid-run": (
        _in_hooks(lambda m: [(f"{_neuron(m)}.hook_z", boom)], _none, lambda m, t: m.run_with_cache(t)),
        Boom,
    ),
    "run_with_cache(compact=False)/forward hook raises": (
        _in_hooks(lambda m: [(_last(m), boom)], _none, lambda m, t: m.run_with_cache(t, compact=False)),
        Boom,
    ),
    "run_with_cache(incl_bwd)/backward hook raises": (
        _in_hooks(
            _none,
            lambda m: [(f"{_attention(m)}.hook_z", boom)],
            lambda m, t: m.run_with_cache(t, return_type="loss", incl_bwd=True),
        ),
        Boom,
    ),
    "run_with_cache(incl_bwd)/backward of non-scalar logits fails": (
        lambda m, t: m.run_with_cache(t, incl_bwd=True),
        RuntimeError,
    ),
    "run_with_cache/names_filter raises": (
        lambda m, t: m.run_with_cache(t, names_filter=lambda name: boom() if name.endswith("hook_z") else True),
        Boom,
    ),
    "run_with_cache/metric raises reading the cache": (_cache_then_metric_fails, Boom),
}


def check_hooks_removed_after(aot: Any, tokens: Tensor, scenario: Scenario) -> None:
    """Run ``scenario`` (it must raise its exception); then only the user's permanent hook is left, the context level
    is back to 0, and once that hook is removed a forward is bitwise unchanged and takes the fast path."""
    action, kind = scenario
    baseline = fast_path_logits(aot, tokens)
    seen: list[int] = []
    aot.add_hook("blocks.0.hook_resid_pre", lambda act, hook: seen.append(1), is_permanent=True)
    with pytest.raises(kind):
        action(aot, tokens)
    assert attached_hooks(aot) == {"blocks.0.hook_resid_pre": (1, 0, 0, 0)}, "only the permanent hook may remain"
    assert getattr(aot, "context_level", 0) == 0, "the hooks() context level was not restored"
    seen.clear()
    with torch.no_grad():
        aot(tokens)
    assert seen == [1], "the permanent hook no longer fires"
    aot.reset_hooks(including_permanent=True)
    assert_no_hooks(aot)
    torch.testing.assert_close(fast_path_logits(aot, tokens), baseline, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# Source integrity and determinism.
# ---------------------------------------------------------------------------------------------------------------


def check_source_unchanged(source: nn.Module, convert: Callable[[], Any], raises: Any = None) -> Any:
    """Run ``convert()`` (which must raise ``raises`` if given) and assert it left ``source`` exactly as it was:
    bitwise state dict and buffers, the same parameter objects, requires_grad flags, training modes, hooks, config
    and bridge flags; and that it did not touch the global RNG or the grad mode. On success, also assert the converted
    model shares no storage with the source (changing it leaves the source unchanged). Returns the converted model."""
    snapshot = ModelSnapshot.take(source)
    rng, grad_mode = torch.get_rng_state(), torch.is_grad_enabled()
    aot = None
    if raises is not None:
        with pytest.raises(raises):
            convert()
    else:
        aot = convert()
    snapshot.assert_unchanged(source)
    assert torch.equal(torch.get_rng_state(), rng), "convert consumed the global random state"
    assert torch.is_grad_enabled() == grad_mode, "convert changed the grad mode"
    if aot is not None:
        with torch.no_grad():
            for p in aot.parameters():
                p.add_(1.0)
            for b in aot.buffers():
                if b.is_floating_point():
                    b.add_(1.0)
        snapshot.assert_unchanged(source)
    return aot


def check_deterministic(make_source: Callable[[], Any], tokens: Tensor, **options: Any) -> None:
    """Converting the same source twice, and an identically built source, gives bit-identical parameters and buffers,
    equal configs and reports; and the converted model's outputs (plain, cached, dense-path, gradients) are
    bit-identical across runs."""
    source = make_source()
    first, second = lens_aot.convert(source, **options), lens_aot.convert(source, **options)
    third = lens_aot.convert(make_source(), **options)
    for other in (second, third):
        assert_same_bits(state_bits(first), state_bits(other))
        assert report_fields(first.report) == report_fields(other.report)
        assert first.cfg == other.cfg
        assert repr(first) == repr(other)
    with torch.no_grad():
        torch.testing.assert_close(first(tokens), first(tokens), rtol=0, atol=0)
        torch.testing.assert_close(first(tokens), second(tokens), rtol=0, atol=0)
    _, cache_a = first.run_with_cache(tokens)
    _, cache_b = first.run_with_cache(tokens)
    assert sorted(cache_a.keys()) == sorted(cache_b.keys())
    for key in cache_a.keys():
        assert torch.equal(bits(cache_a[key]), bits(cache_b[key])), key
    neuron = f"{first.neuron_module(0)}.hook_pattern"
    dense = [first.run_with_hooks(tokens, fwd_hooks=[(neuron, record)]) for _ in range(2)]
    torch.testing.assert_close(dense[0], dense[1], rtol=0, atol=0)
    grads = []
    for _ in range(2):
        first.zero_grad(set_to_none=True)
        first(tokens, return_type="loss").backward()
        grads.append({name: p.grad.clone() for name, p in first.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    assert all(torch.equal(bits(grads[0][k]), bits(grads[1][k])) for k in grads[0])
