"""Progress output of the command line: one step at a time, a bar on a terminal, one line per step otherwise."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["Steps"]


@contextlib.contextmanager
def _hub_progress_bars(enabled: bool) -> Iterator[None]:
    """Turn Hugging Face's own progress bars (weight loading, downloads) off for ``--quiet``, restoring them after."""
    if enabled:
        yield
        return
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        yield
        return
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


class Steps:
    """A progress bar over a command's long steps (tqdm on a terminal; one line per step on stderr otherwise)."""

    def __init__(self, total: int, quiet: bool = False) -> None:
        self.total, self.done, self.quiet = total, 0, quiet
        self.bar: Any = None
        if not quiet and sys.stderr.isatty():
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, file=sys.stderr, bar_format="{desc} {bar} {n_fmt}/{total_fmt} {elapsed}")
            except ImportError:
                self.bar = None

    @contextlib.contextmanager
    def step(self, description: str) -> Iterator[None]:
        """Run one step: shown while it runs, counted when it ends."""
        start = time.perf_counter()
        if self.bar is not None:
            self.bar.set_description_str(description)
        elif not self.quiet:
            print(f"[{self.done + 1}/{self.total}] {description} ...", file=sys.stderr, flush=True)
        with _hub_progress_bars(not self.quiet):
            yield
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        elif not self.quiet:
            print(f"[{self.done}/{self.total}] {description}: {time.perf_counter() - start:.1f}s", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
