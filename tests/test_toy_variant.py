"""Variants without core edits (issue 39): a toy attention variant and a toy MLP variant, declared here through the
public registration points alone (a spec dataclass with :func:`~lens_aot.core.spec.fields.saved` fields, a component,
a fit, a :class:`~lens_aot.core.variants.Variant` given to :func:`~lens_aot.core.variants.register_variant`), convert
a source that uses them, agree with the source's own forward, and save and load bit for bit, without a line of
lens_aot changed for them.

* Toy attention: each head's output times a learned gain, ``Σ_h gain_h · z_h W_O,h`` (an :class:`AttentionSpec` with
  one more field, ``gain`` [n_heads]; its component subclasses
  :class:`~lens_aot.core.components.attention.attention.Attention`).
* Toy MLP: Swish-β, ``z · σ(β z)``, which is Huben & Morris (2023) Theorem 3's single neuron head with ``a = β``: the
  :class:`~lens_aot.core.fit.activations.ActivationFit` ``(1·z + 0)·σ(β z + 0)``, exact (``max_error`` 0).

The source is a small torch module (:class:`ToySource`) read into a spec by :func:`read_toy`, registered as a source
reader (:func:`~lens_aot.tl.reading.registry.register_source_reader`): ``lens_aot.convert(source)`` then runs the whole
pipeline (read → fit → build → check against the source's own forward) on it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from jaxtyping import Float
from torch import Tensor, nn

import lens_aot
from lens_aot.core.components.attention.attention import Attention
from lens_aot.core.components.mlp.neuron_mlp import NeuronMLP
from lens_aot.core.fit.activations import ActivationFit
from lens_aot.core.spec.fields import saved
from lens_aot.core.spec.model_spec import AttentionSpec, LayerSpec, MLPSpec, ModelSpec, NormSpec, RotarySpec
from lens_aot.core.variants import VARIANTS, Variant, register_variant
from lens_aot.errors import LoadError
from lens_aot.tl.reading.registry import register_source_reader, source_readers, unregister_source_reader

D_MODEL, N_HEADS, D_HEAD, D_MLP, D_VOCAB, N_CTX = 16, 4, 4, 24, 40, 16

# ---------------------------------------------------------------------------------------------------------------
# The toy attention variant: a per-head output gain.
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class GainAttentionSpec(AttentionSpec):
    """An attention layer whose head h's output is multiplied by ``gain[h]`` before ``W_O``."""

    gain: Float[Tensor, " n_heads"] | None = saved("tensor", None)


class GainAttention(Attention):
    """:class:`Attention` with each head's ``z`` times its gain before ``W_O``."""

    def __init__(self, spec: GainAttentionSpec, causal: bool, rotary: RotarySpec | None = None) -> None:
        super().__init__(spec, causal, rotary)
        assert spec.gain is not None
        self.gain = nn.Parameter(spec.gain.detach().clone(), requires_grad=False)

    def write_out(self, z: Float[Tensor, "batch pos head d_head"]) -> Float[Tensor, "batch pos d_model"]:
        return super().write_out(z * self.gain[:, None])

    def spec(self) -> GainAttentionSpec:
        base = super().spec()
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(AttentionSpec)}
        return GainAttentionSpec(**fields, gain=self.gain.detach().clone())


# ---------------------------------------------------------------------------------------------------------------
# The toy MLP variant: Swish-β, z·σ(βz).
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class SwishBetaSpec(MLPSpec):
    """A plain MLP with ``act(z) = z · σ(β z)``."""

    swish_beta: float = saved("float", 1.0)


def swish_beta_fit(mlp: SwishBetaSpec, norm: Any, max_neuron_error: Any, heads: Any, layer: int) -> ActivationFit:
    """Theorem 3's single head with ``a = β``: ``(1·z + 0)·σ(β z + 0)`` is ``z·σ(βz)`` itself (exact)."""
    return ActivationFit("swish_beta", (1.0,), (0.0,), (float(mlp.swish_beta),), (0.0,), 0.0)


class SwishBetaMLP(NeuronMLP):
    """Neuron heads of a Swish-β MLP, which remember β (for ``to_spec`` / save)."""

    def __init__(self, mlp: SwishBetaSpec, fit: ActivationFit) -> None:
        super().__init__(mlp, fit)
        self.swish_beta = float(mlp.swish_beta)

    def spec(self) -> SwishBetaSpec:
        base = super().spec()
        return SwishBetaSpec(
            **{f.name: getattr(base, f.name) for f in dataclasses.fields(MLPSpec)}, swish_beta=self.swish_beta
        )


def register_toys() -> None:
    """Declare both toys (once per process): each its spec, component and (the MLP) fit; save/load derives from the
    spec's declared fields."""
    if "toy_gain" not in VARIANTS:
        register_variant(
            Variant(
                "toy_gain",
                "attention",
                GainAttentionSpec,
                extends=AttentionSpec,
                component=GainAttention,
                label="per-head output gain",
            )
        )
    if "toy_swish_beta" not in VARIANTS:
        register_variant(
            Variant(
                "toy_swish_beta",
                "mlp",
                SwishBetaSpec,
                extends=MLPSpec,
                component=SwishBetaMLP,
                fit=swish_beta_fit,
                label="Swish-β",
                activation="swish_beta",  # exact like SiLU (Theorem 3, a = β): SiLU's stated error
                stated_error={torch.float32: 1e-5, torch.float64: 1e-10},
            )
        )


# ---------------------------------------------------------------------------------------------------------------
# The source: a small torch transformer using both, and its reader.
# ---------------------------------------------------------------------------------------------------------------


class ToySource(nn.Module):
    """A pre-LN causal transformer with learned positions, gain attention and Swish-β MLPs (its own forward: the
    independent computation the converted model is checked against)."""

    def __init__(self, n_layers: int = 2, seed: int = 0, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)

        def rand(*shape: int, scale: float = 1.0) -> nn.Parameter:
            return nn.Parameter((scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype))

        self.W_E, self.W_pos = rand(D_VOCAB, D_MODEL), rand(N_CTX, D_MODEL, scale=0.3)
        self.layers = nn.ModuleList()
        for i in range(n_layers):
            layer = nn.Module()
            layer.ln1_w, layer.ln1_b = rand(D_MODEL, scale=0.1), rand(D_MODEL, scale=0.1)
            layer.ln2_w, layer.ln2_b = rand(D_MODEL, scale=0.1), rand(D_MODEL, scale=0.1)
            layer.W_Q, layer.W_K, layer.W_V = (rand(N_HEADS, D_MODEL, D_HEAD, scale=D_MODEL**-0.5) for _ in range(3))
            layer.b_Q, layer.b_K, layer.b_V = (rand(N_HEADS, D_HEAD, scale=0.1) for _ in range(3))
            layer.W_O, layer.b_O = rand(N_HEADS, D_HEAD, D_MODEL, scale=0.5), rand(D_MODEL, scale=0.1)
            layer.gain = rand(N_HEADS)
            layer.W_in, layer.b_in = rand(D_MODEL, D_MLP, scale=D_MODEL**-0.5), rand(D_MLP, scale=0.1)
            layer.W_out, layer.b_out = rand(D_MLP, D_MODEL, scale=D_MLP**-0.5), rand(D_MODEL, scale=0.1)
            layer.swish_beta = 0.75 + 0.5 * i
            self.layers.append(layer)
        self.ln_w, self.ln_b = rand(D_MODEL, scale=0.1), rand(D_MODEL, scale=0.1)
        self.W_U, self.b_U = rand(D_MODEL, D_VOCAB, scale=D_MODEL**-0.5), rand(D_VOCAB, scale=0.1)

    @staticmethod
    def _ln(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
        x = x - x.mean(-1, keepdim=True)
        return x / (x.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * (1 + w) + b

    def forward(self, tokens: Tensor, return_type: str = "logits") -> Tensor:
        n = tokens.shape[1]
        resid = self.W_E[tokens] + self.W_pos[:n]
        mask = torch.ones(n, n, dtype=torch.bool).tril()
        for layer in self.layers:
            x = self._ln(resid, layer.ln1_w, layer.ln1_b)
            q, k, v = (
                torch.einsum("bpd,hde->bphe", x, W) + b
                for W, b in ((layer.W_Q, layer.b_Q), (layer.W_K, layer.b_K), (layer.W_V, layer.b_V))
            )
            scores = torch.einsum("bqhe,bkhe->bhqk", q, k) / D_HEAD**0.5
            pattern = scores.masked_fill(~mask, float("-inf")).softmax(-1)
            z = torch.einsum("bhqk,bkhe->bqhe", pattern, v) * layer.gain[:, None]
            resid = resid + torch.einsum("bqhe,hed->bqd", z, layer.W_O) + layer.b_O
            pre = self._ln(resid, layer.ln2_w, layer.ln2_b) @ layer.W_in + layer.b_in
            resid = resid + (pre * torch.sigmoid(layer.swish_beta * pre)) @ layer.W_out + layer.b_out
        return self._ln(resid, self.ln_w, self.ln_b) @ self.W_U + self.b_U


def read_toy(source: ToySource) -> ModelSpec:
    """The spec of a :class:`ToySource` (TransformerLens layout; LayerNorm weights ``1 + w``)."""
    t = lambda p: p.detach().clone()  # noqa: E731

    def norm(w: Tensor, b: Tensor) -> NormSpec:
        return NormSpec("LN", 1e-5, t(1 + w), t(b))

    layers = []
    for layer in source.layers:
        attn = GainAttentionSpec(
            *(t(getattr(layer, n)) for n in ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O")),
            attn_scale=D_HEAD**0.5,
            gain=t(layer.gain),
        )
        mlp = SwishBetaSpec(t(layer.W_in), t(layer.b_in), t(layer.W_out), t(layer.b_out), "swish_beta")
        mlp.swish_beta = float(layer.swish_beta)
        layers.append(LayerSpec(norm(layer.ln1_w, layer.ln1_b), attn, norm(layer.ln2_w, layer.ln2_b), mlp))
    return ModelSpec(
        d_model=D_MODEL,
        n_ctx=N_CTX,
        d_vocab=D_VOCAB,
        d_vocab_out=D_VOCAB,
        causal=True,
        W_E=t(source.W_E),
        layers=layers,
        ln_final=norm(source.ln_w, source.ln_b),
        W_U=t(source.W_U),
        b_U=t(source.b_U),
        W_pos=t(source.W_pos),
        model_name="toy",
    )


def convert_toy(source: ToySource, **options: Any) -> Any:
    """``lens_aot.convert(source)`` with the toys and their source reader registered (once per process)."""
    register_toys()
    if "toy source" not in [reader.name for reader in source_readers()]:
        register_source_reader("toy source", lambda model: isinstance(model, ToySource), read_toy)
    return lens_aot.convert(source, **options)


def _tokens() -> Tensor:
    return torch.randint(0, D_VOCAB, (3, N_CTX), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def converted() -> tuple[ToySource, Any]:
    source = ToySource()
    return source, convert_toy(source)


def test_the_toys_are_chosen_by_the_tables(converted: tuple[ToySource, Any]) -> None:
    """Registering put each toy's component in the factory tables: the converted blocks are the toys' own."""
    _, aot = converted
    assert all(isinstance(block.attn, GainAttention) for block in aot.blocks)
    assert all(isinstance(block.mlp, SwishBetaMLP) for block in aot.blocks)
    assert aot.cfg.activation_fits[1].b == (1.25,)  # the fit registered for SwishBetaSpec (Theorem 3, a = β)


def test_the_converted_model_computes_the_source(converted: tuple[ToySource, Any]) -> None:
    """The attention-only model agrees with the toy source's own forward to float64 rounding (both toys exact)."""
    source, aot = converted
    tokens = _tokens()
    with torch.no_grad():
        want = source(tokens)
        got = aot(tokens)
    assert (got - want).abs().max().item() < 1e-9
    no_gain = ToySource()
    with torch.no_grad():
        for layer in no_gain.layers:
            layer.gain.fill_(1.0)
        assert (aot(tokens) - no_gain(tokens)).abs().max().item() > 1e-3  # the gain matters: the check can fail


def test_convert_runs_the_whole_pipeline_on_the_registered_source(converted: tuple[ToySource, Any]) -> None:
    """``lens_aot.convert`` read the toy source through its registered reader and checked the result against the
    source's own forward (the report's measured error, within the stated bound)."""
    _, aot = converted
    report = aot.report
    assert report.max_abs_logit_error is not None and report.max_abs_logit_error < 1e-9
    assert report.neuron_heads == 2 * D_MLP and report.max_neuron_error == 0.0


def test_a_wrong_reading_of_a_registered_source_is_refused_by_the_check() -> None:
    """The check step judges a registered reader's spec against the source's own forward: a reader that forgets the
    gain gets a FaithfulnessError, not a model."""
    register_toys()

    def forgetful(source: ToySource) -> ModelSpec:
        spec = read_toy(source)
        for layer in spec.layers:
            layer.attn.gain = torch.ones_like(layer.attn.gain)
        return spec

    register_source_reader("forgetful toy", lambda model: isinstance(model, ToySource), forgetful, priority=10)
    try:
        with pytest.raises(lens_aot.FaithfulnessError, match="exceeds"):
            lens_aot.convert(ToySource(seed=3))
    finally:
        unregister_source_reader("forgetful toy")


def test_an_unregistered_kind_of_source_is_refused_naming_what_convert_takes() -> None:
    """Without a matching source reader, convert refuses the model by its type and says what it takes."""
    with pytest.raises(lens_aot.UnsupportedArchitectureError, match=r"HookedTransformer.*ToySource"):
        with _without_reader("toy source"):
            lens_aot.convert(ToySource(seed=4))


@contextmanager
def _without_reader(name: str) -> Iterator[None]:
    register_toys()
    entry = next((r for r in source_readers() if r.name == name), None)
    if entry is not None:
        unregister_source_reader(name)
    try:
        yield
    finally:
        if entry is not None:
            register_source_reader(entry.name, entry.matches, entry.read, priority=entry.priority)


def test_save_and_load_round_trip_bitwise(converted: tuple[ToySource, Any], tmp_path: Path) -> None:
    """Saved and loaded through the derived records: the toys' fields are written under their names, the loaded
    model is built of the toys' components and its logits equal the saved model's bit for bit."""
    _, aot = converted
    lens_aot.save(aot, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    layer = config["spec"]["layers"][1]
    assert set(layer["attn"]["toy_gain"]) == {"gain"} and layer["mlp"]["toy_swish_beta"] == {"swish_beta": 1.25}
    loaded = lens_aot.load(tmp_path)
    assert all(isinstance(block.attn, GainAttention) for block in loaded.blocks)
    assert all(isinstance(block.mlp, SwishBetaMLP) for block in loaded.blocks)
    tokens = _tokens()
    with torch.no_grad():
        assert torch.equal(loaded(tokens), aot(tokens))


def test_a_file_with_an_unregistered_toy_is_refused_by_name(converted: tuple[ToySource, Any], tmp_path: Path) -> None:
    """A lens_aot without the toy registered refuses its file by the toy's field name (a newer lens_aot's file)."""
    _, aot = converted
    lens_aot.save(aot, tmp_path)
    gain = VARIANTS.pop("toy_gain")
    try:
        with pytest.raises(LoadError, match=r"fields \['toy_gain'\].*newer lens_aot"):
            lens_aot.load(tmp_path)
    finally:
        VARIANTS["toy_gain"] = gain


def test_a_variant_field_without_a_saved_form_is_refused() -> None:
    """register_variant refuses a spec whose own field does not say how it is saved, naming the field and the fix."""

    @dataclass
    class Undeclared(AttentionSpec):
        gain: Tensor | None = None

    with pytest.raises(ValueError, match=r"fields \['gain'\].*saved\(kind, default\)"):
        register_variant(Variant("toy_undeclared", "attention", Undeclared, extends=AttentionSpec, component=Attention))
    assert "toy_undeclared" not in VARIANTS


def test_the_built_in_variants_fill_the_tables_in_their_order() -> None:
    """The built-in descriptors give the factory and fit tables the rows (and the first-match order) they had when
    the tables were written by hand."""
    from lens_aot.core.components import factory
    from lens_aot.core.fit.clamped_swiglu import ClampedSwiGLUSpec
    from lens_aot.core.fit.gating import GATED_FITS, ChainedGatedFit
    from lens_aot.core.fit.neuron_fits import FITS
    from lens_aot.core.fit.xielu import GatedXIELUFit, XIELUFit, XIELUSpec
    from lens_aot.core.spec.beside_moe import MoEBesideMLPSpec
    from lens_aot.core.spec.compressed import CompressedAttentionSpec
    from lens_aot.core.spec.mla import MLASpec
    from lens_aot.core.spec.model_spec import MoESpec
    from lens_aot.core.spec.routed import RoutedAttentionSpec

    builtin = lambda table: [kind for kind, _ in table if kind.__module__.startswith("lens_aot.")]  # noqa: E731
    assert builtin(factory.ATTENTION) == [MLASpec, CompressedAttentionSpec, RoutedAttentionSpec]
    assert builtin(factory.MOE) == [MoEBesideMLPSpec]
    assert builtin(factory.NEURON_MLP_BY_SPEC) == [ClampedSwiGLUSpec]
    assert builtin(factory.NEURON_MLP_BY_FIT) == [GatedXIELUFit, XIELUFit, ChainedGatedFit]
    assert {MLPSpec, MoESpec, XIELUSpec} <= set(FITS) and list(GATED_FITS) == [ClampedSwiGLUSpec]


def test_a_subclass_row_goes_before_its_base_row() -> None:
    """A variant of a registered variant's spec type is chosen first (first match wins): its row is inserted before
    the base's."""
    from lens_aot.core.components import factory

    register_toys()

    @dataclass
    class GainAttentionSpec2(GainAttentionSpec):
        pass

    try:
        register_variant(Variant("toy_gain_2", "attention", GainAttentionSpec2, component=GainAttention))
        kinds = [kind for kind, _ in factory.ATTENTION]
        assert kinds.index(GainAttentionSpec2) < kinds.index(GainAttentionSpec)
    finally:
        VARIANTS.pop("toy_gain_2", None)
        factory.ATTENTION[:] = [row for row in factory.ATTENTION if row[0] is not GainAttentionSpec2]


def test_bad_declarations_are_refused_with_the_fix() -> None:
    """A name taken twice, and a fit with no spec type to choose it by, are refused, naming what to change."""
    register_toys()
    with pytest.raises(ValueError, match="already registered; give this one another name"):
        register_variant(Variant("toy_gain", "attention", GainAttentionSpec, component=GainAttention))
    with pytest.raises(ValueError, match="no spec type to choose it by; give it spec="):
        register_variant(Variant("toy_fit_only", "mlp", fit=swish_beta_fit))
    assert "toy_fit_only" not in VARIANTS
