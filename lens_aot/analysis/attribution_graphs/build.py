"""Building an attribution graph from one prompt: its target logits, the candidate neurons (and heads) ranked by
first-order attribution to them, and every edge among the kept ones, with each node's input, constant and error.

:func:`~lens_aot.analysis.attribution_graphs.graph.attribution_graph` calls these steps in order; :func:`graph_fields`
returns the fields of an :class:`~lens_aot.analysis.attribution_graphs.graph.AttributionGraph`, which that module
builds. The prompt's frozen run (patterns, norm scales and router weights held at their values) is
:mod:`~lens_aot.analysis.attribution_graphs.run`'s.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from lens_aot.analysis.attribution_graphs.nodes import node_name
from lens_aot.analysis.attribution_graphs.run import FrozenPrompt, Site, float32_steps, narrower
from lens_aot.core.components.residual.writes import written
from lens_aot.core.runtime.model import AttentionOnlyTransformer
from lens_aot.errors import InputError, UnsupportedArchitectureError

# a graph above this many nodes is stored sparse where that is smaller than dense
SPARSE_FROM = 1024
# bytes of source gradients held at once by a batch of backward passes (sets the batch size)
BATCH_BYTES = 256 * 2**20


def _storage(A: Tensor, sparse: bool | None = None) -> Tensor:
    """``A`` dense, or sparse COO (``sparse``; None: above :data:`SPARSE_FROM` nodes when that is smaller, a value and
    two indices per stored entry against one value per entry)."""
    if sparse is None:
        n = A.shape[0]
        nnz = A._nnz() if A.is_sparse else int((A != 0).sum())
        item = A.dtype.itemsize
        sparse = n > SPARSE_FROM and nnz * (16 + item) < n * n * item
    if sparse:
        return A.coalesce() if A.is_sparse else A.to_sparse().coalesce()
    return A.to_dense() if A.is_sparse else A


def _prompt(aot: AttentionOnlyTransformer, tokens: Any) -> Int[Tensor, "1 pos"]:
    """The prompt as ``[1, pos]`` token ids, checked."""
    if isinstance(tokens, str):
        ids = aot.to_tokens(tokens, truncate=False)
    elif isinstance(tokens, Tensor):
        ids = tokens
    elif isinstance(tokens, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        ids = torch.tensor(list(tokens), dtype=torch.long)
    else:
        raise InputError(
            f"tokens must be a string, a list of token ids or a tensor of token ids [pos] / [1, pos]; got "
            f"{type(tokens).__name__}"
        )
    ids = ids[None] if ids.ndim == 1 else ids
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise InputError(
            f"an attribution graph is of one prompt: pass tokens of shape [pos] or [1, pos]; got {tuple(ids.shape)}. "
            "For a batch, build one graph per prompt."
        )
    if ids.shape[1] == 0:
        raise InputError("the prompt is empty: pass at least one token")
    if ids.shape[1] > aot.cfg.n_ctx:
        raise InputError(
            f"the prompt has {ids.shape[1]} tokens, more than the model's context n_ctx={aot.cfg.n_ctx}; shorten "
            f"it to its last {aot.cfg.n_ctx} tokens (tokens[..., -{aot.cfg.n_ctx}:])"
        )
    return aot._as_tokens(ids, None)


def _targets(
    aot: AttentionOnlyTransformer, target: Any, logits: Float[Tensor, " vocab"], max_n: int, desired: float
) -> list[int]:
    """The target token ids at the last position."""
    vocab = logits.shape[-1]
    if target is None:
        if isinstance(max_n, bool) or not isinstance(max_n, int) or max_n < 1:
            raise InputError(f"max_n_logits must be a positive int; got {max_n!r}")
        probs = torch.softmax(logits.to(torch.float64), -1)
        top_p, top = torch.topk(probs, min(max_n, vocab))
        cut = int(torch.searchsorted(torch.cumsum(top_p, 0), torch.tensor(desired, dtype=top_p.dtype))) + 1
        return [int(t) for t in top[: min(cut, len(top))]]
    items = [target] if isinstance(target, (int, str)) else list(target)
    if not items:
        raise InputError("target is empty: pass a token id, a string that is one token, or None for the likely ones")
    out = []
    for item in items:
        if not isinstance(item, (str, bool)):
            try:
                item = operator.index(item)  # an int, a NumPy or 0-d tensor integer
            except TypeError:
                pass
        if isinstance(item, str):
            if aot.tokenizer is None:
                raise InputError(
                    f"target {item!r} is a string but this model has no tokenizer: pass the token's id (0..{vocab - 1})"
                )
            ids = aot.to_tokens(item, prepend_bos=False)[0]
            if ids.numel() != 1:
                raise InputError(
                    f"unknown target token {item!r}: it is {ids.numel()} tokens for this tokenizer, not one; pass a "
                    f"string that is one token (e.g. with its leading space) or the token id"
                )
            item = int(ids[0])
        if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item < vocab:
            raise InputError(
                f"unknown target token {item!r}: a target is a token id in 0..{vocab - 1} or a string that is one token"
            )
        if item not in out:
            out.append(item)
    return out


Candidates = list[tuple[Int[Tensor, " k"], Float[Tensor, " k"], Site]]


def _candidates(prompt: FrozenPrompt, logit_tokens: list[int], probs: Tensor) -> Candidates:
    """Per source site (neurons and heads): its active nodes (flat indices ``p·width + unit``) and their scores, the
    probability-weighted first-order attribution to the target logits (module docstring)."""
    run = prompt.run("linearized")
    last = prompt.n_pos - 1
    rows = len(logit_tokens)
    positions = torch.full((rows,), last, dtype=torch.long, device=prompt.logits.device)
    units = torch.tensor(logit_tokens, dtype=torch.long, device=prompt.logits.device)
    grads = prompt.backward(run, "logits", positions, units, prompt.sites)
    weights = probs / probs.sum() if float(probs.sum()) > 0 else torch.full_like(probs, 1 / len(probs))
    out: Candidates = []
    for site in prompt.sites:
        if site.kind == "emb":
            continue
        active = _active(prompt, site).flatten()
        if site.key in grads:
            attr = prompt.contributions(site, grads[site.key]).flatten(1).to(torch.float64)
            score = (attr.abs() * weights[:, None].to(attr.device)).sum(0)
        else:
            score = torch.zeros(active.shape, dtype=torch.float64, device=active.device)
        index = active.nonzero()[:, 0]
        out.append((index.cpu(), score[index].cpu(), site))
    del run
    return out


def _active(prompt: FrozenPrompt, site: Site) -> Bool[Tensor, "pos width"]:
    """Which nodes of a site write something: a nonzero activation (times a nonzero router weight); every head."""
    value = prompt.source_value(site)[0]
    if site.kind == "attn":
        return torch.ones(value.shape[:2], dtype=torch.bool, device=value.device)
    assert site.mlp is not None
    return (value != 0) & (prompt.router_weight(site.mlp) != 0)[:, None]


def _select(candidates: Candidates, max_nodes: int | None) -> list[tuple[Site, Int[Tensor, " k"]]]:
    """The kept nodes of each site (sorted flat indices): the ``max_nodes`` largest scores overall (ties: forward
    order), every active node when ``max_nodes`` is None or covers them."""
    total = sum(len(index) for index, _, _ in candidates)
    if max_nodes is None or max_nodes >= total:
        return [(site, index) for index, _, site in candidates]
    scores = torch.cat([score for _, score, _ in candidates])
    order = torch.sort(scores, descending=True, stable=True).indices[:max_nodes]
    chosen = torch.zeros(total, dtype=torch.bool)
    chosen[order] = True
    out, start = [], 0
    for index, _, site in candidates:
        mask = chosen[start : start + len(index)]
        out.append((site, index[mask]))
        start += len(index)
    return out


def _graph_fields(
    prompt: FrozenPrompt,
    kept: list[tuple[Site, Tensor]],
    logit_tokens: list[int],
    probs: Tensor,
    batch_size: int | None,
) -> dict[str, Any]:
    """Every edge among the kept nodes, their inputs, constants and errors: the fields of an
    :class:`~lens_aot.analysis.attribution_graphs.graph.AttributionGraph`, by name."""
    aot = prompt.aot
    n_pos, last = prompt.n_pos, prompt.n_pos - 1
    device, dtype = prompt.logits.device, prompt.logits.dtype
    # ---- the nodes, in order: embeddings, then each site's kept nodes, then the logits
    emb_site = next(s for s in prompt.sites if s.kind == "emb")
    columns: list[tuple[Site, Tensor]] = [(emb_site, torch.arange(n_pos))] + [(s, i) for s, i in kept if len(i)]
    names: list[str] = []
    starts: dict[str, int] = {}
    for site, index in columns:
        starts[site.key] = len(names)
        names += [_name(site, int(i)) for i in index]
    logit_start = len(names)
    names += [node_name("logit", len(aot.blocks), t, last) for t in logit_tokens]
    n = len(names)
    gated = any(m.two_inputs for m in prompt.mlps)

    kept_index = {site.key: index for site, index in columns}
    A = torch.zeros(n, n, dtype=dtype, device=device)
    L = torch.zeros(n, n, dtype=dtype, device=device) if gated else None
    inputs, constant, error = (torch.zeros(n, dtype=torch.float64) for _ in range(3))
    inputs_l, constant_l, error_l = (torch.zeros(n, dtype=torch.float64) for _ in range(3))
    activations = torch.zeros(n, dtype=torch.float64)
    slopes, slopes_l = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)

    run = prompt.run("leaves")
    with torch.no_grad():
        zero = prompt.run("zero")
    per_row = sum(int(v.numel()) for v in run.sources.values()) * dtype.itemsize * 3
    rows_per_pass = batch_size or max(1, min(512, BATCH_BYTES // max(per_row, 1)))

    # each site's nodes left out of the graph (flat indices): what they write into a target is its error
    left_out = {site.key: _complement(index, prompt.n_pos * site.width) for site, index in columns}
    for site in prompt.sites:
        left_out.setdefault(site.key, torch.arange(prompt.n_pos * site.width))

    def fill(target: str, rows: Tensor, positions: Tensor, units: Tensor, M: Tensor, error_out: Tensor) -> None:
        """Rows ``rows`` of ``M`` and of ``error_out`` (what the sources left out write) from ``target``'s
        entries."""
        for start in range(0, len(rows), rows_per_pass):
            part = slice(start, start + rows_per_pass)
            grads = prompt.backward(run, target, positions[part], units[part], prompt.sites)
            with torch.no_grad():
                dropped = torch.zeros(len(rows[part]), dtype=torch.float64, device=device)
                block = torch.zeros(len(rows[part]), n, dtype=dtype, device=device)
                for site in prompt.sites:
                    if site.key not in grads:
                        continue
                    contrib = prompt.contributions(site, grads[site.key]).flatten(1).to(device)  # site's -> logits'
                    dropped += contrib.index_select(1, left_out[site.key].to(device)).sum(1, dtype=torch.float64)
                    if site.key in starts:
                        index = kept_index[site.key].to(device)
                        cols = starts[site.key] + torch.arange(len(index), device=device)
                        block[:, cols] = contrib.index_select(1, index)
                M[rows[part].to(device)] = block
                error_out[rows[part]] = dropped.cpu()
            del grads

    # ---- neuron targets, site by site
    for site, index in columns:
        if site.kind != "mlp" or not len(index):
            continue
        mlp = site.mlp
        assert mlp is not None
        rows = starts[site.key] + torch.arange(len(index))
        positions, units = index // site.width, index % site.width  # CPU indices: valid on every layer's device
        hook = f"{mlp.path}.hook_pre"
        fill(hook, rows, positions, units, A, error)
        inputs[rows] = prompt.clean[hook][0, positions, units].double().cpu()
        constant[rows] = zero.targets[hook][0, positions, units].double().cpu()
        post = prompt.clean[f"{mlp.path}.hook_post"][0, positions, units]
        activations[rows] = post.double().cpu()
        j_g, j_u = prompt.slopes(mlp)
        slopes[rows] = j_g[0, positions, units].double().cpu()
        if mlp.two_inputs:
            assert L is not None and j_u is not None
            hook = f"{mlp.path}.hook_pre_linear"
            fill(hook, rows, positions, units, L, error_l)
            inputs_l[rows] = prompt.clean[hook][0, positions, units].double().cpu()
            constant_l[rows] = zero.targets[hook][0, positions, units].double().cpu()
            slopes_l[rows] = j_u[0, positions, units].double().cpu()
    # ---- logit targets
    rows = logit_start + torch.arange(len(logit_tokens))
    positions = torch.full((len(logit_tokens),), last, dtype=torch.long, device=device)
    units = torch.tensor(logit_tokens, dtype=torch.long, device=device)
    fill("logits", rows, positions, units, A, error)
    inputs[rows] = prompt.logits[last, units].double().cpu()
    constant[rows] = zero.targets["logits"][last, units].double().cpu()
    activations[rows] = inputs[rows]
    # ---- what embeddings and heads write
    for site, index in columns:
        if site.kind == "mlp":
            continue
        rows = starts[site.key] + torch.arange(len(index))
        activations[rows] = _output_norms(prompt, site, index).double().cpu()

    _check_linear(prompt, names, A.double().sum(1).cpu() + error + constant, inputs)
    linear: dict[str, Any] = {}
    if L is not None:
        _check_linear(prompt, names, L.double().sum(1).cpu() + error_l + constant_l, inputs_l)
        linear = dict(
            inputs_linear=inputs_l,
            constant_linear=constant_l,
            error_linear=error_l,
            slopes_linear=slopes_l,
        )
    adjacency = _storage(A.cpu())
    if L is not None:
        linear["adjacency_linear"] = _storage(L.cpu(), adjacency.is_sparse)
    decoded = _decoded(aot, prompt.tokens[0])
    info = dict(
        model_name=str(getattr(aot.cfg, "model_name", "")),
        n_layers=len(aot.blocks),
        d_mlp=int(aot.cfg.d_mlp or 0),
        dtype=str(dtype).replace("torch.", ""),
        float32_steps=float32_steps(aot),
        logit_token_text=dict(zip(logit_tokens, _decoded(aot, torch.tensor(logit_tokens)), strict=True)),
        tokenizer=aot.tokenizer is not None,  # prompt_tokens are decoded text, else token ids (the export's prompt)
    )
    return dict(
        nodes=names,
        adjacency=adjacency,
        inputs=inputs,
        constant=constant,
        error=error,
        activations=activations,
        slopes=slopes,
        tokens=prompt.tokens[0].cpu(),
        prompt_tokens=decoded,
        logit_tokens=list(logit_tokens),
        logit_probs=probs.cpu(),
        info=info,
        **linear,
    )


def _complement(index: Tensor, size: int) -> Tensor:
    """The flat indices in ``range(size)`` not in ``index``."""
    mask = torch.ones(size, dtype=torch.bool)
    mask[index] = False
    return mask.nonzero()[:, 0]


def _name(site: Site, flat: int) -> str:
    position, unit = divmod(flat, site.width)
    if site.kind == "emb":
        return node_name("emb", -1, 0, flat)
    if site.kind == "attn":
        return node_name("head", site.layer, unit, position)
    assert site.mlp is not None
    return node_name("neuron", site.layer, unit, position, site.mlp.expert)


def _output_norms(prompt: FrozenPrompt, site: Site, index: Tensor) -> Tensor:
    """The norm of what each embedding (the residual before layer 0) or head (``z·W_O``, times a half-precision
    Granite's residual multiplier) node writes."""
    value = prompt.source_value(site)[0]
    if site.kind == "emb":
        return value.norm(dim=-1)[index.to(value.device)]
    attn = prompt.aot.blocks[site.layer].attn
    out = torch.einsum("phe,hed->phd", value, written(attn).to(value.dtype))
    return out.norm(dim=-1).flatten()[index.to(value.device)]


def _check_linear(prompt: FrozenPrompt, names: list[str], rebuilt: Tensor, inputs: Tensor) -> None:
    """Every input equals the sum of every source's contribution and the constant, to rounding (the frozen run is
    affine): else something between the nodes is nonlinear and not frozen, and the graph would be wrong."""
    dtype = prompt.logits.dtype
    steps = float32_steps(prompt.aot)
    eps = torch.finfo(torch.float32 if steps or narrower(torch.float32, dtype) else dtype).eps
    scale = inputs.abs() + rebuilt.abs() + 1.0
    bad = (rebuilt - inputs).abs() > 1e4 * eps * scale
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise UnsupportedArchitectureError(
            f"the frozen model does not reproduce {names[i]}'s input ({float(inputs[i]):.6g} against "
            f"{float(rebuilt[i]):.6g} from its sources): this model has a nonlinear step between nodes that the "
            "attribution graph cannot freeze"
        )


def _decoded(aot: AttentionOnlyTransformer, tokens: Tensor) -> list[str]:
    if aot.tokenizer is None:
        return [str(int(t)) for t in tokens]
    return [aot.tokenizer.decode([int(t)]) for t in tokens]
