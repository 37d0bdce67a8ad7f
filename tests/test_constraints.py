"""The tested versions: constraints/tl{3,4}.txt pin what `make test` installs, and the README and the Makefile say
the same versions (issue 22: a fresh install gets what CI tested)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _pins(major: int) -> dict[str, str]:
    lines = (ROOT / "constraints" / f"tl{major}.txt").read_text(encoding="utf-8").splitlines()
    pins = dict(line.split("==", 1) for line in lines if line and not line.startswith("#"))
    return {name.lower().replace("_", "-"): version for name, version in pins.items()}


def test_constraints_pin_every_package_exactly() -> None:
    for major in (3, 4):
        lines = [line for line in (ROOT / "constraints" / f"tl{major}.txt").read_text().splitlines() if line]
        assert all(line.startswith("#") or re.fullmatch(r"[A-Za-z0-9_.\-]+==[^=\s]+", line) for line in lines)
        pins = _pins(major)
        assert pins["transformer-lens"].startswith(f"{major}."), pins["transformer-lens"]
        assert "torch" not in pins and "lens-aot" not in pins  # torch: the Makefile's CPU build; lens_aot: editable


def test_makefile_and_readme_state_the_pinned_versions() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    setup = " ".join(
        (ROOT / "README.md").read_text(encoding="utf-8").split("## Set-up", 1)[1].split("\n## ", 1)[0].split()
    )
    for major in (3, 4):
        tl = _pins(major)["transformer-lens"]
        assert f"TL{major} ?= transformer-lens=={tl}" in makefile
        assert f"TransformerLens {tl}" in setup or f"and {tl}" in setup, tl
    transformers = {_pins(3)["transformers"], _pins(4)["transformers"]}
    assert len(transformers) == 1
    assert f"transformers {transformers.pop()}" in setup
    torch_pin = re.search(r"TORCH \?= torch==([\d.]+)", makefile)
    assert torch_pin is not None and f"torch {torch_pin.group(1)}" in setup
    assert "-c constraints/tl$*.txt" in makefile and "test-newest:" in makefile


def _dry_run(target: str) -> str:
    """What `make -n target` would run, as if every environment were built (`-o` marks their .ready files old)."""
    ready = [f"-o.venv-{name}/.ready" for name in ("tl3", "tl4", "new3", "new4", "ct")]
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}  # not the outer make's
    done = subprocess.run(
        ["make", "-n", "-C", str(ROOT), *ready, target], capture_output=True, text=True, check=True, timeout=60, env=env
    )
    return done.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine (the README's commands need it)")
@pytest.mark.parametrize(("target", "envs"), [("test", ("tl3", "tl4")), ("test-newest", ("new3", "new4"))])
def test_each_test_target_runs_the_suite_in_its_environments(target: str, envs: tuple[str, str]) -> None:
    """`make test` and `make test-newest` each run pytest in both of their environments (a target whose recipe
    make never runs, e.g. a pattern rule for a .PHONY name, would pass while testing nothing)."""
    commands = _dry_run(target)
    for env in envs:
        assert f".venv-{env}/bin/python -m pytest -q" in commands, (target, env, commands)
