"""Inputs and forward passes shared by activation patching, path patching and attribution: token and argument
checks, the metric's scalar check, chunking of stacked runs, and forwards with temporary hooks."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, TypeAlias

import torch
from jaxtyping import Int
from torch import Tensor
from tqdm.auto import tqdm

from lens_aot.analysis.patching.options import Direction, Method, Metric, ReceiverInput, TokensLike
from lens_aot.analysis.progress import Progress, progress_bar, show_progress
from lens_aot.core.components.moe.source_expert_hooks import dense_expert_hooks
from lens_aot.core.runtime.model import AttentionOnlyTransformer
from lens_aot.errors import InputError, one_of

Hook: TypeAlias = tuple[str, Callable[..., Any]]

# Elements one chunk of per-sender tensors may hold (edge attribution), and per stacked forward of EAP-IG.
_CHUNK_ELEMENTS = 1 << 24


# ==================================================================================================== arguments
def _tokens(aot: AttentionOnlyTransformer, tokens: TokensLike, what: str) -> Int[Tensor, "batch pos"]:
    if (
        isinstance(tokens, list)
        and tokens
        and (all(isinstance(t, int) for t in tokens) or all(isinstance(t, list) for t in tokens))
    ):
        tokens = torch.tensor(tokens)
    elif isinstance(tokens, (str, list)):
        tokens = aot.to_tokens(tokens)
    if not isinstance(tokens, Tensor):
        raise InputError(f"{what} must be a tensor of token ids (or text); got {type(tokens).__name__}")
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise InputError(f"{what} tokens must be an integer tensor of token ids; got dtype {tokens.dtype}")
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2:
        raise InputError(f"{what} tokens must have shape [batch, pos] or [pos]; got {tuple(tokens.shape)}")
    return tokens.to(aot.cfg.device)


def _pair(
    aot: AttentionOnlyTransformer, clean: TokensLike, corrupted: TokensLike
) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"]]:
    clean_t, corrupted_t = _tokens(aot, clean, "clean"), _tokens(aot, corrupted, "corrupted")
    if clean_t.shape != corrupted_t.shape:
        raise InputError(
            f"clean and corrupted tokens must have the same shape (a patch swaps activations position by position); "
            f"got clean {tuple(clean_t.shape)} and corrupted {tuple(corrupted_t.shape)}. Pad or trim them to the same "
            f"length and batch size."
        )
    return clean_t, corrupted_t


def _scalar(value: Any, where: str) -> float:
    if isinstance(value, Tensor) and value.numel() == 1:
        return float(value.detach())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    desc = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, Tensor) else f"a {type(value).__name__}"
    raise InputError(
        f"metric must return a scalar (a float or a one-element tensor); on the {where} logits it returned {desc}. "
        f"Reduce over the batch and positions inside the metric, e.g. "
        f"lambda logits: (logits[:, -1, a] - logits[:, -1, b]).mean()"
    )


def _scalars(values: Sequence[Any], where: str) -> list[float]:
    """:func:`_scalar` of each of ``values``, with one host-device transfer for all the tensors among them (not one
    synchronisation per patched run)."""
    tensors = [v for v in values if isinstance(v, Tensor) and v.numel() == 1]
    if len(tensors) < len(values):  # a non-scalar or a Python number: the one-by-one check (and its error)
        return [_scalar(v, where) for v in values]
    return torch.stack([t.detach().reshape(()).to(torch.float64) for t in tensors]).cpu().tolist()


def _no_blocks(options: Mapping[str, Any]) -> None:
    """Refuse lens_aot 0.1's ``blocks=`` (flat block indices) with the new spelling."""
    if "blocks" in options:
        raise InputError(
            "blocks= is gone: the converted model is numbered like its source, and heads live in head modules named "
            "'blocks.{l}.attn' / 'blocks.{l}.mlp.heads' (aot.sublayers() lists them in order); pass modules=[...] "
            "(names, or sub-layer indices)"
        )


def _direction(direction: str) -> Direction:
    options = {
        "denoise": "run corrupted, patch in clean values",
        "noise": "run clean, patch in corrupted values",
    }
    return one_of("direction", direction, options)  # type: ignore[return-value]


def _positions(positions: int | Iterable[int] | None, n_pos: int) -> list[int] | None:
    if positions is None:
        return None
    items = [positions] if isinstance(positions, int) else list(positions)
    out = []
    for p in items:
        if isinstance(p, bool) or not isinstance(p, int) or not -n_pos <= p < n_pos:
            raise InputError(f"position {p!r} out of range for {n_pos} token positions (0..{n_pos - 1}, or negative)")
        out.append(p % n_pos)
    if not out:
        raise InputError("positions is empty; pass None for every position")
    return list(dict.fromkeys(out))


def _patched_positions(positions: int | Iterable[int] | None, n_pos: int, per_position: bool) -> list[int] | None:
    """The positions a node result covers: ``positions`` checked, every position when ``per_position`` without them."""
    pos_list = _positions(positions, n_pos)
    return list(range(n_pos)) if per_position and pos_list is None else pos_list


def _receiver_inputs(receiver_input: str | Iterable[str]) -> tuple[ReceiverInput, ...]:
    letters = list(receiver_input) if isinstance(receiver_input, str) else [x for item in receiver_input for x in item]
    if not letters or any(x not in ("q", "k", "v") for x in letters):
        raise InputError(
            f"receiver_input must be 'q', 'k', 'v' or a combination such as 'qk' or ('q', 'v'); got {receiver_input!r}"
        )
    return tuple(dict.fromkeys(letters))  # type: ignore[arg-type]


# ==================================================================================================== runs
def _chunks(n: int, size: int) -> Iterator[range]:
    for start in range(0, n, size):
        yield range(start, min(n, start + size))


def _progress(items: list[Any], progress: Progress, desc: str) -> Iterable[Any]:
    """``items``, counted by a tqdm bar when ``progress`` says to show one (:mod:`lens_aot.analysis.progress`)."""
    return tqdm(items, desc=desc) if show_progress(progress) else items


def _capture(hook_names: Iterable[str], store: dict[str, Tensor]) -> list[Hook]:
    """Hooks storing each named hook's activation in ``store[hook name]`` (detached copies)."""

    def keep(act: Tensor, hook: Any) -> None:
        store[hook.name] = act.detach().clone()

    return [(name, keep) for name in dict.fromkeys(hook_names)]


def _run(aot: AttentionOnlyTransformer, tokens: Tensor, hooks: list[Hook], **kwargs: Any) -> Tensor:
    """One forward with temporary hooks, removed on exit even if the forward raises."""
    with aot.hooks(fwd_hooks=hooks), dense_expert_hooks(aot):
        return aot(tokens, **kwargs)


def _differentiable(value: Any, where: str) -> Tensor:
    """The metric's value, checked to be a differentiable one-element tensor."""
    if not isinstance(value, Tensor) or value.numel() != 1:
        desc = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, Tensor) else f"a {type(value).__name__}"
        raise InputError(
            f"gradient attribution needs a metric that returns a differentiable scalar tensor; on the {where} logits "
            f"it returned {desc}. Return a one-element tensor computed from the logits with torch operations, e.g. "
            f"lambda logits: (logits[:, -1, a] - logits[:, -1, b]).mean()"
        )
    if not value.requires_grad:
        raise InputError(
            f"gradient attribution needs a metric that is differentiable in the logits; on the {where} logits it "
            f"returned a tensor that does not require grad (computed under torch.no_grad(), detached, via .item() / "
            f"numpy, or from argmax / comparisons). Use activation patching (lens_aot.patching) for such metrics."
        )
    return value.reshape(())


class _Pass(NamedTuple):
    """One input's run: the metric, the recorded activations, and (gradient runs) the gradients at ``grads``."""

    metric: float
    acts: dict[str, Tensor]
    grads: dict[str, Tensor]


def _forward(
    aot: AttentionOnlyTransformer,
    tokens: Tensor,
    metric: Metric,
    record: Iterable[str],
    grads: Sequence[str] = (),
    *,
    what: str,
    embed: Tensor | None = None,
    n_runs: int = 1,
) -> _Pass:
    """A forward recording ``record`` (detached) and, when ``grads`` is not empty, the gradient of the metric (summed
    over the ``tokens.shape[0] / batch`` stacked runs when ``embed`` replaces ``hook_embed``) at those hooks."""
    record = list(dict.fromkeys(record))
    acts: dict[str, Tensor] = {}
    live: dict[str, Tensor] = {}

    def keep(act: Tensor, hook: Any) -> Tensor:
        if hook.name in grads:
            if not act.requires_grad:
                act = act.detach().requires_grad_(True)
            live[hook.name] = act
        if hook.name in record:
            acts[hook.name] = act.detach()
        return act

    hooks: list[Hook] = [(name, keep) for name in dict.fromkeys([*record, *grads])]
    if embed is not None:
        hooks.insert(0, ("hook_embed", lambda act, hook: embed.to(act.dtype)))
    with torch.set_grad_enabled(bool(grads)), aot.hooks(fwd_hooks=hooks), dense_expert_hooks(aot):
        logits = aot(tokens)
        if not grads:
            value = metric(logits)
            return _Pass(_scalar(value, what), acts, {})
        batch = logits.shape[0] // n_runs
        total = sum(_differentiable(metric(logits[r * batch : (r + 1) * batch]), what) for r in range(n_runs))
        assert isinstance(total, Tensor)
        names = [name for name in grads if name in live]
        found = torch.autograd.grad(total, [live[n] for n in names], allow_unused=True)
    out = {n: torch.zeros_like(live[n]) if g is None else g.detach() for n, g in zip(names, found, strict=True)}
    return _Pass(float(total.detach()) / n_runs, acts, out)


class _Runs(NamedTuple):
    """Both inputs' runs: ``base`` is the run that is patched (on ``base_tokens``), ``other`` the input patched in
    from; ``grads``: the metric's gradients (attribution)."""

    base: _Pass
    other: _Pass
    base_tokens: Tensor
    grads: dict[str, Tensor]
    clean_metric: float
    corrupted_metric: float


def _both_runs(
    aot: AttentionOnlyTransformer,
    clean: Tensor,
    corrupted: Tensor,
    metric: Metric,
    direction: Direction,
    record: Sequence[str],
    grads: Sequence[str] = (),
    method: Method = "atp",
    steps: int = 16,
    progress: Progress = False,
) -> _Runs:
    """The run that is patched (the corrupted input for "denoise", the clean one for "noise") and the other input's
    run, both recording ``record`` and checking the metric; with the metric's gradient at ``grads``: on the base run
    ("atp"), or averaged over ``steps`` runs whose token embeddings interpolate between the two inputs ("ig"). A
    ``progress`` bar counts the passes: the two runs, and each of EAP-IG's ``steps``."""
    base_t, other_t = (corrupted, clean) if direction == "denoise" else (clean, corrupted)
    base_what, other_what = ("corrupted", "clean") if direction == "denoise" else ("clean", "corrupted")
    record = [*record, "hook_embed"] if method == "ig" else list(record)
    desc = "integrated gradients" if method == "ig" else "attribution"
    with progress_bar(progress, 2 + (steps if method == "ig" else 0), desc) as bar:
        base = _forward(aot, base_t, metric, record, grads if method == "atp" else (), what=base_what)
        bar.update(1)
        other = _forward(aot, other_t, metric, record, what=other_what)
        bar.update(1)
        clean_run, corrupted_run = (other, base) if direction == "denoise" else (base, other)
        runs = _Runs(base, other, base_t, base.grads, clean_run.metric, corrupted_run.metric)
        if method == "atp":
            return runs
        return runs._replace(grads=_integrated_grads(aot, runs, metric, grads, steps, bar))


def _integrated_grads(
    aot: AttentionOnlyTransformer, runs: _Runs, metric: Metric, grads: Sequence[str], steps: int, bar: Any
) -> dict[str, Tensor]:
    """The metric's gradients at ``grads`` averaged over ``steps`` runs of the base tokens whose token embeddings
    (``hook_embed``) are interpolated between the two runs' (midpoints ``α = (k + ½)/steps``; EAP-IG); ``bar`` counts
    the steps."""
    e0, e1 = runs.base.acts["hook_embed"], runs.other.acts["hook_embed"]
    batch = runs.base_tokens.shape[0]
    per = max(1, min(steps, _CHUNK_ELEMENTS // max(1, e0.numel() * 8)))
    sums: dict[str, Tensor] = {}
    chunks = [range(s, min(steps, s + per)) for s in range(0, steps, per)]
    for chunk in chunks:
        alphas = torch.tensor([(k + 0.5) / steps for k in chunk], dtype=e0.dtype, device=e0.device)
        embed = (e0[None] + alphas[:, None, None, None] * (e1 - e0)[None]).flatten(0, 1)
        tokens = runs.base_tokens.repeat(len(chunk), 1)
        run = _forward(aot, tokens, metric, (), grads, what="interpolated", embed=embed, n_runs=len(chunk))
        for name, g in run.grads.items():
            g = g.reshape(len(chunk), batch, *g.shape[1:]).sum(0)
            sums[name] = g if name not in sums else sums[name] + g
        bar.update(len(chunk))
    return {name: g / steps for name, g in sums.items()}


def _require_linear_writes(aot: AttentionOnlyTransformer, what: str) -> None:
    """Refuse ``what`` (an algorithm that maps a head's output change or gradient through ``W_O`` to
    ``hook_attn_out`` / ``hook_mlp_out``) on layers that normalize a sublayer's output before it reaches the residual
    stream (sandwich norms ``ln1_post`` / ``ln2_post``: Gemma 2/3; post-norm: OLMo-2), where that map is not linear (a
    half-precision Granite's residual multiplier is linear: carried by :func:`~.module_hooks._write_map` and
    :func:`~.module_hooks._head_grads`)."""
    for layer, block in enumerate(aot.blocks):
        if block.post_norm or hasattr(block, "ln1_post") or hasattr(block, "ln2_post"):
            raise InputError(
                f"{what} treats hook_attn_out / hook_mlp_out as the sum of the heads' outputs, but layer {layer} "
                f"normalizes its sublayers' outputs first (sandwich or post norms), so a head's change does not reach "
                f"them linearly. Use activation patching (patch_heads / patch_neurons), which reruns the model."
            )
