"""How each per-head hook of a neuron block follows from the block's stored entries (the compact cache's data,
:mod:`lens_aot.core.runtime.cache`), and the dense ``[.., head, query, key]`` scores and pattern of Theorem 3's heads,
which
:class:`~lens_aot.core.components.mlp.neuron_attention.NeuronAttention` computes with the same two functions.

Each head of a neuron block attends to itself (score ``q·k``, with ``k = 0`` on real positions) and to its bias slot
(score ``−q``), Huben & Morris 2023, Theorem 3; so every per-head hook is a fixed function of the neurons'
pre-activations while no hook intervenes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from jaxtyping import Float
from torch import Tensor

__all__ = [
    "DENSE_HOOKS",
    "HeadDerivation",
    "RoutedHeadDerivation",
    "dense_pattern",
    "dense_scores",
    "neuron_head_derivations",
]


def dense_scores(self_score: Float[Tensor, "... pos n_heads"]) -> Float[Tensor, "... n_heads pos pos"]:
    """Scores over the real keys as [..., head, query, key]: each query sees only itself (``hook_attn_scores``)."""
    pos = self_score.shape[-2]
    eye = torch.eye(pos, dtype=torch.bool, device=self_score.device)
    return torch.diag_embed(self_score.transpose(-1, -2)).masked_fill(~eye, float("-inf"))


def dense_pattern(
    scores: Float[Tensor, "... n_heads pos pos"], bias_score: Float[Tensor, "... pos n_heads"]
) -> Float[Tensor, "... n_heads pos pos"]:
    """Softmax over the real keys and the bias slot, returning the real keys' part (``hook_pattern``)."""
    full = torch.cat((scores, bias_score.transpose(-1, -2)[..., None]), dim=-1)
    return torch.softmax(full, dim=-1)[..., :-1]


Family = Literal["neuron", "product"]
# Hooks whose derived value is [batch, head, query, key]: read lazily (core.cache.LazyHeadTensor), per head on indexing.
DENSE_HOOKS = ("hook_attn_scores", "hook_pattern")


class HeadDerivation:
    """How one per-head hook of a neuron block follows from the block's stored entries, as picklable data.

    ``family`` "neuron" (Theorem 3 neuron heads, and gate heads; source ``hook_pre``): head ``h = n·K + t`` has
    ``q = b_t·z_n + d_t``, ``v = α_t·z_n + β_t``; ``coeffs`` holds ``alpha``, ``beta``, ``b``, ``d`` [K].
    "product" (product heads; sources ``hook_pre_linear`` = u, and ``hook_gate`` = h for values and z): head
    ``2n + s`` has ``q = ±ε_n·u_n``, ``v = h_n``; ``coeffs`` holds ``scales`` [d_mlp]. Every head's key on real
    positions is 0 and on the bias slot −1, so its pattern is ``σ(q)`` on the diagonal (the bias slot takes the rest).
    """

    def __init__(self, family: Family, hook: str, coeffs: dict[str, Tensor], heads_per_neuron: int) -> None:
        self.family = family
        self.hook = hook
        self.coeffs = {k: v.detach().clone() for k, v in coeffs.items()}
        self.heads_per_neuron = heads_per_neuron

    def __repr__(self) -> str:
        return f"HeadDerivation({self.family!r}, {self.hook!r}, heads_per_neuron={self.heads_per_neuron})"

    def map(self, fn: Callable[[Tensor], Tensor]) -> HeadDerivation:
        """A copy (of the same class) with ``fn`` applied to every coefficient tensor (device moves, dtype casts)."""
        return type(self)(self.family, self.hook, {k: fn(v) for k, v in self.coeffs.items()}, self.heads_per_neuron)

    def rows(self, source: Tensor) -> Tensor:
        """A stored source entry as the heads ran on it (itself; :class:`RoutedHeadDerivation` reshapes)."""
        return source

    @property
    def dense(self) -> bool:
        """Whether the entry is a [batch, head, query, key] block (read lazily, per head)."""
        return self.hook in DENSE_HOOKS

    def n_heads(self, first: Tensor) -> int:
        return first.shape[-1] * self.heads_per_neuron

    def _neuron_term(self, first: Tensor, heads: Tensor | None) -> tuple[Tensor, Tensor]:
        """Each selected head's neuron and term index (all heads when ``heads`` is None)."""
        if heads is None:
            heads = torch.arange(self.n_heads(first), device=first.device)
        heads = heads.to(first.device)
        return heads // self.heads_per_neuron, heads % self.heads_per_neuron

    def queries(self, first: Tensor, heads: Tensor | None = None) -> Float[Tensor, "... pos k"]:
        """The selected heads' queries (``hook_q`` without its trailing 1)."""
        neuron, term = self._neuron_term(first, heads)
        z = first.index_select(-1, neuron)
        if self.family == "neuron":
            b, d = (self.coeffs[k].to(first.device) for k in ("b", "d"))
            return torch.addcmul(d[term], z, b[term])  # the operation NeuronAttention.queries uses
        scaled = z * self.coeffs["scales"].to(first.device)[neuron]
        return torch.where(term == 1, -scaled, scaled)

    def values(self, source: Tensor, heads: Tensor | None = None) -> Float[Tensor, "... pos k"]:
        """The selected heads' values (``hook_v`` without its trailing 1); ``source`` is ``hook_pre`` or
        (product heads) ``hook_gate``."""
        neuron, term = self._neuron_term(source, heads)
        z = source.index_select(-1, neuron)
        if self.family == "product":
            return z
        alpha, beta = (self.coeffs[k].to(source.device) for k in ("alpha", "beta"))
        return torch.addcmul(beta[term], z, alpha[term])

    def dense_entry(self, first: Tensor, heads: Tensor | None = None) -> Float[Tensor, "... k query key"]:
        """``hook_attn_scores`` / ``hook_pattern`` of the selected heads: ``[..., k, query, key]``."""
        k = self.n_heads(first) if heads is None else heads.numel()
        scores = dense_scores(first.new_zeros(()).expand(*first.shape[:-1], k))
        if self.hook == "hook_attn_scores":
            return scores
        return dense_pattern(scores, -self.queries(first, heads))

    def __call__(self, *sources: Tensor) -> Tensor:
        first = sources[0]
        if self.hook == "hook_q":
            return self.queries(first)[..., None]
        if self.hook == "hook_k":
            return first.new_zeros(*first.shape[:-1], self.n_heads(first), 1)
        if self.hook == "hook_v":
            return self.values(sources[-1])[..., None]
        if self.hook == "hook_z":
            return (torch.sigmoid(self.queries(first)) * self.values(sources[-1]))[..., None]
        if self.dense:
            return self.dense_entry(first)
        raise KeyError(f"no derivation for {self.hook!r}")


def neuron_head_derivations(
    family: Family, coeffs: dict[str, Tensor], heads_per_neuron: int
) -> dict[str, tuple[tuple[str, ...], HeadDerivation]]:
    """The ``derivations()`` of neuron / gate (``family`` "neuron") or product heads: hook -> (sources, how), the
    sources named relative to the MLP holding the heads (``hook_pre``, ``hook_pre_linear``,
    ``product_heads.hook_gate``)."""
    pre = ("hook_pre",) if family == "neuron" else ("hook_pre_linear",)
    value_src = pre if family == "neuron" else ("product_heads.hook_gate",)
    sources = {"hook_v": value_src, "hook_z": pre + value_src if family == "product" else pre}
    hooks = ("hook_q", "hook_k", "hook_v", "hook_attn_scores", "hook_pattern", "hook_z")
    return {h: (sources.get(h, pre), HeadDerivation(family, h, coeffs, heads_per_neuron)) for h in hooks}


class RoutedHeadDerivation(HeadDerivation):
    """A :class:`HeadDerivation` of a source-named mixture-of-experts expert's heads
    (:mod:`lens_aot.core.components.moe.source_expert_hooks`): its sources ``hook_gate`` / ``hook_pre`` are stored as
    the
    source's 2-D ``[routed, d_mlp]``, read as the ``[1, routed, d_mlp]`` the heads ran on, so each derived entry has the
    shape the forward's hook would have had."""

    @classmethod
    def of(cls, how: HeadDerivation) -> RoutedHeadDerivation:
        """``how`` read from routed sources, sharing its coefficient copies (no second copy per cache)."""
        out = cls.__new__(cls)
        out.__dict__.update(how.__dict__)
        return out

    def rows(self, source: Tensor) -> Tensor:
        """The source's 2-D ``[routed, d_mlp]`` entry as the heads' ``[1, routed, d_mlp]``."""
        return source[None] if source.ndim == 2 else source

    def __call__(self, *sources: Tensor) -> Tensor:
        return super().__call__(*(self.rows(s) for s in sources))
