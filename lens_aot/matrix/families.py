"""The support matrix's families: TransformerLens's bridge registry intersected with transformers' causal-LM
classes, each built tiny with random weights from its own ``transformers`` config class, offline.

Every family gets the same shape (:data:`TINY`: 2 layers, hidden 64, 4 heads, 2 KV heads, MLP 128 unless the config
derives it, vocabulary 128; :data:`TINY_MOE`: 4 experts top-2 where the config has experts), set through whichever
field names its config class uses; every other config field keeps its default. What a family needs beyond that to
be tiny and valid is in ONE table, :data:`OVERRIDES`, printed on the matrix page. Weights are a deterministic
function of the seed (:func:`randomize_`), so a family's figures are reproducible.
"""

from __future__ import annotations

import copy
import inspect
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "OUT_OF_SCOPE",
    "OVERRIDES",
    "TINY",
    "VARIANTS",
    "Family",
    "build_hf_model",
    "config_has_experts",
    "families",
    "has_experts",
    "randomize_",
    "tiny_config",
    "tiny_tokenizer",
]

VOCAB = 128

# (value, candidate field names): the first name a config class's __init__ accepts gets the value.
TINY: dict[str, tuple[Any, tuple[str, ...]]] = {
    "vocab": (VOCAB, ("vocab_size",)),
    "hidden": (64, ("hidden_size", "n_embd", "d_model")),
    "layers": (2, ("num_hidden_layers", "n_layer", "num_layers", "n_layers")),
    "heads": (4, ("num_attention_heads", "n_head", "num_heads", "n_heads", "attention_heads")),
    "kv_heads": (2, ("num_key_value_heads", "num_kv_heads")),
    "head_dim": (16, ("head_dim",)),
    "mlp": (128, ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size")),
    # multi-head latent attention (DeepSeek V2/V3 and its descendants): ranks and per-head widths
    "q_lora_rank": (32, ("q_lora_rank",)),
    "kv_lora_rank": (16, ("kv_lora_rank",)),
    "qk_nope_head_dim": (16, ("qk_nope_head_dim",)),
    "qk_rope_head_dim": (8, ("qk_rope_head_dim",)),
    "v_head_dim": (16, ("v_head_dim",)),
    "index_heads": (4, ("index_n_heads",)),
    "index_head_dim": (16, ("index_head_dim",)),
}

# Kept at their default where it is None: the config derives them from the fields above (e.g. GPT-2's MLP width,
# 4 x hidden; TransformerLens 3.9's GPT-2 config assumes exactly that).
DERIVED = ("mlp",)

# Mixture of experts, set only where the config has experts by default (its expert count is not None): 4 experts,
# top-2, expert MLPs 32 wide, at most one dense layer before the first MoE layer, one expert group.
TINY_MOE: dict[str, tuple[Any, tuple[str, ...]]] = {
    "experts": (4, ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")),
    "top_k": (2, ("num_experts_per_tok", "top_k_experts", "moe_k")),
    "expert_mlp": (32, ("moe_intermediate_size",)),
    "shared_expert_mlp": (32, ("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size")),
    "groups": (1, ("n_group",)),
    "top_groups": (1, ("topk_group",)),
}
DENSE_PREFIX = ("first_k_dense_replace", "num_dense_layers")  # capped at 1 (a 2-layer model keeps one MoE layer)

# Token ids must index the small vocabulary (several configs default to ids > 128).
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "cls_token_id", "sep_token_id")

# Per-family config fields beyond TINY: only what makes the family tiny and valid at TINY's shape. Keyed by config
# class name (applied to sub-configs too).
OVERRIDES: dict[str, dict[str, Any]] = {
    "GPT2Config": {
        "n_ctx": 1024
    },  # as GPT-2's Hub config has it (TransformerLens 3.9 reads it; transformers ignores it)
    "GPTJConfig": {"rotary_dim": 8},  # default 64 > head_dim 16
    "CodeGenConfig": {"rotary_dim": 8},  # default 64 > head_dim 16
    "GPTNeoConfig": {"attention_types": [[["global", "local"], 1]]},  # default lists 24 layers
    "Gemma4TextConfig": {"vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16},  # 262144 x 256
    "Mamba2Config": {"head_dim": 32, "n_groups": 1},  # hidden 64 x expand 2 = heads 4 x head_dim; groups <= heads
    "GlmMoeDsaConfig": {"num_key_value_heads": 4},  # its attention has one key/value per query head
    # MLA: one key / value per query head (the source's eager attention repeats kv heads heads/num_key_value_heads
    # times, which breaks its own forward for any other value)
    "DeepseekV2Config": {"num_key_value_heads": 4},
    "DeepseekV3Config": {"num_key_value_heads": 4},
    "Glm4MoeLiteConfig": {"num_key_value_heads": 4},
    "YoutuConfig": {"num_key_value_heads": 4},
    "Lfm2MoeConfig": {"layer_types": ["conv", "full_attention"]},  # default None: the model cannot be built
    # Hybrids whose default layer pattern puts no attention layer in the first 2 layers (their 2-layer model then
    # cannot run its own forward): one mixer layer, then one attention layer.
    "BambaConfig": {"attn_layer_indices": [1]},
    "GraniteMoeHybridConfig": {"layer_types": ["mamba", "attention"]},
    "JambaConfig": {"attn_layer_period": 2, "attn_layer_offset": 1},
    "Qwen3NextConfig": {"layer_types": ["linear_attention", "full_attention"]},
    "Qwen3_5TextConfig": {"layer_types": ["linear_attention", "full_attention"]},
    "Qwen3_5MoeTextConfig": {"layer_types": ["linear_attention", "full_attention"]},
    "RecurrentGemmaConfig": {"block_types": ["recurrent", "attention"]},
    "Zamba2Config": {"layers_block_type": ["mamba", "hybrid"]},  # default lists 54 layers
}

# Families the count of decoder-only text architectures leaves out, with the reason. They are still built and
# converted (lens_aot must refuse them clearly) and reported in their own section of the matrix.
_MIXER = "state-space / recurrent / hybrid mixer"
OUT_OF_SCOPE: dict[str, str] = {
    "BertLMHeadModel": "encoder (post-norm BERT)",
    "Gemma3ForConditionalGeneration": "multimodal",
    "Gemma3nForConditionalGeneration": "multimodal",
    "Gemma4ForConditionalGeneration": "multimodal",
    "Gemma4UnifiedForConditionalGeneration": "multimodal",
    **{
        name: _MIXER
        for name in (
            "BambaForCausalLM",
            "FalconH1ForCausalLM",
            "FalconMambaForCausalLM",
            "GraniteMoeHybridForCausalLM",
            "HrmTextForCausalLM",
            "JambaForCausalLM",
            "Lfm2ForCausalLM",
            "Lfm2MoeForCausalLM",
            "Mamba2ForCausalLM",
            "MambaForCausalLM",
            "NemotronHForCausalLM",
            "OlmoHybridForCausalLM",
            "Qwen3NextForCausalLM",
            "Qwen3_5ForCausalLM",
            "Qwen3_5MoeForCausalLM",
            "RecurrentGemmaForCausalLM",
            "RwkvForCausalLM",
            "Zamba2ForCausalLM",
        )
    },
}

# Extra rows for a family whose config switches its block layout: (architecture, variant label, config fields).
VARIANTS: list[tuple[str, str, dict[str, Any]]] = [
    ("GPTNeoXForCausalLM", "sequential", {"use_parallel_residual": False}),
    # Gemma 4 26B-A4B's layout: experts beside each dense MLP, values shared with keys, no per-layer inputs
    (
        "Gemma4ForCausalLM",
        "experts",
        {"enable_moe_block": True, "attention_k_eq_v": True, "hidden_size_per_layer_input": 0},
    ),
]

# Config fields that switch on experts whose count defaults to None (the variant's experts then get TINY_MOE's shape).
MOE_SWITCHES = ("enable_moe_block",)


@dataclass(frozen=True)
class Family:
    """One row of the matrix: a registry architecture, optionally a layout variant with its config fields."""

    architecture: str
    variant: str = ""
    fields: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.architecture} ({self.variant})" if self.variant else self.architecture

    @property
    def in_scope(self) -> bool:
        return self.architecture not in OUT_OF_SCOPE


def causal_lm_classes() -> set[str]:
    """The class names transformers registers as causal language models (``AutoModelForCausalLM``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names: set[str] = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update(value if isinstance(value, list | tuple) else [value])
    return names


def families(registry: list[str]) -> list[Family]:
    """The matrix's rows: the architectures of ``registry`` (e.g. :func:`lens_aot.tl.registry.bridge_architectures`)
    that transformers ships as a causal-LM class, sorted by name, each followed by its :data:`VARIANTS`."""
    import transformers

    causal = causal_lm_classes()
    rows: list[Family] = []
    for architecture in sorted(set(registry) & causal, key=str.lower):
        if getattr(transformers, architecture, None) is None:
            continue
        rows.append(Family(architecture))
        rows += [Family(a, label, fields) for a, label, fields in VARIANTS if a == architecture]
    return rows


def _defaults(config_class: type) -> dict[str, Any]:
    """The keyword arguments a config class's ``__init__`` names, with their defaults."""
    parameters = inspect.signature(config_class.__init__).parameters
    return {n: p.default for n, p in parameters.items() if n not in ("self", "kwargs", "args")}


def config_has_experts(config_class: type, extra: dict[str, Any] | None = None) -> bool:
    """Whether ``config_class`` (with the variant's fields ``extra``) builds a mixture of experts: its expert count
    defaults to a number, or ``extra`` switches experts on (:data:`MOE_SWITCHES`)."""
    defaults = _defaults(config_class)
    experts = next((n for n in TINY_MOE["experts"][1] if n in defaults), None)
    return experts is not None and (defaults[experts] is not None or any((extra or {}).get(s) for s in MOE_SWITCHES))


def has_experts(family: Family) -> bool:
    """Whether ``family``'s tiny model is a mixture of experts (:func:`config_has_experts` of its config class)."""
    import transformers

    return config_has_experts(getattr(transformers, family.architecture).config_class, family.fields)


def tiny_config(config_class: type, extra: dict[str, Any] | None = None) -> Any:
    """A ``config_class`` instance at :data:`TINY`'s shape (sub-configs, e.g. a multimodal model's text and vision
    configs, made tiny the same way), token ids 0, every other field at its default, then ``extra``."""
    defaults = _defaults(config_class)
    kwargs: dict[str, Any] = {}
    groups = [*TINY.items(), *(TINY_MOE.items() if config_has_experts(config_class, extra) else ())]
    for key, (value, names) in groups:
        name = next((n for n in names if n in defaults), None)
        if name is not None and not (key in DERIVED and defaults[name] is None):
            kwargs[name] = value
    for name in DENSE_PREFIX:
        if isinstance(defaults.get(name), int):
            kwargs[name] = min(defaults[name], 1)
    kwargs.update({name: 0 for name in TOKEN_IDS if name in defaults})
    for name, sub_class in (getattr(config_class, "sub_configs", None) or {}).items():
        if name not in defaults:
            continue
        if not hasattr(sub_class, "model_type") or not sub_class.model_type:  # AutoConfig: the default's class
            sub_class = type(getattr(config_class(), name))
        kwargs[name] = tiny_config(sub_class).to_dict()
    kwargs.update(OVERRIDES.get(config_class.__name__, {}))
    kwargs.update(extra or {})
    return config_class(**kwargs)


def randomize_(model: nn.Module, seed: int = 0) -> None:
    """Overwrite every parameter of ``model`` in place with seeded values that keep activations O(1).

    Matrices: N(0, 1/fan_in) (``nn.Linear``: ``[out, in]``; GPT-2's ``Conv1D``: ``[in, out]``; other matrices and
    expert stacks: fan-in = last dimension), embeddings N(0, 0.0625); vectors and scalars: their initial value + 0.1·
    N(0, 1), so norm scales stay near their neutral value (1, or 0 where a norm multiplies by 1 + w) and biases are
    non-zero; the MoE score-correction biases that are buffers (MiniMax-M2, GLM-4-MoE) likewise, so the routing they
    steer is exercised. Values come from a private float32 generator (the global RNG is untouched); tied parameters
    once.
    """
    from transformers.pytorch_utils import Conv1D

    gen = torch.Generator().manual_seed(seed)
    owners = dict(model.named_modules())
    with torch.no_grad():
        for name, param in model.named_parameters():
            module = owners[name.rpartition(".")[0]]
            shape = tuple(param.shape)
            if param.ndim < 2:
                values = param.detach().float().cpu() + 0.1 * torch.randn(shape, generator=gen)
            else:
                if isinstance(module, nn.Embedding):
                    std = 0.25
                elif isinstance(module, Conv1D):  # weight [in, out]
                    std = 1.0 / math.sqrt(shape[0])
                else:
                    std = 1.0 / math.sqrt(shape[-1])
                values = std * torch.randn(shape, generator=gen)
            param.copy_(values.to(param.dtype))
        for name, buffer in model.named_buffers():
            if name.rpartition(".")[2] == "e_score_correction_bias":  # routing-bias buffers (MiniMax-M2, GLM-4-MoE)
                values = buffer.detach().float().cpu() + 0.1 * torch.randn(tuple(buffer.shape), generator=gen)
                buffer.copy_(values.to(buffer.dtype))


def build_hf_model(family: Family, seed: int = 0) -> nn.Module:
    """The family's tiny Hugging Face model in float32, eval mode, eager attention and eager (per-expert loop) MoE
    experts, random weights (seed ``seed``)."""
    import transformers

    model_class = getattr(transformers, family.architecture)
    config = tiny_config(model_class.config_class, family.fields)
    config._attn_implementation = "eager"
    torch_state = torch.random.get_rng_state()
    try:
        # seeded: parameters randomize_ offsets from their initial value (GPT-OSS's sinks and router bias, which
        # transformers initialises randomly) are then reproducible too
        torch.manual_seed(seed)
        model = model_class(config)
    finally:
        torch.random.set_rng_state(torch_state)
    model = model.float().eval()
    randomize_(model, seed)
    for setter in ("set_attn_implementation", "set_experts_implementation"):
        # Eager experts: transformers' default grouped_mm kernel refuses float64, so the float64 row could not run
        # the source at all; the eager per-expert loop computes the same function in every dtype.
        if hasattr(model, setter):
            try:
                getattr(model, setter)("eager")
            except (ValueError, NotImplementedError):
                pass
    return model


def copy_as(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A deep copy of ``model`` in ``dtype`` (the float64 row is the float32 model's exact weights, cast up)."""
    return copy.deepcopy(model).to(dtype).eval()


def tiny_tokenizer(vocab_size: int = VOCAB) -> Any:
    """An offline word-level tokenizer over ``vocab_size`` tokens (``<bos>`` = 0, ``<unk>`` = 1, ``w0``, ``w1``, ...)
    that prepends ``<bos>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<bos>": 0, "<unk>": 1} | {f"w{i}": i + 2 for i in range(vocab_size - 2)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<bos>", unk_token="<unk>", pad_token="<bos>"
    )
    # TransformerLens re-loads a tokenizer by name unless it already adds BOS; say that it does.
    tok.init_kwargs["name_or_path"] = "tiny-word-level"
    tok.init_kwargs["add_bos_token"] = True
    return tok
