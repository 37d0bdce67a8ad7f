"""auto-circuit (``pip install auto-circuit==1.0.1``, Joseph Miller's edge-pruning library for HookedTransformers) on
the source and the converted model (TransformerLens 3.x; skipped where ``auto_circuit`` is not importable).

auto-circuit is not in the test extras: it pins ``kaleido==0.2.1`` and pulls ``tracr-pypi`` and ``word2word``. With
``pip install --no-deps auto-circuit==1.0.1 ordered-set`` it runs on TransformerLens 3.9 after two shims that the
*source* needs as well, applied here before import (:func:`_shims`): TransformerLens 3 moved
``HookedTransformerKeyValueCache`` (auto-circuit imports it from ``transformer_lens`` and
``transformer_lens.past_key_value_caching``), and ``blobfile`` (imported only to download pretrained SAEs) is
replaced by a stub. The library itself is unmodified.

Calls, on both models: ``patchable_model`` (factorized, split q/k/v, last-position output; it puts its wrappers in
place of the hook points, as SAELens does), ``edge_attribution_patching_prune_scores``,
``mask_gradient_prune_scores`` and ``run_circuits`` at several edge counts. Float32 (auto-circuit's masks are
float32 on a float64 model). Scores agree relative to the largest source score within ``TOLERANCE_FACTOR·B / |metric|``
(as the EAP-IG tests), circuit outputs (logits) within ``2·B``, ``B`` the conversion's logit bound.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any

import pytest
import torch

import lens_aot
from interop.pairs import SELFCHECK, assert_close

TOLERANCE_FACTOR = 20.0
pytestmark = pytest.mark.skipif(SELFCHECK, reason="builds its own converted models")


def _shims() -> None:
    """The names auto-circuit 1.0.1 imports that TransformerLens 3.9 moved, and a stub for ``blobfile``."""
    pytest.importorskip("transformer_lens.HookedTransformer", reason="auto-circuit needs TransformerLens 3.x")
    import transformer_lens
    from transformer_lens.cache import key_value_cache  # TransformerLens 3.9's home of the key-value cache

    cache_class = key_value_cache.TransformerLensKeyValueCache
    transformer_lens.HookedTransformerKeyValueCache = cache_class
    sys.modules.setdefault(
        "transformer_lens.past_key_value_caching", types.SimpleNamespace(HookedTransformerKeyValueCache=cache_class)
    )
    if "blobfile" not in sys.modules:
        try:
            import blobfile  # noqa: F401
        except ImportError:
            sys.modules["blobfile"] = types.SimpleNamespace(BlobFile=None)


def _run(model: Any, clean: torch.Tensor, corrupt: torch.Tensor, answers: torch.Tensor) -> tuple[Any, Any, Any]:
    from auto_circuit.data import PromptDataLoader, PromptDataset
    from auto_circuit.prune import run_circuits
    from auto_circuit.prune_algos.edge_attribution_patching import edge_attribution_patching_prune_scores
    from auto_circuit.prune_algos.mask_gradient import mask_gradient_prune_scores
    from auto_circuit.utils.graph_utils import patchable_model

    data = PromptDataset(clean, corrupt, [a[:1] for a in answers], [a[1:] for a in answers])
    loader = PromptDataLoader(data, seq_len=None, diverge_idx=0, batch_size=len(clean), shuffle=False)
    model.set_use_attn_result(True)
    model.set_use_split_qkv_input(True)
    model.set_use_hook_mlp_in(True)
    if model.cfg.n_key_value_heads is not None:
        model.set_ungroup_grouped_query_attention(True)
    patchable = patchable_model(model, factorized=True, slice_output="last_seq", separate_qkv=True)
    eap = edge_attribution_patching_prune_scores(patchable, loader, official_edges=None)
    mask = mask_gradient_prune_scores(
        patchable, loader, official_edges=None, grad_function="logit", answer_function="avg_diff", mask_val=0.0
    )
    circuits = run_circuits(patchable, loader, [0, 5, 20, patchable.n_edges], eap)
    return eap, mask, circuits


@pytest.mark.parametrize(("family", "act_fn"), [("ln-standard", "gelu"), ("llama", "silu")])
def test_auto_circuit_scores_and_circuits(family: str, act_fn: str) -> None:
    if importlib.util.find_spec("auto_circuit") is None:
        pytest.skip("auto-circuit is not installed (pip install --no-deps auto-circuit==1.0.1 ordered-set)")
    _shims()
    from factories_hooked import make_hooked

    source = make_hooked(family, act_fn, torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    clean = torch.randint(1, int(source.cfg.d_vocab), (8, 6), generator=generator)
    corrupt = clean.clone()
    corrupt[:, -2] = (clean[:, -2] + 7) % (int(source.cfg.d_vocab) - 1) + 1
    aot = lens_aot.convert(source, check_tokens=torch.cat([clean, corrupt]))
    bound = float(aot.report.logit_bound)
    with torch.no_grad():
        logits = source(clean)[:, -1]
    answers = logits.topk(2).indices
    metric = float((logits.gather(1, answers[:, :1]) - logits.gather(1, answers[:, 1:])).abs().mean())
    tolerance = TOLERANCE_FACTOR * bound / metric
    want, got = _run(source, clean, corrupt, answers), _run(aot, clean, corrupt, answers)
    for index, what in ((0, "edge attribution patching"), (1, "mask gradient")):
        assert set(got[index]) == set(want[index]), f"{what}: different destination modules"
        scale = max(float(s.abs().max()) for s in want[index].values())
        assert scale > 0, f"{what}: the source's scores are all zero (the test would prove nothing)"
        for name, scores in want[index].items():
            assert_close(got[index][name] / scale, scores / scale, tolerance, f"auto-circuit {what} scores at {name}")
    for edges, batches in want[2].items():
        for key, value in batches.items():
            assert_close(got[2][edges][key], value, 2 * bound, f"auto-circuit run_circuits, {edges} edges")
