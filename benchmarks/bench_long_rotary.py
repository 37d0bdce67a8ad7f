"""``convert``'s time and peak memory for a source with a long context, its rotary tables kept as a verified recipe
(:mod:`lens_aot.core.rotary_recipe`) against the full tables (the build before recipes), each in a fresh process.

The support matrix's tiny Llama 4 (:mod:`lens_aot.matrix.families`, ``Llama4ForCausalLM``: head_dim 16, 2 layers) as
a TransformerBridge, float32, CPU, with ``max_position_embeddings`` raised to ``--positions`` (Llama 4 Scout's
config has 10,485,760) and ``--fields`` (JSON config fields: ``{"head_dim": 128}`` Scout's head width,
``{"no_rope_layers": [1, 0]}`` a NoPE layer as every fourth of Scout's). For each of ``--modes``
(``tables``, ``recipe``), alternating, ``--repeats`` times: ``convert``'s wall time, its extra peak
resident memory over what the process held with the source built and run once (Linux ``VmHWM``, reset through
``/proc/self/clear_refs``), and the time spent in the bitwise check of the recipe against the source's rotary module
at every position (:func:`lens_aot.tl.attention.rotary_tables.verified_recipe`). ``--threads`` CPU threads (default 1).

    python benchmarks/bench_long_rotary.py [--positions 1048576 10485760] [--repeats 3] [--threads 1]
        [--family Llama4ForCausalLM] [--fields '{"head_dim": 128}'] [--modes tables recipe]
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's lens_aot

import lens_aot  # noqa: E402
from lens_aot.matrix.measure import _source  # noqa: E402
from lens_aot.tl.bridge import attention as bridge_attention  # noqa: E402


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def child(family_name: str, positions: int, mode: str, extra: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: build the source, convert it in ``mode`` (``recipe`` / ``tables``), return the figures."""
    families = importlib.import_module("lens_aot.matrix.families")
    family = families.Family(family_name, fields={"max_position_embeddings": positions, **extra})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        source = _source(families.build_hf_model(family), family, "bridge", torch.float32)
    with torch.no_grad():
        source(torch.zeros(1, 64, dtype=torch.long))
    check = [0.0]
    verify = bridge_attention.verified_recipe
    if mode == "tables":  # the build before recipes: no recipe tried, the tables read
        bridge_attention.verified_recipe = lambda *args: None  # type: ignore[assignment]
    else:

        def timed(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return verify(*args)
            finally:
                check[0] += time.perf_counter() - start

        bridge_attention.verified_recipe = timed  # type: ignore[assignment]
    gc.collect()
    base = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    start = time.perf_counter()
    aot = lens_aot.convert(source)
    seconds = time.perf_counter() - start
    recipes = sum(1 for block in aot.blocks if "rotary" in block.attn._modules)
    return {"convert_s": seconds, "extra_bytes": _status("VmHWM") - base, "check_s": check[0], "recipes": recipes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", default="Llama4ForCausalLM")
    parser.add_argument("--positions", type=int, nargs="*", default=[1 << 20, 10_485_760])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fields", type=json.loads, default={})
    parser.add_argument("--modes", nargs="*", default=["tables", "recipe"], choices=["tables", "recipe"])
    parser.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child is not None:
        print(json.dumps(child(args.family, int(args.child[0]), args.child[1], args.fields)))
        return
    shape = f"{args.family} (the matrix's, with {json.dumps(args.fields)})"
    print(f"{shape}, float32, CPU, {args.threads} thread(s); medians of {args.repeats}, alternating\n")
    print("| positions | mode | convert | extra peak RSS | bitwise check | layers on a recipe |")
    print("|---|---|---|---|---|---|")
    for positions in args.positions:
        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in args.modes}
        for _ in range(args.repeats):
            for mode in runs:
                command = [sys.executable, __file__, "--family", args.family, "--threads", str(args.threads)]
                command += ["--fields", json.dumps(args.fields)]
                command += ["--child", str(positions), mode]
                out = subprocess.run(command, capture_output=True, text=True, check=True)
                runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
        for mode, results in runs.items():
            seconds = statistics.median(r["convert_s"] for r in results)
            extra = statistics.median(r["extra_bytes"] for r in results) / 2**20
            check = statistics.median(r["check_s"] for r in results)
            print(
                f"| {positions:,} | {mode} | {seconds:.1f} s | {extra:,.0f} MiB | {check:.1f} s | "
                f"{results[0]['recipes']} |"
            )


if __name__ == "__main__":
    main()
