"""Half precision on CPU: the converted model's forward time against its half source's, and both models' logit error
against the float32 source (issue 38: each forward within 1.25x of the half source's; error within 2x its own).

Shapes (random weights, TransformerLens 3.x HookedTransformer sources, 1x128 tokens, one thread):

* ``llama``: bench_shapes' Llama shape (8 layers, d_model 768, SwiGLU: SiLU gate, one term per neuron);
* ``geglu``: the same with a GeGLU gate (``gelu_pytorch_tanh``, Gemma's: several logistic terms per neuron, whose
  per-head evaluation in half precision is what made the float16 forward slow).

Each row: source and converted forward (median of ``--repeats``, interleaved), their ratio, and max |Δlogit| of the
half source and of the converted half model against the float32 source (same weights before the cast).

    python benchmarks/bench_half.py [--shape llama|geglu] [--dtype bf16|fp16] [--scale 1.0] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's lens_aot, not an installed copy

import lens_aot  # noqa: E402
from lens_aot.core.read import run_source  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SHAPE = dict(n_layers=8, d_model=768, n_heads=12, d_head=64, d_mlp=2048, d_vocab=32000, n_ctx=1024)
ACT = {"llama": "silu", "geglu": "gelu_pytorch_tanh"}


def build(shape: str, scale: float) -> Any:
    """The float32 source of ``shape`` (widths, depth and vocabulary times ``scale``)."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    dims = dict(SHAPE)
    if scale != 1.0:
        heads = max(4, round(dims["n_heads"] * scale) // 4 * 4)
        dims.update(
            n_layers=max(1, round(dims["n_layers"] * scale)),
            n_heads=heads,
            d_model=heads * dims["d_head"],
            d_mlp=max(8, round(dims["d_mlp"] * scale)),
            d_vocab=max(64, round(dims["d_vocab"] * scale)),
        )
    cfg = HookedTransformerConfig(
        **dims, act_fn=ACT[shape], normalization_type="RMS", positional_embedding_type="rotary",
        rotary_dim=dims["d_head"], n_key_value_heads=4, gated_mlp=True, final_rms=True, device="cpu", seed=0,
    )  # fmt: skip
    return HookedTransformer(cfg).eval()


def timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(ACT), default="llama")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    half = DTYPES[args.dtype]
    source = build(args.shape, args.scale)
    tokens = torch.randint(0, source.cfg.d_vocab, (1, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = run_source(source, tokens).float()
        source.to(half)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            aot = lens_aot.convert(source)
        source_error = float((run_source(source, tokens).float() - expected).abs().max())
        error = float((aot(tokens).float() - expected).abs().max())
        runs = {"source": lambda: source(tokens), "converted": lambda: aot(tokens)}
        for run in runs.values():
            run()  # warm-up
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, run in runs.items():
                times[name].append(timed(run))
    src, conv = (statistics.median(times[n]) for n in ("source", "converted"))
    params = sum(p.numel() for p in source.parameters())
    print("| shape | dtype | params | source forward | converted forward | ratio | source err | converted err |")
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| {args.shape} x{args.scale:g} | {args.dtype} | {params / 1e6:.0f}M | {src:.3f} s | {conv:.3f} s | "
        f"{conv / src:.2f}x | {source_error:.2e} | {error:.2e} |"
    )


if __name__ == "__main__":
    main()
