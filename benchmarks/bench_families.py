"""Per-family cost of the conversion: forward time, operations per forward and ``convert``'s peak memory, each
against the source measured in the same run (issue 22's targets: ≤1.25× forward time, ≤2× operations, ≤1.5× the
parameter bytes).

Every family of the support matrix (TransformerBridge, TransformerLens 4.x; or those named with ``--families``) is
built from its own ``transformers`` config class, as the matrix builds it (:mod:`lens_aot.matrix.families`), but at
a benchmark shape instead of the matrix's tiny one: ``--layers`` layers (4), hidden ``--hidden`` (256), 8 heads of
32 (4 key/value heads where the config has them), MLP 4 × hidden, vocabulary 2,000; mixtures of experts keep 4
experts top-2, 64 wide (``--experts``, ``--top-k``, ``--expert-mlp``: e.g. 64 experts top-8 for many small experts,
the shared expert as wide as a routed one). Random weights, float32, CPU, eager attention in the source (the
bridge's), the converted model in its default (dense) attention. Families the conversion refuses get their refusal
as their row.

* **forward**: median of ``--repeats`` forwards of 1 × ``--tokens`` tokens after one warm-up, ``--threads`` CPU
  threads (default 1), source (the TransformerBridge) and converted model alternating. With ``--isolated R``, each
  model is timed in its own fresh process instead (R rounds, source and converted processes alternating; each
  process builds the source and converts it, then times only its model; the row gives the median over rounds):
  on CPU one model's forward leaves the C allocator in a state that speeds or slows the other's by up to ~25%
  (glibc's mmap threshold and heap trimming), so the alternating ratio measures the pair, not each model alone.
* **ops**: ATen operations dispatched by one forward (:func:`lens_aot.core.opcount.count_ops`), converted / source.
* **convert peak**: extra peak resident memory of ``lens_aot.convert`` (its agreement check included) in a fresh
  process, over what the process held with the source built and run once (Linux ``VmHWM``, reset through
  ``/proc/self/clear_refs``), as a multiple of the source's parameter bytes. ``--no-memory`` skips it.

    python benchmarks/bench_families.py [--families GPT2LMHeadModel LlamaForCausalLM ...] [--threads 1]
        [--repeats 5] [--tokens 256] [--layers 4] [--hidden 256] [--experts 4] [--top-k 2] [--expert-mlp 64]
        [--no-memory] [--isolated ROUNDS]
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's lens_aot

import lens_aot  # noqa: E402
from lens_aot.core.opcount import count_ops  # noqa: E402
from lens_aot.errors import LensAOTError  # noqa: E402
from lens_aot.matrix.measure import _source  # noqa: E402
from lens_aot.tl.registry import bridge_architectures  # noqa: E402

fam = importlib.import_module("lens_aot.matrix.families")  # the module (the package exports a function by its name)

TARGETS = {"forward": 1.25, "ops": 2.0, "memory": 1.5}


def shape(args: argparse.Namespace) -> dict[str, Any]:
    """The benchmark shape of ``args`` (``--layers``, ``--hidden``, the experts' ``--experts``, ``--top-k`` and
    ``--expert-mlp``), as overrides of :data:`lens_aot.matrix.families.TINY` / ``TINY_MOE`` values."""
    layers, hidden, heads, head_dim = args.layers, args.hidden, 8, args.hidden // 8
    return {
        "vocab": 2000,
        "hidden": hidden,
        "layers": layers,
        "heads": heads,
        "kv_heads": 4,
        "head_dim": head_dim,
        "mlp": 4 * hidden,
        "q_lora_rank": hidden // 2,
        "kv_lora_rank": hidden // 4,
        "qk_nope_head_dim": head_dim,
        "qk_rope_head_dim": head_dim // 2,
        "v_head_dim": head_dim,
        "experts": args.experts,
        "top_k": args.top_k,
        "expert_mlp": args.expert_mlp,
        "shared_expert_mlp": args.expert_mlp,
    }


@contextmanager
def benchmark_shape(values: dict[str, Any]) -> Iterator[None]:
    """Build families at ``values`` instead of the matrix's tiny shape (restored on exit). Per-family overrides
    sized by the tiny vocabulary (Gemma 4's ``vocab_size_per_layer_input``) or layer count (GPT-Neo's
    ``attention_types``) take the benchmark's."""
    saved = dict(fam.TINY), dict(fam.TINY_MOE), {k: dict(v) for k, v in fam.OVERRIDES.items()}
    for table in (fam.TINY, fam.TINY_MOE):
        for key, (_, names) in list(table.items()):
            if key in values:
                table[key] = (values[key], names)
    for override in fam.OVERRIDES.values():
        if "vocab_size_per_layer_input" in override and "vocab" in values:
            override["vocab_size_per_layer_input"] = values["vocab"]
        if "attention_types" in override and "layers" in values:  # GPT-Neo: one (global, local) pair per 2 layers
            (pattern, _), *_ = override["attention_types"]
            override["attention_types"] = [[pattern, -(-values["layers"] // len(pattern))]]
    try:
        yield
    finally:
        fam.TINY.clear(), fam.TINY.update(saved[0])
        fam.TINY_MOE.clear(), fam.TINY_MOE.update(saved[1])
        for name, override in saved[2].items():
            fam.OVERRIDES[name].clear(), fam.OVERRIDES[name].update(override)


def build(name: str, values: dict[str, Any]) -> Any:
    """The family's TransformerBridge source at the benchmark shape, float32, eval mode."""
    family = next(f for f in fam.families(bridge_architectures()) if f.name == name)
    with benchmark_shape(values):
        model = fam.build_hf_model(family)
    return _source(model, family, "bridge", torch.float32)


def median_times(runs: list[Callable[[], Any]], repeats: int) -> list[float]:
    """Median wall time of each run, the runs alternating so that drift in the machine's load hits them alike."""
    for run in runs:
        run()  # warm-up
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(repeats):
        for run, out in zip(runs, times, strict=True):
            start = time.perf_counter()
            run()
            out.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def peak_child(name: str, values: dict[str, Any]) -> None:
    """In a fresh process: print ``convert``'s extra peak RSS and the source's parameter bytes as JSON."""
    source = build(name, values)
    params = sum(p.numel() * p.element_size() for p in {p.data_ptr(): p for p in source.parameters()}.values())
    with torch.no_grad():
        source(torch.zeros(1, 64, dtype=torch.long))
    gc.collect()
    base = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    lens_aot.convert(source)
    print(json.dumps({"params": params, "extra": _status("VmHWM") - base}))


def child(*arguments: str) -> dict[str, Any]:
    """Run this script in a fresh process with ``arguments`` and return the JSON its last output line holds."""
    out = subprocess.run([sys.executable, __file__, *arguments], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def shape_arguments(args: argparse.Namespace) -> list[str]:
    """The command-line arguments that give a child process this run's shape."""
    keys = ("layers", "hidden", "experts", "top_k", "expert_mlp")
    return [f"--{key.replace('_', '-')}={getattr(args, key)}" for key in keys]


def convert_peak(name: str, args: argparse.Namespace) -> float:
    """``convert``'s extra peak resident memory over the source's parameter bytes, measured in a fresh process."""
    result = child("--peak-child", name, *shape_arguments(args))
    return result["extra"] / result["params"]


def time_child(name: str, which: str, args: argparse.Namespace) -> None:
    """In a fresh process: build the source, convert it, then print the median forward time of ``which`` only
    (``source`` or ``converted``), as JSON."""
    source = build(name, shape(args))
    aot = lens_aot.convert(source).eval()
    model = source if which == "source" else aot
    tokens = torch.randint(0, 2000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        (seconds,) = median_times([lambda: model(tokens)], args.repeats)
    print(json.dumps({"seconds": seconds}))


def isolated_times(name: str, args: argparse.Namespace) -> tuple[float, float]:
    """Median forward times (source, converted) over ``--isolated`` rounds of fresh processes, alternating."""
    shape_args = [*shape_arguments(args), "--tokens", str(args.tokens)]
    shape_args += ["--repeats", str(args.repeats), "--threads", str(args.threads)]
    times: dict[str, list[float]] = {"source": [], "converted": []}
    for _ in range(args.isolated):
        for which in times:
            times[which].append(child(*shape_args, "--time-child", name, which)["seconds"])
    return statistics.median(times["source"]), statistics.median(times["converted"])


def row(name: str, args: argparse.Namespace) -> str:
    """One markdown row: the family's figures, or its refusal."""
    values = shape(args)
    try:
        source = build(name, values)
    except Exception as error:  # noqa: BLE001 - a family transformers or TransformerLens cannot build is a row
        return f"| {name} | not built: {type(error).__name__} | | | | |"
    tokens = torch.randint(0, 2000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            source(tokens)
    except Exception as error:  # noqa: BLE001 - a source that cannot run at this shape is a row, not a refusal
        return f"| {name} | the source's own forward raised {type(error).__name__} at this shape | | | | |"
    try:
        aot = lens_aot.convert(source).eval()
    except LensAOTError as error:
        return f"| {name} | refused: {str(error).splitlines()[0][:120]} | | | | |"
    with torch.no_grad():
        source(tokens), aot(tokens)  # warm-up: first-call work (rotary rows, workspaces) is not counted below
        if args.isolated:
            source_s, aot_s = isolated_times(name, args)
        else:
            source_s, aot_s = median_times([lambda: source(tokens), lambda: aot(tokens)], args.repeats)
        ops = count_ops(lambda: aot(tokens)).total / count_ops(lambda: source(tokens)).total
    memory = "" if args.no_memory else f"{convert_peak(name, args):.2f}×"
    return (
        f"| {name} | {source_s * 1e3:.1f} ms | {aot_s * 1e3:.1f} ms | {aot_s / source_s:.2f}× | {ops:.2f}× | {memory} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="*", default=None, metavar="NAME")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=4, help="experts per MoE layer")
    parser.add_argument("--top-k", type=int, default=2, help="experts chosen per token")
    parser.add_argument("--expert-mlp", type=int, default=64, help="each expert's (and the shared expert's) width")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--isolated", type=int, default=0, metavar="ROUNDS", help="time each model in its own process")
    parser.add_argument("--peak-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--time-child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.time_child:
        time_child(*args.time_child, args)
        return
    if args.peak_child:
        peak_child(args.peak_child, shape(args))
        return
    names = args.families or [f.name for f in fam.families(bridge_architectures()) if f.in_scope]
    print(
        f"TransformerBridge sources, float32, CPU, {torch.get_num_threads()} thread(s), 1 × {args.tokens} tokens, "
        f"{args.layers} layers, hidden {args.hidden}, MoE {args.experts} experts top-{args.top_k} of {args.expert_mlp}"
        + (f", each model timed in its own process ({args.isolated} rounds)" if args.isolated else "")
        + f"; targets: forward ≤ {TARGETS['forward']}×, ops ≤ "
        f"{TARGETS['ops']}×, convert peak ≤ {TARGETS['memory']}× the parameter bytes\n"
    )
    print("| family | source forward | converted forward | ratio | ops ratio | convert peak / params |")
    print("|---|---|---|---|---|---|")
    for name in names:
        print(row(name, args), flush=True)


if __name__ == "__main__":
    main()
