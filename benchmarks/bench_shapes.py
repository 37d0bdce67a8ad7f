"""Performance of a converted model against its source, as ratios measured in one process.

Shapes (random weights, default conversion options):

* ``gpt2``: GPT-2 small, 12 layers, d_model 768, 12 heads, d_mlp 3072, vocab 50257, n_ctx 1024, gelu_new.
* ``llama``: Llama-shaped, 8 layers, d_model 768, 12 heads (4 key/value heads), d_mlp 2048, vocab 32000, n_ctx 1024,
  RMSNorm, rotary, SwiGLU (gated: gate heads write the MLP's own d_mlp scratch, product heads read it).

Two source columns, measured in the same run: **dense** attention (a HookedTransformer on TransformerLens 3.x, which
always computes the full score matrix, or with ``--source bridge`` a TransformerBridge over the Hugging Face model
with ``attn_implementation="eager"``) and **SDPA** (the Hugging Face model of the same shape itself, unwrapped, with
``attn_implementation="sdpa"``, torch's fused ``scaled_dot_product_attention``: a TransformerBridge computes attention
eagerly whatever the HF setting, so it is no SDPA source; the HF model has no hooks, so ``run_with_cache`` is
compared with the dense source only). Each ratio is converted time (or
bytes) over that source's: the converted model's own attention heads use SDPA when unhooked, so "vs SDPA" is the
like-for-like ratio and "vs dense" includes the gain of fused attention. The converted model is timed in both of
its modes: the default (every cheap hook point runs on every forward) and ``set_use_fused_neurons(True)``.
Conversion is timed with default options (``check=True``: one source forward, one converted forward and one
perturbed source forward on 2x64 tokens).
Use ``--threads 1`` for per-core figures. Prints a markdown table (the docs' performance section).

    python benchmarks/bench_shapes.py [--shape gpt2|llama] [--source hooked|bridge] [--repeats 5] [--threads N]
        [--scale 1.0]
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

import lens_aot  # noqa: E402
from lens_aot.core.read import run_source  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    "gpt2": dict(n_layers=12, d_model=768, n_heads=12, d_head=64, d_mlp=3072, d_vocab=50257, n_ctx=1024),
    "llama": dict(n_layers=8, d_model=768, n_heads=12, d_head=64, d_mlp=2048, d_vocab=32000, n_ctx=1024),
}
N_KV_LLAMA = 4


def build_source(shape: str, kind: str, device: str, attn: str = "eager", scale: float = 1.0) -> Any:
    """A random-weight source model of ``shape`` (``kind`` "hooked": a HookedTransformer, dense attention; "bridge":
    a TransformerBridge over the HF model (TransformerLens runs its own eager attention, whatever ``attn``); "hf": the
    Hugging Face model itself with ``attn_implementation=attn``, not wrapped); ``scale`` < 1 shrinks the widths, the
    depth and the vocabulary (for checking the script quickly)."""
    torch.manual_seed(0)
    dims = dict(SHAPES[shape])
    if scale != 1.0:
        heads = max(2, round(dims["n_heads"] * scale) // N_KV_LLAMA * N_KV_LLAMA or N_KV_LLAMA)
        dims.update(
            n_layers=max(1, round(dims["n_layers"] * scale)),
            n_heads=heads,
            d_model=heads * dims["d_head"],
            d_mlp=max(8, round(dims["d_mlp"] * scale)),
            d_vocab=max(64, round(dims["d_vocab"] * scale)),
        )
    if kind == "hooked":
        from transformer_lens import HookedTransformer, HookedTransformerConfig

        if shape == "gpt2":
            cfg = HookedTransformerConfig(**dims, act_fn="gelu_new", normalization_type="LN", device=device, seed=0)
        else:
            cfg = HookedTransformerConfig(
                **dims, act_fn="silu", normalization_type="RMS", positional_embedding_type="rotary",
                rotary_dim=dims["d_head"], n_key_value_heads=N_KV_LLAMA, gated_mlp=True, final_rms=True,
                device=device, seed=0,
            )  # fmt: skip
        return HookedTransformer(cfg).eval()
    from lens_aot.tl.build import bridge_from_hf_module

    if shape == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        hf_cfg = GPT2Config(
            vocab_size=dims["d_vocab"], n_positions=dims["n_ctx"], n_embd=dims["d_model"], n_layer=dims["n_layers"],
            n_head=dims["n_heads"], n_inner=dims["d_mlp"], activation_function="gelu_new",
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation=attn,
        )  # fmt: skip
        model = GPT2LMHeadModel(hf_cfg).eval().to(device)
        if kind == "hf":
            return model
        return bridge_from_hf_module(model, "GPT2LMHeadModel", hf_config=hf_cfg, model_name="gpt2-shape").eval()
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(
        vocab_size=dims["d_vocab"], hidden_size=dims["d_model"], intermediate_size=dims["d_mlp"],
        num_hidden_layers=dims["n_layers"], num_attention_heads=dims["n_heads"], num_key_value_heads=N_KV_LLAMA,
        max_position_embeddings=dims["n_ctx"], tie_word_embeddings=False, attn_implementation=attn,
    )  # fmt: skip
    model = LlamaForCausalLM(hf_cfg).eval().to(device)
    if kind == "hf":
        return model
    return bridge_from_hf_module(model, "LlamaForCausalLM", hf_config=hf_cfg, model_name="llama-shape").eval()


def source_logits(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    """A source's logits: TransformerLens models through ``run_source``, an unwrapped HF model through its own
    forward."""
    if hasattr(model, "run_with_cache"):
        return run_source(model, tokens)
    return model(tokens).logits


def wall(fn: Callable[[], Any], sync: Callable[[], None]) -> Callable[[], float]:
    """``fn`` made to return its wall time in seconds."""

    def run() -> float:
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    return run


def interleaved(runs: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """Times of each run (each returns its own time) over ``repeats`` rounds after one warm-up round, the runs taking
    turns within a round, so load from other processes on a shared machine falls on all of them alike."""
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(repeats):
        for k, run in runs.items():
            times[k].append(run())
    return times


def cache_bytes(cache: Any) -> int:
    """Bytes held by a cache's tensors (shared storage counted once)."""
    # A compact cache derives neuron-head entries on access: count what it holds, not what reading would build.
    items = cache.cache_dict.stored() if hasattr(cache.cache_dict, "stored") else cache.cache_dict.items()
    seen: dict[int, int] = {}
    for _, t in items:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


def param_bytes(model: torch.nn.Module) -> int:
    seen: dict[int, int] = {}
    for p in model.parameters():
        seen[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    return sum(seen.values())


def default_source_kind() -> str:
    """The source the benchmarks build by default: a HookedTransformer where TransformerLens has one (3.x), else a
    TransformerBridge (4.x)."""
    from lens_aot.tl import has_hooked_transformer

    return "hooked" if has_hooked_transformer() else "bridge"


def gpt2_pair(n_layers: int, source_kind: str = "auto") -> tuple[Any, lens_aot.AttentionOnlyTransformer]:
    """The GPT-2-small-shaped source with ``n_layers`` layers (random weights, CPU; ``source_kind`` "hooked",
    "bridge" or "auto") and its conversion (``check=False``: the benchmarks time work, not the check)."""
    kind = default_source_kind() if source_kind == "auto" else source_kind
    SHAPES["gpt2"]["n_layers"] = n_layers
    source = build_source("gpt2", kind, "cpu")
    return source, lens_aot.convert(source, check=False).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gpt2")
    parser.add_argument("--source", choices=["hooked", "bridge", "auto"], default="auto")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--scale", type=float, default=1.0, help="shrink the shape (< 1: a quick check of the script)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kind = default_source_kind() if args.source == "auto" else args.source
    device = args.device
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sources = {
        "dense": build_source(args.shape, kind, device, attn="eager", scale=args.scale),
        # TransformerLens's bridge computes attention eagerly (it replaces the HF attention), so the fused-attention
        # source is the Hugging Face model itself, unwrapped, with the same shape (its own random weights)
        "SDPA": build_source(args.shape, "hf", device, attn="sdpa", scale=args.scale),
    }
    source = sources["dense"]
    d_vocab = source.cfg.d_vocab

    start = time.perf_counter()
    aot = lens_aot.convert(source)  # default options: the agreement check included
    convert_s = time.perf_counter() - start
    aot.eval()

    # The converted model in its two modes: "hooks" (the default: every cheap hook point runs on every forward, the
    # neuron heads' hook_q/k/v/z included) and "fused" (set_use_fused_neurons(True): the closed-form activation while
    # no neuron-head hook is attached). Both use SDPA for the source's heads while their patterns are unhooked.
    def in_mode(mode: str, fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            aot.set_use_fused_neurons(mode == "fused")
            try:
                return fn()
            finally:
                aot.set_use_fused_neurons(False)

        return run

    modes = ("hooks", "fused")
    rows: list[tuple[str, dict[str, list[float]], str]] = []  # name, times of the sources and modes, target
    gen = torch.Generator().manual_seed(0)

    def toks(n: int) -> torch.Tensor:
        return torch.randint(0, d_vocab, (1, n), generator=gen).to(device)

    def row(
        name: str, src_fn: Callable[[Any], Any], aot_fn: Callable[[], Any], target: str, on: tuple[str, ...] = ()
    ) -> None:
        """A measure on the sources (``on``: only those; default all) and the converted model in both modes."""
        runs = {k: wall(lambda s=s: src_fn(s), sync) for k, s in sources.items() if not on or k in on}
        runs.update({m: wall(in_mode(m, aot_fn), sync) for m in modes})
        rows.append((name, interleaved(runs, args.repeats), target))

    with torch.no_grad():
        for n in (128, 1024):
            t = toks(n)
            row(f"forward, {n} tokens", lambda s, t=t: source_logits(s, t), lambda t=t: aot(t), "≤ 1.25")
        t = toks(256)
        # the unwrapped HF model has no hooks, so no cache: run_with_cache is compared with the dense source only
        row(
            "run_with_cache, 256 tokens",
            lambda s: s.run_with_cache(t),
            lambda: aot.run_with_cache(t),
            "≤ 2",
            ("dense",),
        )
        _, src_cache = source.run_with_cache(t)
        src_b = cache_bytes(src_cache)
        del src_cache
        gc.collect()
        _, aot_cache = aot.run_with_cache(t)
        aot_b = cache_bytes(aot_cache)
        del aot_cache
        gc.collect()
        # a dense neuron-head pattern is built when asked for, in the standard shape
        name = f"{aot.neuron_module(0)}.hook_pattern"
        _, aot_cache = aot.run_with_cache(t, names_filter=lambda n: n == name)
        assert aot_cache[name].shape == (1, aot.head_module(aot.neuron_module(0)).n_heads, 256, 256)
        del aot_cache
        gc.collect()

    def backward(model: Any, t: torch.Tensor) -> float:
        model.zero_grad(set_to_none=True)
        logits = model(t) if model is aot else source_logits(model, t)
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], t[0, 1:])
        start = time.perf_counter()
        loss.backward()
        sync()
        return time.perf_counter() - start

    t = toks(128)
    runs = {k: lambda s=s: backward(s, t) for k, s in sources.items()}
    runs.update({m: in_mode(m, lambda: backward(aot, t)) for m in modes})
    rows.append(("backward, 128 tokens", interleaved(runs, args.repeats), "≤ 1.5"))

    machine = (
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    if device.startswith("cuda"):
        machine = f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    dense_kind = type(source).__name__ + ("" if kind == "hooked" else ", HF eager attention")
    print(f"{args.shape} shape (scale {args.scale:g}), {aot.cfg.act_fn}, {device} ({machine}), {args.repeats} repeats")
    print(f"sources: dense = {dense_kind}; SDPA = the unwrapped HF model, sdpa attention. Converted: hooks = default "
          "(every cheap hook point runs), fused = set_use_fused_neurons(True); both use SDPA for the source's heads. "
          "Ratios: converted / source.")  # fmt: skip
    print(f"Times: median of {args.repeats} interleaved runs (minimum in brackets); ratios: of the medians (of the "
          "minima).")  # fmt: skip
    print(f"conversion: {aot.report.heads_per_neuron} heads per neuron, bound {aot.report.max_neuron_error:.0e}\n")
    print(
        "| measure | source dense | source SDPA | converted, hooks | converted, fused "
        "| hooks / dense | hooks / SDPA | fused / dense | fused / SDPA | target |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, times, target in rows:
        med = {k: statistics.median(v) for k, v in times.items()}
        low = {k: min(v) for k, v in times.items()}
        cells = " | ".join(f"{med[k] * 1e3:.1f} ms ({low[k] * 1e3:.1f})" if k in med else "–" for k in (
            "dense", "SDPA", *modes))  # fmt: skip
        pairs = [(m, k) for m in modes for k in ("dense", "SDPA")]
        ratios = " | ".join(f"{med[m] / med[k]:.2f}× ({low[m] / low[k]:.2f}×)" if k in med else "–" for m, k in pairs)
        print(f"| {name} | {cells} | {ratios} | {target} |")
    print(f"| run_with_cache bytes, 256 tokens (dense source; same in both modes) | {src_b / 2**20:.0f} MiB | | "
          f"{aot_b / 2**20:.0f} MiB | | {aot_b / src_b:.2f}× | | | | ≤ 3 |")  # fmt: skip
    sb, ab = param_bytes(source), param_bytes(aot)
    print(f"| parameter bytes | {sb / 2**20:.0f} MiB | | {ab / 2**20:.0f} MiB | | {ab / sb:.2f}× | | | | ≤ 1.5 |")
    print(f"| conversion time, default options (check on) | | | {convert_s:.2f} s | | | | | | < 10 s |")


if __name__ == "__main__":
    main()
