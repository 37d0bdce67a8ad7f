"""EAP-IG (Michael Hanna's ``eap``, MIB's circuit-localization baseline) runs unmodified on the converted model and
gives the source's scores, circuits and faithfulness (issue 23, item 2). TransformerLens 3.x only (``eap`` imports
``HookedTransformer``).

For each family (LayerNorm/GELU; RMSNorm/rotary/GQA/SwiGLU; bidirectional LayerNorm/gelu_new; the shipped trained
modular-addition model), in float64, the same calls run on the source and on ``lens_aot.convert(source)``:
``Graph.from_model``; ``attribute`` with every method (EAP, EAP-IG-inputs, EAP-IG-activations, clean-corrupted,
information-flow-routes, exact) and every intervention (patching, zero, mean, mean-positional) over the families
(:data:`CASES`: every method on the trained model, all but exact on LayerNorm/GELU, the core ones on the others);
``attribute_node``; ``apply_topn`` / ``apply_greedy``; ``evaluate_graph`` (every intervention); ``evaluate_baseline``.

Tolerances: the metric is a logit difference, so one forward's metric differs by at most ``2·B`` with ``B`` the
conversion's stated logit bound (``aot.report.logit_bound``, measured on these very tokens). Scores are sums of such
metric changes (exact), or gradients of the metric times activation differences: they are compared relative to the
largest source score, within ``TOLERANCE_FACTOR·B / |baseline metric|`` (at least float64 rounding). Circuits must
be the same edges except where the source's own scores tie within that tolerance at the cut.

The one adaptation: EAP allocates its score buffers with ``device='cuda'`` hard-coded; without a GPU those
allocations are made on the CPU (:func:`_cpu_for_cuda`). Nothing else of the library is touched.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor

import lens_aot
from lens_aot.tl import has_hooked_transformer

if not has_hooked_transformer():
    pytest.skip("EAP-IG needs TransformerLens 3.x (it imports HookedTransformer)", allow_module_level=True)
eap_graph = pytest.importorskip("eap.graph", reason="EAP-IG needs TransformerLens 3.x (HookedTransformer)")
from eap import attribute as eap_attribute  # noqa: E402
from eap import attribute_node as eap_attribute_node  # noqa: E402
from eap import evaluate as eap_evaluate  # noqa: E402
from eap import utils as eap_utils  # noqa: E402

Graph = eap_graph.Graph
TOLERANCE_FACTOR = 20.0
FAMILIES = ["ln-gelu", "rms-rotary-gqa-gated", "bidirectional", "trained-modular-addition"]
# every method with every intervention it accepts on the shipped trained model (one layer: exact patching evaluates the
# graph once per edge); every method with its cheaper interventions on LayerNorm/GELU; the core ones on the others
# (CI's time budget)
EVERY = [("EAP", "patching"), ("EAP", "zero"), ("EAP", "mean"), ("EAP", "mean-positional")]
EVERY += [("EAP-IG-inputs", "patching"), ("clean-corrupted", "patching"), ("EAP-IG-activations", "patching")]
EVERY += [("information-flow-routes", "patching")]
TRAINED_ONLY = [("EAP-IG-activations", "zero"), ("EAP-IG-activations", "mean"), ("exact", "patching")]
CORE = [("EAP", "patching"), ("EAP", "mean-positional"), ("EAP-IG-inputs", "patching")]
COVERAGE = {"trained-modular-addition": EVERY + TRAINED_ONLY, "ln-gelu": EVERY}
CASES = [(family, *case) for family in FAMILIES for case in COVERAGE.get(family, CORE)]
GREEDY = ("ln-gelu", "trained-modular-addition")  # greedy selection (one forward per added edge)
FIGURES: dict[str, dict[str, float]] = {}


@pytest.fixture(autouse=True)
def _cpu_for_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """EAP-IG creates its score buffers with ``device='cuda'``; on a machine without CUDA, on the CPU instead."""
    if not torch.cuda.is_available():
        proxy = types.SimpleNamespace(**{k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})

        def zeros(*args: Any, device: Any = None, **kwargs: Any) -> Tensor:
            return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)

        proxy.zeros = zeros
        for module in (eap_attribute, eap_attribute_node, eap_evaluate, eap_utils):
            monkeypatch.setattr(module, "torch", proxy)
    yield


class Family:
    """A float64 source with a tokenizer, its conversion, and a tiny clean/corrupted dataset in EAP's format."""

    def __init__(self, name: str) -> None:
        torch.manual_seed(0)
        self.name = name
        self.source, texts = _source(name)
        self.source.eval()
        clean = [t for t, _ in texts]
        corrupted = [c for _, c in texts]
        tokens = torch.cat([self.source.to_tokens(clean), self.source.to_tokens(corrupted)])
        with torch.no_grad():
            top = self.source(self.source.to_tokens(clean))[:, -1].topk(2).indices
        self.labels = top
        self.data = [(clean[:2], corrupted[:2], top[:2]), (clean[2:], corrupted[2:], top[2:])]
        self.aot = lens_aot.convert(self.source, check_tokens=tokens)
        self.bound = float(self.aot.report.logit_bound)
        for model in (self.source, self.aot):
            model.set_use_attn_result(True)
            model.set_use_split_qkv_input(True)
            model.set_use_hook_mlp_in(True)
            if model.cfg.n_key_value_heads is not None:
                model.set_ungroup_grouped_query_attention(True)

    def models(self) -> tuple[Any, Any]:
        return self.source, self.aot


def _word_tokenizer(n_words: int, bos: bool) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(n_words)} | {"<pad>": n_words}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if bos:
        backend.post_processor = processors.TemplateProcessing(single="w0 $A", special_tokens=[("w0", 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="w0", eos_token="w0", pad_token="<pad>")
    tok.init_kwargs["name_or_path"] = "eap-test-words"
    tok.init_kwargs["add_bos_token"] = True  # else TransformerLens re-loads the tokenizer by name (offline here)
    return tok


def _source(name: str) -> tuple[Any, list[tuple[str, str]]]:
    """The family's source and 4 (clean, corrupted) texts differing in one word."""
    if name == "trained-modular-addition":
        from lens_aot.cli.demo_models import load_modular_addition

        source = load_modular_addition(dtype=torch.float64)
        # "a b =" without BOS (the model was trained on 3 tokens): a tokenizer that says it adds BOS, so that
        # EAP's to_tokens(prepend_bos=True) adds nothing
        source.set_tokenizer(_word_tokenizer(114, bos=False), default_padding_side="right")
        source.cfg.tokenizer_prepends_bos = True
        pairs = [(5, 17), (40, 2), (99, 63), (12, 100)]
        return source, [(f"w{a} w{b} w113", f"w{(a + 9) % 113} w{b} w113") for a, b in pairs]
    from factories_hooked import make_hooked

    family, act_fn, extra = {
        "ln-gelu": ("ln-standard", "gelu", {}),
        "rms-rotary-gqa-gated": ("llama", "silu", {}),
        "bidirectional": ("ln-bidirectional", "gelu_new", {}),
    }[name]
    source = make_hooked(family, act_fn, torch.float64, d_vocab=97, **extra)
    source.set_tokenizer(_word_tokenizer(97, bos=True), default_padding_side="right")
    texts = []
    for i in range(4):
        words = [f"w{1 + (7 * i + 5 * j) % 95}" for j in range(5)]
        clean = " ".join(words)
        words[2] = f"w{1 + (int(words[2][1:]) + 11) % 95}"
        texts.append((clean, " ".join(words)))
    return source, texts


_FAMILIES: dict[str, Family] = {}


def _family(name: str) -> Family:
    if name not in _FAMILIES:
        _FAMILIES[name] = Family(name)
    return _FAMILIES[name]


@pytest.fixture(params=FAMILIES, scope="module")
def family(request: pytest.FixtureRequest) -> Family:
    return _family(request.param)


def _metric(mean: bool) -> Any:
    def metric(logits: Tensor, corrupted_logits: Tensor, input_lengths: Tensor, labels: Tensor) -> Tensor:
        last = logits[torch.arange(logits.shape[0]), input_lengths - 1]
        diff = last.gather(-1, labels[:, :1].to(last.device)) - last.gather(-1, labels[:, 1:].to(last.device))
        return diff.mean() if mean else diff.squeeze(-1)

    return metric


def _baseline(f: Family) -> float:
    return float(eap_evaluate.evaluate_baseline(f.source, f.data, _metric(False), quiet=True).abs().mean())


def _tolerance(f: Family) -> float:
    """Relative tolerance on scores: the logit bound's share of the metric's size, at least float64 rounding."""
    return max(TOLERANCE_FACTOR * f.bound / _baseline(f), 1e-9)


def _scores(model: Any, f: Family, method: str, intervention: str, node: bool = False) -> Any:
    graph = Graph.from_model(model, node_scores=node)
    kwargs: dict[str, Any] = dict(intervention=intervention, quiet=True)
    if intervention.startswith("mean"):
        kwargs["intervention_dataloader"] = f.data
    if "IG" in method:
        kwargs["ig_steps"] = 3
    if node:
        eap_attribute_node.attribute_node(model, graph, f.data, _metric(True), method, **kwargs)
        return graph
    eap_attribute.attribute(model, graph, f.data, _metric(True), method, **kwargs)
    return graph


def _record(f: Family, key: str, value: float) -> None:
    FIGURES.setdefault(f.name, {})
    FIGURES[f.name][key] = max(FIGURES[f.name].get(key, 0.0), value)


def _compare_scores(f: Family, src: Tensor, got: Tensor, what: str) -> None:
    scale = float(src.abs().max())
    assert scale > 0, f"{what}: the source's scores are all zero (the test would prove nothing)"
    rel = float((got - src).abs().max()) / scale
    _record(f, "max relative score difference", rel)
    assert rel <= _tolerance(f), f"{what}: relative score difference {rel:.2e} > {_tolerance(f):.2e}"


def test_graph_from_model_accepts_the_converted_model(family: Family) -> None:
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    assert isinstance(family.aot, HookedTransformer) and isinstance(family.aot.cfg, HookedTransformerConfig)
    src, aot = Graph.from_model(family.source), Graph.from_model(family.aot)
    assert src.n_forward == aot.n_forward and src.n_backward == aot.n_backward
    assert list(src.nodes) == list(aot.nodes) and list(src.edges) == list(aot.edges)


@pytest.mark.parametrize(("family_name", "method", "intervention"), CASES)
def test_attribute_scores_agree(family_name: str, method: str, intervention: str) -> None:
    family = _family(family_name)
    src, aot = (_scores(m, family, method, intervention) for m in family.models())
    mask = src.real_edge_mask
    _compare_scores(family, src.scores[mask], aot.scores[mask], f"{method}/{intervention}")


def test_attribute_node_scores_agree(family: Family) -> None:
    src, aot = (_scores(m, family, "EAP", "patching", node=True) for m in family.models())
    _compare_scores(family, src.nodes_scores, aot.nodes_scores, "attribute_node EAP")


@pytest.mark.parametrize(("family_name", "select"), [(f, "topn") for f in FAMILIES] + [(f, "greedy") for f in GREEDY])
def test_circuits_and_faithfulness_agree(family_name: str, select: str) -> None:
    family = _family(family_name)
    graphs = [_scores(m, family, "EAP-IG-inputs", "patching") for m in family.models()]
    n = 12
    for g in graphs:
        g.apply_topn(n, absolute=True) if select == "topn" else g.apply_greedy(n, absolute=True)
    src, aot = graphs
    chosen_src, chosen_aot = src.in_graph.clone(), aot.in_graph.clone()
    overlap = float((chosen_src & chosen_aot).sum()) / max(float(chosen_src.sum()), 1.0)
    _record(family, f"circuit edges not shared ({select})", 1.0 - overlap)
    differ = chosen_src ^ chosen_aot
    if differ.any():  # allowed only for edges whose source scores tie at the cut within the tolerance
        scale = float(src.scores[src.real_edge_mask].abs().max())
        cut = float(src.scores[chosen_src].abs().min())
        gap = float((src.scores[differ].abs() - cut).abs().max()) / scale
        assert gap <= _tolerance(family), f"{select}: circuits differ beyond ties ({int(differ.sum())} edges)"
    for intervention in ["patching", "zero", "mean", "mean-positional"]:
        kwargs: dict[str, Any] = dict(intervention=intervention, quiet=True)
        if intervention.startswith("mean"):
            kwargs["intervention_dataloader"] = family.data
        # the same circuit (the source's) on both models: faithfulness of the model, not of the selection
        aot.in_graph[:] = src.in_graph
        aot.nodes_in_graph[:] = src.nodes_in_graph
        want, got = (
            eap_evaluate.evaluate_graph(m, g, family.data, _metric(False), **kwargs)
            for m, g in (
                (family.source, src),
                (family.aot, aot),
            )
        )
        error = float((got - want).abs().max())
        _record(family, "faithfulness difference", error)
        assert error <= TOLERANCE_FACTOR * 2 * family.bound, f"evaluate_graph/{intervention}: |Δ| {error:.2e}"
    want, got = (eap_evaluate.evaluate_baseline(m, family.data, _metric(False), quiet=True) for m in family.models())
    assert float((got - want).abs().max()) <= 2 * family.bound


def teardown_module() -> None:
    for name, figures in FIGURES.items():
        print(f"EAP-IG {name}: " + ", ".join(f"{k} {v:.2e}" for k, v in sorted(figures.items())))


@pytest.mark.parametrize("method", ["EAP", "EAP-IG-inputs", "EAP-IG-activations"])
def test_discover_in_eap_ig_names_scores_as_eap_ig_attribute(method: str) -> None:
    """lens_aot.circuits.discover at mlp granularity, called as EAP-IG's attribute is (its method names, ig_steps, its
    scalar metric and string batches), gives EAP-IG's scores on the source, edge by edge. EAP-IG's scalar metric is
    the batch's mean and it divides the sum over batches by the number of examples again, so its scores are lens_aot's
    over the batch size. Signs: EAP-IG scores ``(corrupted − clean)·∂metric``, lens_aot ``(clean − corrupted)·∂metric``
    (positive = supports the clean answer, docs/circuit-discovery.md), so with the same metric they are opposite."""
    from lens_aot.circuits import discover

    f = _family("ln-gelu")
    src = _scores(f.source, f, method, "patching")
    ours = discover(f.aot, f.data, _metric(True), method=method, granularity="mlp", ig_steps=3)
    batch = len(f.data[0][0])
    assert all(len(clean) == batch for clean, _, _ in f.data)
    theirs = torch.tensor([float(src.edges[name].score) for name in ours.edge_names], dtype=torch.float64)
    _compare_scores(f, theirs, -ours.scores / batch, f"discover({method!r})")
