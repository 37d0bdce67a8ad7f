"""The patching API's vocabulary: directions, methods, metrics, token inputs and the keyword options that
``patch_*`` and ``attribute_*`` share (one declaration, so the estimates take the exact calls' arguments)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Literal, TypeAlias, TypedDict

from jaxtyping import Float, Int
from torch import Tensor

from lens_aot.analysis.progress import Progress

Direction = Literal["denoise", "noise"]
Method = Literal["atp", "ig"]
ReceiverInput = Literal["q", "k", "v"]
Metric: TypeAlias = Callable[[Float[Tensor, "batch pos d_vocab_out"]], Tensor | float]
TokensLike: TypeAlias = Int[Tensor, "batch pos"] | Int[Tensor, " pos"] | str | list[str] | list[int] | list[list[int]]


class PatchOptions(TypedDict, total=False):
    """Keyword options of :func:`~lens_aot.patching.patch_units`, taken as they are by ``patch_heads`` and
    ``patch_neurons``."""

    per_position: bool
    positions: int | Iterable[int] | None
    direction: Direction
    batch_size: int | None
    progress: Progress


class AttributionOptions(PatchOptions, total=False):
    """Keyword options of :func:`~lens_aot.patching.attribute_units`, taken as they are by ``attribute_heads`` and
    ``attribute_neurons``: the patching options and the method."""

    method: Method
    steps: int
