"""Cells of notebooks/circuits.ipynb: QK/OV circuits of neuron heads and composition scores (lens_aot.circuits).

``CELLS`` is a list of ``("md" | "code", source)`` pairs (merged into scripts/make_notebooks.py). The notebook reads
the circuits of one neuron head of the trained modular-addition model (what its QK circuit means when all its real
keys are 0, its rank-one OV circuit and its logit weights), measures Q/K/V-composition from the attention heads into
the neuron heads, and finds a planted neuron-to-neuron and head-to-neuron composition in a random two-layer model,
checking the source heads' scores against TransformerLens's own ``all_composition_scores``. A few seconds on a CPU.
"""

from __future__ import annotations

import textwrap

_RAW: list[tuple[str, str]] = [
    (
        "md",
        """
        # Circuits of neuron heads

        After `lens_aot.convert`, every MLP neuron is an attention head (Huben & Morris 2023, Theorem 3), so the
        circuit tools of Elhage et al. (2021, *A Mathematical Framework for Transformer Circuits*) apply to neurons
        too. `lens_aot.circuits` gives every head's **QK** and **OV** circuits as TransformerLens `FactoredMatrix`
        objects and **composition scores** between any two heads in different blocks, neuron heads included.

        One thing is new. A neuron head's keys are 0 at every real position and −1 at a persistent **bias slot**;
        its softmax over {itself, slot} puts `σ(q)` on itself, with `q = b·z + d` and `z` the neuron's
        pre-activation. So `W_Q W_Kᵀ` is the zero matrix, yet the head is anything but inert: its QK circuit is
        taken over the keys it really has, the residual **plus the bias slot** (`[d_model, d_model + 1]`), whose
        last column is `−W_Q`: the direction the neuron reads.
        """,
    ),
    (
        "code",
        """
        import matplotlib.pyplot as plt
        import torch

        import lens_aot
        from lens_aot import circuits, viz
        from lens_aot.cli.demo_models import (
            MODULAR_ADDITION_P as P,
            load_modular_addition,
            load_modular_addition_checkpoint,
            model_from_tl_state_dict,
            modular_addition_dataset,
        )

        torch.set_num_threads(1)
        model = load_modular_addition()  # one layer, ReLU, trained on (a + b) mod 113 (Nanda et al. 2023)
        aot = lens_aot.convert(model)
        tokens, labels = modular_addition_dataset()
        _, cache = aot.run_with_cache(tokens, names_filter=lambda name: name.endswith("hook_z"))
        neuron_block, attn_block = aot.neuron_block(0), aot.attention_block(0)
        top = viz.top_neuron_heads(aot, cache, 3, "max_abs", pos=-1)  # largest |activation| at '='
        head = top[0].ref
        print("heads per block:", aot.cfg.n_heads_per_block)
        for stat in top:
            print(stat.label, stat.ref, stat.origin, f"max |hook_z| at '=': {stat.value:.1f}")
        """,
    ),
    (
        "md",
        """
        ## The QK circuit: self versus the bias slot

        `qk_circuit(aot, head)` is `W_Q W̃_Kᵀ` with `W̃_K = [W_K; k_slot]`. For a neuron head every residual column
        is exactly zero and the slot column is `−W_Q = −b·W_in[:, n]`. `self_vs_slot_direction` turns it into
        `score(self) − score(slot) = x·u + c` on the head's (normalized) input `x`: the gate logit, whose sigmoid is
        the head's attention to itself. We check both against the cache (every 7th of the 113² inputs). This model
        is ReLU, built with a sharp logistic (`b = 0.2785 / max_neuron_error ≈ 3·10⁵`), so the gate is a step.
        """,
    ),
    (
        "code",
        """
        qk = circuits.qk_circuit(aot, head)
        d = aot.cfg.d_model
        print(qk, f"| residual columns: max |entry| = {qk.AB[:, :d].abs().max():.1f}, "
              f"slot column norm = {qk.AB[:, d].norm():.1f}")
        plain = circuits.qk_circuit(aot, head, bias_slot=False)  # TransformerLens's W_Q W_K^T
        print("without the slot, max |W_Q W_K^T| =", plain.AB.abs().max().item())

        u, c = circuits.self_vs_slot_direction(aot, head)
        _, sample = aot.run_with_cache(tokens[::7])  # every 7th input: dense patterns of all 512 heads stay small
        x = circuits.circuit_input(aot, sample, neuron_block)[:, -1]  # what the head reads at '='
        gate_logit = x @ u + c
        q = sample[f"{head.name}.hook_q"][:, -1, head.head, 0]
        self_weight = sample[f"{head.name}.hook_pattern"][:, head.head, -1, -1]
        print(f"max |x·u + c − hook_q| / max |hook_q| = {(gate_logit - q).abs().max() / q.abs().max():.1e} (float32); "
              f"max |σ(x·u + c) − pattern[self]| = {(torch.sigmoid(gate_logit) - self_weight).abs().max():.1e}")

        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        axes[0].scatter(q, gate_logit, s=2)
        axes[0].set(xlabel="hook_q (cached)", ylabel="x·u + c (from the circuit)", title=f"{top[0].label}: gate logit")
        axes[1].scatter(gate_logit, self_weight, s=2)
        axes[1].set(xlabel="x·u + c", ylabel="attention to itself", title="σ of it: a sharp ReLU gate")
        plt.tight_layout()
        plt.show()
        """,
    ),
    (
        "md",
        """
        ## The OV circuit: rank one, straight to the logits

        A neuron head's OV circuit is `α·W_in[:, n] ⊗ W_out[n]`: rank one. With `unembed=True` its second factor is
        `W_out[n] @ W_U`, what one unit of the head's activation (`hook_z`) adds to each logit. For this model it is
        a sinusoid over the answer `c`, at the neuron's frequency (Nanda et al. 2023).
        """,
    ),
    (
        "code",
        """
        ov = circuits.ov_circuit(aot, head)
        print(ov, "singular values:", ov.S)
        logit_weights = circuits.ov_circuit(aot, head, unembed=True).B[0]
        grid = cache[f"{head.name}.hook_z"][:, -1, head.head, 0].reshape(P, P)
        freq = int(viz.frequency_shares_2d(grid[..., None])[0].argmax())
        print(f"{top[0].label}: activation frequency {freq}; share of its logit weights in that frequency: "
              f"{viz.frequency_norms(logit_weights[:, None])[freq]:.2f}")
        fig, ax = plt.subplots(figsize=(7, 3))
        ax.plot(logit_weights.detach(), label="W_out[n] @ W_U")
        ax.set(xlabel="answer c", ylabel="logit per unit of hook_z", title=f"{top[0].label}: OV circuit to the logits")
        plt.show()
        """,
    ),
    (
        "md",
        """
        ## Composition: which attention heads feed which neurons

        Q-, K- and V-composition (Elhage et al. 2021) of sender A into receiver B:
        `‖W_OV^A · M_B‖_F / (‖W_OV^A‖_F ‖M_B‖_F)` with `M_B` B's QK circuit (Q), its transpose (K) or its OV circuit
        (V). For neuron heads two things follow from the construction, and show up exactly:

        * **K-composition into a neuron head is 0**: its keys read nothing from the residual.
        * **Q- and V-composition into a neuron head are equal**: query and value both read `W_in[:, n]`.

        `composition_scores(aot, sender_block, receiver_block, mode)` returns a labelled `[senders, receivers]`
        table, computed from low-rank factors (one rank-one factor per neuron), so it scales to thousands of heads.
        Here the 4 attention heads against the 512 neuron heads, neurons sorted by their frequency.
        """,
    ),
    (
        "code",
        """
        scores = {mode: circuits.composition_scores(aot, attn_block, neuron_block, mode) for mode in "QKV"}
        print(scores["Q"], "| K max:", scores["K"].scores.max().item(),
              "| max |Q − V|:", (scores["Q"].scores - scores["V"].scores).abs().max().item())

        z_grid = cache[f"blocks.{neuron_block}.attn.hook_z"][:, -1, :, 0].reshape(P, P, -1)
        best_share, best_freq = viz.frequency_shares_2d(z_grid).max(dim=1)
        order = torch.argsort(best_freq + 100 * (best_share < 0.5))  # by frequency, mixed neurons last
        key_freqs = [int(f) for f in torch.bincount(best_freq[best_share > 0.5]).argsort(descending=True)[:3]]
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.2), gridspec_kw={"width_ratios": [3, 1]})
        im = axes[0].imshow(scores["Q"].scores[:, order], aspect="auto", cmap="viridis", interpolation="nearest")
        axes[0].set(yticks=range(4), yticklabels=scores["Q"].sender_labels, xlabel="neuron heads, sorted by frequency",
                    title="Q-composition (= V) of attention heads into neuron heads")
        fig.colorbar(im, ax=axes[0])
        for h, label in enumerate(scores["Q"].sender_labels):
            means = [float(scores["Q"].scores[h, (best_freq == f) & (best_share > 0.5)].mean()) for f in key_freqs]
            axes[1].plot([str(f) for f in key_freqs], means, marker="o", label=label)
        axes[1].set(xlabel="neuron frequency", ylabel="mean score", title="per cluster")
        axes[1].legend(fontsize=7)
        plt.tight_layout()
        plt.show()
        """,
    ),
    (
        "md",
        """
        Each attention head composes most with one frequency cluster of neurons: the heads route particular
        Fourier components of `a` and `b` to the `=` position, where the neurons of that frequency read them.

        ## Finding a planted composition

        A random two-layer model (no LayerNorm, as a TransformerLens model) in which we plant two facts:
        neuron 7 of layer 1 reads exactly what neuron 3 of layer 0 writes (`W_in1[:, 7] = W_out0[3]`, score 1), and
        neuron 20 of layer 1 reads the top output direction of attention head 0.1 (score `S₀/‖S‖`, from the head's
        OV singular values). Then we look for them among all pairs.
        """,
    ),
    (
        "code",
        """
        config = dict(load_modular_addition_checkpoint()["config"])
        config.update(n_layers=2, d_model=32, n_heads=4, d_head=8, d_mlp=64, d_vocab=20, d_vocab_out=20, n_ctx=8)
        gen = torch.Generator().manual_seed(0)


        def rand(*shape, scale):
            return scale * torch.randn(*shape, generator=gen)


        sd = {"embed.W_E": rand(20, 32, scale=0.5), "pos_embed.W_pos": rand(8, 32, scale=0.3),
              "unembed.W_U": rand(32, 20, scale=32**-0.5), "unembed.b_U": rand(20, scale=0.1)}
        for layer in range(2):
            attn, mlp = f"blocks.{layer}.attn.", f"blocks.{layer}.mlp."
            for name in "QKV":
                sd[attn + "W_" + name], sd[attn + "b_" + name] = rand(4, 32, 8, scale=32**-0.5), rand(4, 8, scale=0.1)
            sd[attn + "W_O"], sd[attn + "b_O"] = rand(4, 8, 32, scale=32**-0.5), rand(32, scale=0.1)
            sd[mlp + "W_in"], sd[mlp + "b_in"] = rand(32, 64, scale=32**-0.5), rand(64, scale=0.1)
            sd[mlp + "W_out"], sd[mlp + "b_out"] = rand(64, 32, scale=64**-0.5), rand(32, scale=0.1)
        sd["blocks.1.mlp.W_in"][:, 7] = sd["blocks.0.mlp.W_out"][3]  # plant 1: neuron → neuron
        head_ov = (sd["blocks.1.attn.W_V"][0] @ sd["blocks.1.attn.W_O"][0])
        U, S, Vh = torch.linalg.svd(head_ov)
        sd["blocks.1.mlp.W_in"][:, 20] = Vh[0]  # plant 2: neuron 20 reads head 1.0's top output direction
        random_model = model_from_tl_state_dict(config, sd)
        random_aot = lens_aot.convert(random_model)
        print(type(random_model).__name__, "→ blocks with", random_aot.cfg.n_heads_per_block, "heads")

        n0, n1 = random_aot.neuron_block(0), random_aot.neuron_block(1)
        neuron_to_neuron = circuits.composition_scores(random_aot, n0, n1, "Q")
        label = circuits.head_label
        top_pairs = [(label(random_aot, s), label(random_aot, r), round(v, 3)) for s, r, v in neuron_to_neuron.top(3)]
        print("top neuron→neuron pairs:", top_pairs)
        head_to_neuron = circuits.composition_scores(random_aot, random_aot.attention_block(1), n1, "V")
        print(f"L1H0 → L1N20: {head_to_neuron.scores[0, 20]:.4f}, expected S₀/‖S‖ = {S[0] / S.norm():.4f}")
        """,
    ),
    (
        "md",
        """
        On the source's own heads these are TransformerLens's scores: `all_composition_scores` (HookedTransformer on
        TransformerLens 3, TransformerBridge on 4) agrees with `composition_scores` between the two attention blocks.
        Finally, the largest score of each mode for every pair of blocks, and where the planted pair sits among all
        neuron-to-neuron scores.
        """,
    ),
    (
        "code",
        """
        for mode in "QKV":
            reference = random_model.all_composition_scores(mode)
            reference = getattr(reference, "scores", reference)[0, :, 1, :]  # bridges return a CompositionScores
            a0, a1 = random_aot.attention_block(0), random_aot.attention_block(1)
            ours = circuits.composition_scores(random_aot, a0, a1, mode)
            print(f"{mode}: max |ours − TransformerLens| = {(ours.scores - reference).abs().max():.1e}")

        n_blocks = len(random_aot.blocks)
        origins = [random_aot.head_origin(b, 0) for b in range(n_blocks)]
        labels = [f"{b}: {'heads' if o.kind == 'attention' else 'neurons'} L{o.layer}" for b, o in enumerate(origins)]
        fig, axes = plt.subplots(1, 4, figsize=(14, 3.2))
        for ax, mode in zip(axes, "QKV", strict=False):
            table = torch.full((n_blocks, n_blocks), float("nan"))
            for s in range(n_blocks):
                for r in range(s + 1, n_blocks):
                    table[s, r] = circuits.composition_scores(random_aot, s, r, mode).scores.max()
            ax.imshow(table, vmin=0, vmax=1, cmap="viridis")
            for s, r in zip(*torch.where(~table.isnan()), strict=True):
                ax.text(int(r), int(s), f"{table[s, r]:.2f}", ha="center", va="center", color="white", fontsize=8)
            ax.set(title=f"max {mode}-composition", xticks=range(n_blocks), yticks=range(n_blocks),
                   xlabel="receiver block", ylabel="sender block")
            ax.set_yticklabels(labels, fontsize=7)
        axes[3].hist(neuron_to_neuron.scores.flatten(), bins=60, log=True)
        axes[3].axvline(float(neuron_to_neuron.scores[3, 7]), color="red", ls="--", label="planted L0N3 → L1N7")
        axes[3].set(xlabel="Q-composition, neuron heads L0 → L1", title="all 64 × 64 pairs")
        axes[3].legend(fontsize=7)
        plt.tight_layout()
        plt.show()
        """,
    ),
]

CELLS: list[tuple[str, str]] = [(kind, textwrap.dedent(source).strip()) for kind, source in _RAW]
