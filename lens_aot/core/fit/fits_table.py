"""GELU-family activations as sums of logistic neuron heads (Huben & Morris 2023, Theorem 3).

``FITS[act][K - 1] = (sup_error, ((alpha, beta, b, d), ...))`` with K heads, meaning

    act(z) ~= sum_k (alpha_k * z + beta_k) * sigmoid(b_k * z + d_k)

with sum(alpha) = 1, sum(beta) = 0 (up to float rounding) and every b > 0, so the fit tends to z as z -> +inf
and to 0 as z -> -inf. ``sup_error`` is a certified upper bound on sup |fit(z) - act(z)| over all real z for
these exact float64 coefficients: a dense grid on [-200, 200] (step 2e-5 on [-16, 16]) plus a per-cell
second-derivative bound between grid points and an analytic bound beyond |z| = 200. The fits are the best
local minimax optima found by a deterministic multistart search (see the script), not proven global optima.
Targets: ``gelu`` = exact erf GELU, ``gelu_new`` = tanh approximation, ``gelu_fast`` = its 0.7978845608 form.

The coefficients are data, in ``fits_table.json`` beside this file, written by ``scripts/fit_activations.py``
(deterministic: float64, CPU, fixed seeds; do not edit by hand). JSON round-trips float64 exactly.
"""

from __future__ import annotations

import json
from importlib import resources

Term = tuple[float, float, float, float]


def _load() -> dict[str, list[tuple[float, tuple[Term, ...]]]]:
    doc = json.loads(resources.files(__package__).joinpath("fits_table.json").read_text(encoding="utf-8"))
    return {
        act: [(float(err), tuple((a, b, c, d) for a, b, c, d in terms)) for err, terms in fits]
        for act, fits in doc["fits"].items()
    }


FITS: dict[str, list[tuple[float, tuple[Term, ...]]]] = _load()
