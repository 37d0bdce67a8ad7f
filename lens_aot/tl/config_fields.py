"""Every ``HookedTransformerConfig`` field (TransformerLens 3.9), in exactly one of four lists: what
:mod:`lens_aot.tl.hooked.read` carries into the spec, what it refuses by name, the run-time switches ``convert``
carries over, and what does not change the forward.

``tests/test_hooked_config_fields.py`` enumerates the dataclass's fields and fails on any field in none of the lists
(a new TransformerLens release cannot slip a forward-changing field past), turns on every carried variant in a
random tiny model and checks the conversion against the source's own forward, and builds each refused value and
checks the error names the field.
"""

from __future__ import annotations

from typing import Any

# field -> how the reader carries it into the ModelSpec.
CARRIED: dict[str, str] = {
    "d_model": "the weights' shapes",
    "d_head": "the weights' shapes",
    "n_layers": "one LayerSpec per block",
    "n_ctx": "ModelSpec.n_ctx; the rotary tables' rows",
    "n_heads": "the weights' shapes",
    "d_mlp": "the weights' shapes",
    "d_vocab": "the weights' shapes",
    "d_vocab_out": "the weights' shapes",
    "n_key_value_heads": "grouped-query attention: _W_K / _W_V",
    "attn_only": "LayerSpec.mlp None",
    "gated_mlp": "MLPSpec.W_gate",
    "parallel_attn_mlp": "LayerSpec.parallel",
    "act_fn": "MLPSpec.act_fn (relu2 as gate + product heads; xielu and activations that normalise across neurons, "
    "e.g. solu, refused by name)",
    "normalization_type": "NormSpec.kind, read off each norm module",
    "final_rms": "ln_final's kind, read off the module",
    "eps": "NormSpec.eps",
    "dtype": "float32 / float64 (half precision refused, naming the dtype)",
    "attention_dir": "ModelSpec.causal",
    "use_attn_scale": "AttentionSpec.attn_scale, read off the module",
    "attn_scale": "AttentionSpec.attn_scale",
    "scale_attn_by_inverse_layer_idx": "AttentionSpec.attn_scale (the module's, already × (layer + 1))",
    "positional_embedding_type": "standard, shortformer, rotary or alibi (relative biases refused by name)",
    "rotary_dim": "RotarySpec.rotary_dim",
    "rotary_base": "the rotary tables, computed by the source's own attention",
    "rotary_adjacent_pairs": "RotarySpec.adjacent_pairs",
    "rotary_base_local": "AttentionSpec.rotary: a local layer's own tables",
    "rotary_scaling_factor": "the rotary tables (per layer: TransformerLens scales global layers only)",
    "use_NTK_by_parts_rope": "the rotary tables (Llama 3.1 scaling)",
    "NTK_by_parts_low_freq_factor": "the rotary tables",
    "NTK_by_parts_high_freq_factor": "the rotary tables",
    "NTK_by_parts_factor": "the rotary tables",
    "NTK_original_ctx_len": "the rotary tables",
    "use_yarn_rope": "the rotary tables (YaRN, attention factor included)",
    "yarn_factor": "the rotary tables",
    "yarn_attention_factor": "the rotary tables (sin and cos scaled)",
    "yarn_beta_fast": "the rotary tables",
    "yarn_beta_slow": "the rotary tables",
    "yarn_original_max_position_embeddings": "the rotary tables",
    "yarn_truncate": "the rotary tables",
    "yarn_global_attn_only": "the rotary tables, per layer",
    "use_qk_norm": "AttentionSpec.q_norm / k_norm over each head",
    "original_architecture": "OLMo-2/3 post-norm blocks (LayerSpec.post_norm) and QK-norm over the projection",
    "clip_qkv": "AttentionSpec.clip_qkv",
    "use_local_attn": "AttentionSpec.window on local layers",
    "window_size": "AttentionSpec.window",
    "attn_types": "which layers are local (AttentionSpec.window)",
    "use_normalization_before_and_after": "LayerSpec.ln1_post / ln2_post (sandwich norms)",
    "attn_scores_soft_cap": "AttentionSpec.scores_soft_cap",
    "output_logits_soft_cap": "ModelSpec.logits_soft_cap",
    "post_embedding_ln": "ModelSpec.embed_ln",
    "use_attention_sinks": "AttentionSpec.sinks",
    "use_logn_attn": "AttentionSpec.logn_length (Qwen-1's log-n query scaling past train_seq_length)",
    "use_dynamic_ntk_rope": "AttentionSpec.ntk_length / ntk_rotary (Qwen-1's widened rotary tables per key count)",
    "train_seq_length": "where log-n / dynamic NTK scaling starts (AttentionSpec.logn_length / ntk_length)",
    "default_prepend_bos": "ModelSpec.default_prepend_bos",
    "tokenizer_prepends_bos": "ModelSpec.extra",
    "model_name": "ModelSpec.model_name",
    "num_experts": "MoESpec: one expert MLP per expert (lens_aot.tl.moe.read)",
    "experts_per_token": "MoESpec.top_k",
    "norm_topk_prob": "MoESpec.norm_topk_prob",
}

# field -> (a value lens_aot refuses, why): converting a model with it raises an error naming the field.
REFUSED: dict[str, tuple[Any, str]] = {
    "load_in_4bit": (True, "4-bit quantised weights"),
    "n_devices": (2, "a model split across several devices (move it to one device first)"),
}

# TransformerLens's run-time switches: field -> the hook points turning it on creates. They do not change the forward;
# convert carries the source's setting over (the converted model then has the same hooks under the same names).
# tests/test_switches.py enumerates HookedTransformer's / TransformerBridge's set_use_* setters and fails on a switch
# not listed here.
SWITCHES: dict[str, str] = {
    "use_attn_result": "blocks.{l}.attn.hook_result (per-head outputs)",
    "use_split_qkv_input": "blocks.{l}.hook_q_input / hook_k_input / hook_v_input (per-head inputs)",
    "use_hook_mlp_in": "blocks.{l}.hook_mlp_in (the MLP's input)",
    "use_attn_in": "blocks.{l}.hook_attn_in (one per-head input for query, key and value)",
    "ungroup_grouped_query_attention": "hook_k / hook_v (and split inputs) expanded to n_heads",
    "use_hook_tokens": "hook_tokens (the input token ids)",
}

# field -> why it does not change the forward the conversion reproduces.
IRRELEVANT: dict[str, str] = {
    "device": "placement: the converted model is built on the source's devices",
    "uses_rms_norm": "a TransformerBridge hint; HookedTransformer norms are read off their modules",
    "layer_norm_folding": "records folding; the folded norms and weights are read off the modules",
    "tie_word_embeddings": "W_U is read as stored",
    "quantization_method": "only read with load_in_4bit (refused)",
    "relative_attention_max_distance": "T5 relative biases (positional_embedding_type refused)",
    "relative_attention_num_buckets": "T5 relative biases (positional_embedding_type refused)",
    "decoder_start_token_id": "encoder-decoder generation only",
    "init_mode": "initialisation only; the weights are read",
    "initializer_range": "initialisation only; the weights are read",
    "init_weights": "initialisation only; the weights are read",
    "seed": "initialisation only; the weights are read",
    "n_params": "a derived parameter count",
    "from_checkpoint": "checkpoint metadata",
    "checkpoint_index": "checkpoint metadata",
    "checkpoint_label_type": "checkpoint metadata",
    "checkpoint_value": "checkpoint metadata",
    "tokenizer_name": "loading the tokenizer; the tokenizer object is carried",
    "trust_remote_code": "loading from Hugging Face",
}

# Carried fields with values that are refused: field -> (config overrides that set such a value, a word the error
# contains). tests/test_hooked_config_fields.py converts each and checks the message.
REFUSED_VALUES: dict[str, tuple[dict[str, Any], str]] = {
    "positional_embedding_type": (
        {"positional_embedding_type": "relative_positional_bias"},
        "relative_positional_bias",
    ),
    "act_fn": ({"act_fn": "solu_ln"}, "solu"),
    "attn_types": ({"attn_types": ["local", "global"], "use_local_attn": False}, "use_local_attn"),
}
