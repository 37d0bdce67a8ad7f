"""The prompt's frozen model, for :func:`~lens_aot.analysis.attribution_graphs.graph.attribution_graph`: one
recorded forward of the converted model, then forwards in which every nonlinearity that is not a node is frozen at
its value on the prompt, and batched backward passes through them.

**Freezing.** Each norm's scale (every ``*.hook_scale``: ``(x − mean)/scale·w + b`` is then affine in ``x``), each
source attention layer's pattern (``blocks.{l}.attn.hook_pattern``: the layer is then ``pattern·(x W_V + b_V) W_O +
b_O``, affine) and each mixture-of-experts layer's choice of experts and router weights (``hook_expert_indices``,
``hook_topk_weights``) are replaced by their recorded values; a final logit soft-cap ``c·tanh(z/c)`` (and a logit
multiplier) by the ratio of the recorded logit to ``unembed.hook_out``. What is left between the nodes' outputs and
the nodes' inputs is affine, and exactly so: at the prompt it reproduces every recorded value.

**Sources** (where a node's output enters) are hook points whose value a run replaces by a tensor of its own:
``blocks.0.hook_resid_pre`` (the embeddings, token and position, one node per position), each MLP's ``hook_post``
(one node per neuron and position: the neuron's activation, which the MLP writes as ``post·W_out``; an expert's is
scaled by its router weight) and, for head nodes, ``blocks.{l}.attn.hook_z`` (each head's output ``z·W_O``). **Targets**
(the nodes' inputs) are read from each MLP's ``hook_pre`` (the gate's pre-activation for a gated MLP),
``hook_pre_linear`` (a gated MLP's linear branch) and the logits. The MLP itself always computes on the recorded
inputs (its ``hook_pre`` / ``hook_pre_linear`` return them), so its neuron heads see exactly the prompt's values and
its output is whatever the run puts at ``hook_post``.

Three kinds of run (:meth:`FrozenPrompt.run`):

* ``"leaves"``: every source is a leaf tensor holding its recorded value; a target's gradient with respect to a source
  times the source's value is the source's direct effect on it (an edge), since the run is affine in the sources.
* ``"zero"``: every source is zero: the targets' values are the part no node writes (biases; the graph's
  ``constant``).
* ``"linearized"``: the sources keep their values but each neuron follows its inputs to first order (``post + D +
  J·(pre − pre)``, ``J`` the derivative of the converted model's own activation, ``D`` a zero leaf), so a logit's
  gradient with respect to ``D`` is the neuron's total first-order effect, through the neurons after it: the
  candidate ranking.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from jaxtyping import Float
from torch import Tensor, nn

from lens_aot.core.components.mlp.neuron_mlp import NeuronMLP
from lens_aot.core.components.mlp.squared_relu_mlp import PlainAsGatedMLP
from lens_aot.core.components.moe.moe_mlp import MoEMLP
from lens_aot.core.components.moe.source_expert_hooks import LENS_AOT
from lens_aot.core.components.norm import Norm
from lens_aot.core.runtime.model import AttentionOnlyTransformer
from lens_aot.errors import UnsupportedArchitectureError

RunKind = Literal["leaves", "zero", "linearized"]
EMB_HOOK = "blocks.0.hook_resid_pre"
_PATTERN = re.compile(r"^blocks\.\d+\.attn\.hook_pattern$")


@dataclass(frozen=True)
class MLPSite:
    """One MLP whose neurons are nodes: a dense layer's ``blocks.{l}.mlp`` or an expert's
    ``blocks.{l}.mlp.experts.{e}``. ``two_inputs``: a gated MLP (its neurons' inputs are the gate's pre-activation and
    the linear branch); ``prefix``: its neurons' node names start with it (``m3``, ``m3.e2``)."""

    layer: int
    expert: int | None
    path: str
    two_inputs: bool
    d_mlp: int

    @property
    def prefix(self) -> str:
        return f"m{self.layer}" + ("" if self.expert is None else f".e{self.expert}")


@dataclass(frozen=True)
class Site:
    """Where a group of source nodes writes: ``kind`` "emb" (one node per position), "mlp" (per position and neuron)
    or "attn" (per position and head); ``width`` nodes per position."""

    kind: Literal["emb", "mlp", "attn"]
    layer: int
    width: int
    mlp: MLPSite | None = None

    @property
    def key(self) -> str:
        if self.kind == "emb":
            return "emb"
        return self.mlp.path if self.mlp is not None else f"blocks.{self.layer}.attn"

    @property
    def order(self) -> tuple[int, int, int]:
        """Forward order: embeddings, then per layer its attention, then its MLP(s) in expert order."""
        if self.kind == "emb":
            return (-1, 0, 0)
        expert = -1 if self.mlp is None or self.mlp.expert is None else self.mlp.expert
        return (self.layer, 0 if self.kind == "attn" else 1, expert)


def mlp_sites(aot: AttentionOnlyTransformer) -> list[MLPSite]:
    """Every MLP (dense, or each routed expert) of ``aot``, in forward order; refuses what the graph cannot freeze."""
    sites = []
    for layer, block in enumerate(aot.blocks):
        if hasattr(block, "per_layer"):
            raise UnsupportedArchitectureError(
                f"attribution graphs do not cover Gemma 4's per-layer-input sublayer (layer {layer}): its neurons "
                "read the residual through a gate that is not a node"
            )
        if not block.has_mlp:
            continue
        mlp = block.mlp
        if isinstance(mlp, MoEMLP):
            if mlp.hook_names != LENS_AOT or hasattr(mlp, "shared_expert"):
                why = "a shared expert (its sigmoid gate)" if hasattr(mlp, "shared_expert") else "source-named experts"
                raise UnsupportedArchitectureError(
                    f"attribution graphs do not cover layer {layer}'s mixture of experts with {why}; mixtures of "
                    "routed experts with lens_aot's hook names (Mixtral, OLMoE, ...) are covered"
                )
            for e, expert in enumerate(mlp.experts):
                sites.append(_site(layer, e, f"blocks.{layer}.mlp.experts.{e}", expert))
            continue
        sites.append(_site(layer, None, f"blocks.{layer}.mlp", mlp))
    return sites


def _site(layer: int, expert: int | None, path: str, mlp: nn.Module) -> MLPSite:
    if not isinstance(mlp, NeuronMLP) or type(mlp).forward is not NeuronMLP.forward:
        raise UnsupportedArchitectureError(
            f"attribution graphs do not cover {path} ({type(mlp).__name__}): its neurons' activation is not the "
            "plain or gated neuron-head MLP's"
        )
    two = mlp.gated and not isinstance(mlp, PlainAsGatedMLP)
    return MLPSite(layer, expert, path, two, int(mlp.d_mlp))


def activation_fn(mlp: NeuronMLP) -> Callable[[Tensor, Tensor | None], Tensor]:
    """The converted MLP's activation in closed form, ``post(gate, linear)`` (``linear`` None for one input): what
    its neuron heads compute (plain: their sum of logistics; gated: the product heads' ``(2/ε)·h·tanh(ε·u/2)`` of the
    gate heads' ``h``, plus ``b_post``)."""
    if not mlp.gated:
        return lambda g, u: mlp.heads.activation(g)
    same = isinstance(mlp, PlainAsGatedMLP)  # one pre-activation feeds both branches (relu(z)·z)

    def gated(g: Tensor, u: Tensor | None) -> Tensor:
        h = mlp.gate_activation(g)
        return mlp._standard_post(mlp._product_input(g if same or u is None else u), h)

    return gated


def slopes(
    fn: Callable[[Tensor, Tensor | None], Tensor], g: Tensor, u: Tensor | None
) -> tuple[Tensor, Tensor | None, Tensor]:
    """``∂post/∂gate``, ``∂post/∂linear`` (None for one input) and ``post`` of an elementwise activation at
    ``(g, u)``."""
    with torch.enable_grad():
        g = g.detach().clone().requires_grad_(True)
        u = None if u is None else u.detach().clone().requires_grad_(True)
        post = fn(g, u)
        found = torch.autograd.grad(post.sum(), [g] if u is None else [g, u])
    return found[0], (None if u is None else found[1]), post.detach()


@contextmanager
def norms_in_model_dtype(aot: AttentionOnlyTransformer) -> Iterator[None]:
    """Every norm that computes in a narrower dtype than the model's (a float64 conversion of a source whose norms
    upcast to float32: docs/variants.md) computes in the model's own while inside: with its scale frozen, a float32
    rounding would be the one nonlinear step left between the nodes."""
    dtype = aot.cfg.dtype
    changed = [(m, m.compute_dtype) for m in aot.modules() if isinstance(m, Norm) and narrower(m.compute_dtype, dtype)]
    try:
        for m, _ in changed:
            m.compute_dtype = None
        yield
    finally:
        for m, was in changed:
            m.compute_dtype = was


def narrower(dtype: torch.dtype | None, than: torch.dtype) -> bool:
    """Whether floating ``dtype`` is coarser than ``than`` (float32 in a float64 model)."""
    return dtype is not None and dtype.is_floating_point and torch.finfo(dtype).eps > torch.finfo(than).eps


def float32_steps(aot: AttentionOnlyTransformer) -> bool:
    """Whether a norm of ``aot`` computes in a narrower dtype than the model (its recorded values then carry that
    dtype's rounding, which a linear decomposition does not reproduce)."""
    return any(isinstance(m, Norm) and narrower(m.compute_dtype, aot.cfg.dtype) for m in aot.modules())


class FrozenPrompt:
    """One prompt's recorded forward (``tokens`` [1, pos]) and the frozen runs over it (module docstring)."""

    def __init__(self, aot: AttentionOnlyTransformer, tokens: Tensor, include_heads: bool) -> None:
        self.aot, self.tokens, self.include_heads = aot, tokens, include_heads
        self.mlps = mlp_sites(aot)
        self.n_pos = int(tokens.shape[1])
        names = list(aot.hook_dict)
        self.frozen = [n for n in names if n.endswith("hook_scale") or _PATTERN.match(n)]
        self.frozen += [n for n in names if n.endswith(("mlp.hook_topk_weights", "mlp.hook_expert_indices"))]
        attn = [f"blocks.{layer}.attn" for layer in range(len(aot.blocks))]
        missing = [a for a in attn if f"{a}.hook_pattern" not in aot.hook_dict]
        if missing:
            raise UnsupportedArchitectureError(
                f"attribution graphs freeze each attention layer's pattern at blocks.{{l}}.attn.hook_pattern; "
                f"{missing[0]} has none ({type(aot.get_submodule(missing[0])).__name__})"
            )
        self._check_components()
        record = [*self.frozen, EMB_HOOK, "unembed.hook_out"]
        for site in self.mlps:
            record += [f"{site.path}.hook_pre", f"{site.path}.hook_post"]
            record += [f"{site.path}.hook_pre_linear"] if site.two_inputs else []
        record += [f"{a}.hook_z" for a in attn] if include_heads else []
        self.clean: dict[str, Tensor] = {}

        def keep(t: Tensor, hook: Any) -> None:
            self.clean[hook.name] = t.detach()

        with torch.no_grad():
            self.logits = aot.run_with_hooks(tokens, fwd_hooks=[(n, keep) for n in record])[0].detach()
        self.resid_ratio()
        self.sites = self._sites()

    def _check_components(self) -> None:
        aot = self.aot
        for name in ("hc_head", "prediction_head"):
            if hasattr(aot, name):
                raise UnsupportedArchitectureError(
                    f"attribution graphs do not cover this model's {name} (a nonlinear step between the residual "
                    "stream and the logits that is not a node)"
                )
        for layer, block in enumerate(aot.blocks):
            if hasattr(block.attn, "output_gate"):
                raise UnsupportedArchitectureError(
                    f"attribution graphs do not cover layer {layer}'s gated attention output (a sigmoid of the "
                    "residual that is neither frozen nor a node)"
                )

    def resid_ratio(self) -> None:
        """The frozen ratio of each logit to ``unembed.hook_out`` (1 without a soft-cap or multiplier)."""
        raw = self.clean["unembed.hook_out"][0]
        final = self.logits
        exact = torch.equal(raw, final)
        safe = torch.where(raw == 0, torch.ones_like(raw), raw)
        self.ratio = torch.ones_like(raw) if exact else torch.where(raw == 0, torch.ones_like(raw), final / safe)

    def _sites(self) -> list[Site]:
        """Every source site, in forward order."""
        sites = [Site("emb", -1, 1)]
        if self.include_heads:
            n_heads = self.clean["blocks.0.attn.hook_z"].shape[2]
            sites += [Site("attn", layer, int(n_heads)) for layer in range(len(self.aot.blocks))]
        sites += [Site("mlp", m.layer, m.d_mlp, m) for m in self.mlps]
        return sorted(sites, key=lambda s: s.order)

    # ------------------------------------------------------------------ values at the prompt
    def source_value(self, site: Site) -> Tensor:
        """The site's recorded output, [1, pos, ...] (embeddings [1, pos, d_model], an MLP's post [1, pos, d_mlp],
        heads' z [1, pos, head, d_head])."""
        if site.kind == "emb":
            return self.clean[EMB_HOOK]
        if site.kind == "attn":
            return self.clean[f"blocks.{site.layer}.attn.hook_z"]
        assert site.mlp is not None
        return self.clean[f"{site.mlp.path}.hook_post"]

    def router_weight(self, site: MLPSite) -> Float[Tensor, " pos"]:
        """The expert's router weight at each position (0 where it is not chosen); 1 for a dense MLP."""
        if site.expert is None:
            return torch.ones(self.n_pos, dtype=self.logits.dtype, device=self.aot.placement.layers[site.layer])
        layer = f"blocks.{site.layer}.mlp"
        weights = self.clean[f"{layer}.hook_topk_weights"]  # [pos, top_k]
        indices = self.clean[f"{layer}.hook_expert_indices"]
        dense = weights.new_zeros(weights.shape[0], self.aot.blocks[site.layer].mlp.n_experts)
        return dense.scatter(1, indices, weights)[:, site.expert]

    # ------------------------------------------------------------------ runs
    def run(self, kind: RunKind) -> Run:
        """One frozen forward (module docstring); its sources and targets are on the returned :class:`Run`."""
        aot, clean = self.aot, self.clean
        sources: dict[str, Tensor] = {}
        targets: dict[str, Tensor] = {}
        hooks: list[tuple[str, Callable[..., Any]]] = []

        def frozen(t: Tensor, hook: Any) -> Tensor:
            return clean[hook.name]

        def target(t: Tensor, hook: Any) -> Tensor:
            targets[hook.name] = t
            return clean[hook.name]  # the MLP computes on the prompt's own inputs

        def leaf(value: Tensor) -> Tensor:
            if kind == "zero":
                return torch.zeros_like(value)
            return value.clone().requires_grad_(True)

        def source(key: str, hook_name: str) -> Callable[..., Tensor]:
            def replace(t: Tensor, hook: Any) -> Tensor:
                if kind == "linearized" and key != "emb":  # the live value plus a zero leaf
                    sources[key] = torch.zeros_like(clean[hook_name]).requires_grad_(True)
                    return t + sources[key]
                sources[key] = leaf(clean[hook_name])
                return sources[key]

            return replace

        hooks += [(name, frozen) for name in self.frozen]
        hooks.append((EMB_HOOK, source("emb", EMB_HOOK)))
        for site in self.sites:
            if site.kind == "attn":
                name = f"blocks.{site.layer}.attn.hook_z"
                hooks.append((name, source(site.key, name)))
        for mlp in self.mlps:
            hooks.append((f"{mlp.path}.hook_pre", target))
            if mlp.two_inputs:
                hooks.append((f"{mlp.path}.hook_pre_linear", target))
            name = f"{mlp.path}.hook_post"
            if kind == "linearized":
                hooks.append((name, self._linearized(mlp, sources, targets)))
            else:
                hooks.append((name, source(mlp.path, name)))

        def unembed(t: Tensor, hook: Any) -> None:
            targets["logits"] = t[0] * self.ratio

        hooks.append(("unembed.hook_out", unembed))
        with torch.set_grad_enabled(kind != "zero"), norms_in_model_dtype(aot):
            aot.run_with_hooks(self.tokens, fwd_hooks=hooks, return_type=None)
        return Run(kind, sources, targets)

    def _linearized(
        self, mlp: MLPSite, sources: dict[str, Tensor], targets: dict[str, Tensor]
    ) -> Callable[..., Tensor]:
        """``hook_post``'s hook of a linearized run: ``post + D + J_g·(g − g) + J_u·(u − u)``, values unchanged."""
        post = self.clean[f"{mlp.path}.hook_post"]
        j_g, j_u = self.slopes(mlp)

        def replace(t: Tensor, hook: Any) -> Tensor:
            sources[mlp.path] = torch.zeros_like(post).requires_grad_(True)
            g = targets[f"{mlp.path}.hook_pre"]
            out = post + sources[mlp.path] + j_g * (g - g.detach())
            if j_u is not None:
                u = targets[f"{mlp.path}.hook_pre_linear"]
                out = out + j_u * (u - u.detach())
            return out

        return replace

    def slopes(self, mlp: MLPSite) -> tuple[Tensor, Tensor | None]:
        """``∂post/∂gate`` and ``∂post/∂linear`` (None for one input) at the prompt, [1, pos, d_mlp]."""
        module = self.aot.get_submodule(mlp.path)
        g = self.clean[f"{mlp.path}.hook_pre"]
        u = self.clean[f"{mlp.path}.hook_pre_linear"] if mlp.two_inputs else None
        j_g, j_u, _ = slopes(activation_fn(module), g, u)
        return j_g, j_u

    def backward(
        self, run: Run, target: str, positions: Tensor, units: Tensor, sites: Sequence[Site]
    ) -> dict[str, Tensor]:
        """The gradients of a batch of targets (``target``'s entries at ``positions`` / ``units``, one row each) with
        respect to each site's source, ``{site.key: [rows, 1, pos, ...]}`` (absent: the site does not reach them)."""
        out = run.targets[target]
        rows = len(positions)
        cot = out.new_zeros(rows, *out.shape)
        index = torch.arange(rows, device=out.device)
        positions, units = positions.to(out.device), units.to(out.device)  # the target's layer's device
        if target == "logits":
            cot[index, positions, units] = 1
        else:
            cot[index, 0, positions, units] = 1
        wanted = [s for s in sites if s.key in run.sources]
        leaves = [run.sources[s.key] for s in wanted]
        found = torch.autograd.grad(out, leaves, cot, retain_graph=True, is_grads_batched=True, allow_unused=True)
        return {s.key: g for s, g in zip(wanted, found, strict=True) if g is not None}

    def contributions(self, site: Site, grad: Tensor, value: Tensor | None = None) -> Float[Tensor, "rows pos width"]:
        """Each node's contribution (gradient times its output) from a site's gradients ``[rows, 1, pos, ...]``:
        ``[rows, pos, width]``."""
        value = self.source_value(site) if value is None else value
        if site.kind == "mlp":
            return (grad * value)[:, 0]
        per = grad * value
        if site.kind == "emb":
            return per.sum(-1)[:, 0, :, None]
        return per.sum(-1)[:, 0]


@dataclass
class Run:
    """A frozen forward: ``sources`` {site key: the tensor put at its hook}, ``targets`` {hook name or "logits":
    what the run computed there} ([1, pos, d_mlp] per MLP hook, [pos, d_vocab] for the logits)."""

    kind: RunKind
    sources: dict[str, Tensor]
    targets: dict[str, Tensor]
