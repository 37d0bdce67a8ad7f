"""The converted model's map between source neurons and heads: the paper's flat order of head sub-layers
(:meth:`NeuronHeadMap.sublayers`), the heads of a neuron (:meth:`NeuronHeadMap.neuron_heads`) and the neuron of a
head (:meth:`NeuronHeadMap.head_origin`), Theorem 3's heads per neuron (Huben & Morris 2023)."""

from __future__ import annotations

from typing import Any, Literal

from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens import ActivationCache

from lens_aot.core.components.moe.moe_mlp import MoEMLP
from lens_aot.core.fit.per_layer import per_layer_heads
from lens_aot.core.names import Expert, module_expert, parse_module
from lens_aot.core.runtime.head_refs import ExpertHeadOrigin, HeadOrigin, HeadRef, Sublayer
from lens_aot.errors import IndexRangeError, InputError


class NeuronHeadMap:
    """Mixin for a model with ``blocks`` (each a :class:`~lens_aot.core.components.residual.block.TransformerBlock`,
    ``mlp`` a :class:`~lens_aot.core.components.mlp.neuron_mlp.NeuronMLP` or a mixture of experts of them where the
    source layer has an MLP)."""

    blocks: Any

    def sublayers(self) -> list[Sublayer]:
        """The head modules in the paper's flat order (layer 0's attention, its MLP's neuron heads, layer 1, ...)."""
        out: list[Sublayer] = []
        for layer, block in enumerate(self.blocks):
            out.append(Sublayer(len(out), f"blocks.{layer}.attn", "attention", layer))
            if block.has_mlp:
                for attr, _ in block.mlp.head_modules():
                    name = f"blocks.{layer}.mlp.{attr}"
                    out.append(Sublayer(len(out), name, parse_module(name).kind, layer))
        return out

    def sublayer(self, key: str | int) -> Sublayer:
        """A sub-layer by its head-module name or its index in :meth:`sublayers`."""
        subs = self.sublayers()
        if isinstance(key, int):
            if not -len(subs) <= key < len(subs):
                raise IndexRangeError(f"sub-layer {key} out of range: the model has {len(subs)} sub-layers")
            return subs[key]
        for sub in subs:
            if sub.name == key:
                return sub
        parse_module(key)  # a malformed name: say what the forms are
        raise InputError(f"{key!r} is not a head module of this model; aot.sublayers() lists them")

    def head_module(self, name: str) -> nn.Module:
        """The module holding the heads named ``name`` (``blocks.3.attn``, ``blocks.3.mlp.heads``, ...)."""
        layer, kind = parse_module(name)
        block = self.blocks[self._layer(layer)]
        if kind == "attention":
            return block.attn
        try:  # mlp.heads, mlp.experts.{e}.heads of a mixture of experts, or Gemma 4's per_layer.gate_heads
            return block.get_submodule(name.split(".", 2)[2])
        except AttributeError:
            raise InputError(f"{name!r} is not a head module of this model; aot.sublayers() lists them") from None

    def _head_modules(self) -> list[tuple[str, nn.Module]]:
        return [(sub.name, self.head_module(sub.name)) for sub in self.sublayers()]

    def neuron_modules(self, layer: int) -> list[str]:
        """Names of the modules holding source layer ``layer``'s neuron heads, in order: ``mlp.heads`` for a plain
        MLP; ``mlp.gate_heads`` then ``mlp.product_heads`` for a gated one (a gated relu² / xIELU MLP: ``square_heads``
        and, xIELU, ``direct_heads`` between them); none for a layer without an MLP."""
        block = self.blocks[self._layer(layer)]
        if not block.has_mlp:
            return []
        return [f"blocks.{layer % len(self.blocks)}.mlp.{attr}" for attr, _ in block.mlp.head_modules()]

    def neuron_module(self, layer: int) -> str:
        """The module whose heads write source layer ``layer``'s MLP output (gated MLPs: the product heads)."""
        names = self.neuron_modules(layer)
        if not names:
            raise ValueError(f"source layer {layer} has no MLP, so it has no neuron heads")
        return names[-1]

    def neuron_heads(
        self, layer: int, neuron: int, expert: Expert = None, sublayer: Literal["mlp", "per_layer"] = "mlp"
    ) -> list[HeadRef]:
        """The heads that together compute neuron ``neuron`` of source layer ``layer``'s MLP (``sublayer=
        "per_layer"``: of Gemma 4's per-layer-input sublayer, ``blocks.{l}.per_layer``, gated, labels ``L{l}P{n}``).

        Plain MLPs: one head per term of the activation's fit. Gated MLPs: the gate heads (one per term of the gate
        activation's fit), then the neuron's two product heads (``+``, ``−``); a gated relu² / xIELU MLP's gate is a
        chained product, whose square pair (and xIELU's direct heads) come between them, so every head that computes
        part of the neuron is listed once (each :class:`HeadRef`'s ``kind`` names its stage). An xIELU MLP: its
        direct heads, its gate head, its product pair. Mixture-of-experts layers: neuron
        ``neuron`` of expert ``expert`` (an index, or ``"shared"`` for the shared expert), whose heads' output is
        scaled by the expert's router weight at each position.
        """
        block = self.blocks[self._layer(layer)]
        if sublayer != "mlp":
            return per_layer_heads(block, layer % len(self.blocks), neuron, expert, sublayer)
        if not block.has_mlp:
            raise ValueError(f"source layer {layer} has no MLP, so it has no neuron heads")
        prefix = f"blocks.{layer % len(self.blocks)}.mlp"
        if isinstance(block.mlp, MoEMLP):
            if expert is None:
                raise InputError(
                    f"source layer {layer}'s MLP is a mixture of {block.mlp.n_experts} experts: name the expert, "
                    f"aot.neuron_heads({layer}, {neuron}, expert=e) with e in 0..{block.mlp.n_experts - 1}"
                    + (" or 'shared'" if hasattr(block.mlp, "shared_expert") else "")
                )
            return [HeadRef(f"{prefix}.{attr}", head) for attr, head in block.mlp.neuron_heads(neuron, expert)]
        if expert is not None:
            raise InputError(f"source layer {layer}'s MLP is not a mixture of experts; leave expert unset")
        if not 0 <= neuron < block.mlp.d_mlp:
            raise IndexRangeError(
                f"neuron {neuron} out of range: layer {layer}'s MLP has d_mlp={block.mlp.d_mlp} (neurons 0 .. "
                f"{block.mlp.d_mlp - 1})"
            )
        return [HeadRef(f"{prefix}.{attr}", head) for attr, head in block.mlp.neuron_heads(neuron)]

    def head_origin(self, name: str, head: int) -> HeadOrigin | ExpertHeadOrigin:
        """Inverse of :meth:`neuron_heads`: what head ``head`` of module ``name`` (e.g. "blocks.3.mlp.heads") was.

        For a neuron head, ``component`` is its position in ``neuron_heads(layer, index)`` (``expert``: of that
        expert, for a module of a mixture-of-experts layer such as "blocks.3.mlp.experts.5.gate_heads").
        """
        layer, kind = parse_module(name)
        module = self.head_module(name)
        if not 0 <= head < module.n_heads:
            raise IndexRangeError(
                f"head {head} out of range: {name} has {module.n_heads} heads (0 .. {module.n_heads - 1})"
            )
        if kind == "attention":
            return HeadOrigin("attention", layer, head, 0)
        k = module.heads_per_neuron
        if ".per_layer." in name:  # Gemma 4's per-layer-input neurons (core/components/mlp/per_layer_neurons.py)
            offset = _offset(self.blocks[layer].per_layer, name)
            return HeadOrigin("per_layer", layer, head // k, offset + head % k)
        expert = module_expert(name)
        mlp = self.blocks[layer].mlp if expert is None else self.blocks[layer].mlp.expert(expert)
        offset = _offset(mlp, name)
        if expert is None:
            return HeadOrigin("neuron", layer, head // k, offset + head % k)
        return ExpertHeadOrigin("neuron", layer, head // k, offset + head % k, expert)

    def neuron_activations(self, cache: ActivationCache | dict[str, Tensor], layer: int) -> Float[Tensor, "... d_mlp"]:
        """A source layer's MLP activations: ``cache["post", layer]`` (``blocks.{l}.mlp.hook_post``)."""
        self.neuron_module(layer)  # raises for a layer without an MLP
        return cache[f"blocks.{layer % len(self.blocks)}.mlp.hook_post"]

    def _layer(self, layer: int) -> int:
        n = len(self.blocks)
        if not -n <= layer < n:
            raise IndexRangeError(f"source layer {layer} out of range: the source had {n} layers")
        return layer % n


def _offset(mlp: Any, name: str) -> int:
    """Where the heads of module ``name`` start among each neuron's heads (``neuron_heads``): the heads per neuron of
    the MLP's modules before it, in forward order."""
    attr = name.rsplit(".", 1)[1]
    offset = 0
    for other, heads in mlp.head_modules():
        if other == attr:
            return offset
        offset += int(heads.heads_per_neuron)
    raise InputError(f"{name!r} is not a head module of this model; aot.sublayers() lists them")
