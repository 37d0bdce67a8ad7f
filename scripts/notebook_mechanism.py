"""Cells of notebooks/mechanism.ipynb: the published modular-addition mechanism, recovered through neuron heads.

``CELLS`` is a list of ``("md" | "code", source)`` pairs (merged into scripts/make_notebooks.py). On the shipped
one-layer ReLU model trained on ``(a + b) mod 113`` (Nanda et al. 2023, "Progress measures for grokking via
mechanistic interpretability") the notebook finds the key Fourier frequencies of the embedding, shows that the neuron
heads' activations at ``=`` are periodic in ``a`` and ``b`` and cluster by frequency, and that each cluster's OV
circuit to the logits reads out ``cos(w(a + b − c))``, with the original model's neurons alongside. A few seconds on a
CPU.
"""

from __future__ import annotations

import textwrap

_RAW: list[tuple[str, str]] = [
    (
        "md",
        """
        # The modular-addition mechanism, read off neuron heads

        Nanda et al. (2023, *Progress measures for grokking via mechanistic interpretability*) reverse-engineered a
        one-layer transformer trained on `(a + b) mod p`, `p = 113`:

        1. the embedding represents `a` and `b` by `cos(wa)`, `sin(wa)` for a few **key frequencies** `w`
           (here `w` stands for `2πk/p`);
        2. attention and the MLP multiply them: the MLP neurons at `=` compute functions of `cos(w(a + b))`,
           `sin(w(a + b))`, each neuron using **one** key frequency;
        3. the unembedding reads `cos(w(a + b − c))` for every answer `c`, which peaks at `c = (a + b) mod p`.

        lens_aot ships a model trained the same way. Here we convert it and recover steps 1–3 from the converted
        model's **neuron heads** with the ordinary tools (`hook_z`, OV circuits), next to the original model's
        neurons, which they reproduce.
        """,
    ),
    (
        "code",
        """
        import math

        import matplotlib.pyplot as plt
        import torch

        import lens_aot
        from lens_aot import circuits, viz
        from lens_aot.cli.demo_models import (
            MODULAR_ADDITION_P as P,
            load_modular_addition,
            load_modular_addition_checkpoint,
            modular_addition_dataset,
        )

        torch.set_num_threads(1)
        model = load_modular_addition()
        aot = lens_aot.convert(model)
        tokens, labels = modular_addition_dataset()  # every (a, b): row a·P + b is [a, b, =]
        a, b = tokens[:, 0], tokens[:, 1]
        with torch.no_grad():
            source_logits, source_cache = model.run_with_cache(tokens, names_filter="blocks.0.mlp.hook_post")
            logits, cache = aot.run_with_cache(tokens, names_filter=lambda name: name.endswith("hook_z"))
        neuron_block = aot.neuron_block(0)
        n_heads = aot.cfg.n_heads_per_block[neuron_block]
        print(f"{type(model).__name__} → {aot.cfg.n_heads_per_block} heads per block ({n_heads} neuron heads)")
        for name, out in (("source", source_logits), ("converted", logits)):
            print(f"{name:9s} accuracy {(out[:, -1].argmax(-1) == labels).float().mean():.2%}")
        print(f"max |Δlogit| = {(logits - source_logits).abs().max():.1e}")
        """,
    ),
    (
        "md",
        """
        ## 1. Key frequencies of the embedding

        The share of `‖W_E[:p]‖²` in each frequency of the Fourier basis over `Z_p` (`viz.frequency_norms`). A few
        frequencies hold almost everything; those are the key frequencies. (The converted model's `W_E` is the
        source's.)
        """,
    ),
    (
        "code",
        """
        embed_shares = viz.frequency_norms(aot.W_E[:P])
        key_freqs = [int(k) for k in embed_shares.argsort(descending=True) if embed_shares[k] > 0.1]
        print("key frequencies:", key_freqs, "| their share of the embedding:", f"{embed_shares[key_freqs].sum():.2f}")
        fig, ax = plt.subplots(figsize=(9, 3))
        ax.bar(range(len(embed_shares)), embed_shares)
        ax.set(xlabel="frequency k", ylabel="share of ‖W_E‖²", title="embedding in the Fourier basis")
        plt.show()
        """,
    ),
    (
        "md",
        """
        ## 2. Neuron heads are periodic in `a` and `b`, one frequency each

        Each neuron head's activation (`hook_z` at `=`) over the `(a, b)` grid, for the most single-frequency head of
        each key frequency, above the same neuron's `mlp.hook_post` in the **original** model: the same picture.
        `viz.frequency_shares_2d` measures, per head, the share of its variance in the terms of each frequency
        (`{1, cos wa, sin wa} ⊗ {1, cos wb, sin wb}`); its best frequency clusters the heads.
        """,
    ),
    (
        "code",
        """
        z = cache[f"blocks.{neuron_block}.attn.hook_z"][:, -1, :, 0]  # [p², head]
        post = source_cache["blocks.0.mlp.hook_post"][:, -1]  # [p², neuron]: the original model
        print(f"max |neuron heads' activation − source neurons' hook_post| = "
              f"{(aot.neuron_activations(cache, 0)[:, -1] - post).abs().max():.1e}")
        shares = viz.frequency_shares_2d(z.reshape(P, P, -1))  # [head, frequency]
        best_share, best_freq = shares.max(dim=1)
        single = best_share > 0.5
        source_best = viz.frequency_shares_2d(post.reshape(P, P, -1)).argmax(dim=1)

        fig, axes = plt.subplots(2, len(key_freqs), figsize=(3.3 * len(key_freqs), 6.4))
        for col, w in enumerate(key_freqs):
            h = int(torch.where(best_freq == w, best_share, torch.zeros_like(best_share)).argmax())
            ref = circuits.as_head_ref(aot, (neuron_block, h))
            origin = aot.head_origin(*ref)
            axes[0, col].imshow(z[:, h].reshape(P, P).detach(), cmap="RdBu_r")
            axes[0, col].set(title=f"head {circuits.head_label(aot, ref)}: hook_z at '='\\nfrequency {w}, "
                                   f"share {best_share[h]:.2f}", xlabel="b", ylabel="a")
            axes[1, col].imshow(post[:, origin.index].reshape(P, P).detach(), cmap="RdBu_r")
            axes[1, col].set(title=f"source neuron {origin.index}: mlp.hook_post", xlabel="b", ylabel="a")
        plt.tight_layout()
        plt.show()
        """,
    ),
    (
        "code",
        """
        counts = {w: int(((best_freq == w) & single).sum()) for w in key_freqs}
        print(f"{float(single.float().mean()):.0%} of neuron heads have > half their variance in one frequency; "
              f"per key frequency: {counts}; all in a key frequency: "
              f"{all(int(f) in key_freqs for f in best_freq[single])}")
        print(f"same cluster as the source neuron: {float((best_freq == source_best).float().mean()):.1%} of heads")
        order = torch.argsort(best_freq.double() + (~single).double() * 100)
        fig, ax = plt.subplots(figsize=(10, 3.2))
        im = ax.imshow(shares[order][:, 1:].T.detach(), aspect="auto", cmap="magma", interpolation="nearest")
        ax.set(xlabel="neuron heads, sorted by frequency (mixed last)", ylabel="frequency k",
               yticks=[k - 1 for k in key_freqs], yticklabels=key_freqs, title="share of each head's variance")
        fig.colorbar(im)
        plt.show()
        """,
    ),
    (
        "md",
        """
        ## 3. The OV circuit to the logits reads out `cos(w(a + b − c))`

        `circuits.ov_circuit(aot, head, unembed=True)` is the head's OV circuit followed by the unembedding; its
        second factor `W_O @ W_U` is what one unit of `hook_z` adds to each logit `c` (for a neuron head,
        `W_out[n] @ W_U`: the neuron's "logit weights"). A head of frequency `w` puts them in frequency `w` over `c`.
        Summed over a cluster, `Σ_h z_h(a, b)·(W_O W_U)_h[c]` is the cluster's direct effect on the logits, and it is
        close to `cos(w(a + b − c))`: the mechanism's last step. The original model's `W_out @ W_U` and neurons give
        the same numbers.
        """,
    ),
    (
        "code",
        """
        logit_weights = torch.stack(
            [circuits.ov_circuit(aot, (neuron_block, h), unembed=True).B[0] for h in range(n_heads)]
        )  # [head, c]
        state = load_modular_addition_checkpoint()["state_dict"]
        source_weights = state["blocks.0.mlp.W_out"] @ state["unembed.W_U"]  # [neuron, c], the original
        print(f"max |heads' W_O @ W_U − source W_out @ W_U| = {(logit_weights - source_weights).abs().max():.1e}")
        out_shares = viz.frequency_norms(logit_weights.T, per_column=True)  # [frequency, head]
        own = out_shares[best_freq, torch.arange(n_heads)]
        print(f"median share of a head's logit weights in its own frequency: {own[single].median():.2f}")

        c = torch.arange(P)
        fig, axes = plt.subplots(2, len(key_freqs), figsize=(3.3 * len(key_freqs), 6.4))
        for col, w in enumerate(key_freqs):
            cluster = (best_freq == w) & single
            target = torch.cos(2 * math.pi * w * (a[:, None] + b[:, None] - c) / P)  # [p², c]
            fits = {}
            for name, act, weights in (("heads", z, logit_weights), ("source", post, source_weights)):
                direct = (act[:, cluster] @ weights[cluster]).detach()  # the cluster's direct logit effect
                direct = direct - direct.mean()
                coef = (direct * target).sum() / (target * target).sum()
                fits[name] = (coef, 1 - ((direct - coef * target) ** 2).sum() / (direct**2).sum(), direct)
            coef, r2, direct = fits["heads"]
            print(f"frequency {w:2d} ({int(cluster.sum())} heads): direct logits ≈ {coef:.1f}·cos(w(a+b−c)), "
                  f"R² = {r2:.3f} (source neurons: R² = {fits['source'][1]:.3f})")
            axes[0, col].imshow(direct.reshape(P, P, P)[0], cmap="RdBu_r")  # a = 0: over (b, c)
            axes[0, col].set(title=f"cluster {w}: direct logits, a = 0", xlabel="c", ylabel="b")
            axes[1, col].imshow(target.reshape(P, P, P)[0], cmap="RdBu_r")
            axes[1, col].set(title=f"cos(2π·{w}(a + b − c)/p), a = 0", xlabel="c", ylabel="b")
        plt.tight_layout()
        plt.show()
        """,
    ),
    (
        "md",
        """
        Every step of the published algorithm is visible through the neuron heads, with TransformerLens-style hooks
        and circuits, and each number agrees with the original model's neurons. The attention heads that feed these
        neurons, and how they split the frequencies between them, are in `notebooks/circuits.ipynb` (composition
        scores).
        """,
    ),
]

CELLS: list[tuple[str, str]] = [(kind, textwrap.dedent(source).strip()) for kind, source in _RAW]
