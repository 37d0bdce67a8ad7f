"""Forward time of a converted mixture-of-experts model against its source, on CPU, as ratios measured in one process.

Shape (random weights, float32): Mixtral-shaped, 4 layers, d_model 512, 8 heads (4 key/value heads), 8 experts of
d_mlp 1024 with top-2 routing, vocab 32000, RMSNorm, rotary, SwiGLU experts; tokens 4 x 256 (``--vocab``,
``--batch``, ``--pos`` change them). Sources: the Hugging Face model itself (``experts_implementation="eager"``: the
per-expert loop over the routed tokens, and ``attn_implementation="sdpa"``) and the TransformerBridge over it
(TransformerLens 4.x or 3.9; eager attention). The converted model is timed in its default mode and with
``set_use_fused_neurons(True)``. Each expert of the converted model computes only the tokens routed to it, as the
source does, so the ratio does not grow with the number of experts (``--experts`` changes it; ``--top-k`` the
experts per token).

    python benchmarks/bench_moe.py [--repeats 7] [--threads N] [--experts 8] [--top-k 2] [--layers 4] [--vocab V]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's lens_aot, not an installed copy

import lens_aot  # noqa: E402
from lens_aot.tl.build import bridge_from_hf_module  # noqa: E402


def _time(fn: Callable[[], object], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--pos", type=int, default=256)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(
        vocab_size=args.vocab,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    hf = MixtralForCausalLM(cfg).eval()
    hf.set_experts_implementation("eager")
    hf.set_attn_implementation("eager")
    bridge = bridge_from_hf_module(
        hf, "MixtralForCausalLM", hf_config=hf.config, dtype=torch.float32, model_name="mixtral-bench"
    ).eval()
    start = time.perf_counter()
    aot = lens_aot.convert(bridge)
    convert_s = time.perf_counter() - start
    hf.set_attn_implementation("sdpa")
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.pos), generator=torch.Generator().manual_seed(1))

    runs: dict[str, Callable[[], object]] = {
        "HF model (sdpa, eager experts)": lambda: hf(tokens).logits,
        "TransformerBridge": lambda: bridge(tokens),
        "converted (default)": lambda: aot(tokens),
    }
    times: dict[str, list[float]] = {name: [] for name in [*runs, "converted (fused neurons)"]}
    with torch.no_grad():
        for fn in runs.values():
            fn()  # warm-up
        for _ in range(args.repeats):  # interleaved, so load on the machine affects every column alike
            for name, fn in runs.items():
                times[name] += _time(fn, 1)
            aot.set_use_fused_neurons(True)
            times["converted (fused neurons)"] += _time(lambda: aot(tokens), 1)
            aot.set_use_fused_neurons(False)
    median = {name: statistics.median(t) for name, t in times.items()}
    print(
        f"Mixtral-shaped, {args.layers} layers, {args.experts} experts top-{args.top_k}, vocab {args.vocab}, "
        f"tokens {args.batch}x{args.pos}, "
        f"{torch.get_num_threads()} threads; convert {convert_s:.1f} s; max |Δlogit| "
        f"{aot.report.max_abs_logit_error:.2e} (bound {aot.report.logit_bound:.2e})\n"
    )
    print("| model | forward (ms, median) | / HF model | / bridge |\n|---|---|---|---|")
    hf_s, bridge_s = median["HF model (sdpa, eager experts)"], median["TransformerBridge"]
    for name, t in median.items():
        print(f"| {name} | {1000 * t:.1f} | {t / hf_s:.2f}x | {t / bridge_s:.2f}x |")


if __name__ == "__main__":
    main()
