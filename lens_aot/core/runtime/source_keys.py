"""A converted TransformerBridge's weights under the source bridge's ``state_dict`` keys too (issue 23, item 3).

A bridge's ``state_dict()`` names each weight by its bridge component, in the wrapped Hugging Face module's layout:
``blocks.0.attn.q.weight`` ``[n_heads·d_head, d_model]`` (``Linear``) or ``[d_model, n_heads·d_head]`` (GPT-2's
``Conv1D``), ``blocks.0.mlp.in.weight``, ``blocks.0.ln1.weight``, ``embed.weight``. The converted model owns each
weight once, in TransformerLens's layout (``blocks.0.attn.W_Q`` ``[n_heads, d_model, d_head]``). For a bridge
source, :func:`attach` finds, at conversion, which of the converted model's tensors each source key is and in which
layout (:data:`LAYOUTS`: a transpose, the per-head reshapes, two tensors concatenated), checking the values
exactly. Then, with no second copy held:

* ``aot.state_dict()`` holds the source's keys beside its own, with the source's shapes and values, computed from
  the converted model's tensors when asked (a view where the layout allows);
* ``aot.load_state_dict(state)`` accepts the source's keys, alone or with its own (they must then agree), and a
  complete source state dict loads strictly;
* ``fresh_bridge.load_state_dict(aot.state_dict(), strict=False)`` gives the source back.

Found by value, never by an adapter's name: a key is tied to the converted tensor holding its exact values, the
one whose name corresponds when several do (tied embeddings, a norm shared by both branches of a parallel block).
One layout is not exact: Gemma-style norms multiply by ``1 + w`` and the converted model holds ``1 + w``, so the
source's ``w`` is ``(1 + w) − 1``, within an ulp of 1 of the source's (:data:`OFFSETS`). A source key that matches
nothing is listed in ``aot.source_keys_missing``: none in the support matrix (``tests/interop/test_bridge_names.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["LAYOUTS", "OFFSETS", "SourceKey", "attach", "encode", "find_source_keys", "own_keys", "restore"]

# One layout: converted tensor -> the source's layout, and back (given the converted tensor's shape).
Layout = tuple[Callable[[Tensor], Tensor], Callable[[Tensor, torch.Size], Tensor]]


LAYOUTS: dict[str, Layout] = {
    "same": (lambda x: x, lambda s, shape: s),
    "T": (lambda x: x.T, lambda s, shape: s.T),
    # [heads, d_model, d_head] (W_Q/W_K/W_V) as Linear [heads·d_head, d_model] and Conv1D [d_model, heads·d_head]
    "in_linear": (
        lambda x: x.transpose(1, 2).reshape(x.shape[0] * x.shape[2], x.shape[1]),
        lambda s, shape: s.reshape(shape[0], shape[2], shape[1]).transpose(1, 2),
    ),
    "in_conv1d": (
        lambda x: x.transpose(0, 1).reshape(x.shape[1], x.shape[0] * x.shape[2]),
        lambda s, shape: s.reshape(shape[1], shape[0], shape[2]).transpose(0, 1),
    ),
    # [heads, d_head, d_model] (W_O) as Linear [d_model, heads·d_head] and Conv1D [heads·d_head, d_model]
    "out_linear": (
        lambda x: x.reshape(x.shape[0] * x.shape[1], x.shape[2]).T,
        lambda s, shape: s.T.reshape(shape),
    ),
    "out_conv1d": (
        lambda x: x.reshape(x.shape[0] * x.shape[1], x.shape[2]),
        lambda s, shape: s.reshape(shape),
    ),
    "flat": (lambda x: x.reshape(-1), lambda s, shape: s.reshape(shape)),  # [heads, d_head] biases
}

# Gemma-style norms: the source multiplies by 1 + w and the converted model holds 1 + w, as the source's forward
# computes it: in the weight's dtype, or in float32 (HF GemmaRMSNorm's ``1.0 + weight.float()``, in a float64 model
# too). Loading takes w back exactly as the source's forward does; the exported (1 + w) − 1 is within an ulp of 1.
OFFSETS: dict[str, Layout] = {
    "offset": (lambda x: x - 1, lambda s, shape: s + 1),
    "offset_f32": (lambda x: x - 1, lambda s, shape: (s.float() + 1).to(s.dtype)),
}

_EVERY_LAYOUT = {**LAYOUTS, **OFFSETS}


@dataclass(frozen=True)
class SourceKey:
    """One source ``state_dict`` key: the converted tensors it is made of (one, or two concatenated along the rows,
    in ``groups`` equal groups: fused gate-up, fused key-value, MLA's per-head ``kv_b_proj``) and their layouts."""

    key: str
    ours: tuple[str, ...]
    layouts: tuple[str, ...]
    groups: int = 1
    # further converted tensors holding a single-tensor key: (name, layout, scale): a norm both branches of a
    # parallel block share (ln1 and ln2, scale 1), a tied embedding folded with a multiplier (Granite's W_E = m·E)
    also: tuple[tuple[str, str, float], ...] = ()

    def layout(self, i: int) -> Layout:
        """The ``i``-th converted tensor's layout: (to the source's, back)."""
        return _EVERY_LAYOUT[self.layouts[i]]

    def value(self, tensors: dict[str, Tensor]) -> Tensor:
        """The source's tensor, from the converted model's ``tensors`` (by our keys)."""
        parts = [self.layout(i)[0](tensors[name]) for i, name in enumerate(self.ours)]
        if len(parts) == 1:
            return parts[0]
        cols = parts[0].shape[1:]
        return torch.cat([p.reshape(self.groups, -1, *cols) for p in parts], dim=1).reshape(-1, *cols)

    def split(self, value: Tensor, shapes: dict[str, torch.Size]) -> dict[str, Tensor]:
        """The converted model's tensors (by our keys) that ``value``, in the source's layout, holds."""
        if len(self.ours) == 1:
            name = self.ours[0]
            out = {name: self.layout(0)[1](value, shapes[name]).contiguous()}
            for copy, layout, scale in self.also:
                scaled = value if scale == 1.0 else value * torch.tensor(scale, dtype=value.dtype)
                out[copy] = LAYOUTS[layout][1](scaled, shapes[copy]).contiguous()
            return out
        cols = value.shape[1:]
        rows = [shapes[name].numel() // max(1, cols.numel()) // self.groups for name in self.ours]
        pieces = value.reshape(self.groups, -1, *cols).split(rows, dim=1)
        return {
            name: self.layout(i)[1](piece.reshape(-1, *cols), shapes[name]).contiguous()
            for i, (name, piece) in enumerate(zip(self.ours, pieces, strict=True))
        }


def _module(key: str) -> str:
    """``blocks.0.attn.q.weight`` -> ``blocks.0.attn.q``."""
    return key.rsplit(".", 1)[0] if "." in key else ""


def _stem(leaf: str) -> str:
    """``W_Q`` / ``_W_K`` / ``b_in`` / ``w`` -> ``q`` / ``k`` / ``in`` / ``w``: a converted leaf's role."""
    return re.sub(r"^_?[Wb]_", "", leaf).lower()


def _affinity(source: str, ours: str) -> int:
    """How well a converted key's name corresponds to a source key's (ties among equal values: tied embeddings,
    a shared norm, zero biases)."""
    module, leaf = _module(source), source.rsplit(".", 1)[-1]
    our_module, our_leaf = _module(ours), ours.rsplit(".", 1)[-1]
    score = 0
    if our_module == module:
        score += 4
    elif our_module == _module(module) and _stem(our_leaf) == module.rsplit(".", 1)[-1].lower():
        score += 3
    weight = our_leaf.lstrip("_")[:1] in ("W", "w")
    score += int(weight == (leaf == "weight"))
    return score


def _scope(key: str) -> str:
    """The block a key belongs to (``blocks.3.``), or "" for the model's top-level modules."""
    match = re.match(r"(blocks\.\d+\.)", key)
    return match.group(1) if match else ""


def _layouts(x: Tensor, shape: torch.Size) -> Iterator[str]:
    """The layouts of :data:`LAYOUTS` that take ``x`` to ``shape`` (worked out on the meta device: no data)."""
    meta = torch.empty(x.shape, device="meta")
    for name, (forward, _) in LAYOUTS.items():
        if (name == "T" and x.dim() != 2) or (name.startswith(("in_", "out_")) and x.dim() != 3):
            continue
        if (name == "flat" and x.dim() < 2) or x.numel() != shape.numel():
            continue
        if forward(meta).shape == shape:
            yield name


def _holds(x: Tensor, s: Tensor, layout: str) -> bool:
    """Whether ``x`` in ``layout`` is exactly ``s``, compared in ``x``'s layout: ``s`` taken back is a view of it
    for :data:`LAYOUTS` (their way back only splits and permutes dimensions), so nothing is copied."""
    view = _EVERY_LAYOUT[layout][1](s, x.shape)
    return torch.equal(view[:1], x[:1]) and torch.equal(view, x)  # the first row first: most candidates differ there


def _pair(key: str, s: Tensor, candidates: dict[str, Tensor]) -> SourceKey | None:
    """Two converted tensors whose layouts, stacked along the rows (per group), are exactly ``s``."""
    if s.dim() != 2:
        return None
    names = list(candidates)
    for i, a in enumerate(names):
        for b in names[i + 1 :] + names[:i]:
            x, y = candidates[a], candidates[b]
            if x.numel() + y.numel() != s.numel():
                continue
            rows_a, rows_b = x.numel() // s.shape[1], y.numel() // s.shape[1]
            for g in sorted({1, x.shape[0] if x.dim() == 3 else 1}):
                if rows_a % g or rows_b % g:
                    continue
                first, second = s.reshape(g, -1, s.shape[1]).split([rows_a // g, rows_b // g], dim=1)
                first, second = first.reshape(rows_a, s.shape[1]), second.reshape(rows_b, s.shape[1])
                for la in _layouts(x, first.shape):
                    if not _holds(x, first, la):
                        continue
                    for lb in _layouts(y, second.shape):
                        if _holds(y, second, lb):
                            return SourceKey(key, (a, b), (la, lb), g)
    return None


def _offset(key: str, s: Tensor, candidates: dict[str, Tensor]) -> SourceKey | None:
    """A 1-D converted tensor holding exactly ``1 + s`` as the source computes it (:data:`OFFSETS`): an offset
    norm's weight."""
    if s.dim() != 1 or not s.is_floating_point():
        return None
    hits = [
        (name, layout)
        for layout in OFFSETS
        for name, x in candidates.items()
        if x.shape == s.shape and _holds(x, s, layout)
    ]
    if not hits:
        return None
    name, layout = max(hits, key=lambda hit: _affinity(key, hit[0]))
    return SourceKey(key, (name,), (layout,))


def find_source_keys(source_state: dict[str, Tensor], ours: dict[str, Tensor]) -> tuple[list[SourceKey], list[str]]:
    """Each source key's converted tensors and layout (exact values, else a pair, else an offset norm), and the
    source keys no converted tensor holds."""
    found: list[SourceKey] = []
    missing: list[str] = []
    for key, s in source_state.items():
        scope = _scope(key)
        candidates = {
            name: x.detach()
            for name, x in ours.items()
            if _scope(name) == scope and x.dtype == s.dtype and x.device == s.device
        }
        hits = [
            (name, layout) for name, x in candidates.items() for layout in _layouts(x, s.shape) if _holds(x, s, layout)
        ]
        if hits:
            name, layout = max(hits, key=lambda hit: _affinity(key, hit[0]))  # the first of the best named
            found.append(SourceKey(key, (name,), (layout,)))
            continue
        other = _pair(key, s, candidates) or _offset(key, s, candidates)
        if other is None:
            missing.append(key)
        else:
            found.append(other)
    return _with_copies(found, source_state, ours), missing


def _trivial(x: Tensor) -> bool:
    """Whether every entry of ``x`` is the same (zeros, ones): such a tensor cannot say which key it holds."""
    return x.numel() == 0 or bool(x.amin() == x.amax())


def _scale(x: Tensor, s: Tensor) -> float | None:
    """The scalar ``m`` (in ``s``'s dtype, not 0 or 1) with ``x == s · m`` exactly (``s`` in ``x``'s layout), or
    None: the ratio at the largest of ``s``'s first entries, rounded to the dtype, and its neighbours; checked a block
    of rows at a time (no whole-tensor product)."""
    flat_s, flat_x = s.reshape(-1), x.reshape(-1)
    i = int(flat_s[: 1 << 12].abs().argmax())  # among the first entries: no whole-tensor temporary
    if flat_s[i] == 0 or flat_x[i] == 0:
        return None
    ratio = torch.tensor(float(flat_x[i]) / float(flat_s[i]), dtype=s.dtype)
    inf = torch.tensor(float("inf"), dtype=s.dtype)
    step = max(1, (1 << 16) // max(1, s[0].numel())) if s.dim() else 1
    for m in (ratio, torch.nextafter(ratio, inf), torch.nextafter(ratio, -inf)):
        if float(m) != 1.0 and all(
            torch.equal(s[r : r + step] * m, x[r : r + step]) for r in range(0, max(1, len(s)), step)
        ):
            return float(m)
    return None


def _copy_of(name: str, other: str, x: Tensor, s: Tensor) -> tuple[str, float] | None:
    """``x`` (converted, unclaimed) in a layout that is ``s`` exactly (a copy) or ``s`` times a scalar."""
    for layout in _layouts(x, s.shape):
        if _holds(x, s, layout):
            if not _trivial(s) or other.rsplit(".", 1)[-1] == name.rsplit(".", 1)[-1]:  # zero biases: same name only
                return layout, 1.0
        elif not _trivial(s) and s.dim() > 0:
            scale = _scale(x, LAYOUTS[layout][1](s, x.shape))
            if scale is not None:
                return layout, scale
    return None


def _with_copies(found: list[SourceKey], source_state: dict[str, Tensor], ours: dict[str, Tensor]) -> list[SourceKey]:
    """Each single-tensor key with the converted tensors that no key claims, in a sibling module of the one claimed,
    and that hold its values exactly, or exactly times a scalar, in some layout: further converted tensors made from
    one source tensor (``also``)."""
    claimed = {name for entry in found for name in entry.ours}
    out = []
    for entry in found:
        if len(entry.ours) == 1 and entry.layouts[0] in LAYOUTS:
            name, s = entry.ours[0], source_state[entry.key]
            parent = _module(_module(name))  # sibling modules only (ln1 / ln2, embed / unembed)
            also = []
            for other, x in ours.items():
                if (
                    other in claimed
                    or x.numel() != s.numel()
                    or x.dtype != s.dtype
                    or _module(_module(other)) != parent
                ):
                    continue
                hit = _copy_of(name, other, x.detach(), s)
                if hit is not None:
                    also.append((other, *hit))
                    claimed.add(other)
            if also:
                entry = SourceKey(entry.key, entry.ours, entry.layouts, entry.groups, tuple(also))
        out.append(entry)
    return out


def _state_dict_post_hook(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """``state_dict()``: add the source's keys, computed from the converted model's entries."""
    if prefix or getattr(module, "_own_keys_only", False):  # the top level only; not within own_keys()
        return
    for entry in getattr(module, "source_keys", ()):
        if all(name in state for name in entry.ours):
            state.setdefault(entry.key, entry.value(state))


def _load_pre_hook(
    module: nn.Module,
    state: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """``load_state_dict()``: a source key becomes the converted tensors it holds; given with them, it must agree."""
    if prefix:
        return
    entries = getattr(module, "source_keys", ())
    given = [entry for entry in entries if entry.key in state]
    module._complete_source_state = bool(entries) and len(given) == len(entries)
    if not given:  # the converted model's own keys: nothing to translate
        return
    shapes = {name: t.shape for name, t in module.named_parameters(remove_duplicate=False)}
    shapes.update((name, t.shape) for name, t in module.named_buffers(remove_duplicate=False))
    for entry in given:
        value = state.pop(entry.key)
        if all(name in state for name in entry.ours):
            derived = entry.value({name: state[name] for name in entry.ours})
            if derived.shape != value.shape or not torch.equal(derived.to(value), value):
                error_msgs.append(
                    f"the state dict holds both {entry.key} (the source's name) and {', '.join(entry.ours)} (the "
                    f"converted model's) with different values: give one of them"
                )
            continue
        try:
            state.update(entry.split(value, shapes))
        except RuntimeError as e:
            error_msgs.append(f"{entry.key}: shape {list(value.shape)} does not fit the source's: {e}")


def _load_post_hook(module: nn.Module, incompatible: Any) -> None:
    """A complete source state dict loads strictly: the converted model's own constants (buffers, the neuron heads'
    fits, tensors constant by construction such as a zero ``b_U``) are not asked of it. Converted tensors holding
    source weights that the source's ``state_dict`` omits (a bridge's state dict lists no MoE experts) stay
    missing."""
    if not getattr(module, "_complete_source_state", False):
        return
    params = dict(module.named_parameters(remove_duplicate=False))
    targeted = {name for entry in module.source_keys for name in (*entry.ours, *(a[0] for a in entry.also))}
    incompatible.missing_keys[:] = [
        k
        for k in incompatible.missing_keys
        if k in targeted or (k in params and not _CONSTRUCTED.search(k) and not _trivial(params[k]))
    ]


# The neuron heads' own constants (Theorem 3's fit terms, the product heads' scales), built by the conversion.
_CONSTRUCTED = re.compile(r"(^|\.)(heads|gate_heads|square_heads|direct_heads|product_heads)\.")


def attach(aot: nn.Module, source: nn.Module) -> None:
    """Give ``aot`` (converted from the bridge ``source``) the source's ``state_dict`` keys (module docstring)."""
    with own_keys(aot):
        entries, missing = find_source_keys(source.state_dict(), aot.state_dict(keep_vars=False))
    aot.source_keys = tuple(entries)
    aot.source_keys_missing = tuple(missing)
    register(aot)


def register(aot: nn.Module) -> None:
    """The hooks that read ``aot.source_keys`` (once per model)."""
    if getattr(aot, "_source_key_hooks", False):
        return
    aot.register_state_dict_post_hook(_state_dict_post_hook)
    aot.register_load_state_dict_pre_hook(_load_pre_hook)
    aot.register_load_state_dict_post_hook(_load_post_hook)
    aot._source_key_hooks = True


@contextmanager
def own_keys(aot: nn.Module) -> Iterator[None]:
    """Within, ``aot.state_dict()`` holds the converted model's own keys only (what :func:`lens_aot.save` stores)."""
    aot._own_keys_only = True
    try:
        yield
    finally:
        aot._own_keys_only = False


def encode(aot: nn.Module) -> list[list[Any]]:
    """``aot.source_keys`` and ``aot.source_keys_missing`` as JSON (for :func:`lens_aot.save`)."""
    entries = [
        [e.key, list(e.ours), list(e.layouts), e.groups, [list(a) for a in e.also]]
        for e in getattr(aot, "source_keys", ())
    ]
    return [entries, list(getattr(aot, "source_keys_missing", ()))] if entries else []


def restore(aot: nn.Module, data: list[list[Any]]) -> None:
    """The source's keys of a model :func:`lens_aot.load` rebuilt (``data`` from :func:`encode`)."""
    if not data:
        return
    entries, missing = data
    aot.source_keys = tuple(
        SourceKey(key, tuple(ours), tuple(layouts), int(groups), tuple((n, lay, float(m)) for n, lay, m in also))
        for key, ours, layouts, groups, also in entries
    )
    aot.source_keys_missing = tuple(missing)
    register(aot)
