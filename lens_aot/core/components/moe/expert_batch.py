"""A mixture of experts' routed neuron heads in one chunked pass per layer (CPU float32 / float64; issue 22).

Each routed expert of a :class:`~lens_aot.core.components.moe.moe_mlp.MoEMLP` is a gated
:class:`~lens_aot.core.components.mlp.neuron_mlp.NeuronMLP`: gate heads then product heads (Huben & Morris 2023,
Theorem 3 per neuron), each run on the expert's own routed rows. While nothing observes an expert (no hook, pre-hook or
wrapped ``forward`` anywhere in it, no global module hook, no gradient, no ``use_attn_result``, not fused) and its
heads would take the chunked path
(:meth:`~lens_aot.core.components.mlp.self_and_slot_heads.SelfAndSlotHeads._packable`),
:func:`expert_outputs` runs every such expert's gate heads in one loop, with the per-call constants laid out once for
all experts (one ``stack`` of every expert's fit terms, one output buffer, one ``split``) instead of once per head
module: the same operations per chunk, fewer per expert. The product heads' output is the closed form ``u·h``, as on
their own unobserved path (:meth:`~lens_aot.core.components.mlp.product_attention.ProductAttention.attend`): nothing can
see their per-head tensors, so they are not computed.

**Bitwise the same values.** The row chunks are each expert's own
(:func:`~lens_aot.core.components.attention.head_chunks.chunk_rows` of its row count, never crossing an expert's
boundary), and
each chunk is computed by the same kernels on tensors of the same shape, strides and constants (each expert's own fit
terms) as that expert's own call, so every element is computed exactly as before
(:mod:`~lens_aot.core.components.attention.head_chunks` explains why the partition matters). The expert's weights,
hooks (run,
unhooked, in the expert's own order) and ``W_out`` product are its own; the caller sums in expert order as before.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from itertools import repeat

import torch
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from lens_aot.core.components.attention.head_chunks import chunk_rows, chunked
from lens_aot.core.components.mlp.neuron_attention import NeuronAttention, SelfAndSlotHeads
from lens_aot.core.components.mlp.neuron_mlp import NeuronMLP
from lens_aot.core.components.moe.source_expert_hooks import RoutedHookPoint
from lens_aot.core.components.workspace import global_hooks, scratch

PLAIN_HOOK_POINTS = (HookPoint, RoutedHookPoint)  # identities while unhooked: a quiet pass need not call them


class Watch:
    """Every module of some experts, gathered once, so that :meth:`unseen` tells whether anything can observe them by a
    few passes over their hook dictionaries in C (issue 22: at 64 small experts per layer, walking each expert's
    ``modules()`` on every forward cost as much as its arithmetic).

    What can observe an expert: a hook or pre-hook (forward or backward) on any of its modules, hook points included;
    a wrapped ``forward`` on an instance (nnsight installs its controller there); a global module hook; or a module
    that is not one of the expert's own kinds (a :class:`NeuronMLP`, its head modules and plain hook points, e.g. an
    SAE spliced in at a hook point's name), found when the modules are gathered. :meth:`intact` tells whether the
    experts' module tree is still the one gathered: a module replaced or removed anywhere in it is seen (one added
    under a new name is never called by the experts' forward)."""

    def __init__(self, experts: Sequence[nn.Module]) -> None:
        self.experts = tuple(experts)
        modules = [m for expert in self.experts for m in expert.modules()]
        links = [(m._modules, name, child) for m in modules for name, child in m._modules.items()]
        self._links = tuple(zip(*links, strict=True)) if links else ((), (), ())
        hook_dicts = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
        self._hooks = tuple(getattr(m, name) for m in modules for name in hook_dicts if hasattr(m, name))
        self._instances = tuple(m.__dict__ for m in modules)
        self._own_kinds = all(
            isinstance(m, NeuronMLP | SelfAndSlotHeads) or type(m) in PLAIN_HOOK_POINTS for m in modules
        )

    def intact(self, experts: Sequence[nn.Module]) -> bool:
        """Whether ``experts`` are the gathered ones and each module still holds its gathered children."""
        parents, names, children = self._links
        return (
            len(experts) == len(self.experts)
            and all(map(operator.is_, experts, self.experts))
            and all(map(operator.is_, map(dict.get, parents, names), children))
        )

    def unseen(self) -> bool:
        """Whether nothing can observe the experts' computation (the class docstring)."""
        return (
            self._own_kinds
            and not any(self._hooks)
            and not any(map(operator.contains, self._instances, repeat("forward")))
            and not global_hooks()
        )


def unseen(expert: nn.Module) -> bool:
    """Whether nothing can observe ``expert``'s computation (:meth:`Watch.unseen`)."""
    return Watch([expert]).unseen()


def batchable(expert: nn.Module, rows: int, like: Tensor, quiet: bool = False) -> bool:
    """Whether ``expert`` on ``rows`` routed rows (of ``like``'s dtype and device) may join the layer's batched pass:
    a gated :class:`NeuronMLP` with the standard forward, not fused, unobserved (:func:`unseen`), no gradient, and
    both head modules on their chunked path (CPU float32 / float64, at least ``PACKED_MIN_ELEMENTS`` per-head
    elements, as :meth:`~lens_aot.core.components.mlp.self_and_slot_heads.SelfAndSlotHeads._packable` decides).
    ``quiet``:
    the caller found that nothing observes any of the layer's experts (:meth:`Watch.unseen`) and that no gradient is
    recorded (:meth:`~lens_aot.core.components.moe.moe_mlp.MoEMLP.quiet`), so any number of rows from 1 is admitted
    (:func:`expert_outputs` computes them bitwise as the expert's own forward at every size)."""
    if not isinstance(expert, NeuronMLP) or not expert.gated or expert.use_fused:
        return False
    if type(expert).forward is not NeuronMLP.forward or type(expert)._gated_post is not NeuronMLP._gated_post:
        return False
    if type(expert)._scratch_value is not NeuronMLP._scratch_value:  # a chained gate (gated relu²): its own stage
        return False
    gate, product = expert.gate_heads, expert.product_heads
    if not chunked(like) or gate.use_attn_result or product.use_attn_result:
        return False
    if quiet:
        return rows > 0
    if min(rows * gate.n_heads, rows * product.n_heads) < gate.PACKED_MIN_ELEMENTS:
        return False
    if torch.is_grad_enabled() and (like.requires_grad or any(p.requires_grad for p in expert.parameters())):
        return False
    return unseen(expert)


def admitted(experts: list[nn.Module], rows: list[int], like: Tensor, quiet: bool = False) -> list[bool]:
    """Which experts :func:`expert_outputs` computes together: those :func:`batchable` admits with the first admitted
    one's ``d_mlp`` and terms per neuron (its fit's shape), if there are at least two; none otherwise."""
    ok = [batchable(e, r, like, quiet) for e, r in zip(experts, rows, strict=True)]
    if any(ok):
        first = experts[ok.index(True)]
        shape = (first.d_mlp, first.gate_heads.heads_per_neuron)
        ok = [o and (e.d_mlp, e.gate_heads.heads_per_neuron) == shape for o, e in zip(ok, experts, strict=True)]
    return ok if sum(ok) >= 2 else [False] * len(experts)


def expert_outputs(
    experts: list[NeuronMLP], xs: list[Float[Tensor, "rows d_model"]], quiet: bool = False
) -> list[Tensor]:
    """``expert(x)`` ([rows, d_model]) for each expert that :func:`admitted` admits and its routed rows, bitwise as the
    expert's own forward on ``x[None]``: :meth:`NeuronMLP.forward`, with the gate heads of every expert in one chunked
    pass and the product heads' closed form. The matrix products run on the [rows, d] inputs themselves (the same
    ``mm`` that ``[1, rows, d] @ W`` folds to). ``quiet`` (:meth:`Watch.unseen` held for every expert): the experts'
    hook points are not called (plain and unhooked, each returns its input)."""
    if not experts:
        return []
    inputs = [expert._gated_inputs(x, quiet=quiet) for expert, x in zip(experts, xs, strict=True)]
    pres, us = [pre for pre, _ in inputs], [u for _, u in inputs]
    h_all = _gate_pass([e.gate_heads for e in experts], pres)
    hs = h_all.split([p.shape[0] for p in pres])
    outs = []
    for expert, u, h in zip(experts, us, hs, strict=True):  # NeuronMLP._gated_post's and forward's, no result change
        product = expert.product_heads
        h = h if quiet else product.hook_gate(h)  # unhooked: the same tensor (an unseen expert)
        product.check_range(u, h)
        post = expert._standard_post(u, h)
        outs.append((post if quiet else expert.hook_post(post)) @ expert.W_out + expert.b_out)
    return outs


def _gate_pass(gates: list[NeuronAttention], pres: list[Tensor]) -> Float[Tensor, "rows d_mlp"]:
    """Every expert's gate activations ``h``, stacked in the experts' order, as
    :meth:`NeuronAttention.attend_and_sum`'s chunked path computes them: per chunk of each expert's rows (its own
    :func:`chunk_rows`), ``v`` and ``q`` by one ``addcmul`` with its terms laid out per head (K > 1: ``pre`` repeated
    K times first), one ``glu``, and (K > 1) the sum over a neuron's K heads as one ``mv``."""
    d, K = gates[0].d_mlp, gates[0].heads_per_neuron
    n_heads = d * K
    rows = [p.shape[0] for p in pres]
    steps = [chunk_rows(r, n_heads) for r in rows]
    sizes = [min(s, r - start) for r, s in zip(rows, steps, strict=True) for start in range(0, r, s)]
    # every expert's [v offsets, q offsets, v slopes, q slopes] laid out per head (NeuronAttention.packed_writer's)
    # (every expert's offsets, then every expert's slopes): [2, 1, n_heads] each, from one stack, repeat and unbind
    terms = [t for g in gates for t in (g.term_beta, g.term_d)] + [t for g in gates for t in (g.term_alpha, g.term_b)]
    per_expert = torch.stack(terms).repeat(1, d).view(2 * len(gates), 2, 1, n_heads).unbind(0)
    out = pres[0].new_empty((1, sum(rows), d))
    buffers: dict[int, tuple[Tensor, ...]] = {}
    if K == 1:
        z_parts = out.split(sizes, dim=1)  # the chunks' z is their h, written in place
    else:
        ones, outs = pres[0].new_ones(K), out.view(-1).split([n * d for n in sizes])
    chunk = 0
    for e, (pre, step) in enumerate(zip(pres, steps, strict=True)):
        offsets, slopes = per_expert[e], per_expert[len(gates) + e]
        for q_in in pre.split(step) if K == 1 else pre.unsqueeze(-1).split(step):
            n = q_in.shape[0]
            if n not in buffers:
                qv = scratch("neuron_heads.qv", (2, n, n_heads), pre)
                if K == 1:
                    buffers[n] = (qv,)
                else:
                    flat = scratch("neuron_heads.pre", (n, n_heads), pre)
                    z = scratch("neuron_heads.z_rows", (1, n, n_heads), pre)
                    buffers[n] = (qv, flat, flat.view(n, d, K), z, z.view(n * d, K))
            if K == 1:
                qv = buffers[n][0]
                torch.addcmul(offsets, q_in, slopes, out=qv)
                torch.ops.aten.glu.out(qv, 0, out=z_parts[chunk])
            else:
                qv, flat, per_term, z, terms_view = buffers[n]
                per_term.copy_(q_in)
                torch.addcmul(offsets, flat, slopes, out=qv)
                torch.ops.aten.glu.out(qv, 0, out=z)
                torch.mv(terms_view, ones, out=outs[chunk])
            chunk += 1
    return out[0]
