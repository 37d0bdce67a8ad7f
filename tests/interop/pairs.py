"""The interop matrix's pairs and bounds: (source, converted) pairs, and the bound each comparison is judged against.

Every test runs a TransformerLens (or SAELens / nnsight) function, unmodified, on the source and on the converted
model, and asserts the two results agree within the conversion's bound (issue 15). The families are few and small
(the matrix runs in well under a minute per TransformerLens version):

- TransformerBridge (TL 3.9 and 4.3): ``gpt2`` (LN, absolute positions, gelu_new: a fitted activation) and
  ``native-gated`` (RMS, rotary, gated SwiGLU), from ``factories_bridge``;
- HookedTransformer (TL 3.9 only): ``ln-standard`` (SiLU: Theorem 3 exact), ``llama`` (RMS, rotary, GQA, SwiGLU) and
  ``gptj`` (parallel attention + MLP, gelu_new), from ``factories_hooked``;
- the embedded trained model (``lens_aot.cli.demo_models.load_modular_addition``, ReLU, one layer).

Bounds. Logit-space results are judged against ``aot.report.logit_bound`` (``max(stated, 8·S + 4·R)``, measured by
``convert`` on the very tokens the test uses, ``check_tokens``). Any other quantity ``q`` computed from a forward
(stacked head / neuron results, residual decompositions, patching metrics on patched runs) is judged against the SAME
construction applied to ``q`` (:meth:`Pair.bound_for`): ``8·S_q + 4·R_q`` with ``S_q`` the source's own max |Δq| when
every neuron activation is perturbed by ±ε (its per-neuron bound,
``lens_aot.core.check.faithfulness.neuron_sensitivity``) and ``R_q`` the rounding floor at ``q``'s scale
(``lens_aot.core.check.faithfulness.rounding_floor``). Both terms are properties of the source, so a wrong conversion
cannot
widen its own tolerance; a quantity the neurons do not reach (layer 0's attention) gets the rounding floor alone.

``LENS_AOT_INTEROP_SELFCHECK=1`` replaces the converted model by the source itself: every test must pass then too,
which shows each test is correct (it runs the TL function on a real TransformerLens model and compares what it should)
before the source-aligned model lands.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from conftest import HAS_HOOKED_TRANSFORMER
from torch import Tensor

import lens_aot
from lens_aot.core.check.faithfulness import SENSITIVITY_FACTOR, neuron_sensitivity, rounding_floor

SELFCHECK = os.environ.get("LENS_AOT_INTEROP_SELFCHECK", "") not in ("", "0")

# name -> (builder kind, factory family, activation (hooked), dtype)
BRIDGE_FAMILIES = {"bridge-gpt2": ("gpt2", torch.float32), "bridge-native-gated": ("native-gated", torch.float64)}
HOOKED_FAMILIES = {
    "hooked-ln-silu": ("ln-standard", "silu", torch.float32),
    "hooked-llama": ("llama", "silu", torch.float64),
    "hooked-gptj": ("gptj", "gelu_new", torch.float64),
}
FAMILY_NAMES = [*BRIDGE_FAMILIES, *(HOOKED_FAMILIES if HAS_HOOKED_TRANSFORMER else {}), "trained-modular-addition"]
BATCH, POS = 2, 8
# Issue 22 item 8: the interop matrix's cheapest cells (tests/interop/test_new_families.py) on the new families,
# name -> (builder, dtype). TransformerBridge (TL 3.9 and 4.3): Gemma-2 (soft-caps, sandwich norms, windows; float32:
# its float64 RMSNorm is refused), Qwen3 (QK-norm, float64), Mixtral and Qwen2-MoE (shared expert), OLMo-2 (post
# norms: ln1_post / ln2_post under TL 4.3, ln1 / ln2 under 3.9); HookedTransformer (TL 3.9): Gemma-2 (the Gemma
# Scope SAE through HookedSAETransformer) and OLMo-2 as configs (the bridges cover Qwen3 and the MoEs under 3.9 too).
NEW_BRIDGE_FAMILIES = {
    "bridge-gemma2": ("gemma2", torch.float32),
    "bridge-qwen3": ("qwen3", torch.float64),
    "bridge-mixtral": ("moe:mixtral", torch.float32),
    "bridge-qwen2-moe": ("moe:qwen2_moe", torch.float32),
    "bridge-olmo2": ("olmo2", torch.float32),
}
NEW_HOOKED_FAMILIES = {
    "hooked-gemma2": ("variant:gemma2", torch.float64),
    "hooked-olmo2": ("variant:olmo2-post-norm", torch.float64),
}
NEW_FAMILY_NAMES = [*NEW_BRIDGE_FAMILIES, *(NEW_HOOKED_FAMILIES if HAS_HOOKED_TRANSFORMER else {})]
# Functions that only combine ones the matrix runs on every family (``*_every``, ``dest_src_pos``) run on these: the
# trained model (one layer, 4 heads, neurons) is the cheapest pair, under both TransformerLens majors.
WRAPPER_FAMILIES = ["trained-modular-addition"]


@dataclass
class Pair:
    """A source model and its conversion (the source itself under ``LENS_AOT_INTEROP_SELFCHECK``)."""

    name: str
    source: Any
    model: Any  # the converted model, or the source in self-check mode
    aot: Any  # the converted model (always: its report states the bound)
    tokens: Tensor  # [BATCH, POS] clean tokens (the bound is measured on these and the corrupted ones)
    corrupted: Tensor  # the same tokens with the second-to-last position changed

    @property
    def logit_bound(self) -> float:
        """max |Δlogit| stated by ``convert`` for these tokens."""
        return float(self.aot.report.logit_bound)

    @property
    def eps(self) -> dict[int, float]:
        """Per-layer neuron bound ε_l (the conversion's per-neuron error bound, plus its stated rounding)."""
        report = self.aot.report
        per_neuron = float(report.max_neuron_error) + float(report.neuron_rounding)
        return {layer: per_neuron for layer in range(int(self.source.cfg.n_layers))} if self.has_mlp else {}

    @property
    def has_mlp(self) -> bool:
        return not bool(getattr(self.source.cfg, "attn_only", False))

    @property
    def has_resid_mid(self) -> bool:
        """Sequential layers with an MLP have ``hook_resid_mid``; parallel ones do not."""
        return self.has_mlp and not bool(getattr(self.source.cfg, "parallel_attn_mlp", False))

    def bound_for(
        self, quantity: Callable[[Any, list[tuple[str, Any]]], Tensor], *, tokens: Tensor | None = None
    ) -> float:
        """The conversion's bound construction applied to ``quantity(model, fwd_hooks)``: ``8·S_q + 4·R_q``.

        ``quantity`` runs a TL function on ``model`` with ``fwd_hooks`` attached (it must attach them to every forward
        it makes, e.g. ``with model.hooks(fwd_hooks=fwd_hooks): ...``) and returns a tensor."""
        toks = self.tokens if tokens is None else tokens
        with torch.no_grad():
            base = quantity(self.source, []).detach()

        def run(_: Tensor, fwd_hooks: list[tuple[str, Any]]) -> Tensor:
            return quantity(self.source, fwd_hooks).detach()

        sensitivity = neuron_sensitivity(run, toks, self.eps, base) if self.eps else 0.0
        rounding = rounding_floor(base.dtype, base, int(self.source.cfg.n_layers))
        # Logit-space bound's own rounding factor (lens_aot.core.check.faithfulness.ROUNDING_FACTOR = 4).
        return SENSITIVITY_FACTOR * sensitivity + 4.0 * rounding


def _tokens(vocab: int, seed: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, vocab, (BATCH, POS), generator=generator)
    corrupted = tokens.clone()
    corrupted[:, -2] = (tokens[:, -2] + 1 + torch.randint(0, vocab - 2, (BATCH,), generator=generator)) % (
        vocab - 1
    ) + 1
    return tokens, corrupted


def _new_family_source(name: str) -> Any:
    """A source of :data:`NEW_BRIDGE_FAMILIES` / :data:`NEW_HOOKED_FAMILIES` (the tests' factories)."""
    builder, dtype = {**NEW_BRIDGE_FAMILIES, **NEW_HOOKED_FAMILIES}[name]
    if builder.startswith("variant:"):
        from variants_hooked import make_variant

        return make_variant(builder.removeprefix("variant:"), dtype).eval()
    if builder.startswith("moe:"):
        from factories_moe import moe_bridge

        return moe_bridge(builder.removeprefix("moe:"), dtype)
    from factories_bridge import make_bridge

    if builder == "olmo2":  # not in factories_bridge: built as test_bridge_families builds it
        from factories_bridge import FAMILIES, _hf

        FAMILIES.setdefault("olmo2", _hf("Olmo2Config", "Olmo2ForCausalLM", num_key_value_heads=2))
    return make_bridge(builder, dtype=dtype, tokenizer=True)


def _build_source(name: str) -> tuple[Any, Tensor, Tensor]:
    if name in NEW_BRIDGE_FAMILIES or name in NEW_HOOKED_FAMILIES:
        source = _new_family_source(name)
        return (source, *_tokens(int(source.cfg.d_vocab), 0))
    if name in BRIDGE_FAMILIES:
        from factories_bridge import make_bridge

        family, dtype = BRIDGE_FAMILIES[name]
        source = make_bridge(family, dtype=dtype, tokenizer=True)
        return (source, *_tokens(int(source.cfg.d_vocab), 0))
    if name in HOOKED_FAMILIES:
        from factories_bridge import tiny_tokenizer
        from factories_hooked import make_hooked

        family, act_fn, dtype = HOOKED_FAMILIES[name]
        source = make_hooked(family, act_fn, dtype, d_vocab=97)
        source.set_tokenizer(tiny_tokenizer(), default_padding_side="right")
        source.eval()
        return (source, *_tokens(int(source.cfg.d_vocab), 0))
    from lens_aot.cli.demo_models import MODULAR_ADDITION_P, load_modular_addition, modular_addition_dataset

    source = load_modular_addition()
    data, _ = modular_addition_dataset()
    tokens = data[torch.tensor([5, 4000, 9001, 12000])][:BATCH]
    corrupted = tokens.clone()
    corrupted[:, 1] = (tokens[:, 1] + 7) % MODULAR_ADDITION_P
    return source, tokens, corrupted


_CACHE: dict[str, Pair] = {}
# (test id, what, max |Δ|, bound) of every comparison: printed after the run (conftest), the docs' figures
FIGURES: list[tuple[str, str, float, float]] = []


@pytest.fixture(params=FAMILY_NAMES)
def pair(request: pytest.FixtureRequest) -> Pair:
    """One (source, converted) pair per family, built once per session (tests must not change either model;
    switches set with ``set_use_*`` are restored by the test that sets them)."""
    name: str = request.param
    if name not in _CACHE:
        torch.manual_seed(0)
        source, tokens, corrupted = _build_source(name)
        aot = lens_aot.convert(source, check_tokens=torch.cat([tokens, corrupted]))
        _CACHE[name] = Pair(name, source, source if SELFCHECK else aot, aot, tokens, corrupted)
    return _CACHE[name]


def answer_pair(p: Pair) -> tuple[int, int]:
    """Two token ids to take a logit difference between (the clean run's top-2 at the last position)."""
    with torch.no_grad():
        top = p.source(p.tokens)[0, -1].topk(2).indices
    return int(top[0]), int(top[1])


def logit_diff_metric(p: Pair) -> Callable[[Tensor], Tensor]:
    """Mean logit difference at the last position: 2 logits, so |Δ| ≤ 2·(logit bound) on any one forward."""
    a, b = answer_pair(p)

    def metric(logits: Tensor) -> Tensor:
        return (logits[:, -1, a] - logits[:, -1, b]).mean()

    return metric


def assert_close(got: Tensor, want: Tensor, bound: float, what: str) -> None:
    """``got`` has ``want``'s shape and is within ``bound`` of it everywhere (max |Δ| reported on failure)."""
    got, want = torch.as_tensor(got).detach(), torch.as_tensor(want).detach()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != source's {tuple(want.shape)}"
    error = float((got.double() - want.double()).abs().max()) if want.numel() else 0.0
    FIGURES.append((os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0], what, error, bound))
    assert error <= bound, f"{what}: max |Δ| {error:.3e} exceeds the bound {bound:.3e}"
