"""Ground truth for attribution graphs (tests/test_attribution_graph.py), computed with hooks on the converted model
and nothing of ``lens_aot.analysis.attribution_graphs.graph``: the inputs of neurons and logits when chosen node
outputs are zeroed, with the attention patterns, norm scales (and a final logit soft-cap, as a ratio) frozen at the
prompt, and optionally every other neuron (and head) frozen too."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from lens_aot.core.components.norm import Norm

NODE = re.compile(r"^(?:emb|m(\d+)(?:\.e(\d+))?\.n(\d+)|a(\d+)\.h(\d+)|logit:(\d+))@(\d+)$")


def model_dtype_norms(aot: Any) -> Any:
    """``aot`` with every norm computing in the model's dtype (a float64 conversion of a source whose norms upcast to
    float32 rounds there: no linear decomposition reproduces that rounding)."""
    for module in aot.modules():
        if isinstance(module, Norm):
            module.compute_dtype = None
    return aot


def record(aot: Any, tokens: Tensor) -> dict[str, Tensor]:
    """Every hook's value on ``tokens`` [1, pos] (detached), and ``"logits"``."""
    store: dict[str, Tensor] = {}

    def keep(t: Tensor, hook: Any) -> None:
        store[hook.name] = t.detach().clone()

    with torch.no_grad():
        store["logits"] = aot.run_with_hooks(tokens, fwd_hooks=[(lambda name: True, keep)]).detach()
    return store


def _path(layer: int, expert: str | None) -> str:
    return f"blocks.{layer}.mlp" + ("" if expert is None else f".experts.{expert}")


def where(name: str) -> tuple[str, int, int | None]:
    """The hook carrying node ``name``'s output, its position and unit (None: the whole residual)."""
    match = NODE.match(name)
    assert match is not None, name
    m_layer, expert, neuron, a_layer, head, _, pos = match.groups()
    if neuron is not None:
        return f"{_path(int(m_layer), expert)}.hook_post", int(pos), int(neuron)
    if head is not None:
        return f"blocks.{a_layer}.attn.hook_z", int(pos), int(head)
    return "blocks.0.hook_resid_pre", int(pos), None


def removed_inputs(
    aot: Any,
    tokens: Tensor,
    clean: dict[str, Tensor],
    removals: Sequence[Sequence[str]],
    freeze_neurons: bool = True,
    freeze_heads: bool = False,
    freeze_attention: bool = True,
) -> dict[str, Tensor]:
    """One batched forward, row ``b`` with removal ``b``'s nodes zeroed: every neuron input hook (``hook_pre`` /
    ``hook_pre_linear``, ``[rows, pos, d_mlp]``) and ``"logits"`` (``unembed.hook_out`` times the clean ratio of the
    logits to it when ``freeze_attention``, else the logits). Frozen at ``clean``: the norm scales and attention
    patterns (``freeze_attention``), every neuron's ``hook_post`` (``freeze_neurons``), every head's ``hook_z``
    (``freeze_heads``)."""
    rows = len(removals)
    batch = tokens.expand(rows, -1)
    zero: dict[str, list[tuple[int, int, int | None]]] = {}
    for b, names in enumerate(removals):
        for name in names:
            hook, pos, unit = where(name)
            zero.setdefault(hook, []).append((b, pos, unit))
    out: dict[str, Tensor] = {}
    hooks: list[tuple[str, Callable[..., Any]]] = []

    def frozen(t: Tensor, hook: Any) -> Tensor:
        if hook.name.endswith(("hook_topk_weights", "hook_expert_indices")):  # [batch·pos, top_k]
            return clean[hook.name].repeat(rows, 1)
        value = clean[hook.name].expand(rows, *clean[hook.name].shape[1:]).clone()
        for b, pos, unit in zero.get(hook.name, []):
            if unit is None:
                value[b, pos] = 0
            else:
                value[b, pos, unit] = 0
        return value

    def zeroed(t: Tensor, hook: Any) -> Tensor:
        t = t.clone()
        for b, pos, unit in zero[hook.name]:
            if unit is None:
                t[b, pos] = 0
            else:
                t[b, pos, unit] = 0
        return t

    def keep(t: Tensor, hook: Any) -> None:
        out[hook.name] = t.detach().clone()

    names = list(aot.hook_dict)
    freeze = []
    if freeze_attention:
        freeze += [n for n in names if n.endswith("hook_scale") or re.match(r"^blocks\.\d+\.attn\.hook_pattern$", n)]
        freeze += [n for n in names if n.endswith(("mlp.hook_topk_weights", "mlp.hook_expert_indices"))]
    if freeze_neurons:
        freeze += [n for n in names if n.endswith(".hook_post") and ".mlp" in n]
    if freeze_heads:
        freeze += [n for n in names if re.match(r"^blocks\.\d+\.attn\.hook_z$", n)]
    hooks += [(n, frozen) for n in freeze]
    hooks += [(n, zeroed) for n in zero if n not in freeze]
    hooks += [(n, keep) for n in names if n.endswith(".hook_pre") or n.endswith(".hook_pre_linear")]
    hooks.append(("unembed.hook_out", keep))
    with torch.no_grad():
        logits = aot.run_with_hooks(batch, fwd_hooks=hooks)
    if freeze_attention:
        raw = clean["unembed.hook_out"]
        ratio = torch.where(raw == 0, torch.ones_like(raw), clean["logits"] / torch.where(raw == 0, 1.0, raw))
        out["logits"] = out.pop("unembed.hook_out") * ratio
    else:
        out["logits"] = logits
    return out
