"""Independent references on the *source* HookedTransformer for circuit tests (TransformerLens 3.x only).

Nothing here calls lens_aot's circuit code: edges are cut by hand with hooks on the source, receiver by receiver, in
EAP-IG's formulation (a receiver's input is its current input minus ``Σ_{s -> r not in circuit} (out_s −
out_s^corrupted)``), and edge scores come from autograd through a perturbation of each receiver's own input.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

_NAME = re.compile(r"^(?:a(\d+)\.h(\d+)|m(\d+)(?:\.n(\d+))?)$")


def addr(name: str) -> tuple[str, int, int]:
    if name in ("input", "logits"):
        return name, -1, 0
    m = _NAME.match(name)
    assert m is not None
    if m.group(1) is not None:
        return "attention", int(m.group(1)), int(m.group(2))
    if m.group(4) is None:
        return "mlp", int(m.group(3)), 0
    return "neuron", int(m.group(3)), int(m.group(4))


def prepare(model: Any) -> Any:
    model.set_use_split_qkv_input(True)
    model.set_use_attn_result(True)
    model.set_use_hook_mlp_in(True)
    if model.cfg.n_key_value_heads is not None:
        model.set_ungroup_grouped_query_attention(True)  # one k and v input per query head, as EAP-IG requires
    return model


def _outputs(model: Any, cache: dict[str, Tensor], name: str) -> Tensor:
    """A sender's write into the residual, from a source cache."""
    kind, layer, index = addr(name)
    if kind == "input":
        return cache["blocks.0.hook_resid_pre"]
    if kind == "attention":
        return cache[f"blocks.{layer}.attn.hook_result"][:, :, index]
    if kind == "mlp":
        return cache[f"blocks.{layer}.hook_mlp_out"]
    return cache[f"blocks.{layer}.mlp.hook_post"][:, :, index, None] * model.blocks[layer].mlp.W_out[index]


def _neuron_pre(model: Any, layer: int, x: Tensor, n: int) -> dict[str, Tensor]:
    """The source's pre-activation(s) of neuron ``n`` for its own residual copy ``x``."""
    block = model.blocks[layer]
    y = block.ln2(x)
    mlp = block.mlp
    if hasattr(mlp, "W_gate"):
        return {"hook_pre": y @ mlp.W_gate[:, n], "hook_pre_linear": y @ mlp.W_in[:, n]}
    return {"hook_pre": y @ mlp.W_in[:, n] + mlp.b_in[n]}


def brute_force_evaluate(
    model: Any, names: list[str], edges: dict[tuple[str, str, str], bool], clean: Tensor, corrupted: Tensor
) -> Tensor:
    """Logits of the source on ``clean`` with every edge ``(sender, receiver, qkv)`` whose value is False carrying
    the sender's corrupted output. ``edges`` lists every edge of the graph (True: in the circuit)."""
    prepare(model)
    _, cor = model.run_with_cache(corrupted)
    cur: dict[str, Tensor] = {}
    absent: dict[tuple[str, str], list[str]] = {}
    for (s, r, q), keep in edges.items():
        absent.setdefault((r, q), [])
        if not keep:
            absent[(r, q)].append(s)

    def delta(senders: list[str], like: Tensor) -> Tensor:
        total = torch.zeros_like(like)
        for s in senders:
            total = total + (_outputs(model, cur, s) - _outputs(model, cor, s))
        return total

    def keep_hook(x: Tensor, hook: Any) -> Tensor:
        cur[hook.name] = x
        return x

    def qkv_hook(layer: int, q: str) -> Any:
        def hook(x: Tensor, hook: Any) -> Tensor:
            x = x.clone()
            for h in range(model.cfg.n_heads):
                x[:, :, h] = x[:, :, h] - delta(absent.get((f"a{layer}.h{h}", q), []), x[:, :, h])
            return x

        return hook

    def mlp_in_hook(layer: int) -> Any:
        def hook(x: Tensor, hook: Any) -> Tensor:
            cur[hook.name] = x
            if f"m{layer}" in names:
                return x - delta(absent.get((f"m{layer}", ""), []), x)
            return x

        return hook

    def pre_hook(layer: int, which: str) -> Any:
        def hook(pre: Tensor, hook: Any) -> Tensor:
            pre = pre.clone()
            x = cur[f"blocks.{layer}.hook_mlp_in"]
            for n in range(pre.shape[-1]):
                node = f"m{layer}.n{n}"
                if node not in names:
                    continue
                pre[..., n] = _neuron_pre(model, layer, x - delta(absent.get((node, ""), []), x), n)[which]
            return pre

        return hook

    def logits_hook(x: Tensor, hook: Any) -> Tensor:
        return x - delta(absent.get(("logits", ""), []), x)

    hooks: list[tuple[str, Any]] = [("blocks.0.hook_resid_pre", keep_hook)]
    for layer in range(model.cfg.n_layers):
        hooks += [(f"blocks.{layer}.hook_{q}_input", qkv_hook(layer, q)) for q in "qkv"]
        hooks += [(f"blocks.{layer}.attn.hook_result", keep_hook), (f"blocks.{layer}.hook_mlp_in", mlp_in_hook(layer))]
        hooks += [(f"blocks.{layer}.mlp.{w}", pre_hook(layer, w)) for w in ("hook_pre", "hook_pre_linear")]
        hooks += [(f"blocks.{layer}.mlp.hook_post", keep_hook), (f"blocks.{layer}.hook_mlp_out", keep_hook)]
    hooks.append((f"blocks.{model.cfg.n_layers - 1}.hook_resid_post", logits_hook))
    hooks = [(name, fn) for name, fn in hooks if name in model.hook_dict]
    with torch.no_grad():
        return model.run_with_hooks(clean, fwd_hooks=hooks)


def reference_edge_scores(
    model: Any, names: list[str], data: list[tuple[Tensor, Tensor, Tensor]], metric: Any, steps: int | None
) -> dict[tuple[str, str, str], float]:
    """EAP (``steps`` None) or EAP-IG-inputs scores of every edge among ``names`` on the source, by autograd through a
    zero perturbation of each receiver's own input (each neuron's through its own ``ln2``)."""
    prepare(model)
    cfg = model.cfg
    L, H = cfg.n_layers, cfg.n_heads
    senders = [n for n in names if n != "logits"]
    totals: dict[tuple[str, str, str], float] = {}
    n_examples = 0
    for clean, corrupted, labels in data:
        n_examples += clean.shape[0]
        with torch.no_grad():
            _, cor = model.run_with_cache(corrupted)
            _, cln = model.run_with_cache(clean)
            # lens_aot's sign: (out^clean − out^corrupted) · ∂metric/∂in, positive = supports the clean answer
            delta = {s: _outputs(model, cln, s) - _outputs(model, cor, s) for s in senders}
        alphas = [None] if steps is None else [k / steps for k in range(steps)]
        for alpha in alphas:
            b, p = clean.shape
            eps: dict[str, Tensor] = {}
            for layer in range(L):
                for q in "qkv":
                    eps[f"{q}{layer}"] = torch.zeros(b, p, H, cfg.d_model, dtype=cfg.dtype, requires_grad=True)
                eps[f"m{layer}"] = torch.zeros(b, p, cfg.d_model, dtype=cfg.dtype, requires_grad=True)
                eps[f"n{layer}"] = torch.zeros(b, p, cfg.d_mlp, cfg.d_model, dtype=cfg.dtype, requires_grad=True)
            eps["logits"] = torch.zeros(b, p, cfg.d_model, dtype=cfg.dtype, requires_grad=True)
            embeds = None if alpha is None else (alpha, cor["hook_embed"], cln["hook_embed"])
            hooks = _perturbation_hooks(model, names, eps, embeds)
            hooks = [(name, fn) for name, fn in hooks if name in model.hook_dict]
            logits = model.run_with_hooks(clean, fwd_hooks=hooks)
            value = metric(logits, labels).sum()
            keys = list(eps)
            grads = dict(zip(keys, torch.autograd.grad(value, [eps[k] for k in keys], allow_unused=True), strict=True))
            for r in names:
                if r == "input":
                    continue
                kind, layer, index = addr(r)
                if kind == "attention":
                    slots = [(q, grads[f"{q}{layer}"][:, :, index]) for q in "qkv"]
                elif kind == "mlp":
                    slots = [("", grads[f"m{layer}"])]
                elif kind == "neuron":
                    slots = [("", grads[f"n{layer}"][:, :, index])]
                else:
                    slots = [("", grads["logits"])]
                for q, g in slots:
                    if g is None:
                        continue
                    for s in senders:
                        key = (s, r, q)
                        totals[key] = totals.get(key, 0.0) + float((delta[s] * g).detach().sum()) / len(alphas)
    return {k: v / n_examples for k, v in totals.items()}


def _perturbation_hooks(
    model: Any, names: list[str], eps: dict[str, Tensor], embeds: tuple[float, Tensor, Tensor] | None
) -> list[tuple[str, Any]]:
    """Hooks adding each receiver's zero perturbation to its own input (a neuron's through its own ``ln2``), and
    interpolating the token embeddings (EAP-IG) when ``embeds`` is ``(alpha, corrupted, clean)``."""
    mlp_in: dict[int, Tensor] = {}

    def add(key: str) -> Any:
        return lambda x, hook: x + eps[key]

    def keep_in(layer: int) -> Any:
        def hook(x: Tensor, hook: Any) -> Tensor:
            x = x + eps[f"m{layer}"]
            mlp_in[layer] = x
            return x

        return hook

    def per_neuron(layer: int, which: str) -> Any:
        def hook(pre: Tensor, hook: Any) -> Tensor:
            y = model.blocks[layer].ln2(mlp_in[layer][:, :, None] + eps[f"n{layer}"])  # [b, p, n, d]
            mlp = model.blocks[layer].mlp
            if hasattr(mlp, "W_gate"):
                w, bias = (mlp.W_gate, 0) if which == "hook_pre" else (mlp.W_in, 0)
            else:
                w, bias = mlp.W_in, mlp.b_in
            return torch.einsum("bpnd,dn->bpn", y, w) + bias

        return hook

    hooks: list[tuple[str, Any]] = []
    if embeds is not None:
        alpha, e_cor, e_cln = embeds
        hooks.append(("hook_embed", lambda x, hook: e_cor + alpha * (e_cln - e_cor)))
    n_layers = model.cfg.n_layers
    for layer in range(n_layers):
        hooks += [(f"blocks.{layer}.hook_{q}_input", add(f"{q}{layer}")) for q in "qkv"]
        hooks.append((f"blocks.{layer}.hook_mlp_in", keep_in(layer)))
        if any(n.startswith(f"m{layer}.n") for n in names):
            hooks += [(f"blocks.{layer}.mlp.{w}", per_neuron(layer, w)) for w in ("hook_pre", "hook_pre_linear")]
    hooks.append((f"blocks.{n_layers - 1}.hook_resid_post", add("logits")))
    return hooks


def label_metric(logits: Tensor, labels: Tensor) -> Tensor:
    """The circuit tests' metric: the label's last-position logit minus the mean last-position logit."""
    last = logits[:, -1]
    return last.gather(-1, labels[:, None])[:, 0] - last.mean(-1)


def random_batches(vocab: int, pos: int, seed: int = 0, batches: int = 2) -> list[tuple[Tensor, Tensor, Tensor]]:
    """``batches`` random (clean, corrupted, labels) triples of 2 sequences of ``pos`` tokens below ``vocab``."""
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, vocab, (2, pos), generator=g),
            torch.randint(0, vocab, (2, pos), generator=g),
            torch.randint(0, vocab, (2,), generator=g),
        )
        for _ in range(batches)
    ]


def assert_density_ends(got: Tensor, base: Any, density: float, tol: float) -> None:
    """A circuit of ``density`` 0 gives the corrupted metric, 1 the clean one (``base``: ``evaluate_baseline``'s), and
    anything in between changes the metric by far more than ``tol``."""
    if density == 0.0:
        torch.testing.assert_close(got, base.corrupted, rtol=0, atol=tol)
    if density == 1.0:
        torch.testing.assert_close(got, base.clean, rtol=0, atol=tol)
    if 0 < density < 1:
        assert float((got - base.clean).abs().max()) > 20 * tol, "a partial circuit must change the metric"
