"""Research scale: conversion, forward, all-neuron attribution and discover against the source's own passes.

Llama-shaped sources with random weights (RMSNorm, rotary, grouped-query attention, SwiGLU), built as a
HookedTransformer where TransformerLens has one (3.x), else as a TransformerBridge over the Hugging Face model:

* ``cpu`` (default): 32 layers × 14,336 neurons = 458,752 neurons (the 8B model's neuron count) at d_model 64,
  4 heads (2 key/value heads) of 16, vocabulary 512, float32: the issue's CPU shape for attribution;
* ``1b``: Llama-3.2-1B's shape (16 layers, d_model 2,048, 32 heads / 8 key/value heads of 64, d_mlp 8,192,
  vocabulary 128,256);
* ``8b``: Llama-3-8B's shape (32 layers, d_model 4,096, 32 / 8 heads of 128, d_mlp 14,336, vocabulary 128,256);
* ``olmoe``: an OLMoE-1B-7B-like mixture of experts (16 layers, d_model 2,048, 16 heads of 128, 64 experts of
  1,024 neurons, top-8, vocabulary 50,304); its experts' neurons are attributed through ``attribute_heads``
  (``attribute_neurons`` addresses dense MLPs' neurons).

Measured in one process, each against the **source's own forward+backward** (forward, the metric, ``backward()``
into every parameter) on the same tokens:

* ``convert`` time (``check=False``; ``--check``: with its agreement check) and its peak memory above the memory
  before it, over the parameter bytes;
* the converted forward over the source's;
* ``attribute_neurons(method="atp")`` over every neuron (target ≤ 5×);
* ``discover(method="EAP", granularity="neuron")`` over ``--pairs`` pairs, against the source's forward+backward
  over the same pairs.

    python benchmarks/bench_scale.py [--shape cpu|1b|8b|olmoe] [--device cpu|cuda] [--dtype float32|bfloat16|float16]
        [--tokens 128] [--pairs 8] [--repeats 3] [--threads 1] [--layers N] [--scale 1.0] [--skip discover forward]
        [--convert-only] [--check]
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's lens_aot, not an installed copy
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_attribution import _status  # noqa: E402  (a /proc/self/status memory field)

import lens_aot  # noqa: E402
from lens_aot import patching as P  # noqa: E402
from lens_aot.circuits import discover  # noqa: E402
from lens_aot.core.read import run_source  # noqa: E402
from lens_aot.tl import has_hooked_transformer  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    "cpu": dict(n_layers=32, d_model=64, n_heads=4, n_kv=2, d_head=16, d_mlp=14336, d_vocab=512),
    "1b": dict(n_layers=16, d_model=2048, n_heads=32, n_kv=8, d_head=64, d_mlp=8192, d_vocab=128256),
    "8b": dict(n_layers=32, d_model=4096, n_heads=32, n_kv=8, d_head=128, d_mlp=14336, d_vocab=128256),
    "olmoe": dict(n_layers=16, d_model=2048, n_heads=16, n_kv=16, d_head=128, d_mlp=1024, d_vocab=50304, experts=64),
}
TOP_K = 8


def build_source(dims: dict[str, Any], dtype: torch.dtype, device: str) -> Any:
    """A random-weight Llama-shaped source (OLMoE-like with ``experts``): a HookedTransformer under TransformerLens
    3.x, else a TransformerBridge over the Hugging Face model."""
    torch.manual_seed(0)
    experts = dims.get("experts")
    if has_hooked_transformer():
        from transformer_lens import HookedTransformer, HookedTransformerConfig

        moe = dict(num_experts=experts, experts_per_token=TOP_K) if experts else {}
        cfg = HookedTransformerConfig(
            n_layers=dims["n_layers"], d_model=dims["d_model"], n_heads=dims["n_heads"], d_head=dims["d_head"],
            d_mlp=dims["d_mlp"], d_vocab=dims["d_vocab"], n_ctx=2048, act_fn="silu", normalization_type="RMS",
            positional_embedding_type="rotary", rotary_dim=dims["d_head"], n_key_value_heads=dims["n_kv"],
            gated_mlp=True, final_rms=True, device=device, dtype=dtype, seed=0, **moe,
        )  # fmt: skip
        return HookedTransformer(cfg).eval()
    from lens_aot.tl.build import bridge_from_hf_module

    if experts:
        from transformers import OlmoeConfig, OlmoeForCausalLM

        hf_cfg: Any = OlmoeConfig(
            vocab_size=dims["d_vocab"], hidden_size=dims["d_model"], intermediate_size=dims["d_mlp"],
            num_hidden_layers=dims["n_layers"], num_attention_heads=dims["n_heads"],
            num_key_value_heads=dims["n_kv"], num_experts=experts, num_experts_per_tok=TOP_K,
            max_position_embeddings=2048,
        )  # fmt: skip
        model: Any = OlmoeForCausalLM(hf_cfg)
        arch = "OlmoeForCausalLM"
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        hf_cfg = LlamaConfig(
            vocab_size=dims["d_vocab"], hidden_size=dims["d_model"], intermediate_size=dims["d_mlp"],
            num_hidden_layers=dims["n_layers"], num_attention_heads=dims["n_heads"],
            num_key_value_heads=dims["n_kv"], head_dim=dims["d_head"], max_position_embeddings=2048,
            tie_word_embeddings=False,
        )  # fmt: skip
        model = LlamaForCausalLM(hf_cfg)
        arch = "LlamaForCausalLM"
    model = model.eval().to(device=device, dtype=dtype)
    return bridge_from_hf_module(model, arch, hf_config=hf_cfg, model_name=f"{arch}-shape").eval()


def measured(fn: Callable[[], Any], device: str) -> tuple[float, int, Any]:
    """Wall time, peak memory above the memory before the call (CUDA: allocated bytes; CPU: resident bytes, Linux
    ``VmHWM`` reset through ``/proc/self/clear_refs``), and the result."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:  # pragma: no cover - not Linux
            pass
        before = _status("VmRSS")
    start = time.perf_counter()
    out = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = _status("VmHWM")
    return time.perf_counter() - start, max(0, peak - before), out


def median_time(fn: Callable[[], Any], device: str, repeats: int) -> float:
    fn()  # warm-up
    return statistics.median(measured(fn, device)[0] for _ in range(repeats))


def param_bytes(model: torch.nn.Module) -> int:
    seen: dict[int, int] = {}
    for p in model.parameters():
        seen[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    return sum(seen.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="cpu")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers for a quick run")
    parser.add_argument("--scale", type=float, default=1.0, help="shrink d_model, d_mlp and the vocabulary (a check)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["discover", "forward"])
    parser.add_argument("--convert-only", action="store_true", help="measure convert's time and peak memory only")
    parser.add_argument("--check", action="store_true", help="convert with its agreement check (default: check=False)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dims = dict(SHAPES[args.shape])
    if args.layers:
        dims["n_layers"] = args.layers
    if args.scale != 1.0:
        for key in ("d_model", "d_mlp", "d_vocab"):
            dims[key] = max(64, round(dims[key] * args.scale))
        dims["d_head"] = dims["d_model"] // dims["n_heads"]
    default_dtype = "float32" if args.shape == "cpu" or args.device == "cpu" else "bfloat16"
    dtype = getattr(torch, args.dtype or default_dtype)
    source = build_source(dims, dtype, args.device)
    n_param = param_bytes(source)
    convert_s, convert_peak, aot = measured(lambda: lens_aot.convert(source, check=args.check).eval(), args.device)
    if args.convert_only:
        _print_table(args, dims, dtype, source, [_convert_row(convert_s, convert_peak, n_param, args.check)])
        return

    gen = torch.Generator().manual_seed(0)
    clean = torch.randint(0, dims["d_vocab"], (1, args.tokens), generator=gen).to(args.device)
    corrupted = clean.clone()
    corrupted[0, args.tokens // 2 :: 7] = torch.randint(
        0, dims["d_vocab"], corrupted[0, args.tokens // 2 :: 7].shape, generator=gen
    ).to(args.device)

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return (logits[:, -1, 11] - logits[:, -1, 12]).float().mean()

    def source_fwd_bwd(tokens: torch.Tensor = clean) -> None:
        source.zero_grad(set_to_none=True)
        metric(run_source(source, tokens)).backward()
        source.zero_grad(set_to_none=True)

    rows: list[tuple[str, str, str, str]] = []
    with torch.no_grad():
        fwd_src = median_time(lambda: run_source(source, clean), args.device, args.repeats)
        fwd_aot = 0.0 if "forward" in args.skip else median_time(lambda: aot(clean), args.device, args.repeats)
    src_s = median_time(source_fwd_bwd, args.device, args.repeats)
    rows.append((f"source forward+backward, 1×{args.tokens}", f"{src_s * 1e3:.0f} ms", "1.00×", ""))
    rows.append(_convert_row(convert_s, convert_peak, n_param, args.check))
    if "forward" not in args.skip:
        rows.append(("forward, converted / source", f"{fwd_aot * 1e3:.0f} ms", f"{fwd_aot / fwd_src:.2f}×", "≤ 1.0×"))

    moe = "experts" in dims
    if moe:  # every head, the experts' neuron heads included

        def attribute() -> P.PatchingResult:
            return P.attribute_heads(aot, clean, corrupted, metric, method="atp")
    else:

        def attribute() -> P.PatchingResult:
            return P.attribute_neurons(aot, clean, corrupted, metric, method="atp")

    attribute()  # warm-up
    atp = [measured(attribute, args.device) for _ in range(args.repeats)]
    atp_s, atp_mem, res = statistics.median(r[0] for r in atp), max(r[1] for r in atp), atp[-1][2]
    what = "attribute_heads atp, every head" if moe else "attribute_neurons atp, every neuron"
    rows.append((f"{what} ({len(res):,} units), extra peak {atp_mem / 2**20:.0f} MiB", f"{atp_s * 1e3:.0f} ms",
                 f"{atp_s / src_s:.2f}×", "≤ 5×"))  # fmt: skip

    if "discover" not in args.skip:
        data = []
        for i in range(args.pairs):
            g = torch.Generator().manual_seed(100 + i)
            c = torch.randint(0, dims["d_vocab"], (1, 16), generator=g)
            x = c.clone()
            x[0, 8:] = torch.randint(0, dims["d_vocab"], (8,), generator=g)
            data.append((c.to(args.device), x.to(args.device), torch.tensor([11], device=args.device)))
        batched = [(torch.cat([d[0] for d in data]), torch.cat([d[1] for d in data]), torch.cat([d[2] for d in data]))]

        def label_metric(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return logits[:, -1].float().log_softmax(-1).gather(-1, labels[:, None])[:, 0]

        def source_pairs() -> None:
            source.zero_grad(set_to_none=True)
            label_metric(run_source(source, batched[0][0]), batched[0][2]).sum().backward()
            source.zero_grad(set_to_none=True)

        pairs_s = median_time(source_pairs, args.device, args.repeats)
        disc_s, disc_mem, graph = measured(lambda: discover(aot, batched, label_metric, "EAP", "neuron"), args.device)
        rows.append((f"source forward+backward, {args.pairs}×16 pairs", f"{pairs_s * 1e3:.0f} ms", "1.00×", ""))
        rows.append((f"discover EAP neuron, {graph.cfg['neurons_scored']:,} neurons scored, "
                     f"{graph.cfg['neurons_kept']} kept, extra peak {disc_mem / 2**20:.0f} MiB",
                     f"{disc_s * 1e3:.0f} ms", f"{disc_s / pairs_s:.2f}×", ""))  # fmt: skip

    _print_table(args, dims, dtype, source, rows)


def _convert_row(convert_s: float, convert_peak: int, n_param: int, check: bool = False) -> tuple[str, str, str, str]:
    """The table's row for ``convert``: its time and its peak over the parameter bytes."""
    return (f"convert (check={check}), peak over {n_param / 2**20:.0f} MiB of parameters", f"{convert_s:.1f} s",
            f"{convert_peak / n_param:.2f}× param bytes", "≤ 1.5×")  # fmt: skip


def _print_table(
    args: argparse.Namespace, dims: dict[str, Any], dtype: torch.dtype, source: Any, rows: list[tuple[str, ...]]
) -> None:
    """The run's setting (shape, dtype, source class, device, threads), then ``rows`` as a Markdown table."""
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "CPU"
    print(f"shape {args.shape} {dims}, {str(dtype).removeprefix('torch.')}, source {type(source).__name__}, "
          f"{where}, {torch.get_num_threads()} torch thread(s), torch {torch.__version__}\n")  # fmt: skip
    print("| measure | time | ratio | target |")
    print("|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
