"""What the documentation's code blocks assume exists, built offline for tests/test_docs.py.

A page's ```python blocks run in order in one namespace. A block preceded by ``<!-- docs-test: setup=NAME -->``
first gets the names :data:`SETUPS` ``[NAME]`` returns (once per page); ``<!-- docs-test: skip REASON -->`` marks a
block that cannot run offline on a CPU (a Hub download, CUDA, several devices), with the reason. A setup that needs
what the running TransformerLens lacks (HookedTransformer, EAP-IG, SAELens: 3.x only) skips the page there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from factories_bridge import D_VOCAB, make_bridge

import lens_aot


def _tokens(seed: int = 0, shape: tuple[int, int] = (2, 6), vocab: int = D_VOCAB) -> torch.Tensor:
    return torch.randint(1, vocab, shape, generator=torch.Generator().manual_seed(seed))


def tiny(ns: dict[str, Any]) -> dict[str, Any]:
    """``model``: a tiny random GPT-2 TransformerBridge (gelu_new: 4 heads per neuron, 2 layers, 64 neurons, a word
    tokenizer) and ``tokens`` ``[2, 6]``."""
    return {"torch": torch, "lens_aot": lens_aot, "model": make_bridge("gpt2", tokenizer=True), "tokens": _tokens()}


def task(ns: dict[str, Any]) -> dict[str, Any]:
    """:func:`tiny`, converted (``aot``), with a patching task: ``clean`` / ``corrupted`` tokens, ``answers``, a
    scalar ``metric(logits)`` (the mean logit of the answer), their caches, some ``heads`` and ``ref``, and
    ``senders`` / ``receivers`` for path patching."""
    import transformer_lens

    out = tiny(ns)
    aot = lens_aot.convert(out["model"])
    clean, corrupted = _tokens(1), _tokens(2)
    answers = _tokens(3, (2, 1))[:, 0]

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[:, -1].gather(-1, answers[:, None]).mean()

    _, clean_cache = aot.run_with_cache(clean)
    ref = aot.neuron_heads(0, 17)[0]
    return {
        **out,
        "transformer_lens": transformer_lens,
        "aot": aot,
        "clean": clean,
        "corrupted": corrupted,
        "tokens": clean,
        "answers": answers,
        "metric": metric,
        "clean_cache": clean_cache,
        "cache": clean_cache,
        "ref": ref,
        "heads": ["L0H1", ref],
        "senders": [("blocks.0.attn", 1), ("blocks.0.attn", 2)],
        "receivers": [("blocks.1.attn", 0)],
    }


def hooked(ns: dict[str, Any]) -> dict[str, Any]:
    """``source``: a tiny random HookedTransformer (TransformerLens 3.x; SiLU, LayerNorm), ``aot`` its conversion,
    ``tokens``."""
    from lens_aot.tl import has_hooked_transformer

    if not has_hooked_transformer():
        pytest.skip("this page's code needs HookedTransformer (TransformerLens 3.x)")
    from factories_hooked import make_hooked

    source = make_hooked("ln-standard", "silu", torch.float32)
    tokens = _tokens(vocab=int(source.cfg.d_vocab))
    return {"torch": torch, "lens_aot": lens_aot, "source": source, "aot": lens_aot.convert(source), "tokens": tokens}


def bridge_source(ns: dict[str, Any]) -> dict[str, Any]:
    """``source`` and ``fresh``: two tiny random GPT-2 TransformerBridges (other seeds), ``aot`` the first's
    conversion."""
    source = make_bridge("gpt2", seed=0)
    return {"source": source, "fresh": make_bridge("gpt2", seed=1), "aot": lens_aot.convert(source)}


def eap(ns: dict[str, Any]) -> dict[str, Any]:
    """:func:`hooked`, and ``dataloader``: EAP-IG's batches ``(clean, corrupted, labels)`` of token tensors."""
    pytest.importorskip("eap.graph", reason="EAP-IG needs TransformerLens 3.x")
    out = hooked(ns)
    v = int(out["source"].cfg.d_vocab)
    return {**out, "dataloader": [(_tokens(4, vocab=v), _tokens(5, vocab=v), _tokens(6, (2, 1), vocab=v)[:, 0])]}


def sae(ns: dict[str, Any]) -> dict[str, Any]:
    """:func:`hooked`, ``hooked_sae_transformer`` (the same weights in SAELens's class) and a random ``sae`` at
    ``blocks.0.hook_resid_post``."""
    sae_lens = pytest.importorskip("sae_lens", reason="SAELens needs TransformerLens 3.x")
    from interop.sae_helpers import make_sae

    out = hooked(ns)
    hst = sae_lens.HookedSAETransformer(out["source"].cfg)
    hst.load_state_dict(out["source"].state_dict())
    sae_ = make_sae("blocks.0.hook_resid_post", int(out["source"].cfg.d_model), torch.float32)
    return {**out, "hooked_sae_transformer": hst, "sae": sae_}


def moe(ns: dict[str, Any]) -> dict[str, Any]:
    """``mixtral_bridge`` and ``qwen2_moe_bridge``: tiny random TransformerBridges (4 experts, top-2, 2 layers;
    Qwen2-MoE with a shared expert), and ``hf_moe_model``: a tiny random ``MixtralForCausalLM``."""
    from factories_moe import _hf, moe_bridge

    hf_moe_model, _ = _hf("mixtral")
    return {
        "lens_aot": lens_aot,
        "torch": torch,
        "mixtral_bridge": moe_bridge("mixtral"),
        "qwen2_moe_bridge": moe_bridge("qwen2_moe"),
        "hf_moe_model": hf_moe_model.eval(),
    }


SETUPS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "tiny": tiny,
    "task": task,
    "hooked": hooked,
    "bridge-source": bridge_source,
    "eap": eap,
    "sae": sae,
    "moe": moe,
}
