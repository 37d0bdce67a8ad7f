"""DeepSeek-V4 through a TransformerBridge (TransformerLens 4.3): manifold-constrained hyper-connections (the residual
stream is hc_mult streams), sliding / compressed-sparse (with the Lightning indexer) / heavily-compressed attention
with attention sinks, a shared key-value head and a grouped low-rank output, and mixtures of experts routed by
sqrt-softplus scores with a selection bias or by a token-id table (hash routing), with clamped-SwiGLU experts and a
shared expert; faithful to the source's own forward in float32 and float64, with compressions that happen (compress
rates 4 and 8 on 24 tokens), a window that binds (8) and clamps that bind (``swiglu_limit`` 0.5). A 1e-3 change of the
clamp, the linear branch's offset, the routed scaling, a hyper-connection's scale, a compressor's position bias, the
rotary frequencies or a norm's eps (the key-value norm's, a hyper-connection's, ln2's), or another hash table, leaves
the tolerance. The pieces alone are checked bitwise in tests/test_compressed_attention.py and
tests/test_hyper_connection.py; save / load in tests/test_deepseek_v4_io.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from conftest import TOLERANCES
from factories_bridge import matrix_bridges, source_error

import lens_aot
from lens_aot.core.components.attention.compressed_attention import CompressedAttention
from lens_aot.core.components.residual.hyper_block import HyperConnectionBlock
from lens_aot.core.fit.clamped_swiglu import ClampedSwiGLUSpec
from lens_aot.core.names import neuron_label, parse_label
from lens_aot.core.read import read_model, run_source
from lens_aot.core.spec.model_spec import MoESpec
from lens_aot.errors import InputError
from lens_aot.matrix.families import Family, build_hf_model

ARCH = "DeepseekV4ForCausalLM"
DTYPES = [torch.float32, torch.float64]
FIELDS = {
    "num_hidden_layers": 3,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    "mlp_layer_types": ["hash_moe", "moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "sliding_window": 8,
    "index_topk": 3,
    "swiglu_limit": 0.5,
    "hc_mult": 3,
}


def _tokens(seed: int = 3) -> torch.Tensor:
    return torch.randint(1, 128, (2, 24), generator=torch.Generator().manual_seed(seed))


def _randomize_routing(model: torch.nn.Module) -> None:
    """Hash tables of distinct experts per token and nonzero selection biases (the builder leaves zeros)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = layer.mlp.gate
            if hasattr(gate, "tid2eid"):
                n_experts, (vocab, top_k) = gate.weight.shape[0], gate.tid2eid.shape
                table = torch.stack([torch.randperm(n_experts, generator=gen)[:top_k] for _ in range(vocab)])
                gate.tid2eid.copy_(table)
            else:
                gate.e_score_correction_bias.copy_(0.2 * torch.randn(gate.weight.shape[0], generator=gen))


@pytest.fixture(scope="module")
def bridges() -> dict[torch.dtype, Any]:
    torch.set_num_threads(1)
    model = build_hf_model(Family(ARCH, "test", FIELDS))
    _randomize_routing(model)
    return matrix_bridges(model, ARCH, DTYPES)


_error = source_error


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp64"])
def test_logits_match_the_source(bridges, dtype: torch.dtype) -> None:
    bridge, tokens = bridges[dtype], _tokens()
    aot = lens_aot.convert(bridge)
    report = aot.report
    assert report.max_abs_logit_error is not None and report.max_abs_logit_error <= report.logit_bound < 0.05
    tol = report.logit_bound
    assert _error(bridge, aot, tokens) <= tol
    with torch.no_grad():  # the Hugging Face model's own forward too
        assert float((aot(tokens) - bridge.original_model(tokens).logits).abs().max()) <= tol
    aot.set_use_fused_neurons(True)  # the closed-form path computes the same clamps
    assert _error(bridge, aot, tokens) <= tol
    # the source's heads stay attention heads; the blocks keep every stream
    assert all(isinstance(b, HyperConnectionBlock) and isinstance(b.attn, CompressedAttention) for b in aot.blocks)
    assert report.attention_heads == 3 * 4


def test_what_the_test_exercises_happens(bridges) -> None:
    """Compressed entries exist on both compressed layers, the indexer chooses among them, the window and the clamps
    bind, and the hash layer routes by the table."""
    bridge, tokens = bridges[torch.float64], _tokens()
    aot = lens_aot.convert(bridge)
    _, cache = aot.run_with_cache(tokens)
    assert cache["blocks.1.attn.hook_compressed_kv"].shape == (2, 24 // 4, 16)
    assert cache["blocks.2.attn.hook_compressed_kv"].shape == (2, 24 // 8, 16)
    assert cache["blocks.1.attn.hook_indexer_topk"].shape == (2, 24, 3)
    assert bool((cache["blocks.0.attn.hook_pattern"][..., :24].triu(-8) == 0).any())  # the window binds
    table = bridge.original_model.model.layers[0].mlp.gate.tid2eid
    assert torch.equal(cache["blocks.0.mlp.hook_expert_indices"], table[tokens.reshape(-1)])
    assert bool((cache["blocks.1.mlp.experts.0.hook_pre"] > 0.5).any())  # the gate clamp binds
    assert bool((cache["blocks.1.mlp.shared_expert.hook_pre_linear"].abs() > 0.5).any())  # and the linear one
    assert cache["blocks.1.hook_resid_pre"].shape == (2, 24, 3, 64)
    assert cache["blocks.1.mlp_hc.hook_comb"].shape == (2, 24, 3, 3)


def test_the_pieces_are_read_as_the_source_computes_them(bridges) -> None:
    bridge = bridges[torch.float64]
    hf, spec = bridge.original_model, read_model(bridge)
    assert spec.hc_head is not None and spec.hc_head.hc_mult == 3
    for layer, (piece, hf_layer) in enumerate(zip(spec.layers, hf.model.layers, strict=True)):
        moe, gate, experts = piece.mlp, hf_layer.mlp.gate, hf_layer.mlp.experts
        assert isinstance(moe, MoESpec) and (moe.scoring, moe.top_k, moe.softmax_dtype) == ("sqrtsoftplus", 2, None)
        assert moe.routed_scaling_factor == hf.config.routed_scaling_factor
        assert torch.equal(moe.W_router, gate.weight.T)
        if layer == 0:
            assert moe.hash_table is not None and torch.equal(moe.hash_table, gate.tid2eid)
            assert moe.e_score_correction_bias is None
        else:
            assert moe.hash_table is None and torch.equal(moe.e_score_correction_bias, gate.e_score_correction_bias)
        d_mlp = hf.config.moe_intermediate_size
        for e, expert in enumerate(moe.experts):
            assert isinstance(expert, ClampedSwiGLUSpec)
            assert (expert.alpha, expert.limit, expert.up_offset) == (1.0, 0.5, 0.0)
            assert torch.equal(expert.W_gate, experts.gate_up_proj[e][:d_mlp].T)  # gate first, then up
            assert torch.equal(expert.W_in, experts.gate_up_proj[e][d_mlp:].T)
            assert torch.equal(expert.W_out, experts.down_proj[e].T)
        assert isinstance(moe.shared, ClampedSwiGLUSpec) and moe.shared.up_offset == 0.0
        assert piece.hc_attn is not None and piece.hc_mlp is not None
        assert torch.equal(piece.hc_attn.fn, hf_layer.attn_hc.fn) and torch.equal(
            piece.hc_mlp.base, hf_layer.ffn_hc.base
        )


def _perturbed(spec: Any, piece: str) -> Any:
    """``spec`` with one piece off by 1e-3 (``hash``: layer 0's table with the experts of two tokens swapped)."""
    for i, layer in enumerate(spec.layers):
        moe, attn, hc = layer.mlp, layer.attn, layer.hc_attn
        if piece in ("limit", "up_offset"):
            step = {piece: getattr(moe.experts[0], piece) + 1e-3}
            moe = dataclasses.replace(moe, experts=[dataclasses.replace(e, **step) for e in moe.experts])
        elif piece == "routed scaling":
            moe = dataclasses.replace(moe, routed_scaling_factor=moe.routed_scaling_factor + 1e-3)
        elif piece == "hash" and moe.hash_table is not None:
            table = moe.hash_table.clone()
            table[:, 0] = (table[:, 0] + 1) % moe.n_experts
            moe = dataclasses.replace(moe, hash_table=table)
        elif piece == "hc scale":
            hc = dataclasses.replace(hc, scale=hc.scale + 1e-3)
        elif piece == "position bias" and attn.compressor is not None:
            comp = attn.compressor  # one window slot's (a shift of every slot leaves the gate's softmax as it is)
            bias = comp.position_bias.clone()
            bias[0] += 1e-3
            attn = dataclasses.replace(attn, compressor=dataclasses.replace(comp, position_bias=bias))
        elif piece == "inv_freq":
            attn = dataclasses.replace(attn, inv_freq=attn.inv_freq * (1 + 1e-3))
        elif piece == "kv norm eps":
            attn = dataclasses.replace(attn, kv_norm=dataclasses.replace(attn.kv_norm, eps=attn.kv_norm.eps + 1e-3))
        elif piece == "hc norm eps":
            hc = dataclasses.replace(hc, norm_eps=hc.norm_eps + 1e-3)
        ln2 = layer.ln2 if piece != "ln2 eps" else dataclasses.replace(layer.ln2, eps=layer.ln2.eps + 1e-3)
        spec.layers[i] = dataclasses.replace(layer, attn=attn, mlp=moe, hc_attn=hc, ln2=ln2)
    return spec


@pytest.mark.parametrize(
    "piece",
    [
        "limit",
        "up_offset",
        "routed scaling",
        "hash",
        "hc scale",
        "position bias",
        "inv_freq",
        "kv norm eps",
        "hc norm eps",
        "ln2 eps",
    ],
)
def test_a_wrong_piece_is_detected(bridges, piece: str) -> None:
    """Each 1e-3 change takes the float64 logits out of the tolerance, which the reading meets with a wide margin at
    a per-neuron bound of 1e-8."""
    bridge, tokens, tol = bridges[torch.float64], _tokens(), TOLERANCES[("gated", torch.float64)]
    assert _error(bridge, lens_aot.convert(read_model(bridge), check=False, max_neuron_error=1e-8), tokens) <= tol / 100
    wrong = lens_aot.convert(_perturbed(read_model(bridge), piece), check=False, max_neuron_error=1e-8)
    assert _error(bridge, wrong, tokens) > tol


def test_hash_routing_needs_the_tokens(bridges) -> None:
    """A forward from the residual stream reaches the hash-routed layer only with the tokens, and then matches."""
    bridge, tokens = bridges[torch.float32], _tokens()
    aot = lens_aot.convert(bridge)
    with torch.no_grad():
        streams = aot.streams(aot.embed(tokens))
        with pytest.raises(InputError, match=r"MoE layer 0 chooses its experts by token id.*tokens="):
            aot(streams, start_at_layer=0)
        assert torch.equal(aot(streams, start_at_layer=0, tokens=tokens), aot(tokens))


def test_expert_neurons_are_patchable(bridges) -> None:
    """An expert neuron's heads are addressed by expert, and zeroing the expert's output changes the logits."""
    bridge, tokens = bridges[torch.float32], _tokens()
    aot = lens_aot.convert(bridge)
    heads = aot.neuron_heads(1, 3, expert=2)  # one gate head and the two product heads of neuron 3 of expert 2
    assert [h.name for h in heads] == [
        "blocks.1.mlp.experts.2.gate_heads",
        *["blocks.1.mlp.experts.2.product_heads"] * 2,
    ]
    assert neuron_label(1, 3, expert=2) == "L1E2N3" and parse_label("L1E2N3").expert == 2
    with torch.no_grad():
        patched = aot.run_with_hooks(tokens, fwd_hooks=[("blocks.1.mlp.experts.2.hook_out", lambda x, hook: 0 * x)])
        assert float((patched - aot(tokens)).abs().max()) > 1e-4


def test_generate_and_revert(bridges) -> None:
    """Greedy generation (without a key-value cache: the whole sequence each step) follows the source's argmax, and
    the reverted reference model is the source to rounding."""
    bridge, tokens = bridges[torch.float64], _tokens()[:1, :10]
    aot = lens_aot.convert(bridge)
    out = aot.generate(tokens, max_new_tokens=4, do_sample=False, verbose=False)
    expected = tokens
    with torch.no_grad():
        for _ in range(4):
            expected = torch.cat([expected, run_source(bridge, expected)[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(out, expected)
    reference = lens_aot.revert(aot)
    with torch.no_grad():
        assert float((reference(_tokens()) - run_source(bridge, _tokens())).abs().max()) <= 1e-10
