"""Circuit discovery at scale: ``discover(method="EAP", granularity="neuron")`` on a GPT-2-small-shaped model.

GPT-2 small shape (12 layers, d_model 768, 12 heads, d_mlp 3072 → 36,864 neurons, vocab 50257, gelu_new, random
weights), ``--pairs`` clean/corrupted pairs of ``--tokens`` tokens (default 1,024 × 16, the issue's figure) in batches
of ``--batch``, a per-example logit-difference metric. Measured in one process against the **source's own
forward+backward over the same data** (forward, metric, ``backward()`` into every parameter, every batch):

* discover's time and its ratio to that (target ≤ 20×);
* its extra peak memory (target ≤ 2 GB; peak resident memory above the resident memory before the call, Linux
  ``VmHWM`` reset through ``/proc/self/clear_refs``).

    python benchmarks/bench_discover.py [--pairs 1024] [--tokens 16] [--batch 8] [--top-nodes 1000] [--layers 12]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_attribution import peak_extra  # noqa: E402
from bench_shapes import SHAPES, gpt2_pair  # noqa: E402

from lens_aot.circuits import discover  # noqa: E402
from lens_aot.core.read import run_source  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--top-nodes", type=int, default=1000)
    parser.add_argument("--layers", type=int, default=12, help="fewer for a quick run")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--source", choices=["hooked", "bridge", "auto"], default="auto")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    source, aot = gpt2_pair(args.layers, args.source)
    gen = torch.Generator().manual_seed(0)
    vocab = SHAPES["gpt2"]["d_vocab"]
    clean = torch.randint(0, vocab, (args.pairs, args.tokens), generator=gen)
    corrupted = clean.clone()
    corrupted[:, args.tokens // 2] = torch.randint(0, vocab, (args.pairs,), generator=gen)
    labels = torch.randint(0, vocab, (args.pairs, 2), generator=gen)
    data = [(clean[i : i + args.batch], corrupted[i : i + args.batch], labels[i : i + args.batch])
            for i in range(0, args.pairs, args.batch)]  # fmt: skip

    def metric(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        last = logits[:, -1]
        return last.gather(-1, labels[:, :1])[:, 0] - last.gather(-1, labels[:, 1:])[:, 0]

    def source_fwd_bwd() -> None:
        source.zero_grad(set_to_none=True)
        for c, _, lab in data:
            metric(run_source(source, c), lab).sum().backward()

    source_fwd_bwd()  # warm-up
    src_s, src_mem, _ = peak_extra(source_fwd_bwd)
    source.zero_grad(set_to_none=True)
    start = time.perf_counter()
    disc_s, disc_mem, graph = peak_extra(
        lambda: discover(aot, data, metric, method="EAP", granularity="neuron", top_nodes=args.top_nodes)
    )
    assert time.perf_counter() - start >= disc_s
    machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch thread(s), CPU"
    print(f"GPT-2-small shape, {args.layers} layers, source {type(source).__name__}, {args.pairs} pairs × "
          f"{args.tokens} tokens (batches of {args.batch}), float32, {machine}, torch {torch.__version__}")  # fmt: skip
    print(f"graph: {graph.cfg['neurons_scored']} neurons scored, {graph.cfg['neurons_kept']} kept, "
          f"{len(graph.src):,} edges scored\n")  # fmt: skip
    print("| measure | time | ratio to source fwd+bwd | extra peak memory | target |")
    print("|---|---|---|---|---|")
    print(f"| source forward+backward over the data | {src_s:.1f} s | 1.00× | {src_mem / 2**20:.0f} MiB | |")
    print(f"| discover EAP, neuron granularity, top_nodes={args.top_nodes} | {disc_s:.1f} s | "
          f"{disc_s / src_s:.2f}× | {disc_mem / 2**20:.0f} MiB | ≤ 20×, ≤ 2 GB |")  # fmt: skip


if __name__ == "__main__":
    main()
