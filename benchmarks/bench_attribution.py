"""Gradient attribution at scale: every head and neuron head of a GPT-2-small-shaped converted model.

GPT-2 small shape (12 layers, d_model 768, 12 heads, d_mlp 3072, vocab 50257, gelu_new, random weights; default
conversion: 4 heads per neuron → 147,456 neuron heads + 144 attention heads), 1×128 tokens, a logit-difference
metric. Measured in one process, against the **source's own forward+backward** (forward, metric, ``backward()`` into
every parameter):

* ``attribute_heads(method="atp")`` over all 147,600 units (target ≤ 5× the source's forward+backward), and its
  extra peak memory (target ≤ 2 GB; peak resident memory above the resident memory before the call, Linux
  ``VmHWM`` reset through ``/proc/self/clear_refs``);
* the same at 64 tokens, to show memory grows with the units (× positions), not with their square;
* ``attribute_edges`` between all units of two chosen blocks: layer 5's 12 attention heads → layer 5's 12,288 neuron
  heads (``"qv"``: exact recomputation of each receiver), and layer 5's 12,288 neuron heads → layer 6's 12 attention
  heads (``"qkv"``).

    python benchmarks/bench_attribution.py [--threads 1] [--repeats 3] [--layers 12] [--source hooked|bridge]
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_shapes import SHAPES, gpt2_pair  # noqa: E402

from lens_aot import patching as P  # noqa: E402
from lens_aot.core.read import run_source  # noqa: E402


def _status(field: str) -> int:
    """A ``/proc/self/status`` memory field in bytes (0 where unavailable)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover - not Linux
        pass
    return 0


def peak_extra(fn: Callable[[], Any]) -> tuple[float, int, Any]:
    """Wall time, extra peak resident bytes over the resident bytes before the call, and the result."""
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident size
    except OSError:  # pragma: no cover - not Linux
        pass
    before = _status("VmRSS")
    start = time.perf_counter()
    out = fn()
    elapsed = time.perf_counter() - start
    return elapsed, max(0, _status("VmHWM") - before), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=12, help="fewer for a quick run")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--source", choices=["hooked", "bridge", "auto"], default="auto")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    source, aot = gpt2_pair(args.layers, args.source)
    gen = torch.Generator().manual_seed(0)
    vocab = SHAPES["gpt2"]["d_vocab"]
    clean = torch.randint(0, vocab, (1, args.tokens), generator=gen)
    corrupted = clean.clone()
    corrupted[0, args.tokens // 2 :: 7] = torch.randint(
        0, vocab, corrupted[0, args.tokens // 2 :: 7].shape, generator=gen
    )

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return (logits[:, -1, 11] - logits[:, -1, 12]).mean()

    def source_fwd_bwd(tokens: torch.Tensor = clean) -> None:
        source.zero_grad(set_to_none=True)
        metric(run_source(source, tokens)).backward()

    source_fwd_bwd()  # warm-up
    src = statistics.median(peak_extra(source_fwd_bwd)[0] for _ in range(args.repeats))
    source.zero_grad(set_to_none=True)  # measure the gradients' memory too
    src_mem = peak_extra(source_fwd_bwd)[1]
    source.zero_grad(set_to_none=True)
    units = P.head_units(aot)
    n_neuron = sum(u.kind == "neuron_head" for u in units)

    def heads(tokens: int = args.tokens) -> P.PatchingResult:
        return P.attribute_heads(aot, clean[:, :tokens], corrupted[:, :tokens], metric, method="atp")

    heads()  # warm-up
    runs = [peak_extra(heads) for _ in range(args.repeats)]
    atp_s, atp_mem, res = statistics.median(r[0] for r in runs), max(r[1] for r in runs), runs[-1][2]
    half_mem = peak_extra(lambda: heads(args.tokens // 2))[1]
    layer = min(5, args.layers - 2)
    att, neu, att_next = f"blocks.{layer}.attn", aot.neuron_module(layer), f"blocks.{layer + 1}.attn"
    att_units, neu_units = P.head_units(aot, modules=[att]), P.head_units(aot, modules=[neu])
    next_units = P.head_units(aot, modules=[att_next])
    edges = P.attribute_edges
    e1_s, e1_mem, e1 = peak_extra(lambda: edges(aot, clean, corrupted, metric, att_units, neu_units, "qv"))
    e2_s, e2_mem, e2 = peak_extra(lambda: edges(aot, clean, corrupted, metric, neu_units, next_units, "qkv"))

    machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch thread(s), CPU"
    print(f"GPT-2-small shape, {args.layers} layers, source {type(source).__name__}, 1×{args.tokens} tokens, "
          f"float32, {machine}, torch {torch.__version__}")  # fmt: skip
    print(f"units: {len(units)} ({len(units) - n_neuron} attention heads + {n_neuron} neuron heads)\n")
    print("| measure | time | ratio to source fwd+bwd | extra peak memory | target |")
    print("|---|---|---|---|---|")
    print(f"| source forward+backward (metric, all parameter grads) | {src * 1e3:.0f} ms | 1.00× | "
          f"{src_mem / 2**20:.0f} MiB | |")  # fmt: skip
    print(f"| attribute_heads atp, all {len(res)} units | {atp_s * 1e3:.0f} ms | {atp_s / src:.2f}× | "
          f"{atp_mem / 2**20:.0f} MiB | ≤ 5×, ≤ 2 GB |")  # fmt: skip
    print(f"| same, 1×{args.tokens // 2} tokens | | | {half_mem / 2**20:.0f} MiB | grows with units × positions |")
    print(f"| attribute_edges L{layer} heads → L{layer} neuron heads (qv), {e1.values.numel()} edges | "
          f"{e1_s * 1e3:.0f} ms | {e1_s / src:.2f}× | {e1_mem / 2**20:.0f} MiB | seconds |")  # fmt: skip
    print(f"| attribute_edges L{layer} neuron heads → L{layer + 1} heads (qkv), {e2.values.numel()} edges | "
          f"{e2_s * 1e3:.0f} ms | {e2_s / src:.2f}× | {e2_mem / 2**20:.0f} MiB | seconds |")  # fmt: skip
    print("\ntop 5 units:", ", ".join(f"{e.unit.label} {e.effect:+.3g}" for e in res.top(5)))
    print(f"activation patching of all {len(res)} units would take {len(res)} patched forwards")


if __name__ == "__main__":
    main()
