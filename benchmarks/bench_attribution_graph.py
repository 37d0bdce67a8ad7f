"""Attribution graphs at scale: a GPT-2-small-shaped converted model, one 16-token prompt, 500 / 2,000 / 8,000 kept
neurons (``lens_aot.circuits.attribution_graph``).

GPT-2 small shape (12 layers, d_model 768, 12 heads, d_mlp 3072, vocab 50257, gelu_new, random weights; 589,824
neuron activations on 16 tokens), float32, the salient target logits (circuit-tracer's choice: up to 10, probability
0.95). Measured in one process, each graph against the **source's own forward+backward** of the prompt (forward, the
target logit, ``backward()`` into every parameter; ``bench_attribution.py``'s reference) and, for comparison, the
converted model's forward+backward:

* time per kept node: the whole ``attribution_graph`` call (candidate ranking, every edge among the kept nodes, the
  constants) over the kept neurons (target ≤ 1× one forward+backward);
* extra peak memory: peak resident memory above the resident memory before the call (Linux ``VmHWM`` reset through
  ``/proc/self/clear_refs``; target ≤ 2 GB at 8,000 nodes);
* the pruning (``graph.prune(0.8, 0.98)``) and the JSON export of each graph, for scale.

The script runs itself with ``MALLOC_MMAP_THRESHOLD_=131072``: glibc then maps every large block and returns it when
freed, so memory an earlier step freed (the forward+backward's gradients) does not stay resident and hide the graph's
own peak (with the default, the threshold grows after each large free and freed blocks stay in the heap).

    python benchmarks/bench_attribution_graph.py [--threads 1] [--nodes 500 2000 8000] [--layers 12]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_attribution import peak_extra  # noqa: E402
from bench_shapes import SHAPES, gpt2_pair  # noqa: E402

from lens_aot.circuits import attribution_graph  # noqa: E402
from lens_aot.core.read import run_source  # noqa: E402


def main() -> None:
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:  # see the module docstring
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"})
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="forward+backward timings (median)")
    parser.add_argument("--layers", type=int, default=12, help="fewer for a quick run")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--nodes", type=int, nargs="+", default=[500, 2000, 8000])
    parser.add_argument("--source", choices=["hooked", "bridge", "auto"], default="auto")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    source, aot = gpt2_pair(args.layers, args.source)
    vocab = SHAPES["gpt2"]["d_vocab"]
    tokens = torch.randint(0, vocab, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        top = int(run_source(source, tokens)[0, -1].argmax())

    def source_fwd_bwd() -> None:
        source.zero_grad(set_to_none=True)
        run_source(source, tokens)[0, -1, top].backward()

    def converted_fwd_bwd() -> None:
        aot.zero_grad(set_to_none=True)
        aot(tokens)[0, -1, top].backward()

    def reference(fn) -> float:  # noqa: ANN001
        fn()  # warm-up
        return statistics.median(peak_extra(fn)[0] for _ in range(args.repeats))

    rows = []
    for n in args.nodes:
        src, conv = reference(source_fwd_bwd), reference(converted_fwd_bwd)
        source.zero_grad(set_to_none=True)
        aot.zero_grad(set_to_none=True)
        seconds, extra, graph = peak_extra(lambda n=n: attribution_graph(aot, tokens, max_nodes=n))
        kept = int(graph.kind_mask("neuron").sum())
        prune_s, prune_mem, small = peak_extra(lambda graph=graph: graph.prune(0.8, 0.98))
        json_s, _, data = peak_extra(lambda small=small: small.to_dict())
        rows.append((kept, len(graph), seconds, extra, src, conv, prune_s, prune_mem, len(small), len(data["links"])))
        print(f"... {n} nodes: {seconds:.1f} s, {extra / 2**20:.0f} MiB", file=sys.stderr, flush=True)
        del graph, small, data

    machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch thread(s), CPU"
    print(f"GPT-2-small shape, {args.layers} layers, source {type(source).__name__}, 1×{args.tokens} tokens, float32, "
          f"{machine}, torch {torch.__version__}\n")  # fmt: skip
    print(
        "| kept neurons | graph nodes | time | per kept node | source / converted fwd+bwd (just before) | per "
        "kept node ÷ source / converted fwd+bwd | extra peak memory | prune(0.8, 0.98) | pruned nodes / links |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for kept, total, seconds, extra, src, conv, prune_s, prune_mem, small_n, links in rows:
        per = seconds / kept
        print(f"| {kept} | {total} | {seconds:.1f} s | {per * 1e3:.1f} ms | {src * 1e3:.0f} / {conv * 1e3:.0f} ms | "
              f"{per / src:.3f}× / {per / conv:.3f}× | {extra / 2**20:.0f} MiB | {prune_s:.1f} s, "
              f"{prune_mem / 2**20:.0f} MiB | {small_n} / {links} |")  # fmt: skip
    print("\ntargets: per kept node ≤ 1× a forward+backward of the prompt, ≤ 2 GB extra peak memory at 8,000 nodes")


if __name__ == "__main__":
    main()
