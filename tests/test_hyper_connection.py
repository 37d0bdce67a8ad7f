"""DeepSeek-V4's manifold-constrained hyper-connections (lens_aot.core.components.residual.hyper_connection, read by
lens_aot.tl.blocks.hyper) checked bitwise against transformers' own modules inside a tiny ``DeepseekV4ForCausalLM``'s
forward, in float32 and float64: each layer's ``attn_hc`` / ``ffn_hc``, the stream mix after each sublayer (a whole
decoder layer's output) and the model's ``hc_head``."""

from __future__ import annotations

import dataclasses
from functools import cache
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from deepseek_v4_helpers import tiny_deepseek_v4
from torch import nn

from lens_aot.core.components.residual.hyper_connection import HyperConnection, HyperHead, expand_streams, mix_streams
from lens_aot.errors import UnsupportedArchitectureError
from lens_aot.matrix.families import copy_as
from lens_aot.tl.blocks.hyper import read_hyper_connection, read_hyper_head

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    not hasattr(transformers, "DeepseekV4ForCausalLM"), reason="transformers has no DeepSeek-V4"
)

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
HC_MULTS = pytest.mark.parametrize("hc_mult", [3, 4])
BATCH, POS, D_MODEL, N_LAYERS = 2, 7, 64, 2
CONNECTIONS = ("attn_hc", "ffn_hc")


@cache
def _hf(hc_mult: int) -> nn.Module:
    """A tiny DeepSeek-V4 (sliding-window attention, one hash-routed and one top-2 MoE layer), every parameter random
    (``_init_weights`` leaves ``base`` at 0 and ``scale`` at 1, which would hide their use)."""
    return tiny_deepseek_v4(
        vocab_size=50,
        hidden_size=D_MODEL,
        num_attention_heads=4,
        head_dim=32,
        q_lora_rank=16,
        o_groups=2,
        o_lora_rank=8,
        hc_mult=hc_mult,
        num_hidden_layers=N_LAYERS,
        layer_types=["sliding_attention"] * N_LAYERS,
        mlp_layer_types=["hash_moe", "moe"],
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        sliding_window=8,
    )


def _ids() -> torch.Tensor:
    return torch.randint(0, 50, (BATCH, POS), generator=torch.Generator().manual_seed(2))


def _first(args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> torch.Tensor:
    return args[0] if args else kwargs[name]


@cache
def _run(hc_mult: int, dtype: torch.dtype) -> tuple[nn.Module, dict[str, Any]]:
    """The model in ``dtype`` and, from one forward, each layer's input / output, its hyper-connections' inputs and
    outputs, its sublayers' outputs, and the hyper head's input / output (keys ``"{l}.attn_hc.in"`` etc.)."""
    model = copy_as(_hf(hc_mult), dtype)
    seen: dict[str, Any] = {}

    def record(key: str, arg: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
            seen[f"{key}.in"] = _first(args, kwargs, arg).detach().clone()
            seen[f"{key}.out"] = tuple(o.detach().clone() for o in out) if isinstance(out, tuple) else out.detach()

        return hook

    handles = [model.model.hc_head.register_forward_hook(record("hc_head", "x"), with_kwargs=True)]
    for i, layer in enumerate(model.model.layers):
        for key, module, arg in (
            ("layer", layer, "hidden_states"),
            ("attn_hc", layer.attn_hc, "hidden_streams"),
            ("ffn_hc", layer.ffn_hc, "hidden_streams"),
            ("self_attn", layer.self_attn, "hidden_states"),
            ("mlp", layer.mlp, "hidden_states"),
        ):
            handles.append(module.register_forward_hook(record(f"{i}.{key}", arg), with_kwargs=True))
    try:
        with torch.no_grad():
            seen["logits"] = model(_ids()).logits
    finally:
        for handle in handles:
            handle.remove()
    return model, seen


def _assert_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: {got.dtype} vs {want.dtype}"
    assert torch.equal(got, want), f"{what}: max |Δ| {float((got - want).abs().max()):.3e}"


@HC_MULTS
@DTYPES
def test_hyper_connections_are_the_sources_bitwise(hc_mult: int, dtype: torch.dtype) -> None:
    """Every ``attn_hc`` / ``ffn_hc``: ``(post, comb, collapsed)`` equal the module's on its own recorded input, in
    its dtypes (float64 pre/post/comb in the float64 model: its float32 logits plus a float64 base)."""
    model, seen = _run(hc_mult, dtype)
    for i, layer in enumerate(model.model.layers):
        for name in CONNECTIONS:
            spec = read_hyper_connection(getattr(layer, name), i, name)
            assert (spec.hc_mult, spec.sinkhorn_iters, spec.d_model) == (hc_mult, 20, D_MODEL)
            assert spec.fn.dtype == dtype
            with torch.no_grad():
                got = HyperConnection(spec)(seen[f"{i}.{name}.in"])
            for what, g, w in zip(("post", "comb", "collapsed"), got, seen[f"{i}.{name}.out"], strict=True):
                _assert_equal(g, w, f"layer {i} {name} {what}")
            assert got[0].dtype == dtype and got[2].dtype == dtype


@HC_MULTS
@DTYPES
def test_hyper_head_is_the_sources_bitwise(hc_mult: int, dtype: torch.dtype) -> None:
    """The model's ``hc_head`` equals the module's output on its recorded input, and the model's final norm of it
    is the source's last hidden state's input (the logits follow)."""
    model, seen = _run(hc_mult, dtype)
    head = HyperHead(read_hyper_head(model.model.hc_head))
    with torch.no_grad():
        got = head(seen["hc_head.in"])
        logits = model.lm_head(model.model.norm(got))
    _assert_equal(got, seen["hc_head.out"], "hc_head")
    _assert_equal(logits, seen["logits"], "logits")
    assert torch.equal(seen["hc_head.in"], seen[f"{N_LAYERS - 1}.layer.out"])


@HC_MULTS
@DTYPES
def test_mix_is_a_whole_decoder_layer_bitwise(hc_mult: int, dtype: torch.dtype) -> None:
    """From a layer's input streams and its sublayers' recorded outputs, the components give the ffn connection's
    input streams and the layer's output bitwise; the first layer's input is the embedding expanded to the streams."""
    model, seen = _run(hc_mult, dtype)
    embed = model.model.embed_tokens(_ids())
    _assert_equal(expand_streams(embed, hc_mult), seen["0.layer.in"], "expanded embedding")
    for i, layer in enumerate(model.model.layers):
        attn_hc = HyperConnection(read_hyper_connection(layer.attn_hc))
        ffn_hc = HyperConnection(read_hyper_connection(layer.ffn_hc))
        streams = seen[f"{i}.layer.in"]
        with torch.no_grad():
            post, comb, collapsed = attn_hc(streams)
            _assert_equal(collapsed, seen[f"{i}.attn_hc.out"][2], f"layer {i} attention input")
            mid = attn_hc.mix(streams, seen[f"{i}.self_attn.out"][0], post, comb)
            _assert_equal(mid, seen[f"{i}.ffn_hc.in"], f"layer {i} streams after attention")
            post, comb, _ = ffn_hc(mid)
            out = mix_streams(mid, seen[f"{i}.mlp.out"], post, comb)
        _assert_equal(out, seen[f"{i}.layer.out"], f"layer {i} output")
        if i + 1 < N_LAYERS:
            _assert_equal(out, seen[f"{i + 1}.layer.in"], f"layer {i + 1} input")


@DTYPES
def test_every_hook_point_fires_with_its_shape(dtype: torch.dtype) -> None:
    """``hook_in`` / ``hook_pre`` / ``hook_post`` / ``hook_comb`` / ``hook_out`` / ``input_norm.hook_in`` /
    ``input_norm.hook_out`` fire once each with the documented shapes; a hook that rewrites ``hook_in`` is what the
    connection computes from."""
    hc = 4
    model, seen = _run(hc, dtype)
    shapes = {
        "hook_in": (BATCH, POS, hc, D_MODEL),
        "hook_pre": (BATCH, POS, hc),
        "hook_post": (BATCH, POS, hc),
        "hook_comb": (BATCH, POS, hc, hc),
        "hook_out": (BATCH, POS, D_MODEL),
        "input_norm.hook_in": (BATCH, POS, hc * D_MODEL),
        "input_norm.hook_out": (BATCH, POS, hc * D_MODEL),
    }
    for module, streams in (
        (HyperConnection(read_hyper_connection(model.model.layers[0].attn_hc)), seen["0.attn_hc.in"]),
        (HyperHead(read_hyper_head(model.model.hc_head)), seen["hc_head.in"]),
    ):
        fired: dict[str, list[tuple[int, ...]]] = {}
        for name, hook in module.named_modules():
            if name.rpartition(".")[2].startswith("hook_"):
                hook.add_hook(lambda t, hook, n=name, f=fired: f.setdefault(n, []).append(tuple(t.shape)))
        with torch.no_grad():
            module(streams)
        want = {n: [s] for n, s in shapes.items() if n in dict(module.named_modules())}
        assert fired == want, type(module).__name__
        module.hook_in.remove_hooks()
        module.hook_in.add_hook(lambda t, hook: t.flip(2))
        with torch.no_grad():
            flipped = module(streams)
            direct = type(module)(module.spec())(streams.flip(2))
        for g, w in zip(
            flipped if isinstance(flipped, tuple) else (flipped,),
            direct if isinstance(direct, tuple) else (direct,),
            strict=True,
        ):
            assert torch.equal(g, w)


def _outputs(module: nn.Module, streams: torch.Tensor) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        out = module(streams)
    return out if isinstance(out, tuple) else (out,)


@DTYPES
def test_a_small_change_of_scale_or_base_changes_the_output(dtype: torch.dtype) -> None:
    """A 1e-3 change of any one entry of ``scale``, or of one entry of ``base``'s pre / post / comb parts, changes
    the output it feeds (so the bitwise tests above can fail)."""
    hc = 3
    model, seen = _run(hc, dtype)
    spec = read_hyper_connection(model.model.layers[1].ffn_hc)
    streams = seen["1.ffn_hc.in"]
    want = _outputs(HyperConnection(spec), streams)
    feeds = {0: 2, 1: 0, 2: 1}  # scale / base part → the output it changes: pre → collapsed, post → post, comb → comb
    first = {0: 0, 1: hc, 2: 2 * hc}  # one entry: a shift of a whole softmax row would change nothing
    for part, output in feeds.items():
        for field in ("scale", "base"):
            changed = getattr(spec, field).clone()
            changed[part if field == "scale" else first[part]] += 1e-3
            got = _outputs(HyperConnection(dataclasses.replace(spec, **{field: changed})), streams)
            assert not torch.equal(got[output], want[output]), (field, part)
    head_spec = read_hyper_head(model.model.hc_head)
    want_head = _outputs(HyperHead(head_spec), seen["hc_head.in"])[0]
    for field in ("scale", "base"):
        changed = getattr(head_spec, field) + 1e-3
        got = _outputs(HyperHead(dataclasses.replace(head_spec, **{field: changed})), seen["hc_head.in"])[0]
        assert not torch.equal(got, want_head), field


def test_read_through_a_bridge_component_and_the_spec_round_trips() -> None:
    """An object wrapping the module as ``original_component`` (a TransformerBridge component) reads the same; a
    component's ``spec()`` builds an equal component; the reading's weights are detached copies in the module's
    dtype; a module of another layout is refused naming its piece."""
    model, seen = _run(3, torch.float64)
    module = model.model.layers[0].attn_hc
    direct, wrapped = read_hyper_connection(module), read_hyper_connection(SimpleNamespace(original_component=module))
    for field in ("fn", "base", "scale"):
        a, b, source = getattr(direct, field), getattr(wrapped, field), getattr(module, field)
        assert torch.equal(a, b) and torch.equal(a, source) and a.dtype == torch.float64
        assert not a.requires_grad and a.data_ptr() != source.data_ptr()
    hc = HyperConnection(direct)
    again = HyperConnection(hc.spec())
    for g, w in zip(_outputs(again, seen["0.attn_hc.in"]), _outputs(hc, seen["0.attn_hc.in"]), strict=True):
        assert torch.equal(g, w)
    head = read_hyper_head(SimpleNamespace(original_component=model.model.hc_head))
    assert torch.equal(HyperHead(head).spec().fn, head.fn)
    with pytest.raises(UnsupportedArchitectureError, match=r"^layer 1 ffn_hc: .*hc_sinkhorn_iters"):
        read_hyper_connection(model.model.hc_head, 1, "ffn_hc")


@DTYPES
def test_read_through_a_transformer_bridge_matches_its_hooks(dtype: torch.dtype) -> None:
    """Read from TransformerLens's own DeepSeek-V4 bridge (``blocks.{l}.attn_hc`` / ``mlp_hc``, ``hc_head``): the
    components reproduce the bridge's cached ``hook_post`` / ``hook_comb`` / ``hook_out`` (and ``input_norm``'s
    hooks) bitwise from its ``hook_in``, and carry every hook name the bridge has there."""
    from transformer_lens.model_bridge.supported_architectures.deepseek_v4 import DeepseekV4HyperConnectionBridge

    from lens_aot.matrix.families import tiny_tokenizer
    from lens_aot.tl.build import bridge_from_hf_module

    model = copy_as(_hf(3), dtype)
    bridge = bridge_from_hf_module(
        model,
        "DeepseekV4ForCausalLM",
        hf_config=model.config,
        tokenizer=tiny_tokenizer(50),
        dtype=dtype,
        model_name="tiny-deepseek-v4",
    ).eval()
    with torch.no_grad():
        _, cache = bridge.run_with_cache(_ids(), names_filter=lambda name: "hc" in name)
    carried: dict[str, nn.Module] = {"hc_head": HyperHead(read_hyper_head(bridge.hc_head))}
    for i, block in enumerate(bridge.blocks):
        for name in ("attn_hc", "mlp_hc"):
            assert isinstance(getattr(block, name), DeepseekV4HyperConnectionBridge)
            carried[f"blocks.{i}.{name}"] = HyperConnection(read_hyper_connection(getattr(block, name), i, name))
    for prefix, module in carried.items():
        seen: dict[str, torch.Tensor] = {}
        for name, hook in module.named_modules():
            if name.rpartition(".")[2].startswith("hook_"):
                hook.add_hook(lambda t, hook, n=name, s=seen: s.__setitem__(n, t))
        with torch.no_grad():
            module(cache[f"{prefix}.hook_in"])
        bridge_names = {n.removeprefix(f"{prefix}.") for n in cache if n.startswith(f"{prefix}.")}
        assert bridge_names <= set(seen), prefix
        for name in bridge_names:
            _assert_equal(seen[name], cache[f"{prefix}.{name}"], f"{prefix}.{name}")
