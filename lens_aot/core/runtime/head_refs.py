"""What the converted model's head-address methods return (:meth:`~lens_aot.core.runtime.model.AttentionOnlyTransformer.
neuron_heads`, ``head_origin``, ``sublayers``): plain named tuples, re-exported by
:mod:`lens_aot.core.runtime.model`."""

from __future__ import annotations

from typing import Literal, NamedTuple

from lens_aot.core.names import Expert, HeadKind, parse_module

__all__ = ["ExpertHeadOrigin", "HeadOrigin", "HeadRef", "Sublayer"]


class HeadRef(NamedTuple):
    """A head of the converted model: ``name`` is its head module's hook prefix (``blocks.3.attn``,
    ``blocks.3.mlp.heads``, ...), ``head`` its index there; :attr:`kind` what its heads compute."""

    name: str
    head: int

    @property
    def kind(self) -> HeadKind:
        """What the head computes, named by its module: "attention", "neuron" (a plain MLP's Theorem 3 heads),
        "gate", "square" / "direct" (a chained gate's inner stages, writing the scratch the product heads read) or
        "product"."""
        return parse_module(self.name).kind


class HeadOrigin(NamedTuple):
    """What a head of the converted model was in the source.

    ``kind`` "attention": head ``index`` of source layer ``layer``'s attention. ``kind`` "neuron": neuron ``index`` of
    source layer ``layer``'s MLP, ``component`` the head's position in ``neuron_heads(layer, index)``. Heads of an
    expert of a mixture-of-experts layer have an :class:`ExpertHeadOrigin`. ``kind`` "per_layer": neuron ``index`` of
    Gemma 4's per-layer-input sublayer (``neuron_heads(layer, index, sublayer="per_layer")``).
    """

    kind: Literal["attention", "neuron", "per_layer"]
    layer: int
    index: int
    component: int

    @property
    def expert(self) -> Expert:
        """None: the head is not an expert's."""
        return None


class ExpertHeadOrigin(NamedTuple):
    """What a neuron head of a mixture-of-experts layer was: neuron ``index`` of expert ``expert`` (an index, or
    ``"shared"``) of source layer ``layer``'s MLP; ``component``: its place in ``neuron_heads(layer, index, ...)``."""

    kind: Literal["neuron"]
    layer: int
    index: int
    component: int
    expert: int | Literal["shared"]


class Sublayer(NamedTuple):
    """One attention-only sub-layer in the paper's flat ordering: ``name`` its head module, ``kind`` what its heads
    compute, ``layer`` the source layer it belongs to."""

    index: int
    name: str
    kind: HeadKind
    layer: int
