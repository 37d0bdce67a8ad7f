"""Measure max |Δlogit| between converted and source models for every supported family (the docs' matrix).

Random-weight models from the test factories (tests/factories_*.py), float32 and float64, default conversion options
(check on: a conversion beyond its stated bound would raise). Per row: max |Δlogit|, and the per-neuron error: max
over layers, positions and neurons of |``cache["post", l]`` − the source's own ``mlp.hook_post``| (the
conversion's per-neuron bound, ``report.max_neuron_error``, in the last column). Gated and parallel rows also give
the argmax agreement (in parentheses).
Run under TransformerLens 3.x for HookedTransformer rows, under either major for TransformerBridge rows:

    python benchmarks/faithfulness.py [--gated-parallel]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's lens_aot (not an installed copy) and its factories

import lens_aot  # noqa: E402

DTYPES = (torch.float32, torch.float64)
GATED_PARALLEL_HOOKED = [
    ("llama", "silu"),
    ("gemma-like", "gelu_new"),
    ("mistral-like", "silu"),
    ("gated-ln", "gelu"),
    ("gptj", "gelu_new"),
    ("neox-parallel", "gelu"),
    ("parallel-gated", "silu"),
]


def measure(model: Any, tokens: torch.Tensor) -> tuple[float, float, float, float]:
    """(max |Δlogit|, argmax agreement, per-neuron error (nan: no neurons), the conversion's per-neuron bound)."""
    aot = lens_aot.convert(model)
    with torch.no_grad():
        got, cache = aot.run_with_cache(tokens)
        ref, ref_cache = model.run_with_cache(tokens, names_filter=lambda name: name.endswith("mlp.hook_post"))
    ref = getattr(ref, "logits", ref)
    neuron = float("nan")
    for layer in aot.cfg.activation_fits:
        err = float((cache["post", layer] - ref_cache[f"blocks.{layer}.mlp.hook_post"]).abs().max())
        neuron = err if neuron != neuron else max(neuron, err)
    agree = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    return float((got - ref).abs().max()), agree, neuron, aot.report.max_neuron_error


def row(source: str, family: str, act: str, cells: list[tuple[float, float, float, float]], agree: bool) -> str:
    """One table row: per dtype, Δlogit (argmax agreement) and per-neuron error; then the per-neuron bound."""
    out = [source, family, act]
    for err, agreement, neuron, _ in cells:
        out += [f"{err:.1e}" + (f" ({agreement:.0%})" if agree else ""), "—" if neuron != neuron else f"{neuron:.1e}"]
    out.append(f"{cells[0][3]:.1e}")
    return "| " + " | ".join(out) + " |"


def main() -> None:
    from factories_bridge import CONVERTIBLE, GATED_PARALLEL, make_bridge

    from lens_aot.tl import has_hooked_transformer

    only_gated = "--gated-parallel" in sys.argv  # only the gated / parallel rows

    rows: list[str] = []
    tokens = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(0))
    if has_hooked_transformer():  # TransformerLens 3.x (4.x has no HookedTransformer)
        from factories_hooked import ACTIVATIONS, FAMILIES, make_hooked

        for family in [] if only_gated else sorted(FAMILIES):
            for act in ACTIVATIONS:
                cells = [measure(make_hooked(family, act, dtype, d_vocab=97, n_ctx=32), tokens) for dtype in DTYPES]
                rows.append(row("HookedTransformer", family, act, cells, agree=False))
                if "attn-only" in family:
                    break
        for family, act in GATED_PARALLEL_HOOKED:
            cells = [measure(make_hooked(family, act, dtype, d_vocab=97), tokens[:, :24]) for dtype in DTYPES]
            rows.append(row("HookedTransformer", family, act, cells, agree=True))
    for family in GATED_PARALLEL:
        for compat in (False, True):
            nan = float("nan")
            cells = []
            for dtype in DTYPES:
                try:
                    cells.append(measure(make_bridge(family, dtype, compat=compat), tokens))
                except lens_aot.UnsupportedArchitectureError:
                    cells.append((nan, nan, nan, nan))  # refused (printed as nan)
            aot = lens_aot.convert(make_bridge(family, torch.float32, compat=compat))
            label = f"{family}{' (compat)' if compat else ''}"
            act = f"{aot.cfg.act_fn}{' gated' * aot.cfg.gated_mlp}"
            rows.append(row("TransformerBridge", label, act, cells, agree=True))
    for family in [] if only_gated else CONVERTIBLE:
        for compat in (False, True):
            cells = [measure(make_bridge(family, dtype, compat=compat), tokens) for dtype in DTYPES]
            aot = lens_aot.convert(make_bridge(family, torch.float32, compat=compat))
            label = f"{family}{' (compat)' if compat else ''}"
            rows.append(row("TransformerBridge", label, aot.cfg.act_fn or "—", cells, agree=False))
    print("| source | family | activation | Δlogit fp32 | per-neuron fp32 | Δlogit fp64 | per-neuron fp64 | bound |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
