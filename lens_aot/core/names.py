"""Names of the converted model's parts: hook-module names, head and neuron labels, and the old flat layout.

The converted model is numbered like its source (``blocks.{l}`` is source layer ``l``). Its head modules are
``blocks.{l}.attn`` (the source's heads) and, replacing the MLP, ``blocks.{l}.mlp.heads`` (plain MLPs) or
``blocks.{l}.mlp.gate_heads`` and ``blocks.{l}.mlp.product_heads`` (gated MLPs; a gated relu² / xIELU MLP's gate, a
chained product, adds ``blocks.{l}.mlp.square_heads`` and, xIELU, ``blocks.{l}.mlp.direct_heads`` between them).
Labels: ``L3H2`` (attention head),
``L3N17`` (neuron), ``L3N17.2`` (the neuron's head at position 2 of ``aot.neuron_heads(3, 17)``), ``L3N17.4+5`` (a
gated neuron's two product heads, positions 4 and 5, together: the unit patching and attribution use for them).
Mixture-of-experts layers hold each expert's modules under ``blocks.{l}.mlp.experts.{e}`` (the shared expert:
``blocks.{l}.mlp.shared_expert``), labelled ``L3E5N17`` / ``L3SN17`` with the same suffixes. Gemma 4's per-layer-input
sublayer's neuron heads are ``blocks.{l}.per_layer.gate_heads`` / ``product_heads``, labelled ``L3P17``
(:func:`per_layer_label`). This module is the one parser of both.
"""

from __future__ import annotations

import re
from typing import Literal, NamedTuple

from lens_aot.errors import InputError

HeadKind = Literal["attention", "neuron", "gate", "square", "direct", "product"]
# the attribute of a block's ``mlp`` holding each kind of neuron head, in forward order (square and direct heads: the
# inner stages of a chained gate, lens_aot.core.components.mlp.chained_gated_mlp, writing the product heads' scratch)
NEURON_MODULES: dict[str, HeadKind] = {
    "heads": "neuron",
    "gate_heads": "gate",
    "square_heads": "square",
    "direct_heads": "direct",
    "product_heads": "product",
}

_EXPERT = r"(?:experts\.(0|[1-9]\d*)\.|(shared_expert)\.)?"
_MODULE = re.compile(
    rf"^blocks\.(0|[1-9]\d*)\.(attn|mlp\.{_EXPERT}(heads|gate_heads|square_heads|direct_heads|product_heads)|per_layer\.(gate_heads|product_heads))$"
)
_LABEL = re.compile(
    r"^L(0|[1-9]\d*)(?:H(0|[1-9]\d*)|(?:E(0|[1-9]\d*)|(S))?N(0|[1-9]\d*)(?:\.(0|[1-9]\d*)(?:\+(0|[1-9]\d*))?)?)$"
)
Expert = int | Literal["shared"] | None  # an expert of a mixture-of-experts layer, its shared expert, or none


class ModuleName(NamedTuple):
    """A parsed head-module name: its source layer and the kind of heads it holds."""

    layer: int
    kind: HeadKind


class Label(NamedTuple):
    """A parsed label: ``L3H2`` -> (3, "head", 2, None); ``L3N17`` -> (3, "neuron", 17, None); ``L3N17.2`` -> (3,
    "neuron", 17, 2); ``L3N17.4+5`` -> (3, "neuron", 17, 4, pair=True): heads 4 and 5 of ``neuron_heads(3, 17)``.
    Mixture-of-experts layers' labels parse to :class:`ExpertLabel`."""

    layer: int
    kind: Literal["head", "neuron"]
    index: int
    component: int | None
    pair: bool = False  # the heads at ``component`` and ``component + 1`` together (a gated neuron's product pair)

    @property
    def expert(self) -> Expert:
        """None: a dense layer's head or neuron."""
        return None


class ExpertLabel(NamedTuple):
    """A parsed label of an expert's neuron in a mixture-of-experts layer: ``L3E5N17`` -> (3, "neuron", 17, None,
    False, 5); ``L3SN17.1+2`` -> (3, "neuron", 17, 1, True, "shared") (the shared expert). Fields as :class:`Label`'s,
    plus ``expert``."""

    layer: int
    kind: Literal["neuron"]
    index: int
    component: int | None
    pair: bool
    expert: int | Literal["shared"]


def expert_prefix(expert: Expert) -> str:
    """Where an expert's modules live in a mixture-of-experts MLP (``experts.5.``, ``shared_expert.``; ``""``: a
    dense MLP)."""
    if expert is None:
        return ""
    return "shared_expert." if expert == "shared" else f"experts.{expert}."


def module_name(layer: int, kind: HeadKind, expert: Expert = None) -> str:
    """The hook prefix of layer ``layer``'s heads of ``kind`` (of ``expert``, in a mixture-of-experts layer)."""
    if kind == "attention":
        return f"blocks.{layer}.attn"
    attr = next(a for a, k in NEURON_MODULES.items() if k == kind)
    return f"blocks.{layer}.mlp.{expert_prefix(expert)}{attr}"


def module_expert(name: str) -> Expert:
    """The expert a head module belongs to (``blocks.3.mlp.experts.5.heads`` -> 5, ``...shared_expert...`` ->
    ``"shared"``, None for attention and dense MLPs)."""
    match = _match(_MODULE, name, "a head module name like 'blocks.3.attn' or 'blocks.3.mlp.heads'")
    if match.group(4) is not None:
        return "shared"
    return None if match.group(3) is None else int(match.group(3))


def mlp_of(name: str) -> str:
    """The MLP (or expert) a neuron-head module belongs to: ``blocks.3.mlp`` or ``blocks.3.mlp.experts.5``, where its
    ``hook_pre`` / ``hook_pre_linear`` / ``hook_post`` (and an expert's ``hook_out``) are."""
    return name.rsplit(".", 1)[0]


def _match(pattern: re.Pattern[str], text: object, expected: str) -> re.Match[str]:
    """``pattern`` matched against ``text``, or :class:`InputError` saying what was ``expected``."""
    match = pattern.match(text) if isinstance(text, str) else None
    if match is None:
        raise InputError(f"expected {expected}; got {text!r}")
    return match


def parse_module(name: str) -> ModuleName:
    """``"blocks.3.mlp.heads"`` -> ``ModuleName(3, "neuron")``; raises :class:`InputError` naming the valid forms."""
    match = _match(
        _MODULE,
        name,
        "a head module name like 'blocks.3.attn', 'blocks.3.mlp.heads', 'blocks.3.mlp.gate_heads', "
        "'blocks.3.mlp.product_heads', (a chained gate's inner stages) 'blocks.3.mlp.square_heads' / "
        "'blocks.3.mlp.direct_heads', (mixtures of experts) 'blocks.3.mlp.experts.5.gate_heads' or (Gemma 4's "
        "per-layer-input sublayer) 'blocks.3.per_layer.gate_heads'",
    )
    layer, part = int(match.group(1)), match.group(2)
    return ModuleName(layer, "attention" if part == "attn" else NEURON_MODULES[match.group(5) or match.group(6)])


def per_layer_label(layer: int, neuron: int, component: int | None = None, pair: bool = False) -> str:
    """A neuron of Gemma 4's per-layer-input sublayer: ``L3P17``, ``L3P17.2`` (its head at position 2 of
    ``aot.neuron_heads(3, 17, sublayer="per_layer")``), ``L3P17.5+6`` (its product pair). Not a patching unit (the
    sublayer's output goes through its post norm): :func:`parse_label` refuses it."""
    if component is None:
        return f"L{layer}P{neuron}"
    return f"L{layer}P{neuron}.{component}" + (f"+{component + 1}" if pair else "")


def head_label(layer: int, head: int) -> str:
    return f"L{layer}H{head}"


def neuron_label(
    layer: int, neuron: int, component: int | None = None, pair: bool = False, expert: Expert = None
) -> str:
    """``L3N17`` (``component`` None), ``L3N17.2``, or with ``pair`` ``L3N17.2+3`` (heads 2 and 3 together); of an
    expert ``L3E5N17…``, of the shared expert ``L3SN17…``."""
    where = "" if expert is None else ("S" if expert == "shared" else f"E{expert}")
    if component is None:
        return f"L{layer}{where}N{neuron}"
    return f"L{layer}{where}N{neuron}.{component}" + (f"+{component + 1}" if pair else "")


def parse_label(label: str) -> Label | ExpertLabel:
    """Parse ``L3H2``, ``L3N17``, ``L3N17.2``, ``L3N17.4+5``, ``L3E5N17…`` or ``L3SN17…``; raises
    :class:`InputError` naming the forms."""
    match = _match(
        _LABEL,
        label,
        "a label like 'L3H2' (head), 'L3N17' (neuron), 'L3N17.2' (a neuron's head), 'L3N17.4+5' (a gated neuron's "
        "product pair), 'L3E5N17' (neuron 17 of expert 5) or 'L3SN17' (of the shared expert)",
    )
    layer, head, expert_index, shared, neuron, component, second = match.groups()
    expert: Expert = "shared" if shared else (None if expert_index is None else int(expert_index))
    if head is not None:
        return Label(int(layer), "head", int(head), None)
    if second is not None and int(second) != int(component) + 1:
        raise InputError(
            f"{label!r}: a product pair's label names two consecutive heads of the neuron, 'L{layer}N{neuron}."
            f"{component}+{int(component) + 1}'"
        )
    index = None if component is None else int(component)
    if expert is not None:
        return ExpertLabel(int(layer), "neuron", int(neuron), index, second is not None, expert)
    return Label(int(layer), "neuron", int(neuron), index, second is not None)


_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")


def flat_layout_hint(name: str, n_layers: int) -> str | None:
    """Why ``name`` is not a hook of a converted model, when it looks like lens_aot 0.1's flat layout (a neuron block
    ``blocks.{2l+1}.attn``, a block index past ``n_layers``, a neuron block's ``attn.hook_pre``); else None."""
    match = _BLOCK.match(name)
    if match is None:
        return None
    block, rest = int(match.group(1)), match.group(2)
    old = block >= n_layers or rest in ("attn.hook_pre", "attn.hook_pre_linear", "attn.hook_gate")
    if not old:
        return None
    return (
        f"{name!r} is not a hook of this model. The converted model is numbered like its source (n_layers="
        f"{n_layers}): source layer l is blocks.{{l}}, its heads blocks.{{l}}.attn, its MLP's neuron heads "
        f"blocks.{{l}}.mlp.heads (gated MLPs: blocks.{{l}}.mlp.gate_heads / product_heads), its MLP activations "
        f"blocks.{{l}}.mlp.hook_pre / hook_post. lens_aot 0.1's flat numbering (blocks.{{2l}} / blocks.{{2l+1}}) is "
        f"gone; aot.sublayers() lists the attention-only sub-layers in the paper's order."
    )
