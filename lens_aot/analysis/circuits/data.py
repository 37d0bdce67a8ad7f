"""Task data and metrics for circuit discovery and evaluation: batches of ``(clean, corrupted, labels)``.

A dataset is any iterable (a list, a generator factory's output, a ``torch.utils.data.DataLoader``) of batches
``(clean, corrupted, labels)``: token tensors ``[batch, pos]`` (or lists of strings when the model has a tokenizer)
and labels (a tensor or list with one entry per example). A metric is ``metric(logits, labels)`` returning one value
per example (``[batch]``); EAP-IG's signature ``metric(logits, clean_logits, input_lengths, labels)`` is accepted too,
returning ``[batch]`` or, as EAP-IG's metrics with ``mean=True`` do, a scalar: read as the batch's mean (each example
of the batch gets it; gradients, the sum over the batch, are those of the per-example form).
Everything here refuses bad input with an :class:`~lens_aot.errors.InputError` naming the problem and the fix.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from lens_aot.analysis.patching.runs import _pair
from lens_aot.errors import InputError

Dataset = Iterable[tuple[Any, Any, Any]]
CircuitMetric = Callable[..., Tensor]
TokenBatch = Int[Tensor, "batch pos"]  # token ids, one row per example


@dataclass
class Batch:
    """One checked batch: clean and corrupted tokens of one shape, labels, and each example's length."""

    clean: TokenBatch
    corrupted: TokenBatch
    labels: Any
    input_lengths: Int[Tensor, " batch"]

    def __len__(self) -> int:
        return int(self.clean.shape[0])


def _labels(aot: Any, labels: Any, n: int, index: int) -> Any:
    """Labels as a tensor when they are numbers; integer labels must be token ids of the model's vocabulary."""
    if isinstance(labels, (list, tuple)) and labels and all(isinstance(x, (int, float, list, tuple)) for x in labels):
        try:
            labels = torch.tensor(labels)
        except (TypeError, ValueError):
            pass
    if isinstance(labels, Tensor):
        length = labels.shape[0] if labels.ndim else None
    else:
        length = len(labels) if hasattr(labels, "__len__") else None
    if length != n:
        raise InputError(f"batch {index}: labels must have one entry per example ({n}); got {length}")
    if isinstance(labels, Tensor) and not labels.is_floating_point() and labels.dtype != torch.bool:
        d_vocab = int(aot.cfg.d_vocab_out if getattr(aot.cfg, "d_vocab_out", -1) > 0 else aot.cfg.d_vocab)
        if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= d_vocab):
            bad = labels[(labels < 0) | (labels >= d_vocab)].flatten()[:3].tolist()
            raise InputError(
                f"batch {index}: integer labels are token ids and must lie in [0, {d_vocab}) (the model's output "
                f"vocabulary); got {bad}. Map labels to token ids (e.g. model.to_single_token(' word'))"
            )
        labels = labels.to(aot.placement.unembed)  # where the logits come out (the last device of a split model)
    return labels


def batches(aot: Any, dataset: Dataset) -> Iterator[Batch]:
    """Check and tokenize every batch of ``dataset``; raise if it holds no batch at all."""
    if isinstance(dataset, (str, Tensor)) or not isinstance(dataset, Iterable):
        raise InputError(
            f"dataset must be an iterable (list, DataLoader) of (clean, corrupted, labels) batches; got "
            f"{type(dataset).__name__}"
        )
    count = 0
    for index, item in enumerate(dataset):
        if not isinstance(item, (tuple, list)) or len(item) != 3:
            raise InputError(
                f"batch {index} of the dataset is not a (clean, corrupted, labels) triple; got "
                f"{type(item).__name__}{f' of length {len(item)}' if hasattr(item, '__len__') else ''}"
            )
        clean, corrupted, labels = item
        try:
            clean_t, corrupted_t = _pair(aot, clean, corrupted)
        except InputError as error:
            raise InputError(f"batch {index}: {error}") from None
        if clean_t.shape[0] == 0:
            raise InputError(f"batch {index} has no examples")
        n = int(clean_t.shape[0])
        lengths = torch.full((n,), int(clean_t.shape[1]), dtype=torch.long)
        count += 1
        yield Batch(clean_t, corrupted_t, _labels(aot, labels, n, index), lengths)
    if count == 0:
        raise InputError("the dataset is empty: give at least one (clean, corrupted, labels) batch")


def _eap_signature(metric: CircuitMetric) -> bool:
    """Whether ``metric`` takes EAP-IG's four arguments ``(logits, clean_logits, input_lengths, labels)``."""
    try:
        params = [
            p
            for p in inspect.signature(metric).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
        ]
    except (TypeError, ValueError):
        return False
    return len(params) >= 4


def call_metric(
    metric: CircuitMetric,
    logits: Float[Tensor, "batch pos vocab"],
    batch: Batch,
    clean_logits: Float[Tensor, "batch pos vocab"] | None,
) -> Float[Tensor, " batch"]:
    """``metric`` on ``logits``: one value per example, checked."""
    if not callable(metric):
        raise InputError(f"metric must be callable, metric(logits, labels) -> [batch]; got {type(metric).__name__}")
    if _eap_signature(metric):
        value = metric(logits, clean_logits, batch.input_lengths.to(logits.device), batch.labels)
        if isinstance(value, Tensor) and value.ndim == 0:  # EAP-IG's scalar form (mean=True): the batch's mean
            value = value.expand(len(batch))
    else:
        value = metric(logits, batch.labels)
    n = len(batch)
    if not isinstance(value, Tensor) or tuple(value.shape) != (n,):
        got = f"shape {tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__
        raise InputError(
            f"metric must return one value per example, a tensor of shape ({n},); got {got}. Do not reduce over "
            f"the batch, e.g. lambda logits, labels: logits[:, -1].gather(-1, labels[:, None])[:, 0]"
        )
    return value


def needs_clean_logits(metric: CircuitMetric) -> bool:
    return _eap_signature(metric)
