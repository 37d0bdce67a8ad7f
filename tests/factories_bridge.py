"""Offline, random-weight TransformerBridge factories for tests (TransformerLens 3.9 and 4.x alike).

Nothing here touches a model hub: Hugging Face models are built from ``transformers`` config classes and wrapped
with ``build_bridge_from_module`` (eager attention, as ``boot_transformers`` forces); TransformerLens-native models
are built with ``TransformerBridge.boot_native``. Every model is tiny (d_model 32, 4 heads, 2 layers, d_mlp 64,
vocab 97, n_ctx 32) and its weights are a deterministic function of ``seed`` alone (whatever the dtype): weights
~ N(0, 1/fan_in), embeddings ~ N(0, 0.0625), biases ~ 0.1·N(0, 1), norm scales 1 + 0.1·N(0, 1), so activations stay
O(1) and LayerNorm folding / centring have something to do.

Readable families (sequential pre-norm, non-gated MLP):

- ``gpt2`` / ``gpt2-relu`` / ``gpt2-silu`` / ``gpt2-gelu``: GPT-2 (LN, learned absolute positions), activation
  ``gelu_new`` / ``relu`` / ``silu`` / ``gelu``.
- ``neox-seq``: GPT-NeoX with ``use_parallel_residual=False`` (LN, rotary halves layout, partial rotary: 4 of 8).
- ``starcoder2``: Starcoder2 (LN, rotary halves, grouped-query attention 4→2, non-gated gelu_pytorch_tanh MLP).
- ``native-ln``: TransformerLens-native (LN, absolute positions, gelu).
- ``native-lnpre``: TransformerLens-native (parameter-free LNPre norms, absolute positions, gelu_new).
- ``native-rms-gqa``: TransformerLens-native (RMSNorm, full rotary, GQA 4→2, silu MLP).
- ``native-rms-pre``: TransformerLens-native (parameter-free RMSPre, partial rotary 4 of 8, GQA 4→2, relu).
- ``native-rotary``: TransformerLens-native LN + partial rotary (the native rotary is the GPT-J adjacent-pairs
  layout — the only sequential adjacent-pairs family the bridge can build).
- ``native-bidir``: TransformerLens-native bidirectional (non-causal) pre-LN encoder.
- ``native-attn-only``: TransformerLens-native attention-only (RMS, rotary).
- ``native-none``: TransformerLens-native without any normalization (relu MLP).

Gated-MLP and parallel-block families (read exactly; listed in :data:`GATED_PARALLEL`, not in :data:`CONVERTIBLE`
while their conversion is being built):

- ``llama``: Llama (RMSNorm, rotary halves, GQA 4→2, SwiGLU, no biases).
- ``llama-bias``: Llama with ``attention_bias=True`` and ``mlp_bias=True`` (gate/up/down biases).
- ``mistral``: Mistral (as Llama) with ``sliding_window=32``, the context length (not binding).
- ``gemma``: Gemma 1 (GeGLU with gelu_pytorch_tanh, embedding × √d_model, RMSNorm scale 1 + w, GQA 4→2, tied
  embeddings); float32, or float64 after ``enable_compatibility_mode()``.
- ``gptj``: GPT-J (parallel blocks with one shared ``ln_1``, partial rotary 4 of 8 in adjacent pairs, gelu_new);
  float32 only.
- ``neox``: GPT-NeoX / Pythia with ``use_parallel_residual=True`` (parallel, separate norms, partial rotary, gelu).
- ``native-gated``: TransformerLens-native gated SwiGLU (RMS, rotary).
- ``native-gated-gelu``: TransformerLens-native gated GeGLU (gelu_new) with RMS norms and learned absolute positions.

Families read by structure alone (issue 22; :data:`STRUCTURAL`, tested in ``tests/test_bridge_families.py``): qwen2
(and YaRN rope), llama with llama3 rope, phi3, phi, olmo, stablelm, smollm3, glm, falcon, gpt_neo, gpt_bigcode,
GPT-NeoX with linear rope, mistral / starcoder2 with a binding sliding window (8 < 32), qwen3, gemma2, gemma3.

Families for refusal tests: ``llama-tanh`` (gated MLP with tanh), ``native-softcap`` (attention soft-capping in a
native model), ``neox-rope-dynamic`` (dynamic NTK rope beyond its original length), ``bert`` (post-LN),
``gpt2-tanh`` and ``native-solu`` (activations; ``native-solu`` only exists in TransformerLens 4.x).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

D_MODEL = 32
N_LAYERS = 2
N_HEADS = 4
D_HEAD = D_MODEL // N_HEADS
D_MLP = 64
D_VOCAB = 97
N_CTX = 32
# a tiny grouped-query Hugging Face config (2 key-value heads), for config classes that take these names
GQA_FIELDS: dict[str, Any] = {
    "hidden_size": D_MODEL,
    "intermediate_size": 2 * D_MODEL,
    "num_hidden_layers": N_LAYERS,
    "num_attention_heads": N_HEADS,
    "num_key_value_heads": 2,
    "head_dim": D_MODEL // N_HEADS,
    "max_position_embeddings": N_CTX,
}

Source = tuple[str, Any, str]  # ("hf", model, architecture) or ("native", TransformerBridgeConfig, "")


def _randomize_(model: nn.Module, seed: int) -> None:
    """Overwrite every parameter of ``model`` in place with seeded O(1)-activation random values.

    Values come from a private float32 CPU generator (the global RNG is untouched) and are copied in, so a seed gives
    the same values whatever the model's dtype. Tied parameters are visited once.
    """
    gen = torch.Generator().manual_seed(seed)
    owners: dict[str, nn.Module] = dict(model.named_modules())
    with torch.no_grad():
        for name, param in model.named_parameters():
            module_name, _, leaf = name.rpartition(".")
            module = owners[module_name]
            kind = type(module).__name__
            shape = tuple(param.shape)
            if param.ndim == 1:
                # Norm scales near 1; Gemma's RMSNorm stores its scale as an offset (it multiplies by 1 + weight).
                centre = 1.0 if ("Norm" in kind and leaf == "weight" and kind != "GemmaRMSNorm") else 0.0
                values = centre + 0.1 * torch.randn(shape, generator=gen)
            elif param.ndim == 2:
                if isinstance(module, nn.Embedding):
                    std = 0.25
                elif kind == "Conv1D":  # HF GPT-2's transposed linear: weight is [in, out]
                    std = 1.0 / math.sqrt(shape[0])
                else:  # nn.Linear: weight is [out, in]
                    std = 1.0 / math.sqrt(shape[1])
                values = std * torch.randn(shape, generator=gen)
            else:
                raise ValueError(f"unexpected parameter {name} of shape {shape}")
            param.copy_(values.to(param.dtype))


def tiny_tokenizer() -> Any:
    """An offline word-level tokenizer over the 97-token vocabulary (``<bos>`` = 0, ``<unk>`` = 1, ``w0``…``w94``)
    that prepends ``<bos>`` (the support matrix's, at this vocabulary size)."""
    from lens_aot.matrix.families import tiny_tokenizer as word_level

    return word_level(D_VOCAB)


# --- Hugging Face sources -----------------------------------------------------------------------------------------


def _gpt2(activation: str) -> Callable[[], Source]:
    def build() -> Source:
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(
            vocab_size=D_VOCAB,
            n_positions=N_CTX,
            n_embd=D_MODEL,
            n_layer=N_LAYERS,
            n_head=N_HEADS,
            n_inner=D_MLP,
            activation_function=activation,
            layer_norm_epsilon=1e-5,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        return "hf", GPT2LMHeadModel(cfg), "GPT2LMHeadModel"

    return build


def _neox(parallel: bool, rope: dict[str, Any] | None = None) -> Callable[[], Source]:
    def build() -> Source:
        from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

        cfg = GPTNeoXConfig(
            vocab_size=D_VOCAB,
            hidden_size=D_MODEL,
            num_hidden_layers=N_LAYERS,
            num_attention_heads=N_HEADS,
            intermediate_size=D_MLP,
            hidden_act="gelu",
            rotary_pct=0.5,
            max_position_embeddings=N_CTX,
            use_parallel_residual=parallel,
            tie_word_embeddings=False,
            attention_dropout=0.0,
            hidden_dropout=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        if rope is not None:
            cfg.rope_parameters = {**(cfg.rope_parameters or {}), **rope}
        return "hf", GPTNeoXForCausalLM(cfg), "GPTNeoXForCausalLM"

    return build


def _starcoder2(sliding_window: int | None) -> Callable[[], Source]:
    def build() -> Source:
        from transformers import Starcoder2Config, Starcoder2ForCausalLM

        cfg = Starcoder2Config(
            vocab_size=D_VOCAB,
            hidden_size=D_MODEL,
            intermediate_size=D_MLP,
            num_hidden_layers=N_LAYERS,
            num_attention_heads=N_HEADS,
            num_key_value_heads=2,
            hidden_act="gelu_pytorch_tanh",
            max_position_embeddings=N_CTX,
            sliding_window=sliding_window,
            use_bias=True,
            tie_word_embeddings=False,
            attention_dropout=0.0,
            residual_dropout=0.0,
            embedding_dropout=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        return "hf", Starcoder2ForCausalLM(cfg), "Starcoder2ForCausalLM"

    return build


def _llama(bias: bool = False, activation: str = "silu") -> Callable[[], Source]:
    def build() -> Source:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=D_VOCAB,
            hidden_size=D_MODEL,
            intermediate_size=D_MLP,
            num_hidden_layers=N_LAYERS,
            num_attention_heads=N_HEADS,
            num_key_value_heads=2,
            hidden_act=activation,
            max_position_embeddings=N_CTX,
            attention_bias=bias,
            mlp_bias=bias,
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=0,
        )
        return "hf", LlamaForCausalLM(cfg), "LlamaForCausalLM"

    return build


def _mistral(sliding_window: int | None) -> Callable[[], Source]:
    def build() -> Source:
        from transformers import MistralConfig, MistralForCausalLM

        cfg = MistralConfig(
            vocab_size=D_VOCAB,
            hidden_size=D_MODEL,
            intermediate_size=D_MLP,
            num_hidden_layers=N_LAYERS,
            num_attention_heads=N_HEADS,
            num_key_value_heads=2,
            max_position_embeddings=N_CTX,
            sliding_window=sliding_window,
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=0,
        )
        return "hf", MistralForCausalLM(cfg), "MistralForCausalLM"

    return build


def _gemma() -> Source:
    from transformers import GemmaConfig, GemmaForCausalLM

    cfg = GemmaConfig(
        vocab_size=D_VOCAB,
        hidden_size=D_MODEL,
        intermediate_size=D_MLP,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=N_HEADS,
        num_key_value_heads=2,
        head_dim=D_HEAD,
        hidden_act="gelu_pytorch_tanh",
        max_position_embeddings=N_CTX,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return "hf", GemmaForCausalLM(cfg), "GemmaForCausalLM"


def _gptj() -> Source:
    from transformers import GPTJConfig, GPTJForCausalLM

    cfg = GPTJConfig(
        vocab_size=D_VOCAB,
        n_positions=N_CTX,
        n_embd=D_MODEL,
        n_layer=N_LAYERS,
        n_head=N_HEADS,
        rotary_dim=4,
        n_inner=D_MLP,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return "hf", GPTJForCausalLM(cfg), "GPTJForCausalLM"


def _bert() -> Source:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        vocab_size=D_VOCAB,
        hidden_size=D_MODEL,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=N_HEADS,
        intermediate_size=D_MLP,
        max_position_embeddings=N_CTX,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return "hf", BertForMaskedLM(cfg), "BertForMaskedLM"


def _hf(config_cls: str, model_cls: str, **fields: Any) -> Callable[[], Source]:
    """A tiny Hugging Face causal LM of ``model_cls`` with ``config_cls(**common sizes, **fields)``: every family
    lens_aot reads by structure (no reader of its own) is built this way."""

    def build() -> Source:
        import transformers

        common: dict[str, Any] = dict(
            vocab_size=D_VOCAB,
            hidden_size=D_MODEL,
            intermediate_size=D_MLP,
            num_hidden_layers=N_LAYERS,
            num_attention_heads=N_HEADS,
            max_position_embeddings=N_CTX,
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
        cfg = getattr(transformers, config_cls)(**{**common, **fields})
        return "hf", getattr(transformers, model_cls)(cfg), model_cls

    return build


_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}
_YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8}

# Families read by structure alone (issue 22): name -> builder. Each converts in float32 and float64 (those whose
# float64 forward computes a piece in float32 carry that step: tests/test_float32_steps.py).
STRUCTURAL: dict[str, Callable[[], Source]] = {
    "qwen2": _hf("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2),
    "qwen2-yarn": _hf("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2, rope_parameters=_YARN_ROPE),
    "llama3-rope": _hf("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2, rope_parameters=_LLAMA3_ROPE),
    "phi3": _hf("Phi3Config", "Phi3ForCausalLM", num_key_value_heads=2, resid_pdrop=0.0, embd_pdrop=0.0),
    "phi": _hf("PhiConfig", "PhiForCausalLM", resid_pdrop=0.0, embd_pdrop=0.0, hidden_act="gelu_new"),
    "olmo": _hf("OlmoConfig", "OlmoForCausalLM", num_key_value_heads=2),
    "stablelm": _hf("StableLmConfig", "StableLmForCausalLM", num_key_value_heads=2, use_qkv_bias=True),
    "smollm3": _hf("SmolLM3Config", "SmolLM3ForCausalLM", num_key_value_heads=2),
    "glm": _hf("GlmConfig", "GlmForCausalLM", num_key_value_heads=2, head_dim=D_HEAD),
    "falcon": _hf(
        "FalconConfig",
        "FalconForCausalLM",
        ffn_hidden_size=D_MLP,
        parallel_attn=True,
        new_decoder_architecture=False,
        multi_query=True,
        bias=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    ),
    "gpt_neo": _hf(
        "GPTNeoConfig",
        "GPTNeoForCausalLM",
        num_layers=N_LAYERS,
        num_heads=N_HEADS,
        attention_types=[[["global", "local"], 1]],
        window_size=N_CTX,
        resid_dropout=0.0,
        embed_dropout=0.0,
        attention_dropout=0.0,
    ),
    "gpt_bigcode": _hf(
        "GPTBigCodeConfig",
        "GPTBigCodeForCausalLM",
        n_embd=D_MODEL,
        n_layer=N_LAYERS,
        n_head=N_HEADS,
        n_inner=D_MLP,
        n_positions=N_CTX,
        multi_query=True,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    ),
    "neox-rope-linear": _neox(parallel=False, rope={"rope_type": "linear", "factor": 2.0}),
    # With the variant components (docs/variants.md): sliding windows, QK-norm, sandwich norms, soft-caps,
    # per-layer-type rotary tables.
    "mistral-window": _mistral(sliding_window=8),
    "starcoder2-window": _starcoder2(sliding_window=8),
    "qwen3": _hf("Qwen3Config", "Qwen3ForCausalLM", num_key_value_heads=2, head_dim=D_HEAD),
    "gemma2": _hf(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        num_key_value_heads=2,
        head_dim=D_HEAD,
        sliding_window=8,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
    ),
    "gemma3": _hf(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        num_key_value_heads=2,
        head_dim=D_HEAD,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    ),
}


# --- TransformerLens-native sources -------------------------------------------------------------------------------


def _native(**overrides: Any) -> Callable[[], Source]:
    def build() -> Source:
        from transformer_lens.config import TransformerBridgeConfig

        fields: dict[str, Any] = dict(
            d_model=D_MODEL,
            d_head=D_HEAD,
            n_layers=N_LAYERS,
            n_ctx=N_CTX,
            n_heads=N_HEADS,
            d_vocab=D_VOCAB,
            d_mlp=D_MLP,
            act_fn="gelu",
            normalization_type="LN",
            positional_embedding_type="standard",
            seed=0,
            init_weights=True,
        )
        fields.update(overrides)
        return "native", TransformerBridgeConfig(**fields), ""

    return build


FAMILIES: dict[str, Callable[[], Source]] = {
    "gpt2": _gpt2("gelu_new"),
    "gpt2-relu": _gpt2("relu"),
    "gpt2-silu": _gpt2("silu"),
    "gpt2-gelu": _gpt2("gelu"),
    "gpt2-tanh": _gpt2("tanh"),
    "neox-seq": _neox(parallel=False),
    "neox": _neox(parallel=True),
    "neox-rope-dynamic": _neox(
        parallel=False, rope={"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16}
    ),
    "starcoder2": _starcoder2(sliding_window=None),
    "starcoder2-window": _starcoder2(sliding_window=8),
    "llama": _llama(),
    "llama-bias": _llama(bias=True),
    "llama-tanh": _llama(activation="tanh"),
    "mistral": _mistral(sliding_window=N_CTX),
    "mistral-window": _mistral(sliding_window=8),
    "gemma": _gemma,
    "gptj": _gptj,
    "bert": _bert,
    "native-ln": _native(),
    "native-lnpre": _native(normalization_type="LNPre", act_fn="gelu_new"),
    "native-rms-gqa": _native(
        normalization_type="RMS", positional_embedding_type="rotary", n_key_value_heads=2, act_fn="silu", final_rms=True
    ),
    "native-rms-pre": _native(
        normalization_type="RMSPre",
        positional_embedding_type="rotary",
        n_key_value_heads=2,
        rotary_dim=4,
        act_fn="relu",
        final_rms=True,
    ),
    "native-rotary": _native(positional_embedding_type="rotary", rotary_dim=4),
    "native-bidir": _native(attention_dir="bidirectional"),
    "native-attn-only": _native(attn_only=True, normalization_type="RMS", positional_embedding_type="rotary"),
    "native-none": _native(normalization_type=None, act_fn="relu"),
    "native-gated": _native(
        normalization_type="RMS", positional_embedding_type="rotary", gated_mlp=True, act_fn="silu"
    ),
    "native-gated-gelu": _native(normalization_type="RMS", gated_mlp=True, act_fn="gelu_new", final_rms=True),
    "native-softcap": _native(attn_scores_soft_cap=30.0),
    "native-solu": _native(act_fn="solu"),
    **STRUCTURAL,
}


# Families lens_aot converts (the others in FAMILIES exist to test refusals).
CONVERTIBLE = [
    "gpt2",
    "gpt2-relu",
    "gpt2-silu",
    "gpt2-gelu",
    "neox-seq",
    "starcoder2",
    "native-ln",
    "native-lnpre",
    "native-rms-gqa",
    "native-rms-pre",
    "native-rotary",
    "native-bidir",
    "native-attn-only",
    "native-none",
]


# Gated-MLP and parallel-block families the reader reads exactly (in float64 except gptj and gemma, whose float64 forms
# are refused — gemma reads in float64 once compatibility mode has folded its norms).
GATED_PARALLEL = [
    "llama",
    "llama-bias",
    "mistral",
    "gemma",
    "gptj",
    "neox",
    "native-gated",
    "native-gated-gelu",
]


def make_bridge(
    family: str, dtype: torch.dtype = torch.float32, compat: bool = False, seed: int = 0, tokenizer: bool = False
) -> Any:
    """Build an offline random-weight TransformerBridge of ``family`` (a key of :data:`FAMILIES`), in eval mode.

    ``compat`` calls ``enable_compatibility_mode()`` (LayerNorm folding, weight centring, value-bias folding);
    ``tokenizer`` attaches :func:`tiny_tokenizer`. Raises ``KeyError`` for an unknown family; whatever the installed
    TransformerLens raises when it cannot build a family (e.g. ``native-solu`` in 3.9) propagates unchanged.
    """
    if family not in FAMILIES:
        raise KeyError(f"unknown family {family!r}; known: {sorted(FAMILIES)}")
    kind, source, architecture = FAMILIES[family]()
    tok = tiny_tokenizer() if tokenizer else None
    if kind == "hf":
        from lens_aot.tl.build import bridge_from_hf_module

        model: nn.Module = source.eval()
        _randomize_(model, seed)
        model.to(dtype)
        model.set_attn_implementation("eager")
        bridge = bridge_from_hf_module(
            model, architecture, hf_config=model.config, tokenizer=tok, dtype=dtype, model_name=f"random-{family}"
        )
    else:
        from transformer_lens.model_bridge import TransformerBridge

        bridge = TransformerBridge.boot_native(source, tokenizer=tok, dtype=dtype, model_name=f"random-{family}")
        _randomize_(bridge.original_model, seed)
    bridge.eval()
    if compat:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            bridge.enable_compatibility_mode(disable_warnings=True)
    return bridge


def eager_hf_bridge(configs: dict[str, tuple[str, str, dict[str, Any]]], family: str, dtype: torch.dtype) -> Any:
    """A tiny random bridge of ``family`` (a key of ``configs``: config class, model class, config fields) in
    ``dtype``, eval mode, eager attention."""
    import transformers

    from lens_aot.tl.build import bridge_from_hf_module

    config_cls, model_cls, fields = configs[family]
    config = getattr(transformers, config_cls)(vocab_size=D_VOCAB, bos_token_id=0, eos_token_id=0, **fields)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = getattr(transformers, model_cls)(config).eval()
        _randomize_(model, 0)
        model.to(dtype)
        model.set_attn_implementation("eager")
        bridge = bridge_from_hf_module(model, model_cls, hf_config=model.config, dtype=dtype, model_name=family)
    return bridge.eval()


def logit_error(aot: Any, bridge: Any, seed: int = 5, d_vocab: int | None = None) -> float:
    """Max |converted − source| logit on a random [2, 24] batch (tokens below ``d_vocab``, default the model's),
    against the source's own forward."""
    from lens_aot.core.read import run_source

    vocab = aot.cfg.d_vocab if d_vocab is None else d_vocab
    tokens = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return float((aot(tokens) - run_source(bridge, tokens)).abs().max())


def assert_faithful(bridge: Any, dtype: torch.dtype, what: str, d_vocab: int | None = None) -> tuple[Any, float]:
    """Convert ``bridge`` and check its logits against the source's own forward within the tolerance of its
    activation (``gated`` for gated MLPs and product-head ones such as relu²) in ``dtype``; returns the converted model
    and the error (:func:`logit_error`)."""
    from conftest import TOLERANCES

    import lens_aot

    aot = lens_aot.convert(bridge)
    err = logit_error(aot, bridge, d_vocab=d_vocab)
    gated = aot.cfg.gated_mlp or aot.report.gated
    tol = TOLERANCES[("gated" if gated else aot.cfg.act_fn, dtype)]
    assert err <= tol, f"{what}/{dtype}: max |Δlogit| {err:.3g} > {tol:g}"
    return aot, err


def matrix_bridges(model: nn.Module, architecture: str, dtypes: list[torch.dtype]) -> dict[torch.dtype, Any]:
    """``model`` (a float32 model from :func:`lens_aot.matrix.families.build_hf_model`) as an eval-mode
    TransformerBridge in each of ``dtypes``, each over its own copy (copied before bridging: a bridge takes its
    model's modules over)."""
    from lens_aot.matrix.families import copy_as
    from lens_aot.matrix.families import tiny_tokenizer as matrix_tokenizer
    from lens_aot.tl.build import bridge_from_hf_module

    copies = {d: model if d == torch.float32 else copy_as(model, d) for d in dtypes}  # all before bridging
    return {
        d: bridge_from_hf_module(
            copies[d],
            architecture,
            hf_config=copies[d].config,
            tokenizer=matrix_tokenizer(),
            dtype=d,
            model_name=architecture,
        ).eval()
        for d in dtypes
    }


def source_error(source: Any, aot: Any, tokens: torch.Tensor) -> float:
    """max |Δlogit| of ``aot`` against ``source``'s own forward on ``tokens``."""
    from lens_aot.core.read import run_source

    with torch.no_grad():
        return float((aot(tokens) - run_source(source, tokens)).abs().max())
