"""A sparse mixture-of-experts MLP whose experts' neurons are neuron heads (Huben & Morris 2023, Theorem 3, per expert).

``blocks.{l}.mlp`` of a converted MoE source (:class:`~lens_aot.core.spec.model_spec.MoESpec`: Mixtral, Qwen2-MoE,
OLMoE,
TransformerLens's ``MoE``). Each expert is a neuron-wise (gated) MLP, so each is a
:class:`~lens_aot.core.components.mlp.neuron_mlp.NeuronMLP` of neuron heads (gate heads and product heads, exactly the
dense layers' construction), ``experts.{e}``; Qwen2-MoE's shared expert is ``shared_expert``. The router is kept as
the source computes it, and each expert's output is scaled by its router weight at that position (0 where the
expert is not chosen): ``out = Σ_e w_e(x)·expert_e(x) [+ σ(x·W_shared_gate)·shared(x)]``, summed in expert order like
the source, so the sum is the source's MoE output.

Cost follows top-k, as in the source: an expert runs on the tokens routed to it only (``index_select`` /
``index_add``; the tokens are grouped by expert with one sort, :meth:`MoEMLP.token_groups`). While any hook point
inside an expert is hooked (caching, patching, attribution), that expert runs on every position instead, so its
hooks have the dense-MLP shapes ``[batch, pos, ...]`` (patchable between runs that route differently); its output at
an unchosen position is multiplied by weight 0. The value at every chosen position is the same either way. While
nothing can observe any expert (:meth:`MoEMLP.quiet`, :class:`~lens_aot.core.components.moe.expert_batch.Watch`), the
experts run in one quiet pass that calls none of their hook points (unhooked, each would return its input), bitwise
the per-expert values. A
TransformerLens 3.9 ``MoE`` / ``GptOssMoE`` source's experts (``MoESpec.hook_names``) stay routed while hooked, with
the source's hooks and shapes, and run densely only within
:func:`~lens_aot.core.components.moe.source_expert_hooks.dense_expert_hooks` (lens_aot's own tools).

Hooks (TransformerLens 3.9's ``MoE`` names where it has them, with its flat ``[batch·pos, ...]`` shapes):
``hook_router_logits`` [batch·pos, n_experts], ``hook_expert_weights`` [batch·pos, n_experts] (the softmax over all
experts, before top-k, as TransformerLens's), ``hook_expert_indices`` [batch·pos, top_k], ``hook_topk_weights``
[batch·pos, top_k] (the chosen experts' weights, after renormalisation: what scales each expert); per expert
``experts.{e}.hook_pre`` / ``hook_pre_linear`` / ``hook_post`` (the dense gated MLP's names: gate pre-activation,
linear branch, product; a TransformerLens 3.9 source's instead: ``hook_gate`` the gate pre-activation, ``hook_pre``
the linear branch, ``hook_post``, each ``[routed, d_mlp]``, :mod:`~lens_aot.core.components.moe.source_expert_hooks`),
``experts.{e}.hook_out`` [.., d_model] (the expert's output before its router weight) and the neuron heads' own
hooks.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from lens_aot.core.components.attention.head_chunks import chunked
from lens_aot.core.components.moe import expert_batch
from lens_aot.core.components.moe.moe_router import build_router, router_logits
from lens_aot.core.components.moe.moe_routers import router_logits as group_router_logits
from lens_aot.core.components.moe.moe_routers import router_scores, select_experts
from lens_aot.core.components.moe.source_expert_hooks import (
    HOOK_NAMES,
    LENS_AOT,
    TL_MOE,
    name_like_source,
    routed_hooks,
    source_named_derivations,
)
from lens_aot.core.components.ownership import exported, parameter
from lens_aot.core.components.token_ids import current_token_ids
from lens_aot.core.spec.model_spec import MLPSpec, MoESpec
from lens_aot.errors import IndexRangeError, InputError
from lens_aot.hooks import hooked

SHARED = "shared_expert"
# each layer's Watch, beside the module rather than in it: a copy or a pickle of the model gathers its own
_WATCHES: weakref.WeakKeyDictionary[nn.Module, expert_batch.Watch] = weakref.WeakKeyDictionary()


def _rows_of(out: Float[Tensor, "tokens d_model"]) -> Float[Tensor, "1 tokens d_model"]:
    """``out`` as ``[1, tokens, d_model]`` (the rows an expert's ``index_add_`` on dim 1 writes), a view taken at the
    time of the write. A view kept from before an earlier in-place write with a gradient (a densely run expert's
    ``out.add_``, a batched expert's ``out.index_add_``) would still report itself a leaf that requires grad, and a
    second in-place write through it raises "a leaf Variable that requires grad is being used in an in-place
    operation" (gradient runs: attribution with an expert's neuron head as a receiver)."""
    return out[None]


class MoEMLP(nn.Module):
    """Router + experts (each built by ``build_expert(mlp_spec, expert)``: neuron heads in a converted model, a plain
    :class:`~lens_aot.core.components.mlp.mlp.MLP` in the reference), with the source's routing and sum."""

    def __init__(self, spec: MoESpec, build_expert: Callable[[MLPSpec, int | None], nn.Module]) -> None:
        super().__init__()
        self.top_k = int(spec.top_k)
        self.n_experts = spec.n_experts
        if not 1 <= self.top_k <= self.n_experts:
            raise InputError(f"top_k must be in 1..{self.n_experts} (the number of experts); got {self.top_k}")
        self.norm_topk_prob = bool(spec.norm_topk_prob)
        self.softmax_dtype = spec.softmax_dtype
        self.W_gate = parameter(spec.W_router)  # TransformerLens's name for the router, [d_model, n_experts]
        self.logits_dtype = spec.logits_dtype
        self.router = build_router(spec)  # the scoring rule, choice and weights (components/moe/moe_router.py)
        self.b_gate = None if spec.b_router is None else parameter(spec.b_router)
        # a DeepSeek router (lens_aot.core.components.moe.moe_routers); its selection bias is a buffer, as in the source
        self.group_router = None if spec.router is None else replace(spec.router, e_score_correction_bias=None)
        if spec.router is not None and spec.router.e_score_correction_bias is not None:
            self.register_buffer("e_score_correction_bias", spec.router.e_score_correction_bias.detach().clone())
        self.d_mlp = spec.d_mlp
        self.act_fn = spec.act_fn
        self.gated = spec.gated
        self.hook_router_logits = HookPoint()  # [batch·pos, n_experts]
        self.hook_expert_weights = HookPoint()  # [batch·pos, n_experts]
        self.hook_expert_indices = HookPoint()  # [batch·pos, top_k]
        self.hook_topk_weights = HookPoint()  # [batch·pos, top_k]
        self.experts = nn.ModuleList(build_expert(mlp, e) for e, mlp in enumerate(spec.experts))
        if spec.hook_names not in HOOK_NAMES:
            raise InputError(f"MoE hook_names must be one of {HOOK_NAMES}; got {spec.hook_names!r}")
        self.hook_names = spec.hook_names  # the experts' hook names (source_expert_hooks.py)
        self.dense_hooks = spec.hook_names == LENS_AOT  # whether a hooked expert runs on every position
        for e, expert in enumerate(self.experts):
            if spec.hook_names != LENS_AOT:
                name_like_source(expert, f"MoE expert {e}")
            expert.add_module("hook_out", HookPoint())  # [.., d_model]: the expert's output, before its weight
        self._routed_hooks = [routed_hooks(expert) for expert in self.experts]
        if spec.shared is not None:
            self.shared_expert = build_expert(spec.shared, None)
            self.shared_expert.add_module("hook_out", HookPoint())
            self.W_shared_gate = None if spec.W_shared_gate is None else parameter(spec.W_shared_gate)
        self.b_moe = None if spec.b_out is None else parameter(spec.b_out)  # JetMoE's output bias
        # DeepSeek-V4's hash-routed layers: the experts of each token id ([d_vocab, top_k]; None: routed by scores)
        if spec.hash_table is not None and not hasattr(self.router, "choose_from_table"):
            raise InputError(f"hash routing needs a router that weighs given experts; {spec.scoring!r} does not")
        self.register_buffer("hash_table", None if spec.hash_table is None else spec.hash_table.detach().clone())

    # ---- routing ----
    def route(self, flat: Float[Tensor, "tokens d_model"]) -> tuple[torch.Tensor, Float[Tensor, "tokens top_k"]]:
        """The chosen experts ``[tokens, top_k]`` and their weights (activation dtype), through the router hooks.
        Ties: ``torch.topk`` on the same probabilities as the source's own call, so the same experts are chosen."""
        if (
            self.group_router is not None
        ):  # a DeepSeek router (lens_aot.core.components.moe.moe_routers), its hooks at the same points
            logits = self.hook_router_logits(group_router_logits(flat, self.W_gate))
            scores = self.hook_expert_weights(router_scores(self.group_router, logits))
            bias = getattr(self, "e_score_correction_bias", None)
            router = replace(self.group_router, e_score_correction_bias=bias)
            indices, weights = select_experts(router, scores, self.top_k)
            return self.hook_expert_indices(indices), self.hook_topk_weights(weights.to(flat.dtype))
        logits = self.hook_router_logits(router_logits(flat, self.W_gate, self.logits_dtype, self.b_gate))
        probs = self.hook_expert_weights(self.router.scores(logits))
        if self.hash_table is not None:  # DeepSeek-V4's hash routing: the experts of each token id
            name = self.hook_expert_indices.name or ""  # blocks.{l}.mlp.hook_expert_indices
            layer = name.split(".")[1] if name.startswith("blocks.") else "?"
            tokens = current_token_ids(f"MoE layer {layer}")
            indices, weights = self.router.choose_from_table(probs, self.hash_table, tokens)
        else:
            indices, weights = self.router.choose(probs)
        indices = self.hook_expert_indices(indices)
        return indices, self.hook_topk_weights(weights.to(flat.dtype))

    def runs_densely(self, expert: nn.Module) -> bool:
        """Whether ``expert`` runs on every position (a hook point inside it is hooked, and :attr:`dense_hooks`:
        always for lens_aot's names, within :func:`dense_expert_hooks` for a TransformerLens source's), not only on
        its tokens."""
        return self.dense_hooks and hooked(*(m for m in expert.modules() if isinstance(m, HookPoint)))

    def token_groups(
        self, indices: Int[Tensor, "tokens top_k"], weights: Float[Tensor, "tokens top_k"]
    ) -> tuple[tuple[Int[Tensor, " routed"], ...], tuple[Float[Tensor, "routed 1"], ...]]:
        """Per expert, the tokens routed to it and their router weights, slot-major (the order of the source's
        ``one_hot(...).permute`` / ``torch.where``, so ``index_add_`` sums in the source's order): one stable sort of
        the ``top_k·tokens`` choices by expert and one host read of the counts, instead of a mask and a
        ``nonzero`` (a sync on a GPU) per expert."""
        n_tokens = indices.shape[0]
        choice = indices.T.reshape(-1)  # slot-major: entry s·tokens + t is (token t, slot s)
        order = torch.sort(choice, stable=True).indices
        counts = torch.bincount(choice, minlength=self.n_experts).tolist()
        tokens = (order % n_tokens).split(counts)
        # weights.T.reshape(-1)[order] without the copy, as [routed, 1] (broadcasting over d_model)
        return tokens, weights.T.take(order[:, None]).split(counts)

    # ---- forward ----
    input_scaled = False  # the router weight scales each expert's output (InputScaledMoEMLP: its input)

    def weighted(
        self, expert: nn.Module, x: Float[Tensor, "batch pos d_model"], weight: Float[Tensor, "*batch pos 1"]
    ) -> Float[Tensor, "batch pos d_model"]:
        """One expert's routed contribution: its output (through ``hook_out``) times its router weight."""
        return self.expert_output(expert, expert(self.expert_input(x, weight)), weight)

    def expert_input(
        self, x: Float[Tensor, "*batch pos d_model"], weight: Float[Tensor, "*batch pos 1"]
    ) -> Float[Tensor, "*batch pos d_model"]:
        """What an expert reads: ``x`` (:class:`InputScaledMoEMLP`: ``x`` times the router weight)."""
        return x

    def expert_output(
        self, expert: nn.Module, y: Float[Tensor, "*batch pos d_model"], weight: Float[Tensor, "*batch pos 1"]
    ) -> Float[Tensor, "*batch pos d_model"]:
        """An expert's contribution from its output ``y``: through ``hook_out``, then :meth:`scaled_output`."""
        return self.scaled_output(expert.hook_out(y), weight)

    def scaled_output(
        self, y: Float[Tensor, "*batch pos d_model"], weight: Float[Tensor, "*batch pos 1"]
    ) -> Float[Tensor, "*batch pos d_model"]:
        """An expert's output times its router weight (:class:`InputScaledMoEMLP`: unscaled)."""
        return y * weight

    def quiet(self, flat: Float[Tensor, "tokens d_model"]) -> bool:
        """Whether nothing can observe any expert (:class:`~lens_aot.core.components.moe.expert_batch.Watch`, gathered
        once
        and again whenever the experts' module tree changes) and no gradient is recorded, on CPU float32 / float64: the
        experts then run without calling their hook points, in one batched pass (:meth:`routed_batched`)."""
        if torch.is_grad_enabled() or not chunked(flat):
            return False
        experts = [expert for _, expert in self.expert_modules()]
        watch = _WATCHES.get(self)
        if watch is None or not watch.intact(experts):
            watch = _WATCHES[self] = expert_batch.Watch(experts)
        return watch.unseen()

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        batch, pos, d_model = x.shape
        flat = x.reshape(-1, d_model)
        joined: list[Tensor] = []  # the shared expert's output, when it joined the routed experts' batched pass
        out = self.routed(x, *self.route(flat), shared_out=joined if hasattr(self, "shared_expert") else None)
        if hasattr(self, "shared_expert"):
            y = joined[0] if joined else self.shared_expert(x)
            shared = self.shared_expert.hook_out(y).reshape(-1, d_model)
            if self.W_shared_gate is not None:
                shared = torch.sigmoid(flat @ self.W_shared_gate) * shared
            out = out + shared
        out = out.reshape(batch, pos, d_model)
        return out if self.b_moe is None else out + self.b_moe

    def routed(
        self,
        x: Float[Tensor, "batch pos d_model"],
        indices: Int[Tensor, "tokens top_k"],
        weights: Float[Tensor, "tokens top_k"],
        shared_out: list[Tensor] | None = None,
    ) -> Float[Tensor, "tokens d_model"]:
        """``Σ_k w_k·expert_{e_k}(x)`` per token (flat), summed in expert order as the source's ``index_add_``.
        ``shared_out``: a list to which the shared expert's output on every token ([tokens, d_model], before
        ``hook_out``) is appended when it joined the routed experts' batched pass (:meth:`routed_batched`)."""
        batch, pos, d_model = x.shape
        flat = x.reshape(-1, d_model)
        out = flat.new_zeros(flat.shape)
        rows = flat[None]  # [1, batch·pos, d_model]: the routed tokens' rows, gathered on dim 1
        dense_weights: Tensor | None = None
        groups: tuple[tuple[Tensor, ...], tuple[Tensor, ...]] | None = None
        quiet = self.quiet(flat)  # nothing can observe any expert, so none is hooked to run densely
        plan = [False] * self.n_experts if quiet else [self.runs_densely(expert) for expert in self.experts]
        for e, dense in enumerate(plan):
            for hook in self._routed_hooks[e]:
                hook.routed = not dense
        if not any(plan) and chunked(flat):  # every expert on its rows: the heads batched where unobserved
            groups = self.token_groups(indices, weights)
            return self.routed_batched((flat, rows), out, *groups, shared_out, quiet)
        for e, expert in enumerate(self.experts):
            dense = plan[e]
            if dense:
                if dense_weights is None:
                    dense_weights = weights.new_zeros(flat.shape[0], self.n_experts).scatter(1, indices, weights)
                y = self.weighted(expert, x, dense_weights[:, e].reshape(batch, pos, 1))
                out.add_(y.reshape(-1, d_model))
                continue
            if groups is None:
                groups = self.token_groups(indices, weights)
            token, weight = groups[0][e], groups[1][e]
            if token.numel() == 0 and self.hook_names != TL_MOE:  # TransformerLens's MoE runs it on 0 rows
                continue
            _rows_of(out).index_add_(1, token, self.weighted(expert, rows.index_select(1, token), weight))
        return out

    def routed_batched(
        self,
        inputs: tuple[Float[Tensor, "tokens d_model"], Float[Tensor, "1 tokens d_model"]],
        out: Float[Tensor, "tokens d_model"],
        tokens: tuple[Int[Tensor, " routed"], ...],
        weights: tuple[Float[Tensor, "routed 1"], ...],
        shared_out: list[Tensor] | None = None,
        quiet: bool = False,
    ) -> Float[Tensor, "tokens d_model"]:
        """:meth:`routed` with every expert on its own rows: the experts' outputs by
        :func:`~lens_aot.core.components.moe.expert_batch.expert_outputs` (the unobserved experts' neuron heads in one
        chunked pass per head kind, bitwise each expert's own values), summed by ``index_add_`` in expert order as
        :meth:`routed` does. ``quiet`` (:meth:`quiet`): every expert joins that pass whatever its number of rows, and
        no hook point is called."""
        flat, rows = inputs  # the tokens' rows, flat and as [1, tokens, d_model]
        run = [e for e in range(self.n_experts) if tokens[e].numel() or self.hook_names == TL_MOE]
        experts, counts = [self.experts[e] for e in run], [tokens[e].numel() for e in run]
        if shared_out is not None:  # the shared expert (last, as it runs after them) on every token
            experts, counts = [*experts, self.shared_expert], [*counts, out.shape[0]]
        together = expert_batch.admitted(experts, counts, rows, quiet)
        batched = [i for i, ok in enumerate(together) if ok]
        xs = [flat if i == len(run) else self.expert_input(flat.index_select(0, tokens[run[i]]), weights[run[i]])
              for i in batched]  # fmt: skip
        ys = dict(zip(batched, expert_batch.expert_outputs([experts[i] for i in batched], xs, quiet), strict=True))
        if shared_out is not None and len(run) in ys:
            shared_out.append(ys[len(run)])
        for i, e in enumerate(run):
            expert, token, weight = self.experts[e], tokens[e], weights[e]
            if i in ys and quiet:  # hook_out is a plain, unhooked hook point: not called
                out.index_add_(0, token, self.scaled_output(ys[i], weight))
            elif i in ys:  # [routed, d_model]: the values of [1, routed, d_model] (the same mm and elementwise ops)
                out.index_add_(0, token, self.expert_output(expert, ys[i], weight))
            else:
                _rows_of(out).index_add_(1, token, self.weighted(expert, rows.index_select(1, token), weight))
        return out

    # ---- the experts' parts, for the model's maps, the cache and revert ----
    def expert_modules(self) -> list[tuple[str, nn.Module]]:
        """``(attribute, expert)``: ``experts.{e}``, then ``shared_expert``."""
        out = [(f"experts.{e}", expert) for e, expert in enumerate(self.experts)]
        return out + ([(SHARED, self.shared_expert)] if hasattr(self, "shared_expert") else [])

    def expert(self, expert: int | str | None) -> nn.Module:
        """Expert ``expert`` (an index, or ``"shared"`` for the shared expert); raises for anything else."""
        if expert == "shared":
            if not hasattr(self, "shared_expert"):
                raise InputError("this MoE layer has no shared expert")
            return self.shared_expert
        if isinstance(expert, bool) or not isinstance(expert, int) or not 0 <= expert < self.n_experts:
            raise InputError(
                f"expert must be 0..{self.n_experts - 1}"
                + (" or 'shared'" if hasattr(self, "shared_expert") else "")
                + f" for an MoE layer; got {expert!r}"
            )
        return self.experts[expert]

    def head_modules(self) -> list[tuple[str, nn.Module]]:
        """``(attribute, module)`` of every expert's neuron-head modules (e.g. ``experts.3.gate_heads``)."""
        return [
            (f"{name}.{attr}", heads)
            for name, expert in self.expert_modules()
            for attr, heads in getattr(expert, "head_modules", list)()
        ]

    @property
    def use_fused(self) -> bool:
        return all(getattr(expert, "use_fused", False) for _, expert in self.expert_modules())

    @use_fused.setter
    def use_fused(self, value: bool) -> None:
        for _, expert in self.expert_modules():
            if expert.use_fused != value:  # nn.Module.__setattr__ only where it changes
                expert.use_fused = value

    @property
    def b_out(self) -> Float[Tensor, " d_model"]:
        """The MoE's constant output: its output bias (JetMoE's), else 0 (its experts have no output bias; a biased
        expert's bias is routed)."""
        biases = [expert.b_out for _, expert in self.expert_modules()]
        if any(bool(b.detach().ne(0).any()) for b in biases):
            raise InputError("this MoE layer's experts have output biases, which are routed: it has no constant b_out")
        return self.W_gate.new_zeros(self.W_gate.shape[0]) if self.b_moe is None else self.b_moe

    def internal_hooks(self) -> tuple[HookPoint, ...]:
        return tuple(h for _, expert in self.expert_modules() for h in getattr(expert, "internal_hooks", tuple)())

    def derivations(self) -> dict[str, tuple[tuple[str, ...], Any]]:
        """For the compact cache: each expert's derivations, named relative to this MoE layer (a source-named
        expert's: from its ``hook_gate`` / ``hook_pre``, read as the ``[1, routed, d_mlp]`` its heads ran on)."""
        out = {
            f"{name}.{hook}": (tuple(f"{name}.{x}" for x in inputs), how)
            for name, expert in self.expert_modules()
            for hook, (inputs, how) in getattr(expert, "derivations", dict)().items()
        }
        return out if self.hook_names == LENS_AOT else source_named_derivations(out)

    def neuron_heads(self, neuron: int, expert: int | str | None = None) -> list[tuple[str, int]]:
        """``(attribute, head)`` of the heads computing ``neuron`` of ``expert`` (see :meth:`expert`)."""
        module = self.expert(expert)
        prefix = SHARED if expert == "shared" else f"experts.{expert}"
        if not 0 <= neuron < module.d_mlp:
            raise IndexRangeError(f"neuron {neuron} out of range: the expert has d_mlp={module.d_mlp}")
        return [(f"{prefix}.{attr}", head) for attr, head in module.neuron_heads(neuron)]

    def _bias_copy(self) -> Float[Tensor, " n_experts"] | None:
        bias = getattr(self, "e_score_correction_bias", None)
        return None if bias is None else bias.detach().clone()

    def spec(self) -> MoESpec:
        """The :class:`MoESpec` this layer implements (experts with their original activation)."""
        shared = getattr(self, "shared_expert", None)
        shared_gate = getattr(self, "W_shared_gate", None)
        return MoESpec(
            W_router=exported(self.W_gate),
            experts=[expert.spec() for expert in self.experts],
            b_router=None if self.b_gate is None else exported(self.b_gate),
            shared=None if shared is None else shared.spec(),
            W_shared_gate=None if shared_gate is None else exported(shared_gate),
            logits_dtype=self.logits_dtype,
            router=None
            if self.group_router is None
            else replace(self.group_router, e_score_correction_bias=self._bias_copy()),
            **self.router.spec_fields(),  # type: ignore[arg-type]
            b_out=None if self.b_moe is None else exported(self.b_moe),
            input_scaled=self.input_scaled,
            hash_table=None if self.hash_table is None else self.hash_table.clone(),
            hook_names=self.hook_names,
        )
