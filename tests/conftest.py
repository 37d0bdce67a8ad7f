"""Shared fixtures. HookedTransformer tests are collected only where TransformerLens still has it (3.x)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

from lens_aot.core.check.faithfulness import STATED_LOGIT_ERROR
from lens_aot.tl import has_hooked_transformer

sys.path.insert(0, str(Path(__file__).parent))

TL_VERSION = version("transformer-lens")
TL_MAJOR = int(TL_VERSION.split(".")[0])
HAS_HOOKED_TRANSFORMER = has_hooked_transformer()

# HookedTransformer was removed in TransformerLens 4.0: its tests are not collected there (not skipped: they do not
# apply). `make test` runs the suite under both 3.9 and 4.3, so every file is exercised.
collect_ignore_glob = [] if HAS_HOOKED_TRANSFORMER else ["test_hooked_*.py"]

# max |Δlogit| per activation and dtype (the docs' support matrix): ONE table, lens_aot's own, used by convert's
# check, `lens-aot verify` and every test.
TOLERANCES = STATED_LOGIT_ERROR


def pytest_report_header() -> str:
    return f"transformer-lens {TL_VERSION}, torch {torch.__version__}"


@pytest.fixture
def tokens() -> torch.Tensor:
    return torch.randint(0, 50, (3, 20), generator=torch.Generator().manual_seed(1))


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Many tiny matrix products: thread hand-offs would cost more than the work on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
