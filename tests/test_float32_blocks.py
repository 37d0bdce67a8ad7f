"""float32_blocks: a half model's float32 forward one block at a time is bit for bit the forward of the model cast to
float32, holds one block's float32 copy at a time, and leaves the model as it found it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from factories_bridge import D_VOCAB, make_bridge

import lens_aot
from lens_aot.core.check import float32_blocks as float32_blocks_module
from lens_aot.core.check import float32_vocab, residual_bound
from lens_aot.core.check.float32_blocks import float32_blocks, run_blocks
from lens_aot.core.check.float32_vocab import vocab_weights
from lens_aot.core.fit import per_layer
from lens_aot.core.memory import PeakMeter
from lens_aot.core.read import run_source, upcast_half
from lens_aot.tl import has_hooked_transformer


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_blockwise_float32_forward_is_the_float32_forward(family: str, half: torch.dtype) -> None:
    source = make_bridge(family, half)
    tokens = torch.randint(0, D_VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with upcast_half(source, half):  # the whole model in float32 (cast in place and back: new storage)
            whole = run_source(source, tokens)
        tensors = {name: (t, t.data_ptr()) for name, t in [*source.named_parameters(), *source.named_buffers()]}
        with float32_blocks(source):
            blocks = run_source(source, tokens)
            assert source.cfg.dtype == torch.float32
            assert all(t.dtype == half for t in source.parameters())  # cast only while a block runs
    assert blocks.dtype == torch.float32 and torch.equal(blocks, whole)
    # every parameter and buffer is the very tensor it was (same storage, same dtype), and no hook is left behind
    after = dict([*source.named_parameters(), *source.named_buffers()])
    assert after.keys() == tensors.keys()
    assert all(after[n].data_ptr() == ptr and after[n].dtype == t.dtype for n, (t, ptr) in tensors.items())
    assert source.cfg.dtype == half
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in run_blocks(source))


def test_blockwise_float32_forward_holds_one_block() -> None:
    """The float32 copies live one block at a time: torch's peak storage in the forward stays far below a float32 copy
    of the weights (twice their half bytes)."""
    source = make_bridge("llama", torch.bfloat16)
    weights = sum(p.numel() * p.element_size() for p in source.parameters())
    largest = max(sum(p.numel() * p.element_size() for p in unit.parameters()) for unit in run_blocks(source))
    with torch.no_grad(), float32_blocks(source), PeakMeter() as meter:
        run_source(source, torch.arange(8)[None])
    activations = 8 * D_VOCAB * 4 * 4  # a few [8, vocab] float32 tensors
    assert meter.peak <= 2 * largest + activations < 2 * weights, (meter.peak, largest, weights)


@pytest.mark.parametrize("chunk", [64, 97, 8192])
@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma3"])
def test_vocabulary_weights_in_chunks_are_the_whole_cast(
    family: str, half: torch.dtype, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedding looked up from half rows and the unembedding computed a chunk of vocabulary rows at a time
    (across chunk sizes dividing the vocabulary or not) give the whole float32 cast's logits bit for bit."""
    monkeypatch.setattr(float32_vocab, "CHUNK", chunk)
    source = make_bridge(family, half)
    assert {w.kind for unit in run_blocks(source) for w in vocab_weights(unit)} == {"embed", "linear"}
    tokens = torch.randint(0, D_VOCAB, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with upcast_half(source, half):
            whole = run_source(source, tokens)
        with float32_blocks(source):
            blocks = run_source(source, tokens)
    assert torch.equal(blocks, whole)


@pytest.mark.parametrize("shape", [(1, 64, 1000), (7, 96, 5000), (33, 128, 20000), (130, 256, 32768)])
@pytest.mark.parametrize("transposed", [False, True])
def test_linear_in_row_chunks_is_the_whole_product(shape: tuple[int, int, int], transposed: bool) -> None:
    """F.linear on chunks of the weight's rows is bitwise the whole product's columns (this BLAS), for the layouts
    the unembeddings use (nn.Linear's [vocab, d] weight; W_U [d, vocab] transposed)."""
    n, d, vocab = shape
    g = torch.Generator().manual_seed(0)
    x, bias = torch.randn(n, d, generator=g), torch.randn(vocab, generator=g)
    weight = torch.randn(d, vocab, generator=g).T if transposed else torch.randn(vocab, d, generator=g)
    whole = F.linear(x, weight, bias)
    for chunk in (1000, 4096, 8192):
        parts = [F.linear(x, weight[a : a + chunk], bias[a : a + chunk]) for a in range(0, vocab, chunk)]
        assert torch.equal(torch.cat(parts, -1), whole), chunk


def test_float32_run_holds_no_whole_vocabulary_copy() -> None:
    """At a shape whose vocabulary dominates, the float32 run's peak stays below one float32 copy of the embedding
    (the whole cast of either vocabulary weight would exceed it)."""
    from lens_aot.matrix.families import Family, build_hf_model
    from lens_aot.matrix.measure import _source

    vocab, d_model = 32768, 128  # untied: an embedding and an unembedding of 16 MiB each in float32
    fields = dict(vocab_size=vocab, hidden_size=d_model, head_dim=32, intermediate_size=256, num_hidden_layers=1)
    family = Family("LlamaForCausalLM", fields=dict(fields, max_position_embeddings=32, tie_word_embeddings=False))
    source = _source(build_hf_model(family).to(torch.bfloat16), family, "bridge", torch.bfloat16)
    copy = vocab * d_model * 4
    with torch.no_grad(), float32_blocks(source), PeakMeter() as meter:
        logits = run_source(source, torch.arange(4)[None])
    assert torch.isfinite(logits).all()
    assert meter.peak < copy / 2, (meter.peak, copy)


def _gathered_and_whole(
    model: torch.nn.Module, tokens: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> tuple[torch.Tensor, torch.Tensor]:
    """``model``'s float32 run a block at a time, with its vocabulary weights gathered / chunked from their half
    tensors, then with every weight cast whole (``vocab_weights`` patched to find none)."""
    with torch.no_grad():
        with float32_blocks(model):
            blocks = model(tokens)
        monkeypatch.setattr(float32_blocks_module, "vocab_weights", lambda unit: [])  # every weight cast whole
        with float32_blocks(model):
            whole = model(tokens)
    return blocks, whole


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_converted_models_vocabulary_weights_in_float32_blocks(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The converted model (its Embed and Unembed each a block of their own, hooked as the vocabulary weights'
    module too) run a block at a time with its vocabulary weights computed from their half tensors is the run with
    them cast whole, bit for bit."""
    monkeypatch.setattr(float32_vocab, "CHUNK", 64)
    aot = lens_aot.convert(make_bridge(family, torch.bfloat16), check="warn")
    assert {w.kind for unit in run_blocks(aot) for w in vocab_weights(unit)} == {"embed", "unembed"}
    tokens = torch.randint(0, D_VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    blocks, whole = _gathered_and_whole(aot, tokens, monkeypatch)
    assert torch.equal(blocks, whole)


@pytest.mark.parametrize("half", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(32, 64), (128, 1000), (512, 5000), (2048, 3000)])
def test_blockwise_float64_norms_are_the_whole_casts(
    shape: tuple[int, int], half: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The residual bound's and the per-layer fit's float64 norms and maxima, cast a block of columns or rows at a
    time (small blocks here, the smallest allowed among them), are bitwise those of the whole float64 cast."""
    W = torch.randn(*shape, generator=torch.Generator().manual_seed(3)).to(half)
    whole = W.double()
    for block in (1 << 12, 1 << 16, residual_bound.BLOCK_BYTES):
        monkeypatch.setattr(residual_bound, "BLOCK_BYTES", block)
        monkeypatch.setattr(per_layer, "BLOCK_BYTES", block)
        assert torch.equal(residual_bound.norms64(W, 0), whole.norm(dim=0))
        assert torch.equal(residual_bound.norms64(W, 1), whole.norm(dim=1))
        assert torch.equal(per_layer._column_abs_max(W), whole.abs().amax(0))


@pytest.mark.skipif(not has_hooked_transformer(), reason="needs a HookedTransformer (TL 3.x)")
@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_hooked_transformers_vocabulary_weights_in_float32_blocks(
    half: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A HookedTransformer's Embed and Unembed (``W_U.T.contiguous()``) computed from their half tensors give the
    logits of the run with them cast whole, bit for bit."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    shape = dict(n_layers=2, d_model=64, n_heads=4, d_head=16, d_mlp=128, d_vocab=300, n_ctx=32, act_fn="gelu_new")
    model = HookedTransformer(HookedTransformerConfig(**shape, normalization_type="LN", dtype=half, seed=0)).eval()
    assert {w.kind for unit in run_blocks(model) for w in vocab_weights(unit)} == {"embed", "unembed"}
    monkeypatch.setattr(float32_vocab, "CHUNK", 64)
    tokens = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(4))
    blocks, whole = _gathered_and_whole(model, tokens, monkeypatch)
    assert blocks.dtype == torch.float32 and torch.equal(blocks, whole)


def _gemma4_converted(half: torch.dtype, vocab: int = 128, d_model: int = 64) -> object:
    """A Gemma 4 bridge (per-layer inputs) in ``half`` at vocabulary ``vocab``, converted (check off: the tests run
    its float32 forward themselves)."""
    pytest.importorskip("transformers.models.gemma4")
    from gemma4_helpers import SHORT_CONTEXT, bridge_in

    from lens_aot.matrix.families import Family, build_hf_model

    fields = {**SHORT_CONTEXT, "vocab_size": vocab, "vocab_size_per_layer_input": vocab, "hidden_size": d_model}
    model = build_hf_model(Family("Gemma4ForCausalLM", "test", fields))
    return lens_aot.convert(bridge_in(model, half)[1], check=False)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gemma4_per_layer_table_gathered_with_the_embedding(half: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The converted Gemma 4 model's Embed (which passes its ids on to the per-layer inputs' lookup) gathers its own
    table and the per-layer input table at the same rows: the logits are the whole cast's, bit for bit."""
    aot = _gemma4_converted(half)
    kinds = sorted(w.kind for unit in run_blocks(aot) for w in vocab_weights(unit))
    assert kinds == ["embed", "follow", "unembed"], kinds
    monkeypatch.setattr(float32_vocab, "CHUNK", 64)
    tokens = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(6))
    blocks, whole = _gathered_and_whole(aot, tokens, monkeypatch)
    assert blocks.dtype == torch.float32 and torch.equal(blocks, whole)


class _MaxNormModel(torch.nn.Module):
    """An embedding with ``max_norm`` (its lookup renormalises the rows it reads) and a linear readout."""

    def __init__(self, vocab: int, d_model: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d_model, max_norm=1.5)
        self.out = torch.nn.Linear(d_model, 8)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(tokens))


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_max_norm_embedding_gathered(half: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """An ``nn.Embedding`` with ``max_norm`` renormalises the gathered float32 rows as the whole cast renormalises
    its copy's: the same output bit for bit, the half table untouched (renormalised only in float32 temporaries)."""
    torch.manual_seed(0)
    model = _MaxNormModel(300, 32).to(half)
    assert [w.kind for unit in run_blocks(model) for w in vocab_weights(unit)] == ["embed"]
    table = model.embed.weight.detach().clone()
    tokens = torch.randint(0, 300, (3, 17), generator=torch.Generator().manual_seed(7))
    blocks, whole = _gathered_and_whole(model, tokens, monkeypatch)
    assert blocks.dtype == torch.float32 and torch.equal(blocks, whole)
    assert torch.equal(model.embed.weight, table)
    assert (whole.abs() > 0).any()


def _peak(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    """torch's peak storage in ``model``'s float32 run a block at a time (finite output asserted)."""
    with torch.no_grad(), float32_blocks(model), PeakMeter() as meter:
        out = model(tokens)
    assert torch.isfinite(out).all()
    return meter.peak


def test_gathered_embeddings_hold_no_whole_vocabulary_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``max_norm`` embedding and Gemma 4's converted Embed (with its per-layer input table), at shapes whose
    vocabulary dominates: the float32 run's peak stays below a float32 copy of the smaller vocabulary table, which
    the run with the tables cast whole exceeds."""
    tokens = torch.arange(4)[None]
    model = _MaxNormModel(32768, 128).to(torch.bfloat16)
    aot = _gemma4_converted(torch.bfloat16, vocab=65536)
    cases = [(model, 4 * model.embed.weight.numel()), (aot, 4 * aot.embed.per_layer_inputs.W_E.numel())]
    gathered = [_peak(m, tokens) for m, _ in cases]
    monkeypatch.setattr(float32_blocks_module, "vocab_weights", lambda unit: [])  # every weight cast whole
    whole = [_peak(m, tokens) for m, _ in cases]
    for (_, copy), peak, cast in zip(cases, gathered, whole, strict=True):
        assert peak < copy / 2 and cast > copy, (peak, cast, copy)
