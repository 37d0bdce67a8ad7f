"""Edge scores accumulated over gradient runs: ``T[sender node, receiver slot] = Σ Δ_s · G_r``, with each neuron's
own input gradient pulled back through ``ln2`` for that neuron alone (and, in a mixture-of-experts layer, through its
gate), for :func:`~lens_aot.analysis.circuits.discover.eap.discover`.
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from lens_aot.analysis.circuits.graph import Graph
from lens_aot.analysis.circuits.layout import (
    has_mlp,
    head_out,
)
from lens_aot.analysis.circuits.moe import NeuronGroup, group_of
from lens_aot.core.dtypes import HALF_DTYPES
from lens_aot.core.placement import cat_on

_CHUNK = 1 << 24  # elements per intermediate [batch, pos, receivers, ...] block


class _Scorer:
    """Accumulates ``T[sender node, receiver slot] = Σ Δ_s · G_r`` for one graph."""

    def __init__(self, aot: Any, graph: Graph) -> None:
        self.aot, self.graph = aot, graph
        self.slots: dict[tuple[int, int], int] = {}
        for d, q in zip(graph.dst.tolist(), graph.qkv.tolist(), strict=True):
            self.slots.setdefault((d, q), len(self.slots))
        self.T = torch.zeros(len(graph.nodes), len(self.slots), dtype=torch.float64)
        self.node_scores = torch.zeros(len(graph.nodes), dtype=torch.float64)
        self.groups: dict[Any, NeuronGroup] = {}  # (layer, expert) -> the group of kept neurons
        self.neurons: dict[Any, list[int]] = {}  # (layer, expert) -> kept neuron indices (graph order)
        self.neuron_nodes: dict[Any, list[int]] = {}
        for i, name in enumerate(graph.nodes):
            if ".n" in name:
                group, n = group_of(aot, name)
                self.groups.setdefault(group.key, group)
                self.neurons.setdefault(group.key, []).append(n)
                self.neuron_nodes.setdefault(group.key, []).append(i)
        # dense senders (input, then per layer its heads and, at mlp granularity, its MLP): how many precede a
        # receiver of each layer. Later senders are not in its input, so they are never scored.
        self.before_attn: list[int] = []
        self.before_mlp: list[int] = []
        count = 1
        for layer in range(len(aot.blocks)):
            self.before_attn.append(count)
            count += aot.cfg.n_heads
            self.before_mlp.append(self.before_attn[-1] if aot.blocks[layer].parallel else count)
            count += int(graph.granularity == "mlp" and has_mlp(aot, layer))
        self.n_dense = count
        self._dense: tuple[dict[str, Tensor], list[int], Tensor] | None = None

    def _dense_senders(self, diff: dict[str, Tensor]) -> tuple[list[int], Tensor]:
        """Every non-neuron sender's change ``[b, p, s, d]`` (input, heads, MLPs) and its node index (computed once
        per batch: ``diff`` is the batch's)."""
        if self._dense is not None and self._dense[0] is diff:
            return self._dense[1], self._dense[2]
        g, aot = self.graph, self.aot
        idx, parts = [g.node_index["input"]], [diff["blocks.0.hook_resid_pre"][:, :, None]]
        for layer in range(len(aot.blocks)):
            idx += [g.node_index[f"a{layer}.h{h}"] for h in range(aot.cfg.n_heads)]
            parts.append(head_out(aot, layer, diff[f"blocks.{layer}.attn.hook_z"]))
            if g.granularity == "mlp" and has_mlp(aot, layer):
                idx.append(g.node_index[f"m{layer}"])
                parts.append(diff[f"blocks.{layer}.hook_mlp_out"][:, :, None])
        self._dense = (diff, idx, cat_on(aot.W_U.device, parts, dim=2))  # layers' devices -> the logits
        return self._dense[1], self._dense[2]

    def add(
        self,
        diff: dict[str, Tensor],
        receivers: list[tuple[int, int]],
        G: Tensor,
        weight: float,
        where: tuple[str, int] = ("logits", -1),
    ) -> None:
        """Add ``weight · Σ_{b,p} Δ_s · G_r`` for receivers ``(node, qkv)`` with input gradients ``G [b,p,r,d]``,
        over the senders before them: ``where`` is ("attn" | "mlp", layer) or ("logits", -1)."""
        cols = torch.tensor([self.slots[r] for r in receivers if r in self.slots], dtype=torch.long)
        keep = torch.tensor([r in self.slots for r in receivers])
        if not len(cols):
            return
        G = G[:, :, keep]
        kind, at = where
        n_dense = {"attn": self.before_attn, "mlp": self.before_mlp}[kind][at] if kind != "logits" else self.n_dense
        last = len(self.aot.blocks) if kind == "logits" else at  # neurons of earlier layers only
        idx, dense = self._dense_senders(diff)
        block = torch.einsum("bpsd,bprd->sr", dense[:, :, :n_dense], G.to(dense.device)).double()
        self.T[torch.tensor(idx[:n_dense])[:, None], cols[None, :]] += weight * block.cpu()
        for key, neurons in self.neurons.items():
            group = self.groups[key]
            if group.layer >= last:
                continue
            dpost = diff[group.post_hook][:, :, neurons]  # [b, p, k]: the outputs' change (gate·post in MoE)
            w_out = group.W_out[neurons]  # [k, d]
            G = G.to(w_out.device)  # the receiver's gradient, on the sender layer's device
            step = max(1, _CHUNK // max(1, G.shape[0] * G.shape[1] * len(neurons)))
            for start in range(0, G.shape[2], step):
                proj = G[:, :, start : start + step] @ w_out.T  # [b, p, r, k]
                part = torch.einsum("bprk,bpk->kr", proj, dpost).double().cpu()
                rows = torch.tensor(self.neuron_nodes[key])[:, None]
                self.T[rows, cols[None, start : start + step]] += weight * part


def _neuron_input_grads(
    aot: Any,
    group: NeuronGroup,
    neurons: list[int],
    values: dict[str, Tensor],
    grads: dict[str, Tensor],
    jac: dict[Any, Tensor],
) -> Float[Tensor, "batch pos neuron d_model"]:
    """``∂metric/∂(neuron n's own input)``: its pre-activation gradients (and, in an MoE layer, its gate's: ``jac``
    holds ``∂gate/∂y``) pulled back through ``ln2`` at the MLP's input."""
    x = values[f"blocks.{group.layer}.hook_mlp_in"]
    cols = torch.tensor(neurons, device=x.device)
    out = []
    step = max(1, _CHUNK // max(1, x.shape[0] * x.shape[1] * x.shape[2]))
    maps = group.pre_maps()
    for start in range(0, len(neurons), step):
        c = cols[start : start + step]
        v = sum(grads[pm.hook][:, :, c, None] * pm.W[:, c].T for pm in maps)  # [b, p, k, d]
        if group.gated_by_moe:
            g_out = grads[f"blocks.{group.layer}.hook_mlp_out"] @ group.W_out[c].T  # ∂metric/∂(gate·post) [b, p, k]
            v = v + (g_out * values[group.post_hook][:, :, c])[..., None] * jac[group.expert][:, :, None]
        out.append(_norm_backward(aot.blocks[group.layer].ln2, x, v))
    return torch.cat(out, dim=2)


def _output_grads(group: NeuronGroup, grads: dict[str, Tensor], cols: list[int] | slice) -> Tensor:
    """``∂metric/∂(output)`` of neurons ``cols`` ``[b, p, k]``: ``∂/∂post`` in a dense MLP, and ``∂metric/∂mlp_out ·
    W_out[i]`` for an MoE group (whose output is ``gate·post``)."""
    if not group.gated_by_moe:
        return grads[group.post_hook][:, :, cols]
    return grads[f"blocks.{group.layer}.hook_mlp_out"] @ group.W_out[cols].T


def _norm_backward(
    norm: Any, x: Float[Tensor, "batch pos d_model"], v: Float[Tensor, "batch pos k d_model"]
) -> Float[Tensor, "batch pos k d_model"]:
    """``v``'s pull-back through ``norm`` at ``x``, for ``k`` upstream gradients at once (one per neuron). LayerNorm
    and RMSNorm in closed form (``x_c`` = ``x`` centred for LN; ``s = sqrt(mean(x_c²) + eps)``; ``u = v·w``):
    ``∂/∂x_c = u/s − x_c·(x_c·u)/(d·s³)``, then centred again for LN. Other norms (a compute dtype of their own,
    half precision): autograd on ``k`` copies of ``x``."""
    kind = getattr(norm, "kind", "other")
    if kind is None:
        return v
    if kind not in ("LN", "LNPre", "RMS", "RMSPre") or norm.compute_dtype is not None or x.dtype in HALF_DTYPES:
        with torch.enable_grad():
            xe = x[:, :, None].expand(-1, -1, v.shape[2], -1).clone().requires_grad_(True)
            (g,) = torch.autograd.grad(norm(xe), xe, v)
        return g
    xc = x - x.mean(-1, keepdim=True) if kind in ("LN", "LNPre") else x
    s = (xc.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()  # [b, p, 1]
    u = v * norm.w if norm.w is not None else v
    dot = torch.einsum("bpkd,bpd->bpk", u, xc)[..., None]  # [b, p, k, 1]
    g = u / s[:, :, None] - xc[:, :, None] * (dot / (xc.shape[-1] * s.pow(3)[:, :, None]))
    return g - g.mean(-1, keepdim=True) if kind in ("LN", "LNPre") else g
