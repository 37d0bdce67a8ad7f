"""The HookedTransformerConfig feature cases of the installed TransformerLens (3.9), each converted from a tiny random
model: the count docs/families.md states ("Feature cases").

The cases are read off the installed package wherever it lists them, so that a new option shows up here:

* every activation in ``SUPPORTED_ACTIVATIONS``, in a plain and in a gated MLP;
* every value of ``normalization_type``, ``positional_embedding_type`` and ``attention_dir`` that TransformerLens's
  code compares against or its config docstring names (plus ``normalization_type=None``);
* every boolean config field that changes the forward (``config_fields.CARRIED``; tokenizer flags aside) flipped from
  its default, with the companion fields it needs (:data:`_COMPANIONS`; a new one is flipped on its own);
* the numeric / named attention and MLP features (:data:`_VALUED`): grouped- and multi-query attention, partial
  rotary, local rotary bases, global rotary scaling, soft caps, QKV clipping, mixtures of experts, OLMo's post-norm
  and projection QK-norm, a separate output vocabulary, a custom attention scale, float64.

A case the source itself cannot run (its own forward raises: relative position biases, which only T5's blocks
feed) is not a HookedTransformer feature and is left out of the count. A case converts when ``convert`` succeeds (its
check against the source's own forward included) and the logits agree within the certified bound it reports.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import transformer_lens
from factories_hooked import make_hooked
from transformer_lens import HookedTransformerConfig
from transformer_lens.utilities import SUPPORTED_ACTIVATIONS

import lens_aot
from lens_aot.errors import LensAOTError
from lens_aot.tl.config_fields import CARRIED

# Refused cases, each with a word its error contains (docs/families.md says why). SoLU normalises across neurons
# (excused by the issue). Gated relu2 / xIELU (relu(g)²·u, xielu(g)·u: chained products) convert
# (tests/test_hooked_chained_gates.py).
REFUSED: dict[str, str] = {
    "act_fn=solu": "SoLU",
    "act_fn=solu_ln": "SoLU",
    "act_fn=solu+gated": "SoLU",
    "act_fn=solu_ln+gated": "SoLU",
}

_ROTARY = dict(normalization_type="RMS", positional_embedding_type="rotary", rotary_dim=8)
_LOCAL = dict(use_local_attn=True, attn_types=["local", "global"], window_size=6)
_MOE = dict(num_experts=4, experts_per_token=2)
# Boolean fields that need other fields to mean anything (flipped on the rotary base unless given a family here).
_COMPANIONS: dict[str, dict[str, Any]] = {
    "use_NTK_by_parts_rope": dict(NTK_by_parts_factor=4.0, NTK_original_ctx_len=8),
    "use_yarn_rope": dict(yarn_factor=4.0, yarn_original_max_position_embeddings=8),
    "yarn_truncate": dict(use_yarn_rope=True, yarn_factor=4.0, yarn_original_max_position_embeddings=8),
    "yarn_global_attn_only": dict(
        use_yarn_rope=True, yarn_factor=4.0, yarn_original_max_position_embeddings=8, **_LOCAL
    ),
    "use_local_attn": dict(attn_types=["local", "global"], window_size=6),
    "use_logn_attn": dict(train_seq_length=8),
    "use_dynamic_ntk_rope": dict(train_seq_length=8),
    "norm_topk_prob": _MOE,
}
# Boolean fields that are no forward feature (tokenizer flags) or are enumerated with the activations.
_NOT_FEATURES = {"default_prepend_bos", "tokenizer_prepends_bos", "gated_mlp"}
_VALUED: dict[str, dict[str, Any]] = {
    "grouped-query attention": dict(n_key_value_heads=2),
    "multi-query attention": dict(n_key_value_heads=1),
    "partial rotary": dict(rotary_dim=4),
    "local rotary base": dict(rotary_base_local=1000, **_LOCAL),
    "global rotary scaling": dict(rotary_scaling_factor=4.0, **_LOCAL),
    "attention score soft cap": dict(attn_scores_soft_cap=2.0),
    "logit soft cap": dict(output_logits_soft_cap=3.0),
    "QKV clipping": dict(clip_qkv=0.5),
    "mixture of experts": _MOE,
    "OLMo-2 post-norm": dict(original_architecture="Olmo2ForCausalLM"),
    "OLMoE projection QK-norm": dict(original_architecture="OlmoeForCausalLM"),
    "output vocabulary": dict(d_vocab_out=40),
    "custom attention scale": dict(attn_scale=3.0),
    "float64": dict(dtype=torch.float64),
}


def _named_values(field: str) -> list[str]:
    """The values of a string field TransformerLens's code compares against or its config docstring quotes."""
    root = Path(transformer_lens.__file__).parent
    code = "\n".join(
        p.read_text()
        for p in [
            root / "HookedTransformer.py",
            *(root / "components").rglob("*.py"),
            *(root / "factories").rglob("*.py"),
        ]
    )
    values = set(re.findall(rf'{field}\s*==\s*"(\w+)"', code))
    doc = HookedTransformerConfig.__doc__ or ""
    paragraph = re.search(rf"\n\s*{field} ?\(.*?(?=\n\s*\w+ ?\(|\Z)", doc, re.S)
    values |= set(re.findall(r"'(\w+)'", paragraph.group(0) if paragraph else ""))
    return sorted(values)


def feature_cases() -> dict[str, tuple[str, str, dict[str, Any]]]:
    """case name -> (family, act_fn, config overrides)."""
    cases: dict[str, tuple[str, str, dict[str, Any]]] = {}
    for act in SUPPORTED_ACTIVATIONS:
        cases[f"act_fn={act}"] = ("ln-standard", act, {})
        cases[f"act_fn={act}+gated"] = ("gated-ln", act, {})
    for norm in [None, *_named_values("normalization_type")]:
        cases[f"normalization_type={norm}"] = ("ln-standard", "silu", dict(normalization_type=norm))
    for pos in _named_values("positional_embedding_type"):
        extra = dict(rotary_dim=8) if pos == "rotary" else {}
        cases[f"positional_embedding_type={pos}"] = (
            "ln-standard",
            "silu",
            dict(positional_embedding_type=pos, **extra),
        )
    for direction in _named_values("attention_dir"):
        cases[f"attention_dir={direction}"] = ("ln-standard", "silu", dict(attention_dir=direction))
    for f in dataclasses.fields(HookedTransformerConfig):
        if isinstance(f.default, bool) and f.name in CARRIED and f.name not in _NOT_FEATURES:
            overrides = {**_ROTARY, **_COMPANIONS.get(f.name, {}), f.name: not f.default}
            cases[f"{f.name}={not f.default}"] = ("rms-rotary", "silu", overrides)
    for name, overrides in _VALUED.items():
        cases[name] = ("rms-rotary", "silu", {**_ROTARY, **overrides})
    return cases


CASES = feature_cases()
_TOKENS = torch.randint(0, 40, (2, 24), generator=torch.Generator().manual_seed(3))


def _outcome(name: str) -> str:
    """ "converted", "not a HookedTransformer feature" (the source's own forward raises), or the refusal's message."""
    family, act, overrides = CASES[name]
    overrides = dict(overrides)
    dtype = overrides.pop("dtype", torch.float32)
    model = make_hooked(family, act, dtype, **overrides).eval()
    try:
        with torch.no_grad():
            expected = model(_TOKENS)
    except Exception:  # noqa: BLE001 - any failure of the source's own forward
        return "not a HookedTransformer feature"
    try:
        aot = lens_aot.convert(model)
    except LensAOTError as e:
        return f"refused: {e}"
    with torch.no_grad():
        err = float((aot(_TOKENS) - expected).abs().max())
    assert err <= aot.report.logit_bound, (name, err, aot.report.logit_bound)
    return "converted"


@pytest.mark.parametrize("name", sorted(CASES))
def test_feature_case(name: str, one_thread: None) -> None:
    """Each case converts within its certified bound, or is one of the refusals listed (with its reason)."""
    outcome = _outcome(name)
    if name in REFUSED:
        assert outcome.startswith("refused") and REFUSED[name] in outcome, outcome
    elif name in NOT_FEATURES:
        assert outcome == "not a HookedTransformer feature"
    else:
        assert outcome == "converted"


def test_feature_case_count() -> None:
    """The enumeration is the installed TransformerLens's, and the converted count is what docs/families.md states."""
    assert {f"act_fn={a}" for a in SUPPORTED_ACTIVATIONS} <= set(CASES)
    assert {"positional_embedding_type=alibi", "positional_embedding_type=shortformer"} <= set(CASES)
    assert {"normalization_type=RMSPre", "attention_dir=bidirectional", "use_dynamic_ntk_rope=True"} <= set(CASES)
    assert set(REFUSED) <= set(CASES)
    groups = (
        sum(n.startswith("act_fn=") for n in CASES),
        sum(n.startswith(("normalization_type=", "positional_embedding_type=", "attention_dir=")) for n in CASES),
        sum(n.split("=")[0] in {f.name for f in dataclasses.fields(HookedTransformerConfig)} for n in CASES)
        - sum(
            n.startswith(("act_fn=", "normalization_type=", "positional_embedding_type=", "attention_dir="))
            for n in CASES
        ),
        len(_VALUED),
    )
    assert groups == STATED_GROUPS
    counted = len(CASES) - len(NOT_FEATURES)
    assert (counted, counted - len(REFUSED)) == STATED_COUNT, (counted, sorted(REFUSED))


# Cases whose source cannot run (checked by test_feature_case: their forward raises), and (cases, converted) as
# docs/families.md states them.
NOT_FEATURES = ("positional_embedding_type=relative_positional_bias",)
STATED_COUNT = (63, 59)
STATED_GROUPS = (20, 12, 18, 14)  # activations x gating, enumerated values, booleans flipped, valued features
