"""TransformerLens's ``transformer_lens.patching`` call shape for the units it cannot enumerate: neuron heads.

TransformerLens's own patching functions run unmodified on a converted model and cover every unit its source has
(``get_act_patch_attn_head_out_all_pos``, ``get_act_patch_resid_pre``, ``get_act_patch_mlp_out``, ...). The heads that
replace each MLP's neurons (Theorem 3: ``blocks.{l}.mlp.heads``; gated MLPs: ``mlp.gate_heads`` then
``mlp.product_heads``) are not heads of ``cfg.n_heads``, and ``utils.get_act_name`` cannot name their hooks, so
``generic_activation_patch`` cannot reach them. The functions here take TransformerLens's arguments,
``(model, corrupted_tokens, clean_cache, patching_metric)``, and lay their results out as its head functions do:

* :func:`get_act_patch_neuron_head_out_all_pos` -> ``[layer, neuron_head]`` (as ``get_act_patch_attn_head_out_all_pos``
  -> ``[layer, head]``), :func:`get_act_patch_neuron_head_out_by_pos` -> ``[layer, pos, neuron_head]``: one patched
  forward per entry, a column's ``hook_z`` set to its value in ``clean_cache``. The columns of layer ``l`` are the
  units of ``aot.neuron_modules(l)`` taken in order, as :func:`~lens_aot.patching.head_units` gives them: one per
  neuron head, except that a gated MLP's two product heads of a neuron are one column (its product pair, patched
  together; one alone is half of a finite difference). Gated: the gate heads, then the ``d_mlp`` product pairs.
  :func:`neuron_head_columns` names them. Layers without an MLP are rows of NaN. The result has the model's dtype.
* :func:`get_act_patch_mlp_neuron_all_pos` -> ``[layer, d_mlp]``, :func:`get_act_patch_mlp_neuron_by_pos` ->
  ``[layer, pos, d_mlp]``: a whole neuron (``mlp.hook_post[..., n]``) patched, through TransformerLens's own
  ``generic_activation_patch`` (so they run on the source model too, and return what it returns: float32).

lens_aot's batched :func:`~lens_aot.patching.patch_heads` computes the same numbers with labelled units, many patches
per forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from lens_aot.analysis.checks import converted_only
from lens_aot.analysis.patching.units import PatchUnit, _Index
from lens_aot.core.runtime.model import AttentionOnlyTransformer
from lens_aot.errors import InputError

__all__ = [
    "get_act_patch_mlp_neuron_all_pos",
    "get_act_patch_mlp_neuron_by_pos",
    "get_act_patch_neuron_head_out_all_pos",
    "get_act_patch_neuron_head_out_by_pos",
    "neuron_head_columns",
]

PatchingMetric = Callable[[Float[Tensor, "batch pos d_vocab"]], Any]


@converted_only
def neuron_head_columns(model: AttentionOnlyTransformer) -> list[list[PatchUnit]]:
    """Per layer, the unit of each column of :func:`get_act_patch_neuron_head_out_all_pos`'s rows (its ``heads`` and
    ``label``; one neuron head, or a gated neuron's product pair ``L1N17.4+5``); empty for a layer without an MLP."""
    if not isinstance(model, AttentionOnlyTransformer):
        raise InputError(
            f"neuron heads exist only in a converted model (lens_aot.convert); got {type(model).__name__}. For the "
            f"source's own units use transformer_lens.patching, e.g. get_act_patch_attn_head_out_all_pos"
        )
    index = _Index(model)
    return [
        [unit for name in model.neuron_modules(layer) for unit in index.module_units(name)]
        for layer in range(model.cfg.n_layers)
    ]


@converted_only(metric="patching", name="get_act_patch_neuron_head_out_all_pos / _by_pos")
def _neuron_head_patch(
    model: AttentionOnlyTransformer,
    corrupted_tokens: Int[Tensor, "batch pos"],
    clean_cache: Any,
    patching_metric: PatchingMetric,
    by_pos: bool,
) -> Tensor:
    """TransformerLens's generic patching loop over neuron heads (one forward per entry, the patch set in place on
    the corrupted run's ``hook_z``)."""
    columns = neuron_head_columns(model)
    n_cols = max((len(c) for c in columns), default=0)
    if n_cols == 0:
        raise InputError("this model has no MLP, so no neuron heads; use transformer_lens.patching for its heads")
    n_pos = int(corrupted_tokens.shape[-1])
    positions: list[Any] = list(range(n_pos)) if by_pos else [slice(None)]
    out = torch.full((model.cfg.n_layers, len(positions), n_cols), torch.nan, dtype=model.cfg.dtype)
    for layer, units in enumerate(columns):
        for col, unit in enumerate(units):
            name = unit.heads[0].name  # a column's heads share a module
            heads = [ref.head for ref in unit.heads]
            clean = clean_cache[f"{name}.hook_z"]
            for p, pos in enumerate(positions):

                def setter(
                    act: Tensor, hook: Any, pos: Any = pos, heads: list[int] = heads, clean: Tensor = clean
                ) -> Tensor:
                    act = act.clone() if act.requires_grad else act
                    act[:, pos, heads] = clean[:, pos, heads].to(act.dtype)
                    return act

                with torch.no_grad():
                    logits = model.run_with_hooks(corrupted_tokens, fwd_hooks=[(f"{name}.hook_z", setter)])
                out[layer, p, col] = float(torch.as_tensor(patching_metric(logits)).item())
    return (out if by_pos else out[:, 0]).to(model.cfg.device)


# As TransformerLens defines its own ``get_act_patch_*`` functions: partials of one patcher, documented after.
get_act_patch_neuron_head_out_all_pos = functools.partial(_neuron_head_patch, by_pos=False)
get_act_patch_neuron_head_out_all_pos.__doc__ = """Patch each neuron head's output (``hook_z``; a gated neuron's
product pair together) at every position from ``clean_cache`` into the corrupted run:
``get_act_patch_neuron_head_out_all_pos(model, corrupted_tokens, clean_cache, patching_metric)`` -> ``[n_layers,
n_columns]`` of ``patching_metric(logits)``, as ``get_act_patch_attn_head_out_all_pos`` for the source's heads
(columns: :func:`neuron_head_columns`)."""

get_act_patch_neuron_head_out_by_pos = functools.partial(_neuron_head_patch, by_pos=True)
get_act_patch_neuron_head_out_by_pos.__doc__ = """As :func:`get_act_patch_neuron_head_out_all_pos`, one position at
a time: ``[n_layers, pos, n_columns]`` (``get_act_patch_attn_head_out_by_pos``'s layout)."""


def _mlp_neuron_patch(
    model: Any, corrupted_tokens: Tensor, clean_cache: Any, patching_metric: PatchingMetric, by_pos: bool
) -> Tensor:
    """Whole neurons (``mlp.hook_post``) through ``transformer_lens.patching.generic_activation_patch`` with an
    explicit index frame (its ``index_axis_names`` know no neuron axis)."""
    import itertools

    import pandas as pd
    from transformer_lens.patching import generic_activation_patch

    d_mlp = getattr(model.cfg, "d_mlp", None)
    if not d_mlp or getattr(model.cfg, "attn_only", False):
        raise InputError("this model has no MLP, so no neurons to patch; use transformer_lens.patching for its heads")
    n_layers, n_pos = int(model.cfg.n_layers), int(corrupted_tokens.shape[-1])
    axes = [range(n_layers), range(n_pos), range(d_mlp)] if by_pos else [range(n_layers), range(d_mlp)]
    names = ["layer", "pos", "neuron"] if by_pos else ["layer", "neuron"]
    index_df = pd.DataFrame(list(itertools.product(*axes)), columns=names)

    def setter(act: Tensor, index: list[int], clean: Tensor) -> Tensor:
        pos = index[1] if by_pos else slice(None)
        act[:, pos, index[-1]] = clean[:, pos, index[-1]].to(act.dtype)
        return act

    flat = generic_activation_patch(
        model, corrupted_tokens, clean_cache, patching_metric, setter, "post", index_df=index_df
    )
    return flat.reshape(*(len(a) for a in axes))


def get_act_patch_mlp_neuron_all_pos(
    model: Any, corrupted_tokens: Int[Tensor, "batch pos"], clean_cache: Any, patching_metric: PatchingMetric
) -> Float[Tensor, "layer d_mlp"]:
    """Patch each MLP neuron (``blocks.{l}.mlp.hook_post[..., n]``) at every position: ``[n_layers, d_mlp]``. On a
    converted model this patches all of the neuron's heads together; it runs on the source model as well."""
    return _mlp_neuron_patch(model, corrupted_tokens, clean_cache, patching_metric, by_pos=False)


def get_act_patch_mlp_neuron_by_pos(
    model: Any, corrupted_tokens: Int[Tensor, "batch pos"], clean_cache: Any, patching_metric: PatchingMetric
) -> Float[Tensor, "layer pos d_mlp"]:
    """As :func:`get_act_patch_mlp_neuron_all_pos`, one position at a time: ``[n_layers, pos, d_mlp]``."""
    return _mlp_neuron_patch(model, corrupted_tokens, clean_cache, patching_metric, by_pos=True)
