"""Screen, then verify: re-run exact activation (or path) patching on the top-k units of an attribution result.

:func:`verify_attribution` takes any result of gradient attribution (``attribute_heads``, ``attribute_neurons``,
``attribute_units``, ``attribute_edges``), patches its ``k`` largest entries exactly with the matching patching call
(same units, positions, direction, receiver input), and reports attribution against truth as a table and a scatter
plot.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lens_aot.analysis.checks import converted_only, pyplot
from lens_aot.analysis.patching.activation import patch_units
from lens_aot.analysis.patching.options import Metric, TokensLike
from lens_aot.analysis.patching.path import path_patch
from lens_aot.analysis.patching.results import PatchingResult, PathPatchingResult, Ranking
from lens_aot.analysis.patching.units import _receiver_label
from lens_aot.analysis.progress import Progress
from lens_aot.core.runtime.model import AttentionOnlyTransformer
from lens_aot.errors import InputError

__all__ = ["Verification", "verify_attribution"]


@dataclass
class Verification:
    """Attribution against activation patching on the top-k entries.

    ``rows``: one dict per entry (``label``, ``position``, ``receiver`` for edges, ``attribution`` and ``patched``
    effects, ``error``), largest attribution first; ``truth``: the patching result over the same units;
    ``pearson``: correlation of the two effect columns; ``figure``: the scatter plot (matplotlib; None with
    ``plot=False``, or with a warning naming the ``viz`` extra when matplotlib is missing). :attr:`table` is a
    pandas DataFrame when pandas is installed, else ``rows``.
    """

    rows: list[dict[str, Any]]
    truth: PatchingResult | PathPatchingResult
    pearson: float
    figure: Any

    @property
    def table(self) -> Any:
        """``rows`` as a pandas DataFrame (the rows themselves when pandas is not installed)."""
        try:
            import pandas
        except ImportError:  # pragma: no cover - depends on the environment
            return self.rows
        return pandas.DataFrame.from_records(self.rows)

    @property
    def max_abs_error(self) -> float:
        """Largest ``|attribution − patched|`` over the rows."""
        return max(abs(r["error"]) for r in self.rows)

    def __repr__(self) -> str:
        errors = f"pearson r {self.pearson:.4f}, max |error| {self.max_abs_error:.3g}"
        return f"Verification({len(self.rows)} entries; {errors})"


def _pearson(x: Tensor, y: Tensor) -> float:
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    denom = float(x.norm() * y.norm())
    return float((x * y).sum()) / denom if denom > 0 else math.nan


@converted_only(metric="patching")
def verify_attribution(
    aot: AttentionOnlyTransformer,
    result: PatchingResult | PathPatchingResult,
    clean: TokensLike,
    corrupted: TokensLike,
    metric: Metric,
    *,
    k: int = 20,
    by: Ranking = "abs_effect",
    positions: int | list[int] | None = None,
    batch_size: int | None = None,
    progress: Progress = "auto",
    plot: bool = True,
) -> Verification:
    """Exact patching of ``result``'s top ``k`` entries (by ``by``), compared with their attribution.

    Pass the same ``clean``, ``corrupted`` and ``metric`` as to the attribution call; ``positions`` only if that
    call restricted a whole-sequence patch to some positions (per-position results carry their positions).
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise InputError(f"k must be a positive int (entries to verify); got {k!r}")
    top = result.top(k, by=by)
    if isinstance(result, PathPatchingResult):
        senders = list(dict.fromkeys(e.unit for e in top))
        receivers = list(dict.fromkeys(e.receiver for e in top))
        truth: PatchingResult | PathPatchingResult = path_patch(
            aot, clean, corrupted, metric, senders, receivers, result.receiver_input,  # type: ignore[arg-type]
            direction=result.direction, batch_size=batch_size, progress=progress,
        )  # fmt: skip
        patched = [float(truth.effect()[senders.index(e.unit), receivers.index(e.receiver)]) for e in top]
    elif isinstance(result, PatchingResult):
        units = list(dict.fromkeys(e.unit for e in top))
        per_position = result.positions is not None
        truth = patch_units(
            aot, clean, corrupted, metric, units, per_position=per_position,
            positions=result.positions if per_position else positions, direction=result.direction,
            batch_size=batch_size, progress=progress,
        )  # fmt: skip
        effect = truth.effect()
        patched = [
            float(
                effect[units.index(e.unit)]
                if not per_position
                else effect[units.index(e.unit), result.positions.index(e.position)]
            )  # type: ignore[union-attr]
            for e in top
        ]
    else:
        raise InputError(f"result must be a PatchingResult or PathPatchingResult; got {type(result).__name__}")
    rows = []
    for entry, true in zip(top, patched, strict=True):
        row: dict[str, Any] = {"label": entry.unit.label, "kind": entry.unit.kind, "position": entry.position}
        if entry.receiver is not None:
            row["receiver"] = _receiver_label(entry.receiver)
        rows.append(row | {"attribution": entry.effect, "patched": true, "error": entry.effect - true})
    pearson = _pearson(torch.tensor([r["attribution"] for r in rows]), torch.tensor(patched))
    figure = _scatter(rows, pearson) if plot else None
    return Verification(rows, truth, pearson, figure)


def _scatter(rows: list[dict[str, Any]], pearson: float) -> Any:
    try:
        plt = pyplot("verify_attribution's plot")
    except ModuleNotFoundError as err:
        warnings.warn(f"{err} The table is returned with figure=None; pass plot=False not to ask.", stacklevel=3)
        return None
    fig, ax = plt.subplots(figsize=(5, 5))
    x = [r["patched"] for r in rows]
    y = [r["attribution"] for r in rows]
    colours = ["tab:blue" if r["kind"] == "attention" else "tab:orange" for r in rows]
    ax.scatter(x, y, c=colours, s=18)
    lo, hi = min(x + y), max(x + y)
    ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8, ls="--", label="y = x")
    for r in rows[:8]:
        name = r["label"] + (f"→{r['receiver']}" if "receiver" in r else "")
        ax.annotate(name, (r["patched"], r["attribution"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("activation patching effect (exact)")
    ax.set_ylabel("attribution (estimate)")
    ax.set_title(f"top {len(rows)}: pearson r = {pearson:.3f}")
    ax.legend(loc="upper left")
    fig.tight_layout()
    plt.close(fig)
    return fig
