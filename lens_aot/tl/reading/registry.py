"""The registry of bridge readers: which reader reads which source, attention bridge or attention forward.

:func:`lens_aot.tl.bridge.read.read_bridge` names no variant: it asks this registry. Three tables, each tried in a
fixed order, the first match winning:

* **model readers** (:func:`register_model_reader`): what a bridge's source is read as before its shared pieces
  (norms, MLPs, embeddings): a :class:`~lens_aot.tl.reading.record.ModelReading` (per-layer attention readings, or
  per-layer attention specs read whole) or a whole :class:`~lens_aot.core.spec.model_spec.ModelSpec`. Built in: a
  TransformerLens-native source, DeepSeek-V4's several residual streams, multi-head latent attention, routed attention
  heads, and the Hugging Face default (which reads each layer through the attention readers below). Tried by
  descending ``priority``, then registration order.
* **attention readers** (:func:`register_attention_reader`): one layer's attention bridge component, matched by what
  it is (its bridge class, read by name: TransformerLens's classes are not imported here), read into an
  :class:`~lens_aot.tl.reading.record.AttentionReading`. Built in: ALiBi bridges, the refused bridges, a plain
  ``AttentionBridge`` around a registered attention forward, a delegated rotary forward, the position-embeddings and
  joint-QKV bridges. Tried by descending ``priority``, then registration order; no match: refused.
* **attention forwards** (:func:`register_attention_forward`): the Hugging Face attention module a plain
  ``AttentionBridge`` calls, matched exactly by its class (or the class's name), read by a function
  ``(layer, hf_attn, hf_config, dtype, n_ctx) -> AttentionReading``. Built in: GPT-J, GPT-Neo, OPT, XGLM, Llama 4,
  ModernBERT-decoder. A class key is tried before a name key; a subclass is not its parent (its forward may differ).
* **MLP readers** (:func:`register_mlp_reader`): a block's MLP bridge whose wrapped module is not a plain dense MLP,
  matched by what the module is (its structure), read into an ``MLPSpec`` or ``MoESpec``. Built in: Llama 4's MoE,
  sparse top-k MoEs, JetMoE's parallel experts (and the refusal of its other forms), a dense MLP inside an MoE bridge,
  xIELU's learned scalars. Tried by descending ``priority``, then registration order; no match: the dense MLP bridge
  is read (:func:`lens_aot.tl.reading.mlp.read_mlp`).

The built-in readers register through these same functions when :mod:`lens_aot.tl` is imported
(:mod:`lens_aot.tl.builtin_readers`). A reader outside lens_aot registers the same way; whatever it reads is still
checked piece by piece against the source's recorded forward, so a wrong reading is refused, never converted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Generic, Protocol, TypeVar

import torch
from torch import nn

from lens_aot.tl.reading.pieces import wrapped_module
from lens_aot.tl.reading.record import AttentionReading, ModelReading

__all__ = [
    "ATTENTION_FORWARDS",
    "AttentionContext",
    "AttentionForward",
    "AttentionReader",
    "MLPReader",
    "ModelReader",
    "Reader",
    "ReaderTable",
    "SourceReader",
    "attention_forward",
    "attention_readers",
    "mlp_readers",
    "model_reader",
    "model_readers",
    "register_attention_forward",
    "register_attention_reader",
    "register_mlp_reader",
    "register_model_reader",
    "register_source_reader",
    "source_reader",
    "source_readers",
    "unregister_attention_forward",
    "unregister_attention_reader",
    "unregister_mlp_reader",
    "unregister_model_reader",
    "unregister_source_reader",
]

# ---------------------------------------------------------------------------------------------------------------
# Model readers.
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelReader:
    """A model-level reader. ``matches(bridge, model)``: whether it reads this bridge (``model``: the wrapped source
    module; called before any check, so it must not raise). ``read(bridge, model, blocks, dtype)``: a
    :class:`ModelReading`, or a whole ``ModelSpec`` (returned as it is). ``check(bridge, model)``: refusals before
    the blocks are read (e.g. :func:`lens_aot.tl.bridge.checks.check_hf_source`); ``check_block(layer, block)``:
    each block's refusals before ``read`` (e.g. :func:`lens_aot.tl.bridge.checks.check_block`)."""

    name: str
    matches: Callable[[Any, nn.Module], bool]
    read: Callable[[Any, nn.Module, list[Any], torch.dtype], Any]
    check: Callable[[Any, nn.Module], None] | None = None
    check_block: Callable[[int, Any], None] | None = None
    priority: int = 0


class _Entry(Protocol):
    """What a table's entry has: a name, a priority and a ``matches`` test."""

    @property
    def name(self) -> str: ...

    @property
    def priority(self) -> int: ...

    @property
    def matches(self) -> Callable[..., bool]: ...


R = TypeVar("R", bound=_Entry)


class ReaderTable(Generic[R]):
    """A table of named readers of one kind, tried by descending ``priority``, then registration order; ``what``
    names an entry in errors. ``unregister_*`` and ``*_readers`` are its :meth:`unregister` and :meth:`entries`."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._entries: list[R] = []

    def add(self, entry: R) -> R:
        """Add ``entry`` after every entry of its priority or higher (a ValueError when its name is taken); returns
        it."""
        if any(other.name == entry.name for other in self._entries):
            raise ValueError(f"a reader named {entry.name!r} is already registered; unregister it first")
        position = next((i for i, o in enumerate(self._entries) if o.priority < entry.priority), len(self._entries))
        self._entries.insert(position, entry)
        return entry

    def unregister(self, name: str) -> R:
        """Remove the reader ``name`` (KeyError when none is registered under it); returns it."""
        for i, entry in enumerate(self._entries):
            if entry.name == name:
                return self._entries.pop(i)
        raise KeyError(f"no {self.what} named {name!r} is registered (registered: {[e.name for e in self._entries]})")

    def entries(self) -> list[R]:
        """The registered readers, in the order they are tried."""
        return list(self._entries)

    def first(self, *args: Any) -> R | None:
        """The first registered reader whose ``matches(*args)`` holds, or None."""
        return next((entry for entry in self._entries if entry.matches(*args)), None)


M = TypeVar("M")
RD = TypeVar("RD")


@dataclass(frozen=True)
class Reader(Generic[M, RD]):
    """A registered reader of one layer's attention or one block's MLP: its ``name``, its ``matches`` test, its
    ``read`` and its ``priority`` (:class:`AttentionReader`, :class:`MLPReader`)."""

    name: str
    matches: M
    read: RD
    priority: int = 0


_MODEL_READERS = ReaderTable[ModelReader]("model reader")


def register_model_reader(
    name: str,
    matches: Callable[[Any, nn.Module], bool],
    read: Callable[[Any, nn.Module, list[Any], torch.dtype], ModelReading | Any],
    *,
    check: Callable[[Any, nn.Module], None] | None = None,
    check_block: Callable[[int, Any], None] | None = None,
    priority: int = 0,
) -> ModelReader:
    """Register a model-level reader (:class:`ModelReader`); the first whose ``matches`` holds reads the bridge.
    Built-in priorities: native 400, several residual streams 300, MLA 200, routed heads 100, Hugging Face default
    -1000 (it matches every source)."""
    return _MODEL_READERS.add(ModelReader(name, matches, read, check, check_block, priority))


unregister_model_reader = _MODEL_READERS.unregister
model_readers = _MODEL_READERS.entries


def model_reader(bridge: Any, model: nn.Module) -> ModelReader:
    """The first registered model reader whose ``matches(bridge, model)`` holds."""
    entry = _MODEL_READERS.first(bridge, model)
    if entry is not None:
        return entry
    raise LookupError(f"no registered model reader reads a {type(model).__name__} (registered: {model_readers()})")


# ---------------------------------------------------------------------------------------------------------------
# Attention readers (one layer's attention bridge).
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionContext:
    """What an attention reader reads one layer from: the layer's attention bridge ``attn``, the source's Hugging
    Face config, the bridge's config, the model dtype, ``n_ctx`` and the model's ``rotary_emb`` component (None
    without one)."""

    layer: int
    attn: Any
    hf_config: Any
    bridge_cfg: Any
    dtype: torch.dtype
    n_ctx: int
    rotary_bridge: Any = None

    @cached_property
    def hf_attn(self) -> nn.Module:
        """The module the attention bridge wraps (refused when it wraps none)."""
        return wrapped_module(self.attn)

    @property
    def bridge_class(self) -> str:
        """The attention bridge's class name."""
        return type(self.attn).__name__

    @property
    def bridge_classes(self) -> list[str]:
        """The names of the attention bridge's classes, its own first (its MRO)."""
        return [c.__name__ for c in type(self.attn).__mro__]


AttentionMatch = Callable[[AttentionContext], bool]  # must not raise
AttentionRead = Callable[[AttentionContext], AttentionReading]


class AttentionReader(Reader[AttentionMatch, AttentionRead]):
    """An attention reader: ``matches(ctx)`` (must not raise), ``read(ctx)`` → :class:`AttentionReading` (or a
    refusal naming the layer and the piece)."""


_ATTENTION_READERS = ReaderTable[AttentionReader]("attention reader")
unregister_attention_reader = _ATTENTION_READERS.unregister
attention_readers = _ATTENTION_READERS.entries


def register_attention_reader(
    name: str, matches: AttentionMatch, read: AttentionRead, *, priority: int = 0
) -> AttentionReader:
    """Register an attention reader (:class:`AttentionReader`). Built-in priorities: ALiBi 600, refused bridges
    500, registered attention forwards 400, delegated rotary forwards 300, position-embeddings bridges 200, joint-QKV
    position-embeddings bridges 150, joint-QKV bridges 100."""
    return _ATTENTION_READERS.add(AttentionReader(name, matches, read, priority))


# ---------------------------------------------------------------------------------------------------------------
# Attention forwards (the Hugging Face module a plain AttentionBridge calls).
# ---------------------------------------------------------------------------------------------------------------

ForwardRead = Callable[[int, nn.Module, Any, torch.dtype, int], AttentionReading]


@dataclass(frozen=True)
class AttentionForward:
    """How a Hugging Face attention forward is read: ``read(layer, hf_attn, hf_config, dtype, n_ctx)``. The common
    refusals run first (extra components, sinks, clipping, non-causal attention); then a score soft-cap or a binding
    sliding window is refused unless ``windows`` (the reader then reads the window itself)."""

    key: type | str
    read: ForwardRead
    windows: bool = False


# Keyed by a module class or a class name; read with attention_forward (a class key first).
ATTENTION_FORWARDS: dict[type | str, AttentionForward] = {}


def register_attention_forward(
    key: type | str, read: ForwardRead, *, windows: bool = False, replace: bool = False
) -> AttentionForward:
    """Register how the attention module class ``key`` (or every class of that name) is read; ``replace``: over an
    existing registration (else a ValueError)."""
    if not isinstance(key, type | str):
        raise TypeError(f"an attention forward is keyed by a module class or a class name, not {key!r}")
    if key in ATTENTION_FORWARDS and not replace:
        raise ValueError(f"an attention forward for {key!r} is already registered; pass replace=True to replace it")
    entry = AttentionForward(key, read, windows)
    ATTENTION_FORWARDS[key] = entry
    return entry


def unregister_attention_forward(key: type | str) -> AttentionForward:
    """Remove the attention forward registered under ``key`` (KeyError when none is); returns it."""
    if key not in ATTENTION_FORWARDS:
        raise KeyError(f"no attention forward is registered for {key!r}")
    return ATTENTION_FORWARDS.pop(key)


def attention_forward(hf_attn: nn.Module) -> AttentionForward | None:
    """The forward registered for ``hf_attn``'s exact class, else for its class's name, else None."""
    cls = type(hf_attn)
    return ATTENTION_FORWARDS.get(cls) or ATTENTION_FORWARDS.get(cls.__name__)


# ---------------------------------------------------------------------------------------------------------------
# MLP readers (a block's MLP bridge).
# ---------------------------------------------------------------------------------------------------------------


MLPMatch = Callable[[Any, nn.Module, str], bool]  # (mlp_bridge, module, act_fn); must not raise
MLPRead = Callable[[Any, nn.Module, int, torch.dtype, str], Any]  # (mlp_bridge, module, layer, dtype, act_fn)


class MLPReader(Reader[MLPMatch, MLPRead]):
    """An MLP reader: ``matches(mlp_bridge, module, act_fn)`` (``module``: the module the bridge wraps, unwrapped;
    ``act_fn``: the activation read off the module or config; must not raise), ``read(mlp_bridge, module, layer,
    dtype, act_fn)`` → an ``MLPSpec`` or ``MoESpec`` (or a refusal naming the layer)."""


_MLP_READERS = ReaderTable[MLPReader]("MLP reader")
unregister_mlp_reader = _MLP_READERS.unregister
mlp_readers = _MLP_READERS.entries


def register_mlp_reader(name: str, matches: MLPMatch, read: MLPRead, *, priority: int = 0) -> MLPReader:
    """Register an MLP reader (:class:`MLPReader`). Built-in priorities: Llama 4's MoE 600, sparse MoEs 500,
    parallel experts 400, other JetMoE forms (refused) 300, a dense MLP in an MoE bridge 200, xIELU 100."""
    return _MLP_READERS.add(MLPReader(name, matches, read, priority))


# ---------------------------------------------------------------------------------------------------------------
# Source readers.
# ---------------------------------------------------------------------------------------------------------------


SourceMatch = Callable[[Any], bool]  # (model); called on anything passed to convert, so it must not raise
SourceRead = Callable[[Any], Any]  # (model) -> its ModelSpec, refusing (layer and piece named) what it cannot express
SourceReader = Reader[SourceMatch, SourceRead]
"""A reader of a whole source model (``convert``'s input): ``matches(model)`` and ``read(model)``."""

_SOURCE_READERS = ReaderTable[SourceReader]("source reader")


def register_source_reader(name: str, matches: SourceMatch, read: SourceRead, *, priority: int = 0) -> SourceReader:
    """Register a source reader (:data:`SourceReader`): the first whose ``matches(model)`` holds reads what
    ``convert`` is given. Built in: ``"HookedTransformer"`` (TransformerLens 3.x, :mod:`lens_aot.tl.hooked.read`) and
    ``"TransformerBridge"`` (:mod:`lens_aot.tl.bridge.read`), both at priority 0."""
    return _SOURCE_READERS.add(SourceReader(name, matches, read, priority))


unregister_source_reader = _SOURCE_READERS.unregister
source_readers = _SOURCE_READERS.entries


def source_reader(model: Any) -> SourceReader | None:
    """The first registered source reader whose ``matches(model)`` holds, or None (``convert`` then refuses the
    model, naming what it takes)."""
    return _SOURCE_READERS.first(model)
