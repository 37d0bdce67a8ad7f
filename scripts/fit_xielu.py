"""Fit xIELU's negative branch as a sum of shifted logistic neuron heads and write ``lens_aot/core/xielu_fit.json``.

Target (``lens_aot.core.fit.xielu``): ``N(z) = (expm1(z) − z)·[z ≤ 0]``, written in ``t = −z`` as
``M(t) = (expm1(−t) + t)·[t ≥ 0]``. A K-head fit is ``f(t) = Σ_k (a_k·t + c_k)·σ(b_k·t + d_k)`` with ``Σ a = 1``,
``Σ c = −1`` and ``b_k > 0`` by construction (so ``f(t) − (t − 1) → 0`` as ``t → +∞`` and ``f → 0`` as ``t → −∞``, like
``M``); in ``z`` a term is ``(−a·z + c)·σ(−b·z + d)``.

Search (float64, one thread, fixed seeds, deterministic): for K = 2, 3, …: the best (K−1)-head fit with a zero head
inserted at six (b, d), plus three seeded random starts fitted by least squares; each refined by L-BFGS on the smooth
sup-norm surrogate ``log ||e||_p`` (p = 8, 32, 128, 512) on a sinh grid to ±40 plus a fine grid on [−2, 2]; the best
refined further.

Certification of the stored coefficients (exactly the floats written, evaluated in float64): ``e = f − M`` is C¹ with a
piecewise-continuous second derivative, so on each cell of a uniform grid of step ``h`` on [−T, T] (T = 200,
h = 1e-4), ``|e| ≤ max(|e| at the cell's ends) + h²/8·sup|e''|``. ``sup|M''| ≤ 1`` (``e^{−t}`` on t > 0, 0 on t < 0)
and ``sup|f''| ≤ Σ_k [2|a_k|b_k·max σ' + |a_k|b_k·max|u·σ''(u)| + |c_k b_k² − a_k b_k d_k|·max|σ''|]`` (with
``u = b t + d``: ``(a t + c)·b² = a·b·u + c b² − a b d``), ``max σ' = 1/4``, ``max|σ''| = 1/(6√3)``,
``max|u σ''(u)| ≤ 0.2256`` (measured on a fine grid, rounded up). For ``|t| ≥ T`` (every ``b_k T ≥ 1``, so each
``(|a| t + |c|)·e^{−b t}`` decreases): ``|e| ≤ Σ_k (|a_k| T + |c_k|)·e^{−b_k T + |d_k|} + e^{−T}``. The stored error
is the maximum of the cell bounds and the tail bound, plus 1e-12 for float64 evaluation.

Usage::

    .venv-tl4/bin/python scripts/fit_xielu.py            # K = 2..8, writes lens_aot/core/xielu_fit.json
    .venv-tl4/bin/python scripts/fit_xielu.py --kmax 4 --out /tmp/xielu_fit.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from fit_activations import lbfgs as _lbfgs  # scripts/ is on the path when run as a script

torch.set_default_dtype(torch.float64)
torch.set_num_threads(1)

MAX_DSIGMA = 0.25
MAX_D2SIGMA = 1.0 / (6.0 * math.sqrt(3.0))
MAX_U_D2SIGMA = 0.2256
T_TAIL = 200.0
STEP = 1e-4


def target(t: torch.Tensor) -> torch.Tensor:
    return torch.where(t > 0, torch.expm1(-t.clamp(min=0)) + t.clamp(min=0), torch.zeros_like(t))


def grid(n: int, zmax: float = 40.0, c: float = 0.5) -> torch.Tensor:
    u = torch.linspace(-math.asinh(zmax / c), math.asinh(zmax / c), n)
    return c * torch.sinh(u)


def unpack(th: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    a = torch.cat([th[: k - 1], (1 - th[: k - 1].sum()).reshape(1)])
    c = torch.cat([th[k - 1 : 2 * k - 2], (-1 - th[k - 1 : 2 * k - 2].sum()).reshape(1)])
    return a, c, torch.exp(th[2 * k - 2 : 3 * k - 2]), th[3 * k - 2 :]


def pack(a: torch.Tensor, c: torch.Tensor, b: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return torch.cat([a[:-1], c[:-1], torch.log(b), d])


def model(th: torch.Tensor, k: int, t: torch.Tensor) -> torch.Tensor:
    a, c, b, d = unpack(th, k)
    tt = t[:, None]
    return ((a * tt + c) * torch.sigmoid(b * tt + d)).sum(-1)


def lbfgs(x0: torch.Tensor, f, it: int) -> torch.Tensor:
    """fit_activations.py's L-BFGS with this search's settings (history 30, tolerances 1e-13 / 1e-16)."""
    return _lbfgs(x0, f, it, history_size=30, tolerance_grad=1e-13, tolerance_change=1e-16)


def lp(e: torch.Tensor, p: float) -> torch.Tensor:
    return torch.logsumexp(p * torch.log(e.abs() + 1e-300), 0) / p


T_FIT = torch.sort(torch.cat([grid(1500), torch.linspace(-2, 2, 801)])).values
G_FIT = target(T_FIT)


def refine(th: torch.Tensor, k: int, its: tuple[int, ...]) -> torch.Tensor:
    for p, it in zip((8.0, 32.0, 128.0, 512.0), its, strict=True):
        th = lbfgs(th, lambda x, p=p: lp(model(x, k, T_FIT) - G_FIT, p), it)
    return th


def fit_error(th: torch.Tensor, k: int) -> float:
    e = (model(th, k, T_FIT) - G_FIT).abs().max().item()
    return e if math.isfinite(e) else math.inf


def search(kmax: int, log) -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    best: dict[int, torch.Tensor] = {}
    prev = None
    for k in range(2, kmax + 1):
        cands = []
        if prev is not None:
            a, c, b, d = unpack(prev, k - 1)
            for bn, dn in ((1.0, 0.0), (5.0, 0.0), (20.0, 0.0), (2.0, -2.0), (2.0, 2.0), (50.0, -1.0)):
                cands.append(
                    pack(
                        torch.cat([a[:-1], torch.zeros(1), a[-1:]]),
                        torch.cat([c[:-1], torch.zeros(1), c[-1:]]),
                        torch.cat([b[:-1], torch.tensor([bn]), b[-1:]]),
                        torch.cat([d[:-1], torch.tensor([dn]), d[-1:]]),
                    )
                )
        for _ in range(3):
            a0 = torch.randn(k - 1, generator=gen) * 0.3
            c0 = torch.randn(k - 1, generator=gen) * 0.3
            rho = torch.empty(k).uniform_(math.log(0.5), math.log(30), generator=gen)
            d0 = torch.empty(k).uniform_(-3, 3, generator=gen)
            th0 = torch.cat([a0, c0, rho, d0])
            cands.append(lbfgs(th0, lambda x, k=k: ((model(x, k, T_FIT) - G_FIT) ** 2).mean(), 150))
        scored = sorted(((fit_error(th, k), i, refine(th, k, (60, 60, 60, 60))) for i, th in enumerate(cands)),
                        key=lambda s: (fit_error(s[2], k), s[1]))  # fmt: skip
        th = refine(scored[0][2], k, (100, 200, 300, 400))
        best[k] = prev = th
        log(f"K={k}: grid error {fit_error(th, k):.3e}")
    return best


def certify(a: torch.Tensor, c: torch.Tensor, b: torch.Tensor, d: torch.Tensor) -> float:
    """A certified bound on ``sup_t |f(t) − M(t)|`` (module docstring)."""
    if not bool((b * T_TAIL >= 1).all()):
        raise ValueError("a slope b_k < 1/T: the tail bound does not apply")
    f2 = float(
        (2 * a.abs() * b * MAX_DSIGMA + a.abs() * b * MAX_U_D2SIGMA + (c * b * b - a * b * d).abs() * MAX_D2SIGMA).sum()
    )
    worst = 0.0
    n = int(round(2 * T_TAIL / STEP))
    chunk = 1_000_000
    for start in range(0, n, chunk):
        t = -T_TAIL + STEP * torch.arange(start, min(n, start + chunk) + 1, dtype=torch.float64)
        e = ((a * t[:, None] + c) * torch.sigmoid(b * t[:, None] + d)).sum(-1) - target(t)
        ends = torch.maximum(e[:-1].abs(), e[1:].abs())
        worst = max(worst, float(ends.max()))
    cell = worst + STEP * STEP / 8 * (f2 + 1.0)
    tail = float(((a.abs() * T_TAIL + c.abs()) * torch.exp(-b * T_TAIL + d.abs())).sum()) + math.exp(-T_TAIL)
    return max(cell, tail) + 1e-12


def check_constants() -> None:
    """``max|u·σ''(u)| ≤ MAX_U_D2SIGMA`` on a fine grid (the maximum is near |u| ≈ 2.2; it decays like u·e^{−|u|})."""
    u = torch.linspace(-60, 60, 2_400_001)
    s = torch.sigmoid(u)
    measured = float((u * s * (1 - s) * (1 - 2 * s)).abs().max())
    assert measured <= MAX_U_D2SIGMA * (1 - 1e-3), measured


def to_z_terms(th: torch.Tensor, k: int) -> list[list[float]]:
    """The fit in ``z = −t``: ``(−a, c, −b, d)`` per head."""
    a, c, b, d = unpack(th, k)
    return [[float(-ai), float(ci), float(-bi), float(di)] for ai, ci, bi, di in zip(a, c, b, d, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kmax", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path(__file__).parents[1] / "lens_aot/core/xielu_fit.json")
    parser.add_argument("--from-checkpoint", type=Path, default=None, help="a torch.save'd {K: theta} of search()")
    args = parser.parse_args()
    start = time.time()
    check_constants()
    found = torch.load(args.from_checkpoint) if args.from_checkpoint else search(args.kmax, print)
    fits = []
    for k in sorted(found):
        th = found[k][1] if isinstance(found[k], tuple) else found[k]
        terms = to_z_terms(th, k)
        # certify exactly the floats written (in t: a = −alpha, c = beta, b = −b_z, d)
        a, c, b, d = (torch.tensor([s * t[i] for t in terms]) for i, s in ((0, -1.0), (1, 1.0), (2, -1.0), (3, 1.0)))
        err = certify(a, c, b, d)
        print(f"K={k}: certified {err:.4e}")
        fits.append({"heads": k, "error": err, "terms": terms})
    doc = {
        "format": "lens_aot xielu negative-branch fits 1",
        "generated_by": f"scripts/fit_xielu.py (deterministic: float64, one thread, fixed seeds; "
        f"{'certified from a saved search checkpoint' if args.from_checkpoint else 'search and certification'}, "
        f"{time.time() - start:.0f}s); do not edit by hand",
        "meaning": "N(z) = (expm1(z) - z)*[z <= 0] ~= sum_k (alpha_k z + beta_k) sigmoid(b_k z + d_k); terms are "
        "[alpha, beta, b, d]; error is a certified bound on the sup over all real z",
        "fits": fits,
    }
    args.out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
