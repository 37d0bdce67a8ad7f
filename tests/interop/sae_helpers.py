"""Random SAELens SAEs built through SAELens's own config classes, and the bound an SAE-spliced forward is judged
against (the conversion's bound construction applied to the SAE's reconstruction and the logits downstream)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from interop.pairs import Pair


def make_sae(hook_name: str, d_in: int, dtype: torch.dtype, kind: str = "standard", expansion: int = 2) -> Any:
    """A random ``StandardSAE`` or ``JumpReLUSAE`` (a threshold per latent) at ``hook_name`` with ``expansion·d_in``
    latents, O(1) activations, about half of them active; ``hook_z`` SAEs flatten the heads as SAELens's do."""
    sae_lens = pytest.importorskip("sae_lens", reason="sae-lens needs TransformerLens 3.x")
    from sae_lens.saes.sae import SAEMetadata

    config_class, sae_class = {
        "standard": (sae_lens.StandardSAEConfig, sae_lens.StandardSAE),
        "jumprelu": (sae_lens.JumpReLUSAEConfig, sae_lens.JumpReLUSAE),
    }[kind]
    cfg = config_class(
        d_in=d_in,
        d_sae=expansion * d_in,
        dtype=str(dtype).removeprefix("torch."),
        metadata=SAEMetadata(hook_name=hook_name),
        reshape_activations="hook_z" if hook_name.endswith("hook_z") else "none",
    )
    generator = torch.Generator().manual_seed(sum(map(ord, hook_name)) + len(kind))
    sae = sae_class(cfg)
    with torch.no_grad():
        for name, p in sae.named_parameters():
            noise = torch.randn(p.shape, generator=generator, dtype=torch.float64)
            if name == "threshold":  # Gemma Scope's JumpReLU: a positive threshold per latent
                p.copy_(0.05 + 0.1 * noise.abs())
            elif name.startswith("b_"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(noise / p.shape[0] ** 0.5)
    return sae.eval()


def spliced(sae: Any, tokens: Tensor) -> Any:
    """``quantity(model, fwd_hooks)`` for :meth:`Pair.bound_for`: the SAE's input and reconstruction, spliced in at
    its hook name with ``run_with_hooks`` (after ``fwd_hooks`` on that hook), and the logits downstream."""

    def run(model: Any, fwd_hooks: list[tuple[str, Any]]) -> Tensor:
        seen: list[Tensor] = []

        def splice(act: Tensor, hook: Any) -> Tensor:
            seen.extend([act.detach().clone(), sae(act).detach()])
            return seen[-1]

        with torch.no_grad(), model.hooks(fwd_hooks=[*fwd_hooks, (sae.cfg.metadata.hook_name, splice)]):
            logits = model(tokens)
        return torch.cat([seen[0].flatten(), seen[1].flatten(), logits.flatten()])

    return run


def sae_bound(pair: Pair, sae: Any) -> float:
    """The bound for the SAE's input, its reconstruction and the logits downstream:
    ``max(logit bound, 8·S_q + 4·R_q)``."""
    return max(pair.logit_bound, pair.bound_for(spliced(sae, pair.tokens)))


def with_sae(model: Any, pair: Pair, sae: Any) -> tuple[Tensor, Tensor, Tensor]:
    """Logits, reconstruction and latents of ``model`` with ``sae`` spliced in by hook name (its own ``encode`` /
    ``decode``: what SAELens's ``run_with_saes`` does, without SAELens's model class)."""
    seen: dict[str, Tensor] = {}

    def splice(act: Tensor, hook: Any) -> Tensor:
        seen["acts"] = sae.encode(act)
        seen["recon"] = sae.decode(seen["acts"])
        return seen["recon"]

    with torch.no_grad():
        logits = model.run_with_hooks(pair.tokens, fwd_hooks=[(sae.cfg.metadata.hook_name, splice)])
    return logits, seen["recon"], seen["acts"]
