"""Forward time of converted models against their HookedTransformer sources (TransformerLens 3.x) for each attention /
norm / position variant of docs/variants.md, as ratios measured in one process on CPU.

Shape: 4 layers, d_model 256, 8 heads of 32 (key/value heads as the variant's family), d_mlp 1024, vocab 2000,
n_ctx 256, SiLU MLPs, random weights; input 4 x 256 tokens. Each time is the median of ``--repeats`` forwards (after a
warm-up). The converted model is timed in its default mode and with
``set_use_fused_neurons(True)``. Prints a markdown table (docs/variants.md's performance section).

    python benchmarks/bench_variants.py [--repeats 7] [--threads 1] [--variants gemma2 qk-norm ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's lens_aot
sys.path.insert(0, str(ROOT / "tests"))  # the variants' configs (tests/variants_hooked.py)

import lens_aot  # noqa: E402

SHAPE = dict(n_layers=4, d_model=256, n_heads=8, d_head=32, d_mlp=1024, d_vocab=2000, n_ctx=256, rotary_dim=32)


def build(name: str) -> Any:
    from factories_hooked import make_config, randomize
    from transformer_lens import HookedTransformer
    from variants_hooked import VARIANTS

    family, overrides = VARIANTS[name]
    overrides = dict(overrides)
    if "attn_types" in overrides:
        overrides["attn_types"] = (overrides["attn_types"] * SHAPE["n_layers"])[: SHAPE["n_layers"]]
    if overrides.get("window_size"):
        overrides["window_size"] = 64
    if "train_seq_length" in overrides:
        overrides["train_seq_length"] = SHAPE["n_ctx"]
    kv = overrides.pop("n_key_value_heads", None)
    cfg = make_config(family, "silu", torch.float32, **SHAPE, **overrides)
    if cfg.n_key_value_heads is not None:
        cfg.n_key_value_heads = kv or 4
    return randomize(HookedTransformer(cfg), 0).eval()


def median_time(model: Any, tokens: torch.Tensor, repeats: int) -> float:
    model(tokens)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model(tokens)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    from variants_hooked import VARIANTS

    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--variants", nargs="*", default=sorted(VARIANTS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokens = torch.randint(0, SHAPE["d_vocab"], (4, SHAPE["n_ctx"]), generator=torch.Generator().manual_seed(0))
    print(f"torch {torch.__version__}, {args.threads} thread(s), median of {args.repeats}")
    print("| variant | source ms | converted ms (ratio) | fused ms (ratio) | max abs logit error |")
    print("|---|---|---|---|---|")
    for name in args.variants:
        model = build(name)
        aot = lens_aot.convert(model)
        with torch.no_grad():
            err = float((aot(tokens) - model(tokens)).abs().max())
            source = median_time(model, tokens, args.repeats)
            converted = median_time(aot, tokens, args.repeats)
            aot.set_use_fused_neurons(True)
            fused = median_time(aot, tokens, args.repeats)
        print(
            f"| {name} | {1e3 * source:.1f} | {1e3 * converted:.1f} ({converted / source:.2f}x) | "
            f"{1e3 * fused:.1f} ({fused / source:.2f}x) | {err:.1e} |"
        )


if __name__ == "__main__":
    main()
