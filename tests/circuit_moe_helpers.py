"""An independent circuit reference on the *source* Hugging Face mixture-of-experts model (Mixtral, Qwen2-MoE).

Nothing here calls lens_aot. The source runs layer by layer on its own modules: every receiver (an attention head's
q, k and v input, an expert neuron, a shared-expert neuron, the logits) reads its own copy of the residual, the sum
of its senders' outputs, each sender's clean (current) output when the edge is in the circuit and its corrupted
output when it is not (EAP-IG's formulation). A head's output comes from the source's attention module called on
its own copies (``k_proj`` / ``v_proj`` outputs substituted by forward hooks, ``o_proj``'s input read by a pre-hook);
an expert neuron ``m{l}.e{e}.n{i}`` computes, from its own copy through ``post_attention_layernorm``, its routing
(the source's router module ``mlp.gate``) and ``act(gate_up[e][i]·y)·(gate_up[e][d+i]·y)``, and sends
``w_e·post·down_proj[e][:, i]``; a shared-expert neuron ``m{l}.n{i}`` sends ``σ(shared_expert_gate(y))·post·
down_proj[:, i]``. With every edge kept, each layer's neuron outputs are checked to sum to the source's own MoE block
output, and the logits to equal the source's own forward.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

_EXPERT = re.compile(r"^m(\d+)\.e(\d+)\.n(\d+)$")
_SHARED = re.compile(r"^m(\d+)\.n(\d+)$")
_HEAD = re.compile(r"^a(\d+)\.h(\d+)$")

Edges = dict[tuple[str, str, str], bool]


def hf_moe(family: str, dtype: torch.dtype, seed: int = 0) -> Any:
    """The Hugging Face model ``factories_moe.moe_bridge(family, dtype, seed)`` wraps, built the same way."""
    from factories_moe import _hf, _randomize_

    model, _ = _hf(family)
    model.eval()
    _randomize_(model, seed)
    model.to(dtype)
    model.set_attn_implementation("eager")
    model.set_experts_implementation("eager")
    return model


def _layer_of(name: str) -> int:
    m = _HEAD.match(name) or _EXPERT.match(name) or _SHARED.match(name)
    assert m is not None, name
    return int(m.group(1))


class SourceReference:
    """Layer-by-layer runs of the HF source with per-receiver inputs (module docstring)."""

    def __init__(self, hf: Any, names: list[str]) -> None:
        self.hf, self.cfg = hf, hf.config
        self.names = names
        self.heads = [n for n in names if _HEAD.match(n)]
        self.neurons = [n for n in names if _EXPERT.match(n) or _SHARED.match(n)]
        self._senders: dict[str, list[str]] = {}

    def senders_of(self, receiver: str) -> list[str]:
        """The senders in ``receiver``'s input: input, earlier layers' heads and neurons, and (for a neuron) its
        layer's heads."""
        if receiver not in self._senders:
            if receiver == "logits":
                out = ["input", *self.heads, *self.neurons]
            else:
                layer = _layer_of(receiver)
                out = ["input"] + [n for n in self.heads + self.neurons if _layer_of(n) < layer]
                if not _HEAD.match(receiver):
                    out += [n for n in self.heads if _layer_of(n) == layer]
            self._senders[receiver] = out
        return self._senders[receiver]

    def _read(self, receivers: list[tuple[str, str]], out: dict[str, Tensor], edges: Edges | None,
              cor: dict[str, Tensor] | None, eps: dict[tuple[str, str], Tensor] | None) -> Tensor:  # fmt: skip
        """Each ``(receiver, qkv)``'s input ``[b, p, r, d]``: Σ senders (clean if the edge is kept, else corrupted)."""
        cols = []
        for r, q in receivers:
            total = 0
            for s in self.senders_of(r):
                keep = True if edges is None else edges[(s, r, q)]
                total = total + (out[s] if keep else cor[s])  # type: ignore[index]
            if eps is not None:
                total = total + eps[(r, q)]
            cols.append(total)
        return torch.stack(cols, dim=2)

    def run(
        self,
        tokens: Tensor,
        edges: Edges | None = None,
        cor: dict[str, Tensor] | None = None,
        eps: dict[tuple[str, str], Tensor] | None = None,
        embed: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Logits and every sender's output; ``edges`` None keeps every edge (the source's own forward)."""
        model = self.hf.model
        b, p = tokens.shape
        out: dict[str, Tensor] = {"input": model.embed_tokens(tokens) if embed is None else embed}
        pos_ids = torch.arange(p)[None].expand(b, p)
        cos_sin = model.rotary_emb(out["input"], pos_ids)
        dtype = out["input"].dtype
        mask = torch.full((p, p), float("-inf"), dtype=dtype).triu(1)[None, None]
        for layer, block in enumerate(model.layers):
            heads = [n for n in self.heads if _layer_of(n) == layer]
            x = {q: self._read([(h, q) for h in heads], out, edges, cor, eps) for q in "qkv"}
            for j, h in enumerate(heads):
                out[h] = self._head(block, int(_HEAD.match(h).group(2)), *(x[q][:, :, j] for q in "qkv"),
                                    cos_sin, mask)  # fmt: skip
            neurons = [n for n in self.neurons if _layer_of(n) == layer]
            if neurons:
                xs = self._read([(n, "") for n in neurons], out, edges, cor, eps)
                for n, v in zip(neurons, self._neurons(block, neurons, xs), strict=True):
                    out[n] = v
                if edges is None and eps is None:  # the decomposition is the source's MoE block
                    resid = self._read([(neurons[0], "")], out, None, None, None)[:, :, 0]
                    want = block.mlp(block.post_attention_layernorm(resid))
                    got = sum(out[n] for n in neurons)
                    torch.testing.assert_close(got, want, rtol=0, atol=1e-10 * float(want.abs().max()))
        final = self._read([("logits", "")], out, edges, cor, eps)[:, :, 0]
        logits = self.hf.lm_head(model.norm(final))
        if edges is None and eps is None and embed is None:
            torch.testing.assert_close(logits, self.hf(tokens).logits, rtol=0, atol=1e-9)
        return logits, out

    def _head(self, block: Any, h: int, xq: Tensor, xk: Tensor, xv: Tensor, cos_sin: Any, mask: Tensor) -> Tensor:
        attn, ln = block.self_attn, block.input_layernorm
        d_head = attn.head_dim
        k_val, v_val = attn.k_proj(ln(xk)), attn.v_proj(ln(xv))
        seen: dict[str, Tensor] = {}
        handles = [
            attn.k_proj.register_forward_hook(lambda m, i, o: k_val),
            attn.v_proj.register_forward_hook(lambda m, i, o: v_val),
            attn.o_proj.register_forward_pre_hook(lambda m, i: seen.setdefault("z", i[0])),
        ]
        try:
            attn(hidden_states=ln(xq), position_embeddings=cos_sin, attention_mask=mask)
        finally:
            for handle in handles:
                handle.remove()
        z = seen["z"][..., h * d_head : (h + 1) * d_head]
        return z @ attn.o_proj.weight[:, h * d_head : (h + 1) * d_head].T

    def _neurons(self, block: Any, neurons: list[str], xs: Tensor) -> list[Tensor]:
        moe = block.mlp
        y = block.post_attention_layernorm(xs)  # [b, p, n, d]: each neuron's own normalized copy
        n_exp = moe.experts.gate_up_proj.shape[0]
        _, scores, indices = moe.gate(y.reshape(-1, y.shape[-1]))
        w = scores.new_zeros(indices.shape[0], n_exp).scatter(1, indices, scores).to(y.dtype)
        w = w.reshape(*y.shape[:-1], n_exp)  # the source router's weight of every expert, per neuron's copy
        d_exp = moe.experts.gate_up_proj.shape[1] // 2
        outs = []
        for j, name in enumerate(neurons):
            yj = y[:, :, j]
            m = _EXPERT.match(name)
            if m:
                e, i = int(m.group(2)), int(m.group(3))
                up = moe.experts.gate_up_proj[e]
                post = moe.experts.act_fn(yj @ up[i]) * (yj @ up[d_exp + i])
                outs.append((w[:, :, j, e] * post)[..., None] * moe.experts.down_proj[e][:, i])
            else:
                i = int(_SHARED.match(name).group(2))
                sh = moe.shared_expert
                post = sh.act_fn(yj @ sh.gate_proj.weight[i]) * (yj @ sh.up_proj.weight[i])
                gate = torch.sigmoid(moe.shared_expert_gate(yj))[..., 0]
                outs.append((gate * post)[..., None] * sh.down_proj.weight[:, i])
        return outs


def brute_force_evaluate(ref: SourceReference, edges: Edges, clean: Tensor, corrupted: Tensor) -> Tensor:
    """The source's logits on ``clean`` with every edge whose value is False carrying its sender's corrupted
    output."""
    with torch.no_grad():
        _, cor = ref.run(corrupted)
        logits, _ = ref.run(clean, edges, cor)
    return logits


def reference_edge_scores(
    ref: SourceReference, data: list[tuple[Tensor, Tensor, Tensor]], metric: Any, steps: int | None
) -> dict[tuple[str, str, str], float]:
    """EAP (``steps`` None) or EAP-IG-inputs scores ``Σ (out_s^clean − out_s^corrupted) · ∂metric/∂(r's input)`` (the
    sign lens_aot's discover reports: positive = supports the clean answer) of every edge, by autograd
    through a zero perturbation of each receiver's own input, averaged over examples."""
    receivers = [(h, q) for h in ref.heads for q in "qkv"] + [(n, "") for n in ref.neurons] + [("logits", "")]
    totals: dict[tuple[str, str, str], float] = {}
    n_examples = 0
    for clean, corrupted, labels in data:
        n_examples += clean.shape[0]
        with torch.no_grad():
            _, cor = ref.run(corrupted)
            _, cln = ref.run(clean)
        alphas = [None] if steps is None else [k / steps for k in range(steps)]
        for alpha in alphas:
            eps = {r: torch.zeros_like(cln["input"], requires_grad=True) for r in receivers}
            embed = None if alpha is None else cor["input"] + alpha * (cln["input"] - cor["input"])
            logits, _ = ref.run(clean, None, None, eps, embed)
            grads = torch.autograd.grad(metric(logits, labels).sum(), [eps[r] for r in receivers], allow_unused=True)
            for (r, q), g in zip(receivers, grads, strict=True):
                if g is None:
                    continue
                for s in ref.senders_of(r):
                    key = (s, r, q)
                    delta = cln[s] - cor[s]  # lens_aot's sign: positive = supports the clean answer
                    totals[key] = totals.get(key, 0.0) + float((delta * g).sum()) / len(alphas)
    return {k: v / n_examples for k, v in totals.items()}
