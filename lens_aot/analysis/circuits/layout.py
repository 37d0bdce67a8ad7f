"""Where a circuit's senders and receivers live in a converted model (hook names, weights), for discover and evaluate,
and the model's description a graph records to be checked against it (:func:`model_cfg`, :func:`check_model`).

Senders write into the residual stream: ``input`` (``blocks.0.hook_resid_pre``, token plus position embeddings; the
position part is the same on clean and corrupted inputs), attention head ``h`` of layer ``l`` (``hook_z[..., h, :] @
W_O[h]``; ``b_O`` belongs to no head), MLP ``l`` (``hook_mlp_out``) or its neuron ``i`` (``hook_post[..., i] *
W_out[i]``; ``b_out`` belongs to no neuron). Receivers read it: head ``h``'s q/k/v input (``hook_{q,k,v}_input``
with ``use_split_qkv_input``; under grouped-query attention with ``ungroup_grouped_query_attention`` too, so each
query head has its own k and v input, as EAP-IG requires), MLP ``l``'s input (``hook_mlp_in``), neuron ``i``'s own
input (its columns of ``hook_pre``, and of ``hook_pre_linear`` in a gated MLP, recomputed through ``ln2`` from its
own copy of the residual: each neuron is a head with its own input, Huben & Morris 2023 Theorem 3), and the logits
(the last ``hook_resid_post``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from lens_aot.core.components.moe.source_expert_hooks import dense_expert_hooks
from lens_aot.core.components.residual.writes import written
from lens_aot.errors import InputError

FINGERPRINT_PARAMETERS = 64  # parameters sampled (in name order) for a graph's fingerprint of its model's weights
FINGERPRINT_TOLERANCE = 0.05  # relative distance between two fingerprints above which the models differ


@dataclass(frozen=True)
class PreMap:
    """One pre-activation hook of an MLP (or expert) and the map into it: ``hook = ln2(x) @ W + b``
    (:meth:`~lens_aot.analysis.circuits.moe.NeuronGroup.pre_maps`)."""

    hook: str
    W: Float[Tensor, "d_model d_mlp"]
    b: Float[Tensor, " d_mlp"]


def has_mlp(aot: Any, layer: int) -> bool:
    return bool(getattr(aot.blocks[layer], "has_mlp", True))


def mlp_reads(aot: Any, layer: int) -> str:
    """The residual hook an MLP of layer ``layer`` reads (``hook_resid_mid``; parallel blocks ``hook_resid_pre``)."""
    return f"blocks.{layer}.hook_resid_{'pre' if aot.blocks[layer].parallel else 'mid'}"


def final_resid(aot: Any) -> str:
    return f"blocks.{len(aot.blocks) - 1}.hook_resid_post"


def head_out(
    aot: Any, layer: int, z: Float[Tensor, "batch pos head d_head"]
) -> Float[Tensor, "batch pos head d_model"]:
    """Every attention head's write into the residual, ``z_h @ W_O[h]`` (no ``b_O``; times a half-precision Granite's
    residual multiplier, :func:`~lens_aot.core.components.residual.writes.written`)."""
    return torch.einsum("bphe,hed->bphd", z, written(aot.blocks[layer].attn))


def is_moe(aot: Any, layer: int) -> bool:
    """Whether layer ``layer``'s MLP is a mixture of experts (a router and experts, :mod:`lens_aot.core.fit.moe`)."""
    return has_mlp(aot, layer) and hasattr(aot.blocks[layer].mlp, "experts")


def check_supported(aot: Any, granularity: str = "mlp") -> None:
    """Refuse models whose edges this module cannot cut one by one: at ``"neuron"`` granularity, mixture-of-experts
    layers whose experts are not neuron heads with ``hook_pre`` maps or have output biases (routed, so they belong to
    no neuron). Expert neurons are nodes ``m{l}.e{e}.n{i}`` (:mod:`lens_aot.analysis.circuits.moe`).
    Grouped-query attention is supported: circuits run with ``ungroup_grouped_query_attention`` on
    (:func:`split_inputs`), so each query head has its own k and v input, as in EAP-IG. At every granularity,
    Gemma 4's per-layer-input sublayers (``blocks.{l}.per_layer``: neuron heads whose output goes through a post norm,
    so no node holds them) are refused, so that no
    circuit silently leaves part of a layer out of its graph; so are Gemma 4's layers that attend with an earlier
    layer's keys and values (``attn.kv_from``): their keys and values come from that layer's residual stream, an edge
    no node of the graph carries; and Gemma 4's mixtures of experts beside the dense MLP (``mlp.reads_residual``)."""
    for layer, block in enumerate(aot.blocks):
        if getattr(block.attn, "kv_from", None) is not None:
            raise InputError(
                f"layer {layer} attn: Gemma 4's shared keys and values (this layer attends with layer "
                f"{block.attn.kv_from}'s keys and values, an edge from that layer's residual stream that no node of "
                "the graph carries); patch by hook name or with patch_heads / patch_neurons, which rerun the model"
            )
    for layer, block in enumerate(aot.blocks):
        if hasattr(block, "per_layer"):
            raise InputError(
                f"layer {layer} per_layer: Gemma 4's per-layer-input sublayer writes to the residual stream outside "
                "every node of the graph (its neuron heads write through the sublayer's post norm, which no edge "
                "models), so a circuit would cover only "
                f"part of the layer; patch it by hook name (blocks.{layer}.per_layer.hook_out) or with patch_heads / "
                "patch_neurons, which rerun the whole model"
            )
        if getattr(getattr(block, "mlp", None), "reads_residual", False):  # core/components/moe/moe_beside_mlp.py
            raise InputError(
                f"layer {layer} mlp: Gemma 4's mixture of experts beside the dense MLP normalises each branch's output "
                "and its router and experts read the raw residual through their own norms, which no node or edge of "
                "the graph carries; patch by hook name or with patch_heads, which rerun the model"
            )
    if granularity != "neuron":
        return
    for layer in range(len(aot.blocks)):
        if not is_moe(aot, layer):
            continue
        if getattr(aot.blocks[layer].mlp, "input_scaled", False):  # Llama 4 (core/components/moe/input_scaled_moe.py)
            raise InputError(
                f"layer {layer} mlp: its router weights scale each expert's input (Llama 4), inside the activation, "
                "so an expert neuron is no router gate times a neuron node; use granularity='mlp'"
            )
        for name, module in aot.blocks[layer].mlp.expert_modules():
            what = name.replace("experts.", "expert ").replace("_", " ")
            if not (hasattr(module, "heads") or hasattr(module, "gate_heads")) or not hasattr(module, "W_out"):
                raise InputError(
                    f"layer {layer} mlp: {what} ({type(module).__name__}) has no neuron heads with per-neuron "
                    f"pre-activations, so its neurons cannot be graph nodes; use granularity='mlp'"
                )
            if bool(module.b_out.detach().ne(0).any()):
                raise InputError(
                    f"layer {layer} mlp: {what} has an output bias, which the router scales, so it belongs to no "
                    f"neuron node; use granularity='mlp' (one node per MoE layer)"
                )


@contextlib.contextmanager
def split_inputs(aot: Any) -> Iterator[None]:
    """Per-head q/k/v inputs (under grouped-query attention one k and v input per query head, EAP-IG's
    ``ungroup_grouped_query_attention``) and ``hook_mlp_in`` on, restored afterwards (even when a forward raises)."""
    old_split = bool(getattr(aot.cfg, "use_split_qkv_input", False))
    old_mlp_in = bool(getattr(aot.cfg, "use_hook_mlp_in", False))
    old_ungroup = bool(getattr(aot.cfg, "ungroup_grouped_query_attention", False))
    any_mlp = any(has_mlp(aot, layer) for layer in range(len(aot.blocks)))
    aot.set_use_split_qkv_input(True)
    aot.set_ungroup_grouped_query_attention(True)  # grouped-query attention: one k and v input per query head
    if any_mlp:
        aot.set_use_hook_mlp_in(True)
    try:
        yield
    finally:
        aot.set_use_split_qkv_input(old_split)
        aot.set_ungroup_grouped_query_attention(old_ungroup)
        if any_mlp:
            aot.set_use_hook_mlp_in(old_mlp_in)


def record(
    aot: Any, tokens: Tensor, hooks: list[str], extra: list[tuple[str, Any]] | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Run ``tokens`` and return the logits and the values at ``hooks`` (after any ``extra`` hook edits them)."""
    acts: dict[str, Tensor] = {}

    def keep(x: Tensor, hook: Any) -> Tensor:
        acts[hook.name] = x
        return x

    fwd = list(extra or []) + [(name, keep) for name in hooks]
    with dense_expert_hooks(aot):  # experts on every position (a TransformerLens MoE's hooks: routed otherwise)
        logits = aot.run_with_hooks(tokens, fwd_hooks=fwd)
    return logits, acts


# ---------------------------------------------------------------------------------------------- what a graph records
def model_cfg(aot: Any, granularity: str) -> dict[str, Any]:
    """The graph's ``cfg``: EAP-IG's four keys, then what identifies the model and the granularity."""
    cfg = aot.cfg
    parallel = any(bool(getattr(block, "parallel", False)) for block in aot.blocks)
    has_mlp = [bool(getattr(block, "has_mlp", True)) for block in aot.blocks]
    d_mlp = [int(block.mlp.d_mlp) if h else 0 for block, h in zip(aot.blocks, has_mlp, strict=True)]
    moe = [
        _moe_cfg(block.mlp) if h and hasattr(block.mlp, "experts") else None
        for block, h in zip(aot.blocks, has_mlp, strict=True)
    ]
    out = {
        "n_layers": int(cfg.n_layers),
        "n_heads": int(cfg.n_heads),
        "parallel_attn_mlp": parallel,
        "d_model": int(cfg.d_model),
        "granularity": granularity,
        "d_mlp": d_mlp,
        "model_name": str(getattr(cfg, "model_name", "") or ""),
        "fingerprint": weights_fingerprint(aot),
    }
    if any(m is not None for m in moe):  # mixture-of-experts layers: their experts' widths (dense cfgs unchanged)
        out["moe"] = moe
    return out


def weights_fingerprint(aot: Any) -> list[float]:
    """Four values of each of the first :data:`FINGERPRINT_PARAMETERS` parameters (by name), at evenly spaced flat
    positions, as floats: what tells two models of the same shape apart. Two fingerprints are of the same model when
    their relative distance is below :data:`FINGERPRINT_TOLERANCE` (:func:`same_weights`), so the model in another
    dtype or on another device matches, and a model with other weights (another seed, another checkpoint) does not."""
    out: list[float] = []
    named = sorted((name, p) for name, p in aot.named_parameters() if p.numel() and p.device.type != "meta")
    for _, p in named[:FINGERPRINT_PARAMETERS]:
        at = torch.linspace(0, p.numel() - 1, 4).long()
        index = torch.unravel_index(at, tuple(p.shape))  # no flat copy of a non-contiguous parameter
        out += [float(v) for v in p.detach()[tuple(i.to(p.device) for i in index)].double().cpu().tolist()]
    return out


def same_weights(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether two :func:`weights_fingerprint` lists are of the same weights (relative distance at most
    :data:`FINGERPRINT_TOLERANCE`)."""
    if len(a) != len(b):
        return False
    ta, tb = torch.tensor(list(a), dtype=torch.float64), torch.tensor(list(b), dtype=torch.float64)
    scale = max(float(ta.norm()), float(tb.norm()), 1e-30)
    return float((ta - tb).norm()) <= FINGERPRINT_TOLERANCE * scale


def _moe_cfg(mlp: Any) -> dict[str, Any]:
    shared = getattr(mlp, "shared_expert", None)
    return {"d_experts": [int(e.d_mlp) for e in mlp.experts], "d_shared": 0 if shared is None else int(shared.d_mlp)}


def check_model(cfg: dict[str, Any], aot: Any, where: str = "the graph") -> None:
    """Raise :class:`InputError` unless a graph ``cfg`` describes ``aot``: layers, heads, width, MLP widths and, when
    the graph records one (lens_aot's files; EAP-IG's do not), its fingerprint of the weights (:func:`same_weights`),
    so a graph of another model with the same shape is refused too."""
    mine = model_cfg(aot, cfg.get("granularity", "mlp"))
    keys = ["n_layers", "n_heads", "d_model", "parallel_attn_mlp"]
    if cfg.get("granularity") == "neuron" or cfg.get("d_mlp") not in (None, [1] * mine["n_layers"]):
        keys.append("d_mlp")
    if cfg.get("granularity") == "neuron" and (cfg.get("moe") or mine.get("moe")):
        keys.append("moe")
    if cfg.get("model_name") and mine["model_name"]:  # EAP-IG's files name no model
        keys.append("model_name")
    diff = {k: (cfg.get(k), mine.get(k)) for k in keys if cfg.get(k) != mine.get(k)}
    if not diff and cfg.get("fingerprint") and not same_weights(cfg["fingerprint"], mine["fingerprint"]):
        raise InputError(
            f"{where} is of another model: the same shape, but other weights (the graph's fingerprint of the weights "
            f"differs from this model's). Build the graph with Graph.from_model(aot, ...) or discover(aot, ...) on "
            f"this model"
        )
    if diff:
        raise InputError(
            f"{where} is of another model: "
            + ", ".join(f"{k} {a!r} (model: {b!r})" for k, (a, b) in diff.items())
            + ". Build the graph with Graph.from_model(aot, ...) or discover(aot, ...) on this model."
        )
