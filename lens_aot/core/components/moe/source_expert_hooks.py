"""A converted TransformerLens 3.9 mixture of experts' per-expert hooks, under the source's names and shapes.

TransformerLens 3.9's ``MoE`` (``MoEGatedMLP`` experts) and ``GptOssMoE`` (``GptOssExpert``) name each expert's hooks
``experts.{e}.hook_gate`` (the gate's pre-activation ``x·W_gate (+ b_gate)``), ``experts.{e}.hook_pre`` (the LINEAR
branch ``x·W_in (+ b_in)``) and ``experts.{e}.hook_post`` (``act(gate)·pre``; GPT-OSS: its clamped GLU), each
``[routed tokens, d_mlp]``: the rows of the tokens routed to that expert, slot-major (``torch.where(expert_mask[e])``,
every token's first choice in token order, then its second ...). The dense gated MLP that lens_aot's experts are
(:class:`~lens_aot.core.components.mlp.neuron_mlp.NeuronMLP`, Theorem 3 per neuron) names the gate ``hook_pre`` and the
linear branch ``hook_pre_linear``, ``[batch, pos, d_mlp]``; on a model converted from such a source
(``MoESpec.hook_names``, set by :mod:`lens_aot.tl.moe.read`) :func:`name_like_source` gives each expert the source's
three names instead (there is no ``hook_pre_linear``), as :class:`RoutedHookPoint` s, so a hook written for the source
reads and edits the same tensor there.

:class:`~lens_aot.core.components.moe.moe_mlp.MoEMLP` runs such an expert on its routed rows ``[1, routed, d_model]``
(its
non-hooked path) also while hooked; a :class:`RoutedHookPoint` shows its hooks those rows as ``[routed, d_mlp]`` (a
view: in-place edits reach the heads) and reshapes what a hook returns back. The neuron heads' own hooks inside the
expert (``gate_heads.hook_z`` ...) are lens_aot's extras and keep the heads' ``[1, routed, ...]`` shapes.
lens_aot's own tools that patch between runs that route differently (activation and path patching, attribution,
circuits) switch the experts to run on every position (:func:`dense_expert_hooks`), where the hooks show
``[batch, pos, d_mlp]`` as for any other MoE.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from lens_aot.core.components.attention.head_derivations import HeadDerivation, RoutedHeadDerivation
from lens_aot.errors import InputError

LENS_AOT = "lens_aot"
TL_MOE = "transformer_lens_moe"  # MoE: every expert runs, one no token chose on 0 rows
TL_GPT_OSS_MOE = "transformer_lens_gpt_oss_moe"  # GptOssMoE: an expert no token chose is skipped
HOOK_NAMES = (LENS_AOT, TL_MOE, TL_GPT_OSS_MOE)
SOURCE_HOOKS = ("hook_gate", "hook_pre", "hook_post")


class RoutedHookPoint(HookPoint):
    """A hook point that, while :attr:`routed`, shows its hooks a ``[1, routed, d]`` activation as ``[routed, d]``
    (TransformerLens's per-expert shape) and returns what they give back as ``[1, routed, d]``."""

    def __init__(self) -> None:
        super().__init__()
        self.routed = False

    def __call__(self, x: Float[Tensor, "*lead d"]) -> Float[Tensor, "*lead d"]:  # type: ignore[override]
        if not self.routed or not (self._forward_hooks or self._backward_hooks):  # nothing to show: no views
            return super().__call__(x)
        flat = x.reshape(-1, x.shape[-1])  # a view of the contiguous rows: in-place edits reach x
        return super().__call__(flat).reshape(x.shape)


def name_like_source(expert: nn.Module, where: str) -> None:
    """Give gated expert ``expert`` (``where``: e.g. ``layer 3 mlp expert 5``, for the error) TransformerLens 3.9's
    ``hook_gate`` / ``hook_pre`` / ``hook_post`` (module docstring) in place of ``hook_pre`` / ``hook_pre_linear`` /
    ``hook_post``; its forward then reads them through ``gate_hook_name`` / ``linear_hook_name``."""
    if not getattr(expert, "gated", False):
        raise InputError(
            f"{where}: TransformerLens's MoE experts are gated, this one is not; read it with hook_names {LENS_AOT!r}"
        )
    for name in ("hook_pre", "hook_pre_linear", "hook_post"):
        delattr(expert, name)
    for name in SOURCE_HOOKS:
        expert.add_module(name, RoutedHookPoint())
    expert.gate_hook_name, expert.linear_hook_name = "hook_gate", "hook_pre"


def routed_hooks(expert: nn.Module) -> tuple[RoutedHookPoint, ...]:
    """The expert's :class:`RoutedHookPoint` s (none for a lens_aot-named expert)."""
    return tuple(getattr(expert, n) for n in SOURCE_HOOKS if isinstance(getattr(expert, n, None), RoutedHookPoint))


def source_named_derivations(
    derivations: dict[str, tuple[tuple[str, ...], Any]],
) -> dict[str, tuple[tuple[str, ...], Any]]:
    """An MoE layer's compact-cache derivations (``"experts.{e}.<heads>.<hook>"`` -> (sources, how)) with its experts'
    sources under the source's names (the gate ``hook_pre`` -> ``hook_gate``, ``hook_pre_linear`` -> ``hook_pre``)
    and read as ``[1, routed, d_mlp]`` (:class:`~lens_aot.core.runtime.cache.RoutedHeadDerivation`)."""
    rename = {"hook_pre": "hook_gate", "hook_pre_linear": "hook_pre"}

    def source(name: str) -> str:
        where, _, hook = name.rpartition(".")
        return f"{where}.{rename.get(hook, hook)}"

    def routed(how: Any) -> Any:
        if not isinstance(how, HeadDerivation):
            return how
        return RoutedHeadDerivation.of(how)

    return {key: (tuple(source(s) for s in sources), routed(how)) for key, (sources, how) in derivations.items()}


@contextmanager
def dense_expert_hooks(model: nn.Module) -> Iterator[None]:
    """Within: every source-named MoE layer of ``model`` runs a hooked expert on every position (its hooks
    ``[batch, pos, d_mlp]``, weight 0 where not chosen), as lens_aot's own tools need to patch between runs."""
    layers: list[Any] = [m for m in model.modules() if getattr(m, "hook_names", LENS_AOT) != LENS_AOT]
    before = [m.dense_hooks for m in layers]
    for m in layers:
        m.dense_hooks = True
    try:
        yield
    finally:
        for m, value in zip(layers, before, strict=True):
            m.dense_hooks = value
