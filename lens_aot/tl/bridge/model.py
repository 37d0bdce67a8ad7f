"""The converted model of a TransformerBridge as a ``TransformerBridge`` (TransformerLens 4.x), for code that checks
the class (issue 23, item 1).

TransformerLens 4's own tools and code written against a bridge check ``isinstance(model, TransformerBridge)``
(``direct_logit_attribution``'s compatibility-mode checks, ``JacobianLens``) and ``isinstance(model.cfg,
TransformerBridgeConfig)``. :func:`bridge_class` gives the converted model's class with ``TransformerBridge`` as a
*last* base, as :func:`lens_aot.tl.hooked.model.hooked_class` adds ``HookedTransformer`` under 3.x: the converted
model's own methods, weights, hooks and forward come first. Every name the bridge's classes define is in exactly one
place (``tests/interop/test_bridge_class.py`` enumerates them and fails on a new one):

- the converted model defines it (``forward``, ``run_with_cache``, ``set_use_*``, the stacked weights, ...): its own;
- ``torch.nn.Module`` defines it (:data:`TORCH`): torch's own is restored (the bridge's ``__getattr__`` /
  ``__setattr__`` / ``state_dict`` / ``parameters`` / ``to`` delegate to a wrapped Hugging Face model that a
  converted model does not have);
- :data:`INSTANCE`: a property on the bridge, a plain attribute of the converted model (``hook_dict``,
  ``tokenizer``, ...): the instance's value is read;
- :data:`APPLIES`: a bridge method that reads only what the converted model provides (``layer_types``,
  ``get_token_position``, ``tl_parameters``, ...): inherited unchanged;
- :data:`INAPPLICABLE`: refused with :class:`~lens_aot.errors.InputError` naming what to do instead (calls), or
  :class:`BridgeAttributeError` (an ``InputError`` that is also an ``AttributeError``, so ``getattr(model,
  "original_model", None)`` still gives None) for attributes; private helpers of those methods are left as they are.

Nothing here imports TransformerLens 4 names at module import time.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any, NoReturn

from torch import nn

from lens_aot.errors import InputError
from lens_aot.tl.versions import has_hooked_transformer

__all__ = [
    "APPLIES",
    "INAPPLICABLE",
    "INSTANCE",
    "TORCH",
    "REFUSED_ATTRIBUTES",
    "BridgeAttributeError",
    "bridge_class",
    "bridge_config_class",
    "has_transformer_bridge",
]

_REBUILD = "convert the source again: lens_aot.convert(source)"
_LOAD = "load the source with TransformerBridge.boot_transformers(name) (or boot_native), then lens_aot.convert(source)"

# nn.Module names the bridge overrides to act on its wrapped Hugging Face model: torch's own on the converted model.
TORCH = (
    "__getattr__",
    "__setattr__",
    "__setstate__",
    "__str__",
    "cpu",
    "cuda",
    "load_state_dict",
    "named_parameters",
    "parameters",
    "state_dict",
    "to",
    "train",
)

# Bridge properties that are plain instance attributes of the converted model (HookedRootModule.setup's registries,
# the tokenizer): read from the instance, never through the bridge's property.
INSTANCE = ("hook_dict", "mod_dict", "tokenizer")

# Bridge methods and properties that read only the converted model's own surface: name -> what they read.
APPLIES: dict[str, str] = {
    "OV_for_attn_layers": "OV and the attention layers",
    "QK_for_attn_layers": "QK and the attention layers",
    "W_E_pos": "W_E and W_pos",
    "attn_head_labels": "cfg.n_layers / n_heads",
    "block_hooks": "blocks[l]'s hook points",
    "composition_layer_indices": "the blocks with attention",
    "get_hook_point": "hook_dict (the converted model's own: the bridge's reads its hook registry)",
    "get_params": "the stacked weights (W_Q ... W_out)",
    "get_token_position": "to_tokens / to_str_tokens",
    "hook_aliases": "the converted model's hook names are real hook points: no model-level alias is needed",
    "layer_types": "the blocks' computing submodules, e.g. 'attn+mlp' (the converted model's own: the bridge's "
    "would list the hook points the converted model registers as submodules)",
    "block_submodules": "blocks[l]'s computing submodules (the converted model's own, as layer_types)",
    "mps": "torch's Module.to('mps')",
    "n_params_total": "the converted model's own parameters (the source's weights; an untied W_U, a zero b_U)",
    "stack_params_for": "the blocks' parameters",
    "tl_named_parameters": "the stacked weights",
    "tl_parameters": "the stacked weights",
    "to_single_str_token": "the tokenizer",
}

# Bridge names that do not apply to a converted model: name -> what to do instead.
INAPPLICABLE: dict[str, str] = {
    "boot_native": _LOAD,
    "boot_tl_legacy": _LOAD,
    "boot_transformers": _LOAD,
    "check_model_support": "check the source: TransformerBridge.check_model_support(name)",
    "list_supported_models": "list the source's: TransformerBridge.list_supported_models()",
    "enable_compatibility_mode": "enable it on the source (source.enable_compatibility_mode()), then " + _REBUILD,
    "process_weights": "process the source's weights (source.process_weights(...)), then " + _REBUILD,
    "init_weights": "a converted model's weights are its source's; to start from random weights, re-initialise the "
    "source (source.init_weights()), then " + _REBUILD,
    "original_model": "a converted model wraps no Hugging Face model: its weights live in blocks[l].attn / "
    "blocks[l].mlp (the source's original_model is source.original_model)",
    "adapter": "a converted model has no architecture adapter: its components are lens_aot's (blocks[l].attn, "
    "blocks[l].mlp.heads); the source's is source.adapter",
    "clear_hook_registry": "use aot.reset_hooks() to remove hook functions (the hook registry is fixed)",
    "close": "nothing to release: a converted model runs in this process",
    "generate_stream": "use aot.generate(...)",
    "hf_generate": "use aot.generate(...) (a converted model has no Hugging Face generate)",
    "diffusion_generate": "use aot.generate(...) (converted models are autoregressive decoders)",
    "encoder_output": "a converted model is decoder-only",
    "predict_next_sentence": "a converted model is decoder-only",
    "to_sentence_pair_tokens": "a converted model is decoder-only",
    "prepare_multimodal_inputs": "a converted model reads text tokens only",
}


# INAPPLICABLE names that are attributes of a bridge (instance attributes or properties), not methods.
REFUSED_ATTRIBUTES = frozenset({"original_model", "adapter"})


class BridgeAttributeError(InputError, AttributeError):
    """A ``TransformerBridge`` attribute a converted model does not have (an ``AttributeError`` too, so
    ``getattr(model, name, default)`` gives the default)."""


def has_transformer_bridge() -> bool:
    """Whether this TransformerLens has ``TransformerBridge`` and no ``HookedTransformer`` (4.x)."""

    if has_hooked_transformer():
        return False
    try:
        from transformer_lens.model_bridge import TransformerBridge  # noqa: F401
    except ImportError:
        return False
    return True


_UNVETTED = "use the converted model's own methods (lens_aot.tl.bridge.model lists the bridge's that apply)"


def _message(name: str) -> str:
    return (
        f"TransformerBridge.{name} does not apply to a converted (attention-only) model: it acts on the wrapped "
        f"Hugging Face model and adapter, which a converted model does not have. Instead: "
        f"{INAPPLICABLE.get(name, _UNVETTED)}."
    )


def _refusing(name: str) -> Callable[..., NoReturn]:
    def refused(*args: Any, **kwargs: Any) -> NoReturn:
        raise InputError(_message(name))

    refused.__name__ = refused.__qualname__ = name
    refused.__doc__ = f"Refused on a converted model (raises InputError): {INAPPLICABLE.get(name, _UNVETTED)}."
    return refused


class _Absent:
    """A non-data descriptor hiding a bridge property: an instance value wins, else the lookup falls through to
    ``__getattr__`` (torch's registries, then :class:`BridgeAttributeError` for a refused name)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        raise AttributeError(self.name)


def __getattr__(self: Any, name: str) -> Any:  # noqa: N807 - the class's __getattr__
    """torch's ``Module.__getattr__`` (parameters, buffers, submodules); a refused bridge attribute raises
    :class:`BridgeAttributeError` naming what to do instead."""
    try:
        return nn.Module.__getattr__(self, name)
    except AttributeError:
        if name in INAPPLICABLE or (not name.startswith("_") and name in _bridge_names()):
            raise BridgeAttributeError(_message(name)) from None
        raise


def _module_init(self: Any, *args: Any, **kwargs: Any) -> None:
    """torch's ``Module.__init__`` (the bridge's needs a Hugging Face model and an adapter)."""
    nn.Module.__init__(self, *args, **kwargs)


def _n_params_total(self: Any) -> int:
    """Number of parameters, each counted once (``TransformerBridge.n_params_total``): the source's weights, which
    the neuron heads read without a copy, plus an untied ``unembed.W_U`` where the source ties it to ``W_E`` and the
    zero ``b_U`` where it has none (GPT-2's test bridge: 24,481 against the source's 21,280)."""
    return sum(p.numel() for p in nn.Module.parameters(self))


def _get_hook_point(self: Any, hook_name: str) -> Any:
    """The hook point named ``hook_name`` (aliases included), or None (``TransformerBridge.get_hook_point``)."""
    return self.hook_dict.get(hook_name)


def _block_submodules(self: Any, layer_idx: int) -> list[str]:
    """Block ``layer_idx``'s computing submodules (norms, ``attn``, ``mlp``), hook points aside
    (``TransformerBridge.block_submodules``)."""
    from transformer_lens.hook_points import HookPoint

    return [name for name, module in self.blocks[layer_idx].named_children() if not isinstance(module, HookPoint)]


def _layer_types(self: Any) -> list[str]:
    """Per-block labels ``"attn+mlp"`` / ``"attn"`` (``TransformerBridge.layer_types``: what DLA's hybrid-block check
    reads; a converted block is never a state-space or linear-attention block)."""
    return ["+".join(n for n in ("attn", "mlp") if n in block._modules) or "unknown" for block in self.blocks]


def _mps(self: Any) -> Any:
    """torch's ``Module.to("mps")``."""
    return nn.Module.to(self, "mps")


@cache
def _bridge_names() -> dict[str, Any]:
    """Every name the bridge's own classes (``TransformerBridge``, ``BridgeCore``, ...) define: name -> value."""
    from transformer_lens.model_bridge import TransformerBridge

    names: dict[str, Any] = {}
    for klass in reversed(TransformerBridge.__mro__):
        if klass not in nn.Module.__mro__:
            names.update(vars(klass))
    return names


def _own_names(base: type) -> set[str]:
    """Names the converted model's classes define before torch's ``Module``."""
    out: set[str] = set()
    for klass in base.__mro__:
        if klass in nn.Module.__mro__:
            break
        out |= set(vars(klass))
    return out


@cache
def bridge_class(base: type) -> type:
    """``base`` (the converted model's class) with ``TransformerBridge`` as its last base, every bridge name placed
    as the module docstring says; an unclassified public bridge name is refused (a new TransformerLens release
    cannot slip an untested method in)."""
    from transformer_lens.model_bridge import TransformerBridge

    if issubclass(base, TransformerBridge):
        return base
    own, bridge = _own_names(base), _bridge_names()
    # One class between the converted model's and the bridge's in the method resolution order: torch's methods are
    # restored there, so that the converted model's own super() calls (HookedRootModule.__init__ -> super().__init__)
    # reach nn.Module, never the bridge's versions.
    namespace: dict[str, Any] = {"__init__": _module_init}
    for name in sorted(set(bridge) | set(INAPPLICABLE)):
        if name in TORCH:  # also where the converted model defines it: its super() calls land here
            namespace[name] = getattr(nn.Module, name)
        elif name in own or name in APPLIES:
            continue
        elif name.startswith("_"):
            continue  # dunders the converted model does not need, and the bridge methods' private helpers
        elif name in INSTANCE or name in REFUSED_ATTRIBUTES or isinstance(bridge.get(name), property):
            namespace[name] = _Absent()  # an instance value, else __getattr__ (a refused name: its message)
        else:
            namespace[name] = _refusing(name)
    namespace.update(
        __getattr__=__getattr__,
        n_params_total=property(_n_params_total),
        mps=_mps,
        get_hook_point=_get_hook_point,
        layer_types=_layer_types,
        block_submodules=_block_submodules,
        hook_aliases={},
        compatibility_mode=False,  # the source's, set per instance by the converted model
    )
    torch_first = type("TorchBeforeBridge", (), {**namespace, "__module__": __name__})
    namespace = {"__module__": base.__module__, "__qualname__": base.__qualname__, "__doc__": base.__doc__}
    namespace["__reduce_ex__"] = _reduce_as(base, bridge_class)
    return type(base.__name__, (base, torch_first, TransformerBridge), namespace)


@cache
def bridge_config_class(base: type) -> type:
    """``base`` (the converted model's config class) with ``TransformerBridgeConfig`` as its last base. Its
    ``__setattr__`` routes the hook switches to a bound bridge only; a converted model's config is never bound, so a
    switch set on it is a plain field the converted model reads on its next forward (as on the source)."""
    from transformer_lens.config import TransformerBridgeConfig

    if issubclass(base, TransformerBridgeConfig):
        return base
    namespace = {"__module__": base.__module__, "__qualname__": base.__qualname__, "__doc__": base.__doc__}
    namespace["__reduce_ex__"] = _reduce_as(base, bridge_config_class)
    return type(base.__name__, (base, TransformerBridgeConfig), namespace)


def _reduce_as(base: type, derive: Callable[[type], type]) -> Callable[[Any, int], Any]:
    """``__reduce_ex__`` that pickles an instance by ``base`` (importable by name) and rebuilds it as
    ``derive(base)``."""

    def __reduce_ex__(self: Any, protocol: int) -> Any:  # noqa: N807
        reduced = object.__reduce_ex__(self, protocol)
        if isinstance(reduced, tuple) and len(reduced) > 2 and reduced[1][:1] == (type(self),):
            reduced = (new_bridge_instance, (base, derive.__name__), *reduced[2:])
        return reduced

    return __reduce_ex__


def new_bridge_instance(base: type, derive: str) -> Any:
    """An empty instance of ``derive(base)`` (the unpickling of :func:`_reduce_as`)."""
    cls = {"bridge_class": bridge_class, "bridge_config_class": bridge_config_class}[derive](base)
    return object.__new__(cls)
