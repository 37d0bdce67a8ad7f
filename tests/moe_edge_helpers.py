"""Ground truth for edge attribution on mixture-of-experts models (tests/test_attribution_moe.py and its
TransformerLens 3.9 twin): inputs whose clean/corrupted difference is small, and the first-order term of a direct
path computed by hand with autograd from the model's public hooks."""

from __future__ import annotations

from typing import Any

import torch

import lens_aot.patching as P


def logit_diff(logits: torch.Tensor) -> torch.Tensor:
    return (logits[:, -1, 3] - logits[:, -1, 7]).mean()


def near_pair(aot: Any, eps: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Clean tokens and corrupted ones that swap two positions of every row for tokens 95 / 96, whose embeddings
    are set to the clean tokens' plus ``eps``-sized noise (so every activation difference is O(eps): path patching
    is linear in it up to O(eps²), the regime whose first-order term edge attribution estimates). The two rows use
    the same swapped clean tokens, so the two new embeddings stand in for both."""
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(1, 90, (2, 8), generator=g)
    clean[1, 2], clean[1, 5] = clean[0, 2], clean[0, 5]
    corrupted = clean.clone()
    corrupted[:, 2], corrupted[:, 5] = 95, 96
    W_E = aot.embed.W_E
    with torch.no_grad():
        for new, old in ((95, clean[0, 2]), (96, clean[0, 5])):
            W_E[new] = W_E[old] + eps * torch.randn(W_E.shape[1], generator=g, dtype=W_E.dtype)
    return clean, corrupted


def expert_senders(aot: Any, shared: bool) -> list[P.PatchUnit]:
    """Layer 0's expert neurons (product pairs, ``L0E{e}N{n}.1+2``): four of experts 1 and 3 (and of the shared
    expert)."""
    modules = ["blocks.0.mlp.experts.1.product_heads", "blocks.0.mlp.experts.3.product_heads"]
    modules += ["blocks.0.mlp.shared_expert.product_heads"] if shared else []
    return [u for m in modules for u in P.head_units(aot, modules=[m])[:4]]


def layer1_receivers(aot: Any, n_experts: int) -> list[P.PatchUnit]:
    """Three neurons of every expert of layer 1, and layer 1's attention heads."""
    experts = [
        u for e in range(n_experts) for u in P.head_units(aot, modules=[f"blocks.1.mlp.experts.{e}.product_heads"])[:3]
    ]
    return [*experts, *P.head_units(aot, modules=["blocks.1.attn"])]


def check_first_order(aot: Any, n_experts: int, shared: bool) -> None:
    """Edges from layer 0's expert neurons into layer 1's expert neurons and attention heads: ``attribute_edges``
    equals ``path_patch`` to first order (relative 1e-2 at eps = 1e-3, the product heads' construction error
    included), through "qv" and "v", noising and denoising, and the paths are not all 0."""
    clean, corrupted = near_pair(aot, 1e-3)
    senders, receivers = expert_senders(aot, shared), layer1_receivers(aot, n_experts)
    for receiver_input, direction in (("qv", "noise"), ("v", "noise"), ("qv", "denoise")):
        args = (aot, clean, corrupted, logit_diff, senders, receivers, receiver_input)
        truth = P.path_patch(*args, direction=direction)
        est = P.attribute_edges(*args, direction=direction)
        assert est.senders == truth.senders and est.receivers == truth.receivers
        t, e = truth.effect(), est.effect()
        scale = float(t.abs().max())
        assert scale > 1e-5, scale  # O(eps) paths, not all 0
        assert float((e - t).abs().max()) <= 1e-2 * scale, (receiver_input, float((e - t).abs().max()), scale)
        assert int((t.abs() > 1e-3 * scale).sum()) >= len(senders)  # many paths carry signal


def hand_direct_edges(aot: Any, clean: torch.Tensor, corrupted: torch.Tensor, senders: list[P.PatchUnit],
                      kv_head: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per sender (layer 0's attention heads and expert neurons): ``Δout_s · ∂metric/∂resid`` for the logits (the
    gradient at the final residual) and for layer 1's key/value head ``kv_head`` through its value (the gradient of
    the metric when only that head's value reads ``resid_pre + t·Δout_s``, at t = 0), on the clean run, by autograd.
    ``Δout_s``: what the sender adds to the residual, corrupted minus clean: ``Δz_h·W_O[h]`` for a head,
    ``w·Δpost_n·W_out[n]`` for an expert's neuron ``n`` (``w`` the clean run's router weight of the expert, 0 where
    it was not chosen; the shared expert's sigmoid gate)."""
    mlp = aot.blocks[0].mlp
    names = ["blocks.0.attn.hook_z", "blocks.0.hook_resid_mid", "blocks.1.hook_resid_pre"]
    names += ["blocks.0.mlp.hook_expert_indices", "blocks.0.mlp.hook_topk_weights"]
    names += [f"blocks.0.mlp.{m}.hook_post" for m in [*(f"experts.{e}" for e in range(mlp.n_experts)), "shared_expert"]]
    caches = []
    for tokens in (clean, corrupted):
        store: dict[str, torch.Tensor] = {}
        hooks = [(n, lambda a, hook, s=store: s.__setitem__(hook.name, a.detach().clone())) for n in names
                 if n in aot.hook_dict]  # fmt: skip
        with torch.no_grad(), aot.hooks(fwd_hooks=hooks):
            aot(tokens)
        caches.append(store)
    base, other = caches
    batch, pos, d_model = base["blocks.0.hook_resid_mid"].shape
    deltas = []
    for unit in senders:
        (ref, *_) = unit.heads
        if ref.name == "blocks.0.attn":
            dz = other["blocks.0.attn.hook_z"][:, :, ref.head] - base["blocks.0.attn.hook_z"][:, :, ref.head]
            deltas.append(dz @ aot.blocks[0].attn.W_O[ref.head].detach())
            continue
        expert_name = ref.name.rsplit(".", 1)[0].removeprefix("blocks.0.mlp.")
        expert, n = aot.get_submodule(ref.name.rsplit(".", 1)[0]), ref.head // 2
        hook = f"blocks.0.mlp.{expert_name}.hook_post"
        dpost = other[hook][..., n] - base[hook][..., n]
        if expert_name == "shared_expert":
            weight = torch.sigmoid(aot.blocks[0].ln2(base["blocks.0.hook_resid_mid"]) @ mlp.W_shared_gate.detach())[
                ..., 0
            ]
        else:
            e = int(expert_name.split(".")[1])
            chosen = base["blocks.0.mlp.hook_expert_indices"] == e
            weight = (base["blocks.0.mlp.hook_topk_weights"] * chosen).sum(-1).reshape(batch, pos)
        deltas.append((weight * dpost)[..., None] * expert.product_heads.W_out[n].detach())
    delta = torch.stack(deltas)  # [sender, batch, pos, d_model]

    kept: dict[str, torch.Tensor] = {}

    def final(act: torch.Tensor, hook: Any) -> torch.Tensor:
        kept["final"] = act
        return act

    with torch.enable_grad(), aot.hooks(fwd_hooks=[("blocks.1.hook_resid_post", final)]):
        value = logit_diff(aot(clean))
        (g_final,) = torch.autograd.grad(value, kept["final"])
    to_logits = torch.einsum("sbpd,bpd->s", delta, g_final)

    attn, ln1 = aot.blocks[1].attn, aot.blocks[1].ln1
    to_v = []
    for s in range(len(senders)):
        t = torch.zeros((), dtype=delta.dtype, requires_grad=True)

        def value_hook(v: torch.Tensor, hook: Any, t: torch.Tensor = t, s: int = s) -> torch.Tensor:
            x = ln1(base["blocks.1.hook_resid_pre"] + t * delta[s])
            new = x @ attn.W_V[kv_head] + attn.b_V[kv_head]
            torch.testing.assert_close(new.detach(), v[:, :, kv_head].detach())  # at t = 0: the model's own value
            v = v.clone()
            v[:, :, kv_head] = new
            return v

        with torch.enable_grad(), aot.hooks(fwd_hooks=[("blocks.1.attn.hook_v", value_hook)]):
            (g,) = torch.autograd.grad(logit_diff(aot(clean)), t)
        to_v.append(g)
    return to_logits.detach(), torch.stack(to_v).detach()
