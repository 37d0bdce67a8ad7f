"""Memory benchmarks: sparse neuron-head patterns and conversion peak.

* ``patterns``: GPT-2-small shape (random weights, gelu_new, 4 heads per neuron: 12,288 neuron heads per layer),
  1×1024 tokens. Times ``cache[name][:, heads]`` for 10 neuron heads of layer 5 and ``pattern_hook`` on them, and
  counts the bytes of every tensor created (``lens_aot.core.memory.AllocationMeter``, an upper bound on the extra peak),
  beside the size the whole ``[batch, 12288, N, N]`` layer would have. Targets: ≤ 200 MB and ≤ 2 s.

* ``convert``: extra peak resident memory of ``lens_aot.convert`` (agreement check included) in a fresh process, over
  what it held with the GPT-2-shaped source loaded and run once (Linux VmHWM, reset through /proc/self/clear_refs),
  as a multiple of the source's parameter bytes. Target ≤ 1.5x.

* ``one copy`` (``--one-copy``): the same conversion with ``share_weights=True`` and ``consume=True``: its extra
  peak, and the bytes source and converted model hold together afterwards (``lens_aot.core.memory.held_bytes``:
  each storage once), as multiples of the source's parameter bytes (each storage once: a bridge's q/k/v views of
  GPT-2's fused ``c_attn`` and its tied ``lm_head`` count once). Target after conversion ≤ 1.1x (the default
  conversion: 2x). ``--shape llama``: the untied Llama shape instead of GPT-2 small.

* ``forward`` (``--forward``): the converted model's forward time with ``share_weights=True`` (parameters that are
  views of the source's tensors: transposed or per-head strided for a bridge) over a copying conversion's
  (contiguous parameters), both in one process, alternating (ABBA), median of ``--repeats``; 1×``--tokens`` tokens.

    python benchmarks/bench_memory.py [--source hooked|bridge|auto] [--threads N] [--tokens 1024]
    python benchmarks/bench_memory.py --one-copy [--source hooked|bridge|auto] [--shape gpt2|llama]
    python benchmarks/bench_memory.py --forward [--source hooked|bridge|auto] [--shape gpt2|llama] [--tokens 256]
        [--repeats 5]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time

import torch
from bench_shapes import build_source, default_source_kind

import lens_aot
from lens_aot.core.memory import AllocationMeter, held_bytes
from lens_aot.core.runtime.cache import pattern_hook

MB = 1e6


def sparse_patterns(aot: lens_aot.AttentionOnlyTransformer, n_tokens: int, k: int = 10) -> list[str]:
    module = aot.neuron_module(5)
    name = f"{module}.hook_pattern"
    n_heads = aot.head_module(module).n_heads
    heads = torch.linspace(0, n_heads - 1, k).long().tolist()
    tokens = torch.randint(0, aot.cfg.d_vocab, (1, n_tokens), generator=torch.Generator().manual_seed(0))
    item = torch.finfo(aot.cfg.dtype).bits // 8
    whole = n_tokens * n_tokens * n_heads * item
    with torch.no_grad():
        _, cache = aot.run_with_cache(tokens, names_filter=name)
        start = time.perf_counter()
        with AllocationMeter() as meter:
            got = cache[name][:, heads]
        index_s = time.perf_counter() - start
        seen: list[torch.Tensor] = []
        hook_name, observe = pattern_hook(aot, module, heads, lambda pattern, hook: seen.append(pattern))
        hook_meter = AllocationMeter()

        hook_s = 0.0

        def metered(act: torch.Tensor, hook: object) -> None:
            nonlocal hook_s
            start = time.perf_counter()
            with hook_meter:
                observe(act, hook=hook)
            hook_s = time.perf_counter() - start

        start = time.perf_counter()
        aot.run_with_hooks(tokens, return_type=None, fwd_hooks=[(hook_name, metered)])
        forward_s = time.perf_counter() - start
    assert got.shape == (1, k, n_tokens, n_tokens) and seen[0].shape == got.shape
    return [
        f"| `cache[name][:, heads]`, {k} of {n_heads} neuron heads, 1×{n_tokens} tokens | {index_s:.2f} s | "
        f"{meter.total / MB:.0f} MB allocated (largest {meter.largest / MB:.0f} MB; the whole layer: "
        f"{whole / MB:,.0f} MB) | ≤ 2 s, ≤ 200 MB |",
        f"| `pattern_hook` on those heads, in a forward | {hook_s:.2f} s in it (forward {forward_s:.2f} s) | "
        f"{hook_meter.total / MB:.0f} MB allocated by the hook | ≤ 2 s extra, ≤ 200 MB extra |",
    ]


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct storages ``model``'s parameters hold (views of one storage count once)."""
    return sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}.values())


def conversion_peak_child(kind: str, option: str = "copy", shape: str = "gpt2") -> None:
    """Run in a fresh process: print the conversion's extra peak RSS, the source's parameter bytes and what source and
    converted model hold together afterwards as JSON. ``option``: "copy" (default conversion), "share"
    (``share_weights=True``) or "consume" (``consume=True``)."""
    source = build_source(shape, kind, "cpu")
    params = parameter_bytes(source)
    with torch.no_grad():
        source(torch.zeros(2, 64, dtype=torch.long))
    gc.collect()
    base = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    aot = lens_aot.convert(source, share_weights=option == "share", consume=option == "consume")
    extra = _status("VmHWM") - base
    converted = sum(p.numel() * p.element_size() for p in aot.parameters())
    held = held_bytes(source, aot)
    print(json.dumps({"params": params, "extra": extra, "converted": converted, "held": held}))


def _child(kind: str, option: str = "copy", shape: str = "gpt2") -> dict[str, int]:
    command = [sys.executable, __file__, "--peak-child", kind, "--option", option, "--shape", shape]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def one_copy(kind: str, shape: str = "gpt2") -> list[str]:
    """Rows of the one-copy table: per option, extra peak and bytes held after, as multiples of the parameters."""
    rows = []
    for option in ("copy", "share", "consume"):
        r = _child(kind, option, shape)
        call = {"copy": "convert(source)", "share": "share_weights=True", "consume": "consume=True"}[option]
        rows.append(
            f"| {kind} ({shape}) | `{call}` | {r['extra'] / r['params']:.2f}x | {r['held'] / r['params']:.2f}x "
            f"({r['held'] / MB:.0f} MB of {r['params'] / MB:.0f} MB parameters) |"
        )
    return rows


def forward_ratio(kind: str, n_tokens: int, repeats: int, shape: str = "gpt2") -> str:
    """The shared conversion's forward time over the copying conversion's, ``shape``, both in this process."""
    source = build_source(shape, kind, "cpu")
    copied = lens_aot.convert(source, check=False)
    shared = lens_aot.convert(source, check=False, share_weights=True)
    tokens = torch.randint(0, copied.cfg.d_vocab, (1, n_tokens), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {"copied": [], "shared": []}
    with torch.no_grad():
        assert torch.equal(copied(tokens), shared(tokens))  # also the warm-up
        for i in range(repeats):  # ABBA: neither model always runs first
            for name, model in (("copied", copied), ("shared", shared))[:: 1 if i % 2 == 0 else -1]:
                start = time.perf_counter()
                model(tokens)
                times[name].append(time.perf_counter() - start)
    a, b = statistics.median(times["copied"]), statistics.median(times["shared"])
    fastest = min(times["shared"]) / min(times["copied"])
    strided = sum(not p.is_contiguous() for p in shared.parameters())
    return (
        f"| {kind} ({shape}) | 1×{n_tokens} tokens, {torch.get_num_threads()} thread(s) | copying {a:.3f} s "
        f"| share_weights {b:.3f} s ({len(shared.shared_parameters)} shared parameters, {strided} not contiguous) "
        f"| {b / a:.3f}x (fastest runs: {fastest:.3f}x) |"
    )


def conversion_peak(kind: str) -> str:
    r = _child(kind)
    return (
        f"| `convert`, extra peak RSS | | {r['extra'] / MB:.0f} MB = {r['extra'] / r['params']:.2f}x the source's "
        f"{r['params'] / MB:.0f} MB of parameters (the converted model's own: {r['converted'] / MB:.0f} MB) | ≤ 1.5x |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", choices=["hooked", "bridge", "auto"], default="auto")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--one-copy", action="store_true", help="only the share_weights / consume table")
    parser.add_argument("--shape", choices=["gpt2", "llama"], default="gpt2", help="the source's shape")
    parser.add_argument("--forward", action="store_true", help="only the shared / copied forward time")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peak-child", choices=["hooked", "bridge"], help=argparse.SUPPRESS)
    parser.add_argument("--option", choices=["copy", "share", "consume"], default="copy", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak_child:
        conversion_peak_child(args.peak_child, args.option, args.shape)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    kind = default_source_kind() if args.source == "auto" else args.source
    if args.one_copy:
        print(f"{args.shape} shape, {kind} source, float32, CPU: extra peak of convert, and held after\n")
        print("| source | call | extra peak | source + converted after |\n|---|---|---|---|")
        print("\n".join(one_copy(kind, args.shape)))
        return
    if args.forward:
        print("| source | input | time | time | shared / copied |\n|---|---|---|---|---|")
        print(forward_ratio(kind, args.tokens, args.repeats, args.shape))
        return
    aot = lens_aot.convert(build_source("gpt2", kind, "cpu"), check=False)
    print(f"GPT-2-small shape, {kind} source, float32, CPU, {torch.get_num_threads()} thread(s)\n")
    print("| measure | time | memory | target |\n|---|---|---|---|")
    for line in sparse_patterns(aot, args.tokens):
        print(line)
    del aot
    print(conversion_peak(kind))


if __name__ == "__main__":
    main()
