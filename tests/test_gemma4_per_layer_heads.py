"""Issue 22, Gemma 4's per-layer-input sublayer as neuron heads (lens_aot.core.components.mlp.per_layer_neurons).

The support matrix's tiny Gemma 4 with per-layer inputs (``hidden_size_per_layer_input=16``), its norm weights and
layer scalars randomised so that each binds, converted from its TransformerBridge in float32 and float64. Each
sublayer's neurons are gate and product heads; measured against the source's own forward: the logits within the
stated bound, and each sublayer, fed the source's own residual and per-layer inputs, within its per-neuron bound
(``hook_post``) and that bound carried through ``W_proj`` and the post norm (``hook_out``). A gate-fit coefficient or
the post norm's epsilon moved by 1e-3 leaves those bounds.
"""

from __future__ import annotations

import functools
import json
import math
import warnings
from typing import Any

import pytest
import torch
from gemma4_helpers import SCALARS, SHORT_CONTEXT, bridge_in
from gemma4_helpers import tokens as _tokens

import lens_aot
from lens_aot.core.components.mlp.per_layer_neurons import PerLayerNeuronSublayer
from lens_aot.core.components.residual.per_layer_sublayer import PerLayerSublayer
from lens_aot.errors import LoadError

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])


@functools.lru_cache(maxsize=1)
def _float32_source() -> Any:
    """The matrix's tiny Gemma 4 with per-layer inputs, every RMSNorm weight and the layer scalars randomised."""
    from lens_aot.matrix.families import Family, build_hf_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_hf_model(
            Family("Gemma4ForCausalLM", "test", {**SHORT_CONTEXT, "hidden_size_per_layer_input": 16})
        )
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if "norm" in name.rsplit(".", 1)[-1] and isinstance(weight, torch.Tensor) and weight.ndim == 1:
                weight.copy_(0.5 + torch.rand(weight.shape, generator=generator))
        for layer, scalar in zip(model.model.layers, SCALARS, strict=True):
            layer.layer_scalar.fill_(scalar)
    return model


@functools.lru_cache(maxsize=2)
def _converted(dtype: torch.dtype) -> tuple[Any, Any, Any]:
    """(Hugging Face model, its bridge, the converted model) in ``dtype``."""
    model, bridge = bridge_in(_float32_source(), dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        aot = lens_aot.convert(bridge, check_tokens=_tokens())
    return model, bridge, aot


def _error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def _source_sublayers(model: Any, bridge: Any, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """The source's per-layer inputs (``P``) and, per layer, its sublayer's residual input, ``act(g)·p`` and output."""
    names = {
        f"{part}{layer}": f"blocks.{layer}.{hook}"
        for layer in range(2)
        for part, hook in (
            ("resid", "per_layer_input_gate.hook_in"),
            ("post", "per_layer_projection.hook_in"),
            ("out", "post_per_layer_input_norm.hook_out"),
        )
    }
    with torch.no_grad():
        _, cache = bridge.run_with_cache(tokens, names_filter=lambda n: n in names.values())
        text = model.model
        inputs = text.project_per_layer_inputs(text.embed_tokens(tokens), text.get_per_layer_inputs(tokens))
    return {"P": inputs, **{key: cache[name] for key, name in names.items()}}


def _isolated(sub: PerLayerNeuronSublayer, resid: torch.Tensor, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
    """``sub`` run alone on the source's residual and per-layer inputs: its ``hook_post`` and ``hook_out``."""
    seen: dict[str, torch.Tensor] = {}
    handles = [
        getattr(sub, f"hook_{k}").register_forward_hook(lambda m, i, o, k=k: seen.__setitem__(k, o))
        for k in ("post", "out")
    ]
    try:
        sub.store.value = inputs
        with torch.no_grad():
            sub(resid)
    finally:
        sub.store.value = None
        for handle in handles:
            handle.remove()
    return seen


def _bounds(sub: PerLayerNeuronSublayer, source_post_in: torch.Tensor, dtype: torch.dtype) -> tuple[float, Any]:
    """The per-neuron bound ``e`` on ``hook_post`` (the fit's ``max_error`` plus rounding of the values' scale) and,
    per position, that bound carried through ``W_proj`` and the post RMSNorm to ``hook_out``: ``‖Δx‖ ≤ D =
    sqrt(d_ple)·e·‖W_proj‖₂``, and ``x ↦ x·w/sqrt(mean(x²) + eps)``, whose Jacobian has norm at most
    ``max|w|·sqrt(d)/‖y‖`` at ``y``, moves by at most ``max|w|·sqrt(d)·D/(‖x‖ − D)`` (plus rounding)."""
    rounding = 64 * torch.finfo(dtype).eps * (1 + float(source_post_in.abs().max()))
    per_neuron = sub.fit.max_error + rounding
    W = sub.W_proj.detach().double()
    x = source_post_in.double() @ W
    D = per_neuron * math.sqrt(W.shape[0]) * float(torch.linalg.matrix_norm(W, ord=2))
    d, w = x.shape[-1], float(sub.post_norm.spec().w.double().abs().max())
    out_bound = math.sqrt(d) * w * (D / (x.norm(dim=-1) - D) + 64 * torch.finfo(dtype).eps)
    return per_neuron, out_bound


@DTYPES
def test_per_layer_neurons_are_heads_within_the_stated_bound(dtype: torch.dtype) -> None:
    model, bridge, aot = _converted(dtype)
    tokens = _tokens()
    with torch.no_grad():
        error = _error(aot(tokens), model(tokens).logits)
    assert error <= aot.report.logit_bound, (error, aot.report.logit_bound)
    source = _source_sublayers(model, bridge, tokens)
    for layer in range(2):
        sub = aot.blocks[layer].per_layer
        assert isinstance(sub, PerLayerNeuronSublayer) and sub.gated
        assert sub.gate_heads.n_heads == 16 * sub.fit.gate.n_terms and sub.product_heads.n_heads == 32
        got = _isolated(sub, source[f"resid{layer}"], source["P"])
        per_neuron, out_bound = _bounds(sub, source[f"post{layer}"], dtype)
        assert _error(got["post"], source[f"post{layer}"]) <= per_neuron
        assert bool(((got["out"] - source[f"out{layer}"]).double().norm(dim=-1) <= out_bound).all())
    # the neuron heads' bound is in the stated one: the source's response to ±max_error on every such neuron, never
    # below the MLP neurons' alone (and here above it: the perturbation reaches the source's sublayers)
    from lens_aot.core.check.faithfulness import conversion_bound

    with torch.no_grad():
        expected = bridge(tokens)
        args = (bridge, tokens, expected, dict(aot.cfg.activation_fits), 2)
        with_heads = conversion_bound(*args, rounding_dtype=torch.float32, per_layer=dict(aot.cfg.per_layer_fits))
        mlp_only = conversion_bound(*args, rounding_dtype=torch.float32)
    assert with_heads[1] > mlp_only[1] and with_heads[0] == pytest.approx(aot.report.logit_bound, rel=1e-6)
    assert aot.report.neuron_heads == sum(b.mlp.d_mlp * 7 for b in aot.blocks) + sum(
        16 * aot.blocks[i].per_layer.fit.n_terms for i in range(2)
    )


@pytest.mark.parametrize("edit", ["gate_coefficient", "post_norm_eps"])
def test_per_layer_neurons_perturbed_by_1e3_leave_their_bound(edit: str) -> None:
    """A gate-fit coefficient (α of the first term) 1e-3 off, or the post norm's eps 1e-3 off, moves a sublayer fed
    the source's own inputs out of its stated bound."""
    model, bridge, aot = _converted(torch.float64)
    source = _source_sublayers(model, bridge, _tokens())
    left = []
    for layer in range(2):
        sub = aot.blocks[layer].per_layer
        alpha, eps = sub.gate_heads.term_alpha.clone(), sub.post_norm.eps
        try:
            if edit == "gate_coefficient":
                with torch.no_grad():
                    sub.gate_heads.term_alpha[0] *= 1 + 1e-3
            else:
                sub.post_norm.eps = eps + 1e-3
            got = _isolated(sub, source[f"resid{layer}"], source["P"])
        finally:
            with torch.no_grad():
                sub.gate_heads.term_alpha.copy_(alpha)
            sub.post_norm.eps = eps
        per_neuron, out_bound = _bounds(sub, source[f"post{layer}"], torch.float64)
        post_out = _error(got["post"], source[f"post{layer}"]) > per_neuron
        out_out = bool(((got["out"] - source[f"out{layer}"]).double().norm(dim=-1) > out_bound).any())
        left.append(post_out or out_out)
    assert all(left), left


@DTYPES
def test_editing_one_neurons_heads_is_zeroing_its_post_on_the_source(dtype: torch.dtype) -> None:
    """Zeroing ``hook_z`` of neuron n's gate heads (so h_n = 0), or of its product pair, changes the logits as zeroing
    ``act(g)·p`` of neuron n on the source does (within the stated bound), and by far more than the bound."""
    model, bridge, aot = _converted(dtype)
    tokens, bound = _tokens(), aot.report.logit_bound
    layer, neuron = 0, 5
    refs = aot.neuron_heads(layer, neuron, sublayer="per_layer")
    gate = [r.head for r in refs if r.name.endswith("gate_heads")]
    pair = [r.head for r in refs if r.name.endswith("product_heads")]
    assert len(gate) == aot.blocks[layer].per_layer.fit.gate.n_terms and pair == [2 * neuron, 2 * neuron + 1]
    assert [aot.head_origin(r.name, r.head) for r in refs] == [
        lens_aot.HeadOrigin("per_layer", layer, neuron, k) for k in range(len(refs))
    ]

    def zero(heads: list[int]) -> Any:
        def hook(z: torch.Tensor, hook: Any) -> torch.Tensor:
            z = z.clone()
            z[:, :, heads] = 0
            return z

        return hook

    def zero_source(post: torch.Tensor, hook: Any) -> torch.Tensor:
        post = post.clone()
        post[..., neuron] = 0
        return post

    with torch.no_grad():
        want = bridge.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{layer}.per_layer_projection.hook_in", zero_source)])
        effect = _error(want, model(tokens).logits)
        prefix = f"blocks.{layer}.per_layer"
        for module, heads in (("gate_heads", gate), ("product_heads", pair)):
            got = aot.run_with_hooks(tokens, fwd_hooks=[(f"{prefix}.{module}.hook_z", zero(heads))])
            assert _error(got, want) <= bound, (module, _error(got, want), bound)
    assert effect > 10 * bound, (effect, bound)


def test_per_layer_head_hooks_cache_and_fused_path() -> None:
    """The source-aligned hooks keep their shapes; the heads' hooks exist (dense patterns while hooked); the compact
    cache derives them as the eager one stores them; the fused path gives the same logits."""
    aot, tokens = _converted(torch.float64)[2], _tokens()
    prefix = "blocks.1.per_layer"
    with torch.no_grad():
        logits, compact = aot.run_with_cache(tokens, names_filter=lambda n: n.startswith(prefix))
        _, eager = aot.run_with_cache(tokens, names_filter=lambda n: n.startswith(prefix), compact=False)
    shapes = {"hook_per_layer_input": 16, "hook_pre": 16, "hook_post": 16, "hook_out": aot.cfg.d_model}
    for hook, width in shapes.items():
        assert compact[f"{prefix}.{hook}"].shape == (2, 24, width)
    heads = {"gate_heads": aot.blocks[1].per_layer.gate_heads.n_heads, "product_heads": 32}
    for module, n in heads.items():
        for hook in ("hook_q", "hook_k", "hook_v", "hook_z"):
            name = f"{prefix}.{module}.{hook}"
            assert compact[name].shape == (2, 24, n, 1)
            assert torch.allclose(compact[name], eager[name], rtol=0, atol=1e-12), name
        assert eager[f"{prefix}.{module}.hook_pattern"].shape == (2, n, 24, 24)
    assert torch.equal(compact[f"{prefix}.hook_pre_linear"], compact[f"{prefix}.hook_per_layer_input"])
    # the product heads' TransformerLens-layout weights over [resid, scratch h, per-layer input p] give their q and v
    product = aot.blocks[1].per_layer.product_heads
    h, p = compact[f"{prefix}.product_heads.hook_gate"], compact[f"{prefix}.hook_per_layer_input"]
    x = torch.cat([torch.randn(2, 24, aot.cfg.d_model, dtype=h.dtype), h, p], dim=-1)
    for w, b, hook in ((product.W_Q, product.b_Q, "hook_q"), (product.W_V, product.b_V, "hook_v")):
        got = torch.einsum("bpi,hie->bphe", x, w) + b
        assert torch.allclose(got, compact[f"{prefix}.product_heads.{hook}"], rtol=1e-12, atol=1e-12), hook
    aot.set_use_fused_neurons(True)
    try:
        assert all(b.per_layer.use_fused for b in aot.blocks)
        with torch.no_grad():
            fused = aot(tokens)
    finally:
        aot.set_use_fused_neurons(False)
    assert _error(fused, logits) <= 1e-10


def test_per_layer_heads_save_load_and_revert(tmp_path: Any) -> None:
    model, _, aot = _converted(torch.float32)
    tokens = _tokens()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lens_aot.save(aot, tmp_path / "g4")
        loaded = lens_aot.load(tmp_path / "g4")
    with torch.no_grad():
        assert torch.equal(loaded(tokens), aot(tokens))
    assert loaded.cfg.per_layer_fits == aot.cfg.per_layer_fits
    assert all(isinstance(b.per_layer, PerLayerNeuronSublayer) for b in loaded.blocks)
    # a save from before these heads (no per_layer_fits entry) is refused with the fix, not rebuilt with other fits
    config = json.loads((tmp_path / "g4" / "config.json").read_text())
    del config["per_layer_fits"]
    (tmp_path / "g4" / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoadError, match="kept the per-layer-input sublayers dense .* Convert the source again"):
        lens_aot.load(tmp_path / "g4")
    reference = lens_aot.revert(aot, to="reference")
    assert all(type(b.per_layer) is PerLayerSublayer for b in reference.blocks)
    with torch.no_grad():
        assert _error(reference(tokens), model(tokens).logits) <= aot.report.logit_bound


def test_per_layer_heads_are_refused_or_named_by_the_analysis_tools() -> None:
    """Patching and attribution warn that they list no per-layer neuron (their output goes through a post norm);
    circuits refuse the layer by name (tests/test_gemma4.py); a wrong sublayer or neuron, or an input outside the
    certified range, is refused by name."""
    from lens_aot.analysis.patching import head_units
    from lens_aot.errors import InputError, InputRangeError

    aot = _converted(torch.float32)[2]
    with pytest.warns(UserWarning, match=r"^layers \[0, 1\] per_layer: Gemma 4's per-layer-input neurons"):
        units = head_units(aot)
    assert not any(".per_layer." in ref.name for unit in units for ref in unit.heads)
    with pytest.raises(IndexError, match="layer 0's per_layer has d_ple=16"):
        aot.neuron_heads(0, 16, sublayer="per_layer")
    with pytest.raises(InputError, match="sublayer must be 'mlp' or 'per_layer'"):
        aot.neuron_heads(0, 1, sublayer="ple")  # type: ignore[arg-type]
    assert lens_aot.core.names.per_layer_label(3, 17, 5, pair=True) == "L3P17.5+6"
    # an input outside the range the bound is certified on (only an edit can make one) is refused, not computed
    with pytest.raises(InputRangeError, match=r"^layer 1 per_layer \(residual norm ≤ [0-9.]+\): "):
        aot.run_with_hooks(_tokens(), fwd_hooks=[("blocks.1.per_layer.hook_per_layer_input", lambda p, hook: p * 100)])
    with pytest.raises(InputError):
        lens_aot.core.names.parse_label("L3P17")
