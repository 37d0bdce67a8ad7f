"""Progress bars of the analysis functions (``discover``, ``evaluate``, ``faithfulness_curve``,
``compare_granularities``, ``patch_*``, ``attribute_*``): a tqdm bar counting their forward (and backward) passes.

Each takes ``progress=``: True shows the bar, False shows nothing, and "auto" (the default) shows it in a notebook
(a Jupyter kernel) only, so scripts and tests stay quiet.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any, Literal, TypeAlias

from tqdm.auto import tqdm

from lens_aot.errors import InputError

Progress: TypeAlias = bool | Literal["auto"]

__all__ = ["Progress", "in_notebook", "progress_bar", "show_progress"]


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel: IPython's shell is ipykernel's ``ZMQInteractiveShell`` (neither
    package is imported here: a kernel has imported both)."""
    ipython, zmqshell = sys.modules.get("IPython"), sys.modules.get("ipykernel.zmqshell")
    get = getattr(ipython, "get_ipython", None)
    shell = get() if callable(get) else None
    kernel_shell = getattr(zmqshell, "ZMQInteractiveShell", None)
    return shell is not None and isinstance(kernel_shell, type) and isinstance(shell, kernel_shell)


def show_progress(progress: Any) -> bool:
    """Whether to show a bar for ``progress`` (True, False or "auto": in a notebook only), checked."""
    if progress == "auto" and isinstance(progress, str):
        return in_notebook()
    if not isinstance(progress, bool):
        raise InputError(f"progress must be True, False or 'auto' (a bar in notebooks only); got {progress!r}")
    return progress


class _NoBar:
    """What :func:`progress_bar` yields when no bar is shown."""

    def update(self, n: int = 1) -> None:
        """Nothing to count."""


@contextlib.contextmanager
def progress_bar(progress: Progress, total: int, desc: str) -> Iterator[Any]:
    """A tqdm bar of ``total`` steps labelled ``desc`` (``.update(n)`` counts steps), closed on exit even if the
    work raises; a bar that does nothing when ``progress`` says not to show one."""
    if not show_progress(progress):
        yield _NoBar()
        return
    bar = tqdm(total=total, desc=desc)
    try:
        yield bar
    finally:
        bar.close()
