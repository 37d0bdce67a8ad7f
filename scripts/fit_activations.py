"""Fit GELU-family activations as sums of shifted logistic "neuron heads" and write ``lens_aot/core/fits_table.json``.

A neuron head (an attention head of internal dimension 1; Huben & Morris 2023, Theorem 3) computes
``(alpha*z + beta) * sigmoid(b*z + d)`` of a pre-activation ``z``. A GELU neuron is replaced by ``K`` heads::

    f_K(z) = sum_{k=1..K} (alpha_k*z + beta_k) * sigmoid(b_k*z + d_k),   sum alpha_k = 1, sum beta_k = 0, b_k > 0.

The constraints hold by construction (``alpha_K = 1 - sum(others)``, ``beta_K = -sum(others)``, ``b_k = exp(rho_k)``),
so ``f_K(z) - z -> 0`` as ``z -> +inf`` and ``f_K(z) -> 0`` as ``z -> -inf``, exactly like GELU. The objective is the
sup norm of ``f_K - act`` over all of R.

Search (float64, CPU, fixed seeds; each activation and K separately; the same code path every run):

1. Symmetric starts. Every target satisfies ``act(-z) = act(z) - z``; a fit is consistent with that exactly when its
   heads come in mirror pairs ``(alpha, +-beta, b, +-d)`` (plus one head with ``beta = d = 0`` when K is odd), and its
   error is then even, so the half line suffices. Structured starts (equal slopes ``b0``, evenly spaced shifts) and
   seeded random starts are fitted by least squares with ``alpha, beta`` eliminated (variable projection, L-BFGS over
   ``b, d``), then every start gets a short L-BFGS run on the smooth sup-norm surrogate ``log ||e||_p`` (p = 8, 64,
   256); the best few are refined further (p up to 1024).
2. Continuation: the best (K-1)-head fit plus a zero head inserted at several (b, d), refined on L^p without symmetry,
   and the plain (K-1)-head fit with a zero head (so the error cannot increase with K).
3. Hints: a few extra starts (slopes and shifts only, ``HINTS``) from longer searches; see ``--search-hints``.
4. Selection on the exact objective: all candidates are refined by sequential linear programming (SLP: minimise
   ``max_i |e(z_i)|`` on a grid of step 1e-3 on [-12, 12] plus a sinh grid to +-30, linearised at the local maxima of
   ``|e|``, box trust region, each LP solved by a small log-barrier method), by successive halving (``SCHEDULE``).
   The L^p surrogate stalls in curved valleys around these nearly degenerate optima (they do not show the full
   4K - 1 alternations); SLP keeps descending there, and values before it predict values after it poorly.
   "gelu_fast" differs from "gelu_new" by < 1e-12, so it is refined (SLP) from the "gelu_new" fits.

Certification of the stored coefficients (exactly the floats written, evaluated in float64): the error ``e`` and its
analytic second derivative ``e''`` are evaluated on uniform grids: step 2e-5 on [-16, 16], 1e-3 on 16 <= |z| <= 40 and
1e-2 on 40 <= |z| <= 200. On each grid cell of width h, ``|e| <= max(|e| at the ends) + h^2/8 * max|e''|`` (linear
interpolation error), with the sampled ``max|e''|`` of the two ends doubled as a safety margin (|e''| varies on scales
>= 0.1, the cells are <= 1e-2 wide). For |z| >= Z = 200 the bound is analytic: with ``t = |z|`` and
``b_k * Z >= 1``, ``|e(z)| <= sum_k (|alpha_k| Z + |beta_k|) exp(-b_k Z + |d_k|) + |act(-Z)|``, because
``f(z) - z = -sum_k (alpha_k z + beta_k) sigmoid(-b_k z - d_k)``, ``act(z) - z = act(-z)`` and each
``(|alpha| t + |beta|) exp(-b t)`` decreases for ``b t >= 1``. The stored error is the maximum of these cell bounds
and the tail bound, i.e. an upper bound on ``sup_R |f_K - act|`` (it exceeds the grid maximum by < 1e-9 relative).

The fits are the best local optima found by this deterministic multistart search, not proven global minimax fits.
The final table also reports the error when the heads are evaluated in float32 and the largest |alpha|, |beta|.

Usage::

    .venv-tl4/bin/python scripts/fit_activations.py              # writes lens_aot/core/fits_table.json (2 processes)
    .venv-tl4/bin/python scripts/fit_activations.py --out /tmp/fits_table.json --kmax 4
    .venv-tl4/bin/python scripts/fit_activations.py --no-hints   # pure multistart, without HINTS
    .venv-tl4/bin/python scripts/fit_activations.py --search-hints   # slow (~15 min): print new HINTS for K >= 5
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import time
from pathlib import Path

# Bitwise reproducibility: MKL otherwise picks code paths by CPU and memory alignment, and the last-bit differences get
# amplified by the long, ill-conditioned refinements. Must be set before torch (and MKL) is loaded; spawned workers
# re-import this module, so they inherit it too.
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")
os.environ.setdefault("ATEN_CPU_CAPABILITY", "default")

import torch  # noqa: E402

DTYPE = torch.float64
ACTIVATIONS = ("gelu", "gelu_new", "gelu_fast")
K_MAX = 8
C_NEW = math.sqrt(2.0 / math.pi)
C_FAST = 0.7978845608
CUBIC = 0.044715

Term = tuple[float, float, float, float]


# --------------------------------------------------------------------------------------------------------------------
# Targets


def target(name: str, z: torch.Tensor) -> torch.Tensor:
    if name == "gelu":
        return torch.nn.functional.gelu(z)
    if name == "gelu_new":
        return 0.5 * z * (1.0 + torch.tanh(C_NEW * (z + CUBIC * z**3)))
    if name == "gelu_fast":
        return 0.5 * z * (1.0 + torch.tanh(z * C_FAST * (1.0 + CUBIC * z * z)))
    raise ValueError(name)


def target_d2(name: str, z: torch.Tensor) -> torch.Tensor:
    """Analytic second derivative of the target."""
    if name == "gelu":
        return torch.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi) * (2.0 - z * z)
    c = C_NEW if name == "gelu_new" else C_FAST
    t = torch.tanh(c * z * (1.0 + CUBIC * z * z))
    s = 1.0 - t * t
    u1 = c * (1.0 + 3.0 * CUBIC * z * z)
    u2 = 6.0 * c * CUBIC * z
    return s * u1 + 0.5 * z * (s * u2 - 2.0 * t * s * u1 * u1)


# --------------------------------------------------------------------------------------------------------------------
# Parametrisations. Full: theta = [alpha_1..K-1, beta_1..K-1, log b_1..K, d_1..K] (4K-2 free numbers).


def unpack(theta: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    a, be = theta[: k - 1], theta[k - 1 : 2 * k - 2]
    alpha = torch.cat([a, (1.0 - a.sum()).reshape(1)])
    beta = torch.cat([be, (-be.sum()).reshape(1)])
    return alpha, beta, torch.exp(theta[2 * k - 2 : 3 * k - 2]), theta[3 * k - 2 :]


def pack(alpha: torch.Tensor, beta: torch.Tensor, b: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return torch.cat([alpha[:-1], beta[:-1], torch.log(b), d]).detach().clone()


def model(theta: torch.Tensor, k: int, z: torch.Tensor) -> torch.Tensor:
    alpha, beta, b, d = unpack(theta, k)
    zz = z[:, None]
    return ((alpha * zz + beta) * torch.sigmoid(b * zz + d)).sum(-1)


# Symmetric: P = K // 2 mirror pairs (a_j, +-beta_j, b_j, +-d_j), plus a centre head (a_c, 0, b_c, 0) when K is odd.
# v = [a_1..a_na, beta_1..P, log b_1..P, d_1..P, (log b_c)], na = P if K odd (a_c = 1 - 2 sum a) else P - 1
# (a_P = 1/2 - sum of the others).


def sym_terms(v: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    p, odd = k // 2, k % 2
    na = p if odd else p - 1
    a, be = v[:na], v[na : na + p]
    rho, d = v[na + p : na + 2 * p], v[na + 2 * p : na + 3 * p]
    if not odd:
        a = torch.cat([a, (0.5 - a.sum()).reshape(1)])
    alpha, beta, r, dd = torch.cat([a, a]), torch.cat([be, -be]), torch.cat([rho, rho]), torch.cat([d, -d])
    if odd:
        zero = torch.zeros(1, dtype=v.dtype)
        alpha = torch.cat([alpha, (1.0 - 2.0 * a.sum()).reshape(1)])
        beta, r, dd = torch.cat([beta, zero]), torch.cat([r, v[na + 3 * p :]]), torch.cat([dd, zero])
    return alpha, beta, torch.exp(r), dd


def sym_model(v: torch.Tensor, k: int, z: torch.Tensor) -> torch.Tensor:
    alpha, beta, b, d = sym_terms(v, k)
    zz = z[:, None]
    return ((alpha * zz + beta) * torch.sigmoid(b * zz + d)).sum(-1)


def sym_to_full(v: torch.Tensor, k: int) -> torch.Tensor:
    return pack(*sym_terms(v, k))


def sym_varpro(rho: torch.Tensor, d: torch.Tensor, rho_c: torch.Tensor | None, k: int, z, g):
    """Least-squares (a, beta) for fixed slopes/shifts; returns (solution, mean squared residual)."""
    b = torch.exp(rho)
    sp, sm = torch.sigmoid(b * z[:, None] + d), torch.sigmoid(b * z[:, None] - d)
    ca, cb = z[:, None] * (sp + sm), sp - sm
    if rho_c is not None:
        base = z * torch.sigmoid(torch.exp(rho_c) * z)
        ca = ca - 2.0 * base[:, None]
    else:
        base = 0.5 * ca[:, -1]
        ca = ca[:, :-1] - ca[:, -1:]
    mat, y = torch.cat([ca, cb], 1), g - base
    q, r = torch.linalg.qr(mat)
    x = torch.linalg.solve_triangular(r, (q.T @ y)[:, None], upper=True)[:, 0]
    return x, ((mat @ x - y) ** 2).mean()


# --------------------------------------------------------------------------------------------------------------------
# Optimisers


def lbfgs(
    x0: torch.Tensor,
    loss_fn,
    iters: int,
    history_size: int = 50,
    tolerance_grad: float = 1e-14,
    tolerance_change: float = 1e-18,
) -> torch.Tensor:
    """``x0`` after ``iters`` strong-Wolfe L-BFGS iterations on ``loss_fn`` (also scripts/fit_xielu.py's)."""
    x = x0.detach().clone().requires_grad_(True)
    opt = torch.optim.LBFGS(
        [x],
        lr=1,
        max_iter=iters,
        history_size=history_size,
        line_search_fn="strong_wolfe",
        tolerance_grad=tolerance_grad,
        tolerance_change=tolerance_change,
    )

    def closure():
        opt.zero_grad()
        loss = loss_fn(x)
        loss.backward()
        return loss

    try:
        opt.step(closure)
    except RuntimeError:  # singular least-squares matrix on a degenerate start: keep what we have
        pass
    return x.detach()


def lp_loss(err: torch.Tensor, p: float) -> torch.Tensor:
    """log of the (unnormalised) L^p norm of err; tends to log max|err| as p grows."""
    return torch.logsumexp(p * torch.log(err.abs() + 1e-300), 0) / p


def model_jac(theta: torch.Tensor, k: int, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Model values and analytic Jacobian d f(z_i) / d theta (N x (4K-2))."""
    alpha, beta, b, d = unpack(theta, k)
    zz = z[:, None]
    s = torch.sigmoid(b * zz + d)
    lin = alpha * zz + beta
    ds = lin * s * (1.0 - s)
    diff = s[:, :-1] - s[:, -1:]
    return (lin * s).sum(-1), torch.cat([zz * diff, diff, ds * b * zz, ds], 1)


def lp_barrier(a: torch.Tensor, rhs: torch.Tensor, c: torch.Tensor, x0: torch.Tensor, gap: float = 1e-8):
    """min c.x subject to a x <= rhs (small dense LP): log-barrier path following from the strictly feasible x0;
    Newton directions with an exact (safeguarded 1-D Newton) line search on the barrier function. Returns the last
    strictly feasible iterate if rounding breaks the iteration (the linearised problems are badly conditioned)."""
    x = x0.clone()
    tau = 10.0
    eye = torch.eye(x.numel(), dtype=DTYPE)
    while a.shape[0] / tau > gap:
        for _ in range(25):
            slack = rhs - a @ x
            grad = tau * c + a.T @ (1.0 / slack)
            a_s = a / slack[:, None]
            hess = a_s.T @ a_s
            dx = -torch.linalg.solve(hess + 1e-14 * hess.diagonal().max() * eye, grad)
            dec = -(grad @ dx).item()
            if not math.isfinite(dec) or dec < 1e-9:
                break
            adx = a @ dx
            pos = adx > 0
            tmax = (slack[pos] / adx[pos]).min().item() if bool(pos.any()) else math.inf
            cdx = tau * (c @ dx).item()
            t = min(1.0, 0.5 * tmax)
            for _ in range(30):  # phi(t) = tau c.(x + t dx) - sum log(slack - t adx) is convex on [0, tmax)
                r = adx / (slack - t * adx)
                d1, d2 = cdx + r.sum().item(), (r * r).sum().item()
                t_new = min(max(t - d1 / d2, 0.5 * t), t + 0.9 * (tmax - t))
                if not math.isfinite(t_new) or abs(t_new - t) <= 1e-10 * t:
                    break
                t = t_new
            xn = x + t * dx
            if not bool(torch.isfinite(xn).all()) or not bool((rhs - a @ xn > 0).all()):
                return x
            x = xn
        tau *= 20.0
    return x


# Some optima drift towards a confluent limit (two mirrored heads with d -> 0 and beta -> infinity emulate a
# sigmoid-derivative head) with vanishing gains; the SLP refuses steps that make any |alpha| or |beta| exceed this, so
# that evaluating the heads in float32 stays meaningful.
COEF_MAX = 10.0


def slp_minimax(theta: torch.Tensor, k: int, name: str, iters: int, z: torch.Tensor | None = None) -> torch.Tensor:
    """Sequential linear programming with a box trust region on max_i |e(z_i)| (the exact sup-norm objective on the
    training grid). Only the local maxima of |e| above 0.3 max|e| and their three neighbours on either side enter each
    linear program; every step is accepted or rejected on the whole grid."""
    z = slp_grid() if z is None else z
    g = target(name, z)
    m = theta.numel()
    f, jac = model_jac(theta, k, z)
    e = f - g
    cur = e.abs().max().item()
    delta = 1e-3
    eye, zcol = torch.eye(m, dtype=DTYPE), torch.zeros(m, 1, dtype=DTYPE)
    c = torch.zeros(m + 1, dtype=DTYPE)
    c[-1] = 1.0
    x0 = torch.zeros(m + 1, dtype=DTYPE)
    x0[-1] = 1.001
    for _ in range(iters):
        ae = e.abs()
        peak = torch.zeros_like(ae, dtype=torch.bool)
        peak[1:-1] = (ae[1:-1] >= ae[:-2]) & (ae[1:-1] >= ae[2:]) & (ae[1:-1] >= 0.3 * cur)
        act = peak.clone()
        for sh in (1, 2, 3):  # local maxima of |e| and their neighbours: where the maximum can move to
            act[sh:] |= peak[:-sh]
            act[:-sh] |= peak[sh:]
        ja, ea = jac[act] / cur, e[act] / cur  # scaled so that the current level is 1
        ones = torch.ones(ea.numel(), 1, dtype=DTYPE)
        a = torch.cat(
            [
                torch.cat([ja, -ones], 1),
                torch.cat([-ja, -ones], 1),
                torch.cat([eye, zcol], 1),
                torch.cat([-eye, zcol], 1),
            ]
        )
        rhs = torch.cat([-ea, ea, torch.full((2 * m,), delta, dtype=DTYPE)])
        x = lp_barrier(a, rhs, c, x0)
        cand = theta + x[:m]
        fn, jn = model_jac(cand, k, z)
        new = (fn - g).abs().max().item()
        pred = 1.0 - x[-1].item()
        ratio = (1.0 - new / cur) / pred if pred > 0 else -1.0
        alpha, beta, _, _ = unpack(cand, k)
        if max(alpha.abs().max().item(), beta.abs().max().item()) > COEF_MAX:
            ratio = -1.0  # keep the heads well conditioned (see COEF_MAX)
        if ratio > 0 and new < cur:
            theta, e, jac, cur = cand, fn - g, jn, new
        if ratio < 0.1:
            delta *= 0.3
        elif ratio > 0.5:
            delta = min(2.0 * delta, 1.0)
        if delta < 1e-9:
            break
    return theta


def slp_grid() -> torch.Tensor:
    """Grid for the minimax refinement: step 1e-3 on [-12, 12] (where the extrema are) plus a sinh grid to +-30."""
    z = torch.cat([torch.linspace(-12.0, 12.0, 24001, dtype=DTYPE), train_grid(2000)])
    return torch.sort(z[(z < -12.0) | (z > 12.0) | (torch.arange(z.numel()) < 24001)]).values


def sup_err(theta: torch.Tensor, k: int, z: torch.Tensor, g: torch.Tensor) -> float:
    s = (model(theta, k, z) - g).abs().max().item()
    return s if math.isfinite(s) else math.inf


def train_grid(n: int, zmax: float = 30.0, c: float = 2.0) -> torch.Tensor:
    """sinh-spaced grid on [-zmax, zmax], dense near 0 (spacing ~ c * 2 asinh(zmax/c) / n there)."""
    u = torch.linspace(-math.asinh(zmax / c), math.asinh(zmax / c), n, dtype=DTYPE)
    return c * torch.sinh(u)


# --------------------------------------------------------------------------------------------------------------------
# Search for one activation and one K


def sym_search(name: str, k: int, n_random: int, n_lp: int, n_out: int, log, seed: int = 0) -> list[torch.Tensor]:
    """Multistart over mirror-symmetric fits: least squares, cheap L^p screen of every start, then refine the best."""
    p, odd = k // 2, k % 2
    na = p if odd else p - 1
    zh = train_grid(2000)
    zh = zh[zh >= 0]  # the error of a symmetric fit is even
    g = target(name, zh)
    gen = torch.Generator().manual_seed(1000 * k + 17 + 7919 * seed)
    starts = []
    for b0 in (1.3, 1.5, 1.7, 2.0):
        for sp in (1.0, 1.25, 1.5, 1.75, 2.0, 2.5):
            dd = (torch.arange(p, dtype=DTYPE) + (1.0 if odd else 0.5)) * sp
            starts.append((torch.full((p,), math.log(b0), dtype=DTYPE), dd, torch.tensor(math.log(b0), dtype=DTYPE)))
    for i in range(n_random):
        lo, hi, dmax = (0.8, 4.0, 6.0) if i % 3 == 2 else (1.1, 2.6, 5.5)
        rho = torch.empty(p, dtype=DTYPE).uniform_(math.log(lo), math.log(hi), generator=gen)
        dd = torch.empty(p, dtype=DTYPE).uniform_(0.0, dmax, generator=gen)
        rc = torch.empty((), dtype=DTYPE).uniform_(math.log(lo), math.log(hi), generator=gen)
        starts.append((rho, dd, rc))

    def split(q):
        return q[:p], q[p : 2 * p], (q[2 * p] if odd else None)

    def sup_sym(v):
        s = (sym_model(v, k, zh) - g).abs().max().item()
        return s if math.isfinite(s) else math.inf

    screened = []
    best_ls = math.inf
    for rho, dd, rc in starts:
        q0 = torch.cat([rho, dd] + ([rc.reshape(1)] if odd else []))
        q = lbfgs(q0, lambda q: sym_varpro(*split(q), k, zh, g)[1], 100)
        r, dq, rcq = split(q)
        try:
            x, _ = sym_varpro(r, dq, rcq, k, zh, g)
        except RuntimeError:
            continue
        v = torch.cat([x[:na], x[na:], r, dq] + ([rcq.reshape(1)] if odd else []))
        best_ls = min(best_ls, sup_sym(v))
        # cheap L^p screen: the ranking after few iterations predicts the ranking after convergence well
        for pp, iters in ((8.0, 100), (64.0, 150), (256.0, 200)):
            v = lbfgs(v, lambda t, pp=pp: lp_loss(sym_model(t, k, zh) - g, pp), iters)
        screened.append((sup_sym(v), len(screened), v))
    screened.sort(key=lambda t: (t[0], t[1]))
    log(
        f"    [{name}] K={k} sym: {len(starts)} starts, best least squares {best_ls:.3e}, screened {screened[0][0]:.3e}"
    )

    refined = []
    for _, i, v in screened[:n_lp]:
        for pp in (64.0, 256.0, 1024.0):
            v = lbfgs(v, lambda t, pp=pp: lp_loss(sym_model(t, k, zh) - g, pp), 300)
        refined.append((sup_sym(v), i, v))
    refined.sort(key=lambda t: (t[0], t[1]))
    log(f"    [{name}] K={k} sym: refined {refined[0][0]:.3e}")
    return [sym_to_full(v, k) for _, _, v in refined[:n_out]]


def insertion_search(name: str, prev: torch.Tensor, k: int, n_keep: int) -> list[torch.Tensor]:
    z = train_grid(3000)
    g = target(name, z)
    alpha, beta, b, d = unpack(prev, k - 1)
    cands = []
    for bn in (1.2, 2.2):
        for dn in (-4.5, -3.0, -1.5, 0.0, 1.5, 3.0, 4.5):
            zero = torch.zeros(1, dtype=DTYPE)
            th = pack(
                torch.cat([zero, alpha]),
                torch.cat([zero, beta]),
                torch.cat([torch.tensor([bn], dtype=DTYPE), b]),
                torch.cat([torch.tensor([dn], dtype=DTYPE), d]),
            )
            for pp in (64.0, 256.0):
                th = lbfgs(th, lambda t, pp=pp: lp_loss(model(t, k, z) - g, pp), 300)
            cands.append((sup_err(th, k, z, g), len(cands), th))
    cands.sort(key=lambda t: (t[0], t[1]))
    # the unoptimised insertion (an exact copy of the (K-1)-head fit) keeps the sequence monotone in K
    zero = torch.zeros(1, dtype=DTYPE)
    copy = pack(
        torch.cat([zero, alpha]),
        torch.cat([zero, beta]),
        torch.cat([torch.ones(1, dtype=DTYPE), b]),
        torch.cat([zero, d]),
    )
    return [c[2] for c in cands[:n_keep]] + [copy]


# Extra starts: slopes b_k and shifts d_k (rounded to 0.01) of the best fits found by longer searches (--search-hints
# and earlier exploratory multistarts with other seeds); alpha and beta are not given, they come from least squares,
# and each hint goes through the same L^p + SLP refinement as every other start.
HINTS: dict[tuple[str, int], tuple[tuple[tuple[float, float], ...], ...]] = {
    ("gelu", 5): (((1.65, 1.32), (1.45, 3.23), (1.65, -1.32), (1.45, -3.23), (1.59, 0.0)),),
    ("gelu", 6): (((1.54, 0.06), (1.42, 2.02), (1.37, 3.63), (1.54, -0.06), (1.42, -2.02), (1.37, -3.63)),),
    ("gelu", 7): (((1.46, 3.99), (1.67, 0.8), (1.51, 2.37), (1.46, -3.99), (1.67, -0.8), (1.51, -2.37), (1.61, 0.0)),),
    ("gelu", 8): (
        (
            (2.04, 3.41),
            (1.3, 4.1),
            (1.31, 0.43),
            (1.31, 2.13),
            (2.04, -3.41),
            (1.3, -4.1),
            (1.31, -0.43),
            (1.31, -2.13),
        ),
    ),
    ("gelu_new", 5): (((1.19, 1.6), (1.4, 4.14), (1.19, -1.6), (1.4, -4.14), (1.17, 0.0)),),
    ("gelu_new", 6): (((1.33, 0.64), (1.21, 2.43), (1.38, 5.09), (1.33, -0.64), (1.21, -2.43), (1.38, -5.09)),),
    ("gelu_new", 7): (((1.29, 2.89), (1.3, 5.02), (1.52, 1.3), (1.29, -2.89), (1.3, -5.02), (1.52, -1.3), (1.4, 0.0)),),
    ("gelu_new", 8): (
        (
            (1.28, 0.63),
            (1.52, 4.88),
            (1.15, 2.21),
            (1.27, 4.82),
            (1.28, -0.63),
            (1.52, -4.88),
            (1.15, -2.21),
            (1.27, -4.82),
        ),
        (
            (2.04, 3.41),
            (1.3, 4.1),
            (1.31, 0.43),
            (1.31, 2.13),
            (2.04, -3.41),
            (1.3, -4.1),
            (1.31, -0.43),
            (1.31, -2.13),
        ),
    ),
}


def hint_search(name: str, k: int, hints: tuple[tuple[tuple[float, float], ...], ...]) -> list[torch.Tensor]:
    """Starts given as slopes and shifts (b_k, d_k) only; alpha, beta come from least squares, then L^p refinement."""
    z = train_grid(3000)
    g = target(name, z)
    out = []
    for hint in hints:
        b = torch.tensor([h[0] for h in hint], dtype=DTYPE)
        d = torch.tensor([h[1] for h in hint], dtype=DTYPE)
        s = torch.sigmoid(b * z[:, None] + d)
        diff = s[:, :-1] - s[:, -1:]
        mat = torch.cat([z[:, None] * diff, diff], 1)
        x = torch.linalg.lstsq(mat, (g - z * s[:, -1])[:, None]).solution[:, 0]
        th = torch.cat([x, torch.log(b), d])
        for pp in (8.0, 64.0, 256.0, 1024.0):
            th = lbfgs(th, lambda t, pp=pp: lp_loss(model(t, k, z) - g, pp), 300)
        out.append(th)
    return out


def select(name: str, thetas: list[torch.Tensor], k: int, schedule: tuple[tuple[int, int], ...], z, log):
    """Successive halving on the exact objective: refine every candidate by SLP, keep the best few, refine more.

    ``schedule`` = ((iterations, survivors), ...). Values after a few L^p iterations or a short SLP predict the refined
    minimax value poorly on these nearly degenerate problems, hence the staged refinement."""
    g = target(name, z)
    pool = list(thetas)
    for iters, keep in schedule:
        pool = [slp_minimax(th, k, name, iters, z) for th in pool]
        scored = sorted(((sup_err(th, k, z, g), i, th) for i, th in enumerate(pool)), key=lambda t: (t[0], t[1]))
        pool = [th for _, _, th in scored[:keep]]
        log(f"    [{name}] K={k} SLP x{iters}: " + " ".join(f"{s:.3e}" for s, _, _ in scored[: max(keep, 3)]))
    return pool[0]


# (SLP iterations, survivors) per stage of the final selection, and random symmetric starts, per K
SCHEDULE = {
    1: ((100, 1),),
    2: ((40, 2), (100, 1)),
    3: ((40, 2), (100, 1)),
    4: ((40, 2), (200, 1)),
}
SCHEDULE_DEFAULT = ((40, 3), (120, 2), (250, 1))
N_RANDOM = {2: 8, 3: 8, 4: 16}
N_RANDOM_DEFAULT = 20


def fit_activation(name: str, kmax: int, log, use_hints: bool = True) -> list[torch.Tensor]:
    fits: list[torch.Tensor] = []
    z = slp_grid()
    g = target(name, z)
    for k in range(1, kmax + 1):
        t0 = time.time()
        if k == 1:  # f = z * sigmoid(b z + d): two parameters, one start suffices
            th = torch.tensor([math.log(1.702), 0.0], dtype=DTYPE)
            for pp in (8.0, 64.0, 256.0):
                th = lbfgs(th, lambda t, pp=pp: lp_loss(model(t, 1, z) - g, pp), 300)
            cands = [th]
        else:
            cands = sym_search(name, k, N_RANDOM.get(k, N_RANDOM_DEFAULT), n_lp=8, n_out=3, log=log)
            cands += insertion_search(name, fits[-1], k, n_keep=2)
            if use_hints:
                cands += hint_search(name, k, HINTS.get((name, k), ()))
        th = select(name, cands, k, SCHEDULE.get(k, SCHEDULE_DEFAULT), z, log)
        fits.append(th)
        log(f"[{name}] K={k} train sup {sup_err(th, k, z, g):.4e} ({time.time() - t0:.1f}s)")
    return fits


def search_hints(name: str, kmin: int, kmax: int, log) -> None:
    """Slow mode (--search-hints): larger multistart with another seed and long SLP for every survivor; prints the
    (b, d) of the best fit per K in the format of HINTS."""
    z = slp_grid()
    g = target(name, z)
    for k in range(kmin, kmax + 1):
        cands = sym_search(name, k, 100, n_lp=12, n_out=4, log=log, seed=1)
        th = select(name, cands, k, ((100, 4), (300, 1)), z, log)
        _, _, b, d = unpack(th, k)
        hint = tuple((round(float(b[i]), 2), round(float(d[i]), 2)) for i in range(k))
        log(f"HINT ({name!r}, {k}): {hint},  # sup {sup_err(th, k, z, g):.4e}")


# --------------------------------------------------------------------------------------------------------------------
# Certification


def terms_of(theta: torch.Tensor, k: int) -> tuple[Term, ...]:
    alpha, beta, b, d = unpack(theta, k)
    return tuple((float(alpha[i]), float(beta[i]), float(b[i]), float(d[i])) for i in range(k))


def err_and_d2(terms: tuple[Term, ...], name: str, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    e, e2 = -target(name, z), -target_d2(name, z)
    for a, be, b, d in terms:
        s = torch.sigmoid(b * z + d)
        s1 = s * (1.0 - s)
        lin = a * z + be
        e = e + lin * s
        e2 = e2 + 2.0 * a * b * s1 + lin * (b * b) * s1 * (1.0 - 2.0 * s)
    return e, e2


CERT_SEGMENTS = (
    (-16.0, 16.0, 2e-5),
    (-40.0, -16.0, 1e-3),
    (16.0, 40.0, 1e-3),
    (-200.0, -40.0, 1e-2),
    (40.0, 200.0, 1e-2),
)
Z_TAIL = 200.0


def certify(terms: tuple[Term, ...], name: str, chunk: int = 400_000) -> dict[str, float]:
    grid_max, argmax, bound = 0.0, 0.0, 0.0
    for lo, hi, h in CERT_SEGMENTS:
        n = int(round((hi - lo) / h))
        for s0 in range(0, n, chunk):
            z = lo + h * torch.arange(s0, min(n, s0 + chunk) + 1, dtype=DTYPE)
            e, e2 = err_and_d2(terms, name, z)
            ae, a2 = e.abs(), e2.abs()
            i = int(ae.argmax())
            if ae[i].item() > grid_max:
                grid_max, argmax = ae[i].item(), z[i].item()
            cell = torch.maximum(ae[:-1], ae[1:]) + (h * h / 8.0) * 2.0 * torch.maximum(a2[:-1], a2[1:])
            bound = max(bound, cell.max().item())
    if not min(t[2] for t in terms) * Z_TAIL >= 1.0:
        raise ValueError("slope too small for the analytic tail bound")
    tail = sum((abs(a) * Z_TAIL + abs(be)) * math.exp(-b * Z_TAIL + abs(d)) for a, be, b, d in terms)
    tail += abs(target(name, torch.tensor(-Z_TAIL, dtype=DTYPE)).item()) + 1e-300
    return {"grid_max": grid_max, "argmax": argmax, "bound": max(bound, tail), "tail": tail}


# --------------------------------------------------------------------------------------------------------------------
# Driver


def _worker(args):
    name, kmax, mode = args
    torch.set_num_threads(1)
    torch.set_default_dtype(DTYPE)

    def log(msg):
        print(msg, flush=True)

    if mode == "search-hints":
        search_hints(name, 5, kmax, log)
        return name, []
    return name, [th.tolist() for th in fit_activation(name, kmax, log, use_hints=mode == "default")]


def float32_error(terms: tuple[Term, ...], name: str) -> float:
    """max |fit - act| on [-16, 16] (step 1e-3) when the heads are evaluated in float32 (target in float64)."""
    z = torch.linspace(-16.0, 16.0, 32001, dtype=DTYPE)
    z32 = z.to(torch.float32)
    f = torch.zeros_like(z32)
    for a, be, b, d in terms:
        f = f + (a * z32 + be) * torch.sigmoid(b * z32 + d)
    return (f.to(DTYPE) - target(name, z32.to(DTYPE))).abs().max().item()


def polish_from(name: str, fits: list[torch.Tensor]) -> list[torch.Tensor]:
    return [slp_minimax(th, k, name, 100) for k, th in enumerate(fits, start=1)]


def render(results: dict[str, list[tuple[float, tuple[Term, ...]]]], runtime: float) -> str:
    """``lens_aot/core/fits_table.json``: the certified fits as data (``lens_aot/core/fit/fits_table.py`` loads
    them)."""
    doc = {
        "format": "lens_aot activation fits 1",
        "generated_by": f"scripts/fit_activations.py (deterministic: float64, CPU, fixed seeds; last run took "
        f"{runtime:.0f}s); do not edit by hand",
        "meaning": "fits[act][K-1] = [sup_error, [[alpha, beta, b, d], ...]] with K heads: act(z) ~= sum_k "
        "(alpha_k z + beta_k) sigmoid(b_k z + d_k)",
        "fits": {name: [[err, [list(t) for t in terms]] for err, terms in results[name]] for name in ACTIVATIONS},
    }
    return json.dumps(doc, indent=1) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_out = Path(__file__).resolve().parents[1] / "lens_aot" / "core" / "fits_table.json"
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--kmax", type=int, default=K_MAX)
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (gelu and gelu_new run in parallel)")
    parser.add_argument("--no-hints", action="store_true", help="ignore HINTS (pure multistart search)")
    parser.add_argument("--search-hints", action="store_true", help="slow: search for new HINTS (K >= 5) and exit")
    args = parser.parse_args()
    torch.set_default_dtype(DTYPE)
    t_start = time.time()

    mode = "search-hints" if args.search_hints else "no-hints" if args.no_hints else "default"
    jobs = [("gelu", args.kmax, mode), ("gelu_new", args.kmax, mode)]
    if args.jobs > 1:
        with mp.get_context("spawn").Pool(min(args.jobs, 2)) as pool:
            raw = dict(pool.map(_worker, jobs))
    else:
        raw = dict(_worker(j) for j in jobs)
    if args.search_hints:
        return
    torch.set_num_threads(1)
    fits = {name: [torch.tensor(th, dtype=DTYPE) for th in raw[name]] for name in raw}
    t0 = time.time()
    fits["gelu_fast"] = polish_from("gelu_fast", fits["gelu_new"])
    print(f"[gelu_fast] polished from gelu_new in {time.time() - t0:.1f}s", flush=True)

    results: dict[str, list[tuple[float, tuple[Term, ...]]]] = {}
    report = []
    t0 = time.time()
    for name in ACTIVATIONS:
        results[name] = []
        for k, th in enumerate(fits[name], start=1):
            terms = terms_of(th, k)
            cert = certify(terms, name)
            cert["f32"] = float32_error(terms, name)
            cert["coef"] = max(max(abs(t[0]), abs(t[1])) for t in terms)
            results[name].append((cert["bound"], terms))
            report.append((name, k, cert))
    print(f"certified in {time.time() - t0:.1f}s", flush=True)
    runtime = time.time() - t_start
    args.out.write_text(render(results, runtime))

    print(
        f"\n{'activation':<10} {'K':>2} {'sup error (bound)':>18} {'grid max':>11} {'at z':>8} {'tail |z|>200':>12}"
        f" {'float32 eval':>12} {'max|alpha|,|beta|':>17}"
    )
    for name, k, c in report:
        print(
            f"{name:<10} {k:>2} {c['bound']:>18.6e} {c['grid_max']:>11.4e} {c['argmax']:>8.3f} {c['tail']:>12.1e}"
            f" {c['f32']:>12.2e} {c['coef']:>17.3f}"
        )
    for tol in (1e-4, 1e-5, 1e-6):
        best = {n: next((k for n2, k, c in report if n2 == n and c["bound"] <= tol), None) for n in ACTIVATIONS}
        print(f"smallest K with sup error <= {tol:g}: {best}")
    print(f"wrote {args.out}; total runtime {runtime:.1f}s")


if __name__ == "__main__":
    main()
