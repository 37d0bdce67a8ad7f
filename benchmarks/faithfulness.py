"""Measure max |Δlogit| between converted and source models for every supported family (the README's matrix).

Random-weight models from the test factories (tests/factories_*.py), float32 and float64, default conversion options;
gated and parallel rows also give the argmax agreement (in parentheses).
Run under TransformerLens 3.x for HookedTransformer rows, under either major for TransformerBridge rows:

    python benchmarks/faithfulness.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import lens_aot  # noqa: E402
from lens_aot.read import run_source  # noqa: E402

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


def measure(model: object, tokens: torch.Tensor) -> tuple[float, float]:
    aot = lens_aot.convert(model)
    with torch.no_grad():
        got, ref = aot(tokens), run_source(model, tokens)
    return float((got - ref).abs().max()), float((got.argmax(-1) == ref.argmax(-1)).float().mean())


def main() -> None:
    from factories_bridge import CONVERTIBLE, GATED_PARALLEL, make_bridge

    rows: list[str] = []
    tokens = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(0))
    try:
        from factories_hooked import ACTIVATIONS, FAMILIES, make_hooked

        for family in sorted(FAMILIES):
            for act in ACTIVATIONS:
                errs = [measure(make_hooked(family, act, dtype, d_vocab=97, n_ctx=32), tokens)[0] for dtype in DTYPES]
                rows.append(f"| HookedTransformer | {family} | {act} | {errs[0]:.1e} | {errs[1]:.1e} |")
                if "attn-only" in family:
                    break
        for family, act in GATED_PARALLEL_HOOKED:
            errs = [measure(make_hooked(family, act, dtype, d_vocab=97), tokens[:, :24]) for dtype in DTYPES]
            rows.append(
                f"| HookedTransformer | {family} | {act} | {errs[0][0]:.1e} ({errs[0][1]:.0%}) | "
                f"{errs[1][0]:.1e} ({errs[1][1]:.0%}) |"
            )
    except ImportError:  # TransformerLens 4.x: no HookedTransformer
        pass
    for family in GATED_PARALLEL:
        for compat in (False, True):
            cells = []
            for dtype in DTYPES:
                try:
                    err, agree = measure(make_bridge(family, dtype, compat=compat), tokens)
                    cells.append(f"{err:.1e} ({agree:.0%})")
                except lens_aot.UnsupportedArchitectureError:
                    cells.append("refused")
            aot = lens_aot.convert(make_bridge(family, torch.float32, compat=compat))
            label = f"{family}{' (compat)' if compat else ''}"
            act = f"{aot.cfg.act_fn}{' gated' * aot.cfg.gated_mlp}"
            rows.append(f"| TransformerBridge | {label} | {act} | {cells[0]} | {cells[1]} |")
    for family in CONVERTIBLE:
        for compat in (False, True):
            errs = [measure(make_bridge(family, dtype, compat=compat), tokens)[0] for dtype in DTYPES]
            aot = lens_aot.convert(make_bridge(family, torch.float32, compat=compat))
            label = f"{family}{' (compat)' if compat else ''}"
            rows.append(f"| TransformerBridge | {label} | {aot.cfg.act_fn or '—'} | {errs[0]:.1e} | {errs[1]:.1e} |")
    print("| source | family | activation | max abs Δlogit fp32 | max abs Δlogit fp64 |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
