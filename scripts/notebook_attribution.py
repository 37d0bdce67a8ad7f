"""Cells of notebooks/attribution.ipynb: screen every head and neuron head by gradient attribution, verify by patching.

On the shipped modular-addition model (4 attention heads, 512 ReLU neurons = 512 neuron heads) the notebook
attributes every unit with ``attribute_heads`` (AtP and EAP-IG) in well under a second, verifies the top units with
activation patching, attributes the edges from the attention heads into the top neuron heads and from the neurons to
the logits, verifies those by path patching, and draws the circuit. Its claims are asserted in its cells.
"""

from __future__ import annotations

import textwrap

_RAW: list[tuple[str, str]] = [
    (
        "md",
        """
        # Screen, then verify: the neuron-level circuit by attribution

        Activation patching is exact but costs a forward per unit. Gradient attribution (in `lens_aot.patching`)
        estimates the same numbers from gradients — `attribute_heads`, `attribute_neurons`, `attribute_edges`, with
        `method="atp"` (attribution patching: one forward+backward and one forward) or `"ig"` (EAP-IG) — and returns
        **the same result objects** as `patch_heads`, `patch_neurons` and `path_patch`. `verify_attribution` then
        patches the top units exactly. Neuron heads are heads, so the screen reaches individual MLP neurons and the
        edges between heads and neurons.

        The model: lens_aot's one-layer transformer trained on `(a + b) mod 113` (inputs `[a, b, =]`).
        """,
    ),
    (
        "code",
        """
        import time

        import matplotlib.pyplot as plt
        import torch

        import lens_aot
        from lens_aot import patching as P
        from lens_aot.patching import attribute_edges, attribute_heads, verify_attribution
        from lens_aot.cli.demo_models import MODULAR_ADDITION_P as p, load_modular_addition

        aot = lens_aot.convert(load_modular_addition())
        g = torch.Generator().manual_seed(0)
        a, b, b_other = (torch.randint(0, p, (64,), generator=g) for _ in range(3))
        eq = torch.full_like(a, p)
        clean, corrupted = torch.stack([a, b, eq], 1), torch.stack([a, b_other, eq], 1)
        answer = (a + b) % p


        def metric(logits):
            # logit of the correct answer at '=', averaged over the batch (differentiable: a torch scalar)
            return logits[torch.arange(len(answer)), -1, answer].mean()


        print({sub.name: aot.head_module(sub.name).n_heads for sub in aot.sublayers()}, "heads per module")
        """,
    ),
    (
        "md",
        """
        ## Screen: every unit in one backward pass
        """,
    ),
    (
        "code",
        """
        start = time.perf_counter()
        screen = attribute_heads(aot, clean, corrupted, metric, method="atp")
        atp_s = time.perf_counter() - start
        start = time.perf_counter()
        screen_ig = attribute_heads(aot, clean, corrupted, metric, method="ig", steps=16)
        ig_s = time.perf_counter() - start
        print(f"atp: {len(screen)} units in {atp_s:.2f} s; ig (16 steps): {ig_s:.2f} s")
        print(screen.top(5))
        """,
    ),
    (
        "md",
        """
        ## Verify: exact activation patching of the top 20
        """,
    ),
    (
        "code",
        """
        check = verify_attribution(aot, screen, clean, corrupted, metric, k=20)
        print(check)
        display(check.table.head(8))
        assert check.pearson > 0.99
        check.figure
        """,
    ),
    (
        "md",
        """
        For reference, the whole patching sweep (one patched run per unit) against the screen, over all units:
        """,
    ),
    (
        "code",
        """
        start = time.perf_counter()
        truth = P.patch_heads(aot, clean, corrupted, metric)
        patch_s = time.perf_counter() - start


        def pearson(x, y):
            x, y = x - x.mean(), y - y.mean()
            return float((x * y).sum() / (x.norm() * y.norm()))


        r_atp, r_ig = pearson(screen.effect(), truth.effect()), pearson(screen_ig.effect(), truth.effect())
        top = {e.unit for e in truth.top(10)}
        overlap = len(top & {e.unit for e in screen.top(10)})
        print(f"patching all {len(truth)} units: {patch_s:.1f} s ({patch_s / atp_s:.0f}× the atp screen)")
        print(f"pearson r over all units: atp {r_atp:.4f}, ig {r_ig:.4f}; top-10 overlap (atp) {overlap}/10")
        assert r_atp > 0.99 and r_ig > 0.99 and overlap >= 9 and patch_s > atp_s
        """,
    ),
    (
        "md",
        """
        ## Edges: attention heads → neuron heads → logits

        `attribute_edges` takes `path_patch`'s arguments. Into a neuron head through `q` (its gate σ(q)) and `v` the
        receiver is recomputed exactly for each sender (AtP*); the neurons' direct paths to the logits are linear.
        """,
    ),
    (
        "code",
        """
        heads = P.head_units(aot, modules=["blocks.0.attn"])
        neurons = [e.unit for e in screen.top(40) if e.unit.kind != "attention"][:12]
        start = time.perf_counter()
        into = attribute_edges(aot, clean, corrupted, metric, heads, neurons, "qv")
        out = attribute_edges(aot, clean, corrupted, metric, neurons, "logits")
        edges_s = time.perf_counter() - start
        print(f"{into.values.numel() + out.values.numel()} edges in {edges_s:.2f} s")
        check_into = verify_attribution(aot, into, clean, corrupted, metric, k=10, plot=False)
        check_out = verify_attribution(aot, out, clean, corrupted, metric, k=10, plot=False)
        print(check_into, check_out, sep="\\n")
        assert check_into.pearson > 0.95 and check_out.pearson > 0.95
        """,
    ),
    (
        "md",
        """
        ## The circuit

        Nodes: the attention heads, the top neuron heads, the logits; edges: attributed path effects (blue supports
        the clean answer, red opposes it; width ∝ |effect|), the strongest 40 shown.
        """,
    ),
    (
        "code",
        """
        pos = {u.label: (0.0, 1 - i / max(1, len(heads) - 1)) for i, u in enumerate(heads)}
        pos |= {u.label: (1.0, 1 - i / max(1, len(neurons) - 1)) for i, u in enumerate(neurons)}
        pos["logits"] = (2.0, 0.5)
        drawn = [(s.label, r.label, float(into.effect()[i, j])) for i, s in enumerate(into.senders)
                 for j, r in enumerate(into.receivers)]
        drawn += [(s.label, "logits", float(out.effect()[i, 0])) for i, s in enumerate(out.senders)]
        drawn = sorted(drawn, key=lambda e: -abs(e[2]))[:40]
        biggest = max(abs(e[2]) for e in drawn)
        fig, ax = plt.subplots(figsize=(8, 6))
        for s, r, w in drawn:
            (x0, y0), (x1, y1) = pos[s], pos[r]
            ax.plot([x0, x1], [y0, y1], color="tab:blue" if w > 0 else "tab:red", lw=0.3 + 4 * abs(w) / biggest,
                    alpha=0.7)
        for label, (x, y) in pos.items():
            ax.scatter([x], [y], s=300, color="white", edgecolor="black", zorder=3)
            ax.annotate(label, (x, y), ha="center", va="center", fontsize=7, zorder=4)
        ax.set_axis_off()
        ax.set_title("attributed circuit: attention heads → neuron heads (qv) → logits")
        plt.show()
        assert len(drawn) == 40
        """,
    ),
]

CELLS: list[tuple[str, str]] = [(kind, textwrap.dedent(source).strip()) for kind, source in _RAW]
