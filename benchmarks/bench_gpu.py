"""Converted model vs its source on a GPU (or, without CUDA, on CPU): forward time, operations, kernels, syncs,
peak memory and activation-patching throughput, as ratios measured in one process.

Every ratio is *converted / source*, both run on the same device, same dtype (float32), same tokens, no hooks:

* ``fwd ms``: median forward time (CUDA events around each forward, after warm-up; ``time.perf_counter`` on CPU).
* ``ops``: ATen operations dispatched per forward (``lens_aot.core.opcount``; device-independent), in the default
  mode (every cheap hook point runs, neuron heads' ``hook_q/k/v/z`` included) and, ``ops, fused``, with
  ``set_use_fused_neurons(True)`` (the closed-form activation); the other columns are the default mode's.
* ``kernels``: CUDA kernels launched per forward (``torch.profiler`` kernel events; CUDA only).
* ``syncs``: host-device synchronisations per forward (``aten::_local_scalar_dense`` / ``is_nonzero`` / ``item``).
* ``peak MiB``: peak device memory allocated during a forward, above what was allocated before it (CUDA only).
* ``patch heads/s``: :func:`lens_aot.patching.patch_heads` on a subset of heads (converted model only: the source has
  no per-neuron heads to patch), at the first size.

Sources: ``hooked`` is a HookedTransformer (TransformerLens 3.x; its attention is dense — TransformerLens 3.9 offers
no SDPA switch); ``bridge`` is a TransformerBridge over the Hugging Face model as ``build_bridge_from_module`` builds
it. The converted model uses fused attention (``scaled_dot_product_attention``) for the source's heads unless their
scores or pattern are hooked. Shapes: ``benchmarks/bench_shapes.py``'s GPT-2 and Llama shapes, random weights.

    python benchmarks/bench_gpu.py [--shapes gpt2 llama] [--sizes 1x128 8x1024] [--sources hooked bridge]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from bench_shapes import SHAPES, build_source, default_source_kind

import lens_aot
from lens_aot.core.opcount import count_ops
from lens_aot.core.read import run_source
from lens_aot.patching import patch_heads


def timed_ms(fn: Callable[[], Any], repeats: int, device: str) -> float | None:
    """Median milliseconds of ``fn`` over ``repeats`` runs after two warm-ups (CUDA events on a GPU); None when
    ``repeats`` is 0 (counts only)."""
    if repeats <= 0:
        return None
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def cuda_kernels(fn: Callable[[], Any]) -> int | None:
    """CUDA kernels launched by one call of ``fn`` (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)


def peak_mib(fn: Callable[[], Any], device: str) -> float | None:
    """Peak device memory allocated during one call of ``fn``, above what was allocated before (None on CPU)."""
    if not device.startswith("cuda"):
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def patching_rate(aot: Any, tokens: torch.Tensor, n_heads: int) -> float:
    """Heads patched per second by ``patch_heads`` on the first ``n_heads`` heads of layer 0's attention and of its
    neuron heads (``aot.sublayers()[:2]``), clean = ``tokens``, corrupted = ``tokens`` rolled by one position."""
    subs = aot.sublayers()[:2]
    heads = [(s.name, h) for s in subs for h in range(min(n_heads, aot.head_module(s.name).n_heads))]
    corrupted = tokens.roll(1, dims=-1)
    target = int(tokens[0, -1])

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[:, -1, target].mean()

    patch_heads(aot, tokens, corrupted, metric, heads=heads[:2])  # warm-up
    start = time.perf_counter()
    patch_heads(aot, tokens, corrupted, metric, heads=heads)
    if tokens.is_cuda:
        torch.cuda.synchronize()
    return len(heads) / (time.perf_counter() - start)


def ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None or a == 0 else f"{b / a:.2f}×"


def fmt(a: float | None, digits: int = 0) -> str:
    return "n/a" if a is None else f"{a:.{digits}f}"


def bench_source(shape: str, kind: str, sizes: list[str], device: str, repeats: int, patch_heads_n: int) -> None:
    """Print one table row per size for a ``kind`` source of ``shape`` and its conversion."""
    source = build_source(shape, kind, device)
    aot = lens_aot.convert(source, check=False).eval()
    gen = torch.Generator().manual_seed(0)
    rate = None
    for size in sizes:
        batch, pos = (int(v) for v in size.split("x"))
        tokens = torch.randint(0, SHAPES[shape]["d_vocab"], (batch, pos), generator=gen).to(device)
        with torch.no_grad():
            run_src: Callable[[], Any] = lambda t=tokens: run_source(source, t)  # noqa: E731
            run_aot: Callable[[], Any] = lambda t=tokens: aot(t)  # noqa: E731
            t_src, t_aot = timed_ms(run_src, repeats, device), timed_ms(run_aot, repeats, device)
            ops_src, ops_aot = count_ops(run_src), count_ops(run_aot)
            aot.set_use_fused_neurons(True)
            try:
                ops_fused = count_ops(run_aot)
            finally:
                aot.set_use_fused_neurons(False)
            k_src, k_aot = cuda_kernels(run_src), cuda_kernels(run_aot)
            m_src, m_aot = peak_mib(run_src, device), peak_mib(run_aot, device)
        if rate is None and patch_heads_n > 0:
            rate = patching_rate(aot, tokens, patch_heads_n)
        print(
            f"| {shape} | {kind} | {size} | {fmt(t_src, 1)} → {fmt(t_aot, 1)} | {ratio(t_src, t_aot)} "
            f"| {ops_src.total} → {ops_aot.total} | {ratio(ops_src.total, ops_aot.total)} "
            f"| {ops_fused.total} | {ratio(ops_src.total, ops_fused.total)} "
            f"| {fmt(k_src)} → {fmt(k_aot)} | {ratio(k_src, k_aot)} "
            f"| {ops_src.syncs} → {ops_aot.syncs} / {ops_fused.syncs} "
            f"| {fmt(m_src)} → {fmt(m_aot)} | {ratio(m_src, m_aot)} | {fmt(rate, 1)} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    parser.add_argument("--sizes", nargs="+", default=None, help="BATCHxPOS (default 1x128 8x1024; CPU: 1x32 2x64)")
    parser.add_argument("--sources", nargs="+", choices=["hooked", "bridge"], default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=10, help="timed forwards per measurement (0: counts only)")
    parser.add_argument(
        "--patch-heads", type=int, default=4, help="heads patched per module (layer 0 attention and neuron heads)"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    sizes = args.sizes or (["1x128", "8x1024"] if device.startswith("cuda") else ["1x32", "2x64"])
    sources = args.sources
    if sources is None:
        sources = ["hooked", "bridge"] if default_source_kind() == "hooked" else ["bridge"]
    name = torch.cuda.get_device_name() if device.startswith("cuda") else f"CPU, {torch.get_num_threads()} threads"
    print(f"device {device} ({name}), torch {torch.__version__}, float32; ratio = converted / source, same run\n")
    print(
        "| shape | source | batch×pos | fwd ms source → converted | ratio | ops | ratio | ops, fused | ratio "
        "| kernels | ratio | syncs (default / fused) | peak MiB | ratio | patch heads/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        for kind in sources:
            bench_source(shape, kind, sizes, device, args.repeats, args.patch_heads)
            if device.startswith("cuda"):
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
