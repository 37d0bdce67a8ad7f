"""Hook names, inputs and gradients of the converted model's head modules, for the patching code.

Where a head module (``blocks.{l}.attn``, ``blocks.{l}.mlp.heads`` / ``gate_heads`` / ``product_heads``, and a gated
relu² / xIELU MLP's ``square_heads`` / ``direct_heads``) sits in the forward pass, which hooks carry its per-head
output, its inputs and its state, and how a gradient at its output maps to its heads. Used by
:mod:`lens_aot.analysis.patching.units` and the patching modules it serves; it imports none of them.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from jaxtyping import Float
from torch import Tensor

from lens_aot.core.components import NeuronAttention, ProductAttention
from lens_aot.core.components.mlp.chained_gated_mlp import SquareProductAttention
from lens_aot.core.components.residual.writes import scaled, write_scale
from lens_aot.core.names import mlp_of, module_expert, parse_module
from lens_aot.core.runtime.model import AttentionOnlyTransformer
from lens_aot.errors import UnsupportedArchitectureError

# rank of a head module within its layer, in forward order (a chained gate's square and direct heads read the gate's
# pre-activation and its gate heads' output, and write the scratch its product heads read)
_RANK = {"attention": 0, "neuron": 1, "gate": 1, "square": 2, "direct": 2, "product": 3}
# head kinds that write their MLP's scratch (not the residual): each is read by one module of the MLP as its values
_SCRATCH_WRITERS = ("gate", "square", "direct")


@functools.lru_cache(maxsize=4096)
def _order(name: str) -> tuple[int, int]:
    """Position of head module ``name`` in the forward pass (sort key, the order of ``aot.sublayers()``: a module
    reads only earlier ones' outputs)."""
    layer, kind = parse_module(name)
    return layer, _RANK[kind]


def _layer_of(name: str) -> int:
    return parse_module(name).layer


def _kind_of(name: str) -> str:
    return parse_module(name).kind


def _head_module_names(aot: AttentionOnlyTransformer) -> list[str]:
    """Every head module, in forward order."""
    return [sub.name for sub in aot.sublayers()]


def _head_module(aot: AttentionOnlyTransformer, name: str) -> torch.nn.Module:
    """The module holding the heads of ``name`` (Attention, NeuronAttention or ProductAttention)."""
    return aot.head_module(name)


def _z_hook(name: str) -> str:
    """The hook of the head outputs ``[batch, pos, head, d_head]`` of module ``name``."""
    return f"{name}.hook_z"


def _input_hook(name: str, x: str) -> str:
    """The hook of input ``x`` ("q", "k" or "v") of module ``name``'s heads."""
    return f"{name}.hook_{x}"


def _module_of_input(hook_name: str) -> str:
    """The head module whose input hook ``hook_name`` is (inverse of :func:`_input_hook`)."""
    return hook_name.rpartition(".hook_")[0]


def _output_hook(aot: AttentionOnlyTransformer, name: str) -> str:
    """The hook of what module ``name`` writes (``Σ_h z_h · W_O[h] + b_O``): ``hook_attn_out`` (attention),
    ``hook_mlp_out`` (neuron and product heads), or the ``hook_gate`` of the module that reads it as its values (the
    MLP's scratch: the product heads' for gate heads, and for a chained gate's square and direct heads; a chained
    gate's gate heads write ``r``, the square heads' ``hook_gate``). A mixture-of-experts layer's expert: its
    ``hook_out`` (its output before its router weight)."""
    layer, kind = parse_module(name)
    if kind in _SCRATCH_WRITERS:
        reader = _product_module(aot, name)
        assert reader is not None
        return f"{reader}.hook_gate"
    if kind != "attention" and module_expert(name) is not None:
        return f"{mlp_of(name)}.hook_out"
    return f"blocks.{layer}.hook_{'attn' if kind == 'attention' else 'mlp'}_out"


def _state_hooks(aot: AttentionOnlyTransformer, name: str) -> list[str]:
    """The hooks from which every head output (``hook_z``) of module ``name`` follows: ``hook_z`` for the source's
    heads, the MLP's ``hook_pre`` for neuron/gate heads, its ``hook_pre_linear`` and the product heads' ``hook_gate``
    for product heads (a TransformerLens 3.9 MoE's experts: their ``hook_gate`` and ``hook_pre``, the MLP's
    ``gate_hook_name`` / ``linear_hook_name``)."""
    kind = parse_module(name).kind
    if kind == "attention":
        return [_z_hook(name)]
    mlp = aot.get_submodule(mlp_of(name))
    gate_pre = f"{mlp_of(name)}.{getattr(mlp, 'gate_hook_name', 'hook_pre')}"
    if kind == "product":
        return [f"{mlp_of(name)}.{getattr(mlp, 'linear_hook_name', 'hook_pre_linear')}", f"{name}.hook_gate"]
    if kind == "square":  # a chained gate's square pair: query from the gate's pre-activation, value r (its hook_gate)
        return [gate_pre, f"{name}.hook_gate"]
    if kind in ("neuron", "gate", "direct"):
        return [gate_pre]
    return [_z_hook(name)]


def _reads_mid(aot: AttentionOnlyTransformer, name: str) -> bool:
    """Whether module ``name`` reads its layer's ``hook_resid_mid`` (the MLP's heads of a sequential layer)."""
    layer, kind = parse_module(name)
    return kind != "attention" and not aot.blocks[layer].parallel


def _resid_in_hook(aot: AttentionOnlyTransformer, name: str) -> str:
    """The residual-stream hook module ``name``'s heads read (through :func:`_input_norm`)."""
    return f"blocks.{_layer_of(name)}.hook_resid_{'mid' if _reads_mid(aot, name) else 'pre'}"


def _input_hooks(aot: AttentionOnlyTransformer, name: str) -> list[str]:
    """The hooks that together are module ``name``'s input (:func:`_input_of`): its residual, and for product heads
    (and a chained gate's square heads) the MLP's scratch they read (``hook_gate``)."""
    scratch = [f"{name}.hook_gate"] if _kind_of(name) in ("product", "square") else []
    return [_resid_in_hook(aot, name), *scratch]


def _input_of(aot: AttentionOnlyTransformer, name: str, acts: dict[str, Tensor]) -> Float[Tensor, "batch pos d_in"]:
    """Module ``name``'s input from recorded activations: the residual it reads, followed (product heads) by the
    gate values it reads from the MLP's scratch."""
    return torch.cat([acts[hook] for hook in _input_hooks(aot, name)], dim=-1)


def _input_norm(aot: AttentionOnlyTransformer, name: str) -> torch.nn.Module:
    """The norm between the residual stream and module ``name``'s heads (``ln1`` or ``ln2``; none in post-norm)."""
    layer, kind = parse_module(name)
    block = aot.blocks[layer]
    return torch.nn.Identity() if block.post_norm else block.ln1 if kind == "attention" else block.ln2


def _final_resid_hook(aot: AttentionOnlyTransformer) -> str:
    """The residual stream the unembedding reads (through the final norm)."""
    return f"blocks.{len(aot.blocks) - 1}.hook_resid_post"


def _linear_scratch(aot: AttentionOnlyTransformer, name: str) -> bool:
    """Whether gate module ``name``'s output ``Σ_h z_h·W_O[h]`` is what its product heads read (``hook_gate``); False
    for a gated relu² / xIELU MLP, whose product heads read a product of it
    (:class:`~lens_aot.core.components.mlp.chained_gated_mlp.ChainedGatedMLP`)."""
    return bool(getattr(aot.get_submodule(mlp_of(name)), "linear_scratch", True))


def _reads_output_of(aot: AttentionOnlyTransformer, receiver: str | None, sender: str) -> bool:
    """Whether module ``sender``'s output is in the input of module ``receiver`` (None: the logits): a module writing
    its MLP's scratch (gate heads; a chained gate's square and direct heads) reaches only the module of its MLP that
    reads it as values (:func:`_product_module`); the others' reach the residual after them. A chained gate's gate
    module reaches its product heads only through a product (the square heads, gated relu² / xIELU): no linear edge
    to them, refused with :class:`~lens_aot.errors.UnsupportedArchitectureError`."""
    s_layer, s_kind = parse_module(sender)
    if s_kind in _SCRATCH_WRITERS:
        reads = receiver is not None and receiver == _product_module(aot, sender)
        product = receiver is not None and receiver == f"{mlp_of(sender)}.product_heads"
        if s_kind == "gate" and product and not _linear_scratch(aot, sender):
            raise UnsupportedArchitectureError(
                f"{sender}: in a gated relu2 / xIELU MLP the gate heads' output r ≈ relu(g) reaches the product heads "
                f"through the square heads (s ≈ relu(g)·g), a product, so the edge from a gate head to the product "
                f"heads is not linear and edge attribution does not score it. Patch the gate heads as units "
                f"(patch_units, path_patch) or score the neuron as a whole (its product pair, or hook_post)."
            )
        return reads
    if receiver is None:
        return True
    r_layer = _layer_of(receiver)
    return s_layer < r_layer or (s_layer == r_layer and s_kind == "attention" and _reads_mid(aot, receiver))


def _stop_after(names: Iterable[str]) -> int:
    """``stop_at_layer`` for a forward that must run (at least) the modules ``names``."""
    return max(_layer_of(name) for name in names) + 1


def _product_module(aot: AttentionOnlyTransformer, name: str) -> str | None:
    """The module that reads module ``name``'s output as its values (through its ``hook_gate``): the product heads for
    gate heads, and for a chained gate's square and direct heads; a chained gate's square heads for its gate heads
    (they read ``r``); None if ``name`` writes the residual."""
    kind = _kind_of(name)
    if kind not in _SCRATCH_WRITERS:
        return None
    chained = kind == "gate" and not _linear_scratch(aot, name)
    return f"{mlp_of(name)}.{'square_heads' if chained else 'product_heads'}"


def _writes_linearly(aot: AttentionOnlyTransformer, name: str) -> bool:
    """Whether module ``name`` has an output hook and a ``W_O``, so its output is ``Σ_h z_h · W_O[h] + b_O`` and a
    change of head outputs can be applied to its output directly (through :func:`_write_map`, which carries a
    half-precision Granite's residual multiplier)."""
    kind = _kind_of(name)
    if kind == "gate" and not _linear_scratch(aot, name):  # a product of it is read: patch hook_z instead
        return False
    if kind in ("square", "direct"):  # a chained gate's inner stages: patched through hook_z, as its gate heads
        return False
    W_O = getattr(_head_module(aot, name), "W_O", None)
    return _output_hook(aot, name) in aot.hook_dict and isinstance(W_O, Tensor)


def _resid_scale(aot: AttentionOnlyTransformer, name: str) -> float | None:
    """The number the block multiplies module ``name``'s output by before it reaches the residual stream (a
    half-precision Granite's residual multiplier, :func:`~lens_aot.core.components.residual.writes.write_scale`; for
    an expert's too: the block multiplies the whole mixture's output); None for modules writing the MLP's scratch."""
    return None if _kind_of(name) in _SCRATCH_WRITERS else write_scale(_head_module(aot, name))


def _out_scale(aot: AttentionOnlyTransformer, name: str) -> float | None:
    """The number the block multiplies module ``name``'s output by before its :func:`_output_hook`: its
    :func:`_resid_scale`, except for an expert's, whose ``hook_out`` is before the multiplier (None)."""
    expert = _kind_of(name) != "attention" and module_expert(name) is not None
    return None if expert else _resid_scale(aot, name)


def _write_map(
    aot: AttentionOnlyTransformer, name: str, to_residual: bool = False
) -> Float[Tensor, "head d_head d_out"]:
    """Module ``name``'s ``W_O`` (detached) as it maps a change of its head outputs to its :func:`_output_hook`
    (times :func:`_out_scale`), or with ``to_residual`` to the residual stream (times :func:`_resid_scale`): the
    tensor itself where the block multiplies nothing."""
    scale = _resid_scale(aot, name) if to_residual else _out_scale(aot, name)
    return scaled(_head_module(aot, name).W_O.detach(), scale)


def _weight_hooks(aot: AttentionOnlyTransformer, name: str) -> list[str]:
    """The hooks :func:`_expert_weight` reads for module ``name``: a routed expert's router choice
    (``hook_expert_indices``, ``hook_topk_weights``), a gated shared expert's MoE input (the residual its layer's
    ``ln2`` reads); none for other modules."""
    expert = module_expert(name) if _kind_of(name) not in _SCRATCH_WRITERS else None
    if expert is None or _kind_of(name) == "attention":
        return []
    moe = _moe_of(name)
    if expert == "shared":
        return [_resid_in_hook(aot, name)] if getattr(aot.get_submodule(moe), "W_shared_gate", None) is not None else []
    return [] if getattr(aot.get_submodule(moe), "input_scaled", False) else [f"{moe}.{h}" for h in _ROUTER_HOOKS]


_ROUTER_HOOKS = ("hook_expert_indices", "hook_topk_weights")


def _moe_of(name: str) -> str:
    """The mixture of experts (``blocks.{l}.mlp``) expert head module ``name`` belongs to."""
    return mlp_of(mlp_of(name)).removesuffix(".experts")


def _expert_weight(
    aot: AttentionOnlyTransformer, name: str, acts: dict[str, Tensor], batch: int
) -> Float[Tensor, "batch pos 1 1"] | None:
    """What a mixture of experts multiplies expert module ``name``'s output (its ``hook_out``, the
    :func:`_output_hook`) by on each token of a run (``acts``: that run's :func:`_weight_hooks`; ``batch``: its
    number of sequences, as the router hooks are ``[batch·pos, top_k]``): a routed expert's
    router weight (0 on the tokens that did not choose it, where a hooked expert runs densely), a Qwen2-MoE shared
    expert's ``sigmoid(x·W_shared_gate)``; None (1) for other modules, a shared expert without a gate and an
    input-scaled MoE's experts (Llama 4: the weight scales their input, not their output). Broadcasts over
    ``[batch, pos, head, d_head]``: a head's change of output reaches the residual as ``weight·Δz_h·W_O[h]``."""
    hooks = _weight_hooks(aot, name)
    if not hooks:
        return None
    moe = aot.get_submodule(_moe_of(name))
    resid = acts[_resid_in_hook(aot, name)] if module_expert(name) == "shared" else None
    if resid is not None:
        x = _input_norm(aot, name)(resid)
        return torch.sigmoid(x @ moe.W_shared_gate.detach().to(x.dtype))[..., None]
    indices, weights = (acts[hook] for hook in hooks)  # [batch·pos, top_k]
    chosen = (indices == int(module_expert(name))).to(weights.dtype)  # type: ignore[arg-type]
    return (weights * chosen).sum(-1).reshape(batch, -1, 1, 1)


# ==================================================================================================== module inputs
def _into_input(
    aot: AttentionOnlyTransformer, receiver: str, sender: str, contrib: Float[Tensor, "... d_out"]
) -> Float[Tensor, "... d_in"]:
    """Place sender module ``sender``'s output change in receiver ``receiver``'s input (:func:`_input_of`): the
    residual part, or (a gate module feeding its product heads) the scratch part after the residual."""
    scratch = _kind_of(receiver) in ("product", "square")
    width = aot.cfg.d_model + (int(_head_module(aot, receiver).d_mlp) if scratch else 0)
    before = aot.cfg.d_model if _kind_of(sender) in _SCRATCH_WRITERS else 0
    return torch.nn.functional.pad(contrib, (before, width - before - contrib.shape[-1]))


def _state_of(aot: AttentionOnlyTransformer, name: str, x: Float[Tensor, "... d_in"]) -> list[Tensor]:
    """Neuron/gate/product module ``name``'s state (``hook_pre``, or ``u`` and ``h``) for a given input
    (:func:`_input_of`): the pre-activation through its norm, and (product heads) the gate values of the scratch."""
    attn = _head_module(aot, name)
    d_model = aot.cfg.d_model
    pre = _input_norm(aot, name)(x[..., :d_model]) @ attn.W_in + attn.b_in
    if isinstance(attn, ProductAttention):
        return [pre, x[..., d_model : d_model + attn.d_mlp]]
    return [pre]


def _head_grads(
    attn: torch.nn.Module, grad_out: Float[Tensor, "*run batch pos d_out"], scale: float | None = None
) -> Float[Tensor, "*run batch pos head d_head"]:
    """``∂(grad_out · module output)/∂z_h = grad_out · W_O[h]·scale`` for every head (``scale``: the module's
    :func:`_out_scale`, None for 1), without per-head ``W_O`` rows for neuron modules (``grad_out`` at the module's
    :func:`_output_hook`): a neuron head's row is its neuron's ``W_out`` row (gate heads: its scratch channel, the
    gradient at ``hook_gate``; product heads: ``±(2/ε)·W_out[n]``; a chained gate's square heads: ``±(2/ε')`` times
    scratch channel ``n``'s gradient)."""
    return scaled(_unscaled_head_grads(attn, grad_out), scale)


def _unscaled_head_grads(
    attn: torch.nn.Module, grad_out: Float[Tensor, "*run batch pos d_out"]
) -> Float[Tensor, "*run batch pos head d_head"]:
    """:func:`_head_grads` before its scale."""
    if isinstance(attn, SquareProductAttention):
        per_neuron = grad_out * (2 / attn.scales)
        return (per_neuron.repeat_interleave(2, dim=-1) * attn.signs.to(per_neuron.dtype))[..., None]
    if isinstance(attn, ProductAttention):
        main = grad_out @ attn.W_out.T * (2 / attn.scales)
        return torch.stack((main, -main), dim=-1).flatten(-2)[..., None]
    if isinstance(attn, NeuronAttention):
        per_neuron = grad_out if attn.W_out is None else grad_out @ attn.W_out.T
        return per_neuron.repeat_interleave(attn.heads_per_neuron, dim=-1)[..., None]
    return torch.einsum("...d,hed->...he", grad_out, attn.W_O)
