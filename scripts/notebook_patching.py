"""Cells of notebooks/patching.ipynb: activation and path patching on neuron heads (merged into make_notebooks.py).

``CELLS`` is a list of ``("md" | "code", source)`` pairs. On the shipped one-layer ReLU modular-addition model the
notebook patches every head of the converted model (4 attention heads and 512 neuron heads) with
:mod:`lens_aot.patching`, does the same on the original model with TransformerLens's own ``transformer_lens.patching``
(and lens_aot's TransformerLens-shaped neuron functions), and plots both side by side; patches whole frequency
clusters of neurons at once; repeats the comparison on a GELU variant (4 heads per neuron); then path-patches from the
attention heads into the neurons (through their gates ``q`` and their values ``v``) and straight to the logits. About
30 s on a CPU.
"""

from __future__ import annotations

import textwrap

_RAW: list[tuple[str, str]] = [
    (
        "md",
        """
        # Activation and path patching on neuron heads

        After `lens_aot.convert`, every MLP neuron is an attention head, so the tools of head-level analysis apply
        to neurons unchanged. The converted model is numbered like its source, so TransformerLens's own
        `transformer_lens.patching` runs on it unmodified and covers every unit the source has (its attention heads,
        `resid_pre`, `attn_out`, `mlp_out`). The neuron heads (`blocks.{l}.mlp.heads`, `d_mlp × K` heads per layer)
        are units it cannot enumerate; `lens_aot.patching` covers them, with TransformerLens's call shape
        (`get_act_patch_neuron_head_out_all_pos`, `get_act_patch_mlp_neuron_all_pos`, …) and with batched, labelled
        functions:

        * `patch_heads` / `patch_neurons` / `patch_units`: activation patching of head outputs (`hook_z`), one head,
          one neuron (all its heads) or any group of heads at a time, optionally one position at a time; the patched
          runs are stacked along the batch dimension, so hundreds of patches share a forward pass;
        * `path_patch`: path patching (Wang et al. 2022, the IOI paper) from sender heads to receiver heads' `q`,
          `k` or `v`, or straight to the logits, with every other head frozen.

        Results carry labels (`L0H3` is head 3 of layer 0's attention, `L0N17` neuron 17 of layer 0's MLP,
        `L0N17.2` the neuron head computing term 2 of its activation fit) and views per head module, per neuron, top-k,
        plain records and DataFrames.

        We use the model shipped with lens_aot: one layer (4 attention heads, 512 ReLU neurons) trained on
        `(a + b) mod 113` (Nanda et al. 2023); inputs are `[a, b, =]` and the answer is read at `=`.
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
        from lens_aot.cli.demo_models import (
            MODULAR_ADDITION_P as p,
            load_modular_addition,
            load_modular_addition_checkpoint,
            model_from_tl_state_dict,
            modular_addition_dataset,
        )

        torch.set_grad_enabled(False)
        torch.set_num_threads(1)  # small matrices: threads would cost more than they save

        model = load_modular_addition()  # HookedTransformer on TransformerLens 3.x, TransformerBridge on 4.x
        aot = lens_aot.convert(model)
        print(type(model).__name__, "→", aot.cfg.n_layers, "layer; head modules:")
        for sub in aot.sublayers():
            print(f"  {sub.name}: {aot.head_module(sub.name).n_heads} {sub.kind} heads")
        """,
    ),
    (
        "md",
        """
        ## A clean and a corrupted input, and a metric

        Clean inputs are random pairs `(a, b)`; each corrupted input changes `a` to another `a'` and keeps `b`, so
        the model's answer moves from `c = a + b` to `c' = a' + b (mod 113)`. The metric is the logit difference
        `logit(c) − logit(c')` at `=`, averaged over the batch: large and positive on clean inputs, as negative on
        corrupted ones.
        """,
    ),
    (
        "code",
        """
        gen = torch.Generator().manual_seed(0)
        N = 64
        a, b = torch.randint(0, p, (N,), generator=gen), torch.randint(0, p, (N,), generator=gen)
        a_corrupted = (a + torch.randint(1, p, (N,), generator=gen)) % p
        equals = torch.full((N,), p)
        clean = torch.stack([a, b, equals], dim=1)
        corrupted = torch.stack([a_corrupted, b, equals], dim=1)
        answer, corrupted_answer = (a + b) % p, (a_corrupted + b) % p


        def logit_diff(logits):
            last = logits[:, -1]
            return (last.gather(1, answer[:, None]) - last.gather(1, corrupted_answer[:, None])).mean()

        print(f"logit difference: clean {logit_diff(aot(clean)):.2f}, corrupted {logit_diff(aot(corrupted)):.2f}")
        """,
    ),
    (
        "md",
        """
        ## Activation patching every head

        `patch_heads` patches each head of each head module in turn (`direction="denoise"`, TransformerLens's
        convention: run the corrupted input and put one head's clean output back) and records the metric. Here that is
        4 + 512 patches. `normalized()` rescales to the fraction of the clean logit difference restored.
        """,
    ),
    (
        "code",
        """
        start = time.perf_counter()
        heads = P.patch_heads(aot, clean, corrupted, logit_diff)
        print(f"{len(heads)} patches in {time.perf_counter() - start:.1f} s")
        print(heads)
        for entry in heads.top(6):
            print(entry)
        """,
    ),
    (
        "md",
        """
        ## The same on the original model

        In the original model an attention head is patched with TransformerLens's own
        `get_act_patch_attn_head_out_all_pos` (`blocks.0.attn.hook_z[:, :, h]`) and a neuron with
        `P.get_act_patch_mlp_neuron_all_pos` (`blocks.0.mlp.hook_post[..., n]`, through TransformerLens's
        `generic_activation_patch`): one forward per patch. The neuron heads of this ReLU model are one per neuron,
        so `heads.by_neuron(0)` lays their results out as the source's 512 neurons. The same TransformerLens call on
        the converted model gives the same attention-head numbers.
        """,
    ),
    (
        "code",
        """
        import transformer_lens.patching as tlp

        _, clean_cache = model.run_with_cache(clean)
        _, aot_clean_cache = aot.run_with_cache(clean)

        start = time.perf_counter()
        source_neurons = P.get_act_patch_mlp_neuron_all_pos(model, corrupted, clean_cache, logit_diff)[0].double()
        source_heads = tlp.get_act_patch_attn_head_out_all_pos(model, corrupted, clean_cache, logit_diff)[0].double()
        print(f"516 source patches, one forward each: {time.perf_counter() - start:.1f} s")
        tl_on_aot = tlp.get_act_patch_attn_head_out_all_pos(aot, corrupted, aot_clean_cache, logit_diff)[0].double()
        neuron_heads, attention_heads = heads.by_neuron(0), heads.attention(0)
        print(f"max |Δmetric|, neuron heads vs neurons: {(neuron_heads - source_neurons).abs().max():.1e}")
        print(f"max |Δmetric|, attention heads:          {(attention_heads - source_heads).abs().max():.1e}")
        print(f"max |Δmetric|, TransformerLens on both:  {(tl_on_aot - source_heads).abs().max():.1e}")
        print(f"(the metric spans {heads.corrupted_metric:.1f} … {heads.clean_metric:.1f}; the ReLU fit errs by "
              f"≤ {aot.cfg.activation_fits[0].max_error:g} per neuron)")

        scale = heads.clean_metric - heads.corrupted_metric
        fig, axes = plt.subplots(1, 4, figsize=(17, 3.6), layout="constrained", width_ratios=[1.4, 1.4, 1, 0.9])
        vmax = float(heads.by_neuron(0, "normalized").max())
        for ax, values, title in (
            (axes[0], neuron_heads, "lens_aot: 512 neuron heads (hook_z)"),
            (axes[1], source_neurons.double(), "original: 512 neurons (mlp.hook_post)"),
        ):
            restored = ((values - heads.corrupted_metric) / scale).reshape(16, 32)
            im = ax.imshow(restored, cmap="Blues", vmin=0, vmax=vmax)
            ax.set(title=title, xlabel="neuron mod 32", ylabel="neuron // 32")
        fig.colorbar(im, ax=axes[1], label="fraction restored")
        axes[2].scatter(source_neurons, neuron_heads, s=4)
        axes[2].plot(*[[source_neurons.min(), source_neurons.max()]] * 2, color="grey", lw=0.8)
        axes[2].set(xlabel="original model", ylabel="converted model", title="metric after patching one neuron")
        x = torch.arange(4)
        axes[3].bar(x - 0.2, (source_heads - heads.corrupted_metric) / scale, width=0.4, label="original")
        axes[3].bar(x + 0.2, (attention_heads - heads.corrupted_metric) / scale, width=0.4, label="lens_aot")
        axes[3].set(xticks=x, xticklabels=[f"L0H{h}" for h in range(4)], ylim=(0, 0.4), title="attention heads")
        axes[3].legend(fontsize=8, ncols=2)
        plt.show()
        """,
    ),
    (
        "md",
        """
        Each neuron on its own restores at most a few percent, while each attention head restores about a quarter:
        the computation is spread over many neurons. Nanda et al. found that the neurons cluster by the key
        frequency of `a + b` they read. Below, each neuron's frequency comes from the 2-D Fourier transform of its
        neuron head's `hook_z` over all 113² inputs, and `P.group` patches **each cluster as one unit** (and the
        whole MLP as another) in a single call.
        """,
    ),
    (
        "code",
        """
        tokens_all, _ = modular_addition_dataset()
        z_name = "blocks.0.mlp.heads.hook_z"  # [batch, pos, neuron head, 1]; one head per ReLU neuron
        _, cache = aot.run_with_cache(tokens_all, names_filter=z_name)
        acts = cache[z_name][:, -1, :, 0].reshape(p, p, -1)  # [a, b, neuron]
        power = torch.fft.fft2(acts - acts.mean((0, 1)), dim=(0, 1)).abs().square()
        k = torch.arange(1, p // 2 + 1)
        per_freq = power[k, 0] + power[0, k] + power[k, k] + power[k, -k]  # [frequency, neuron]
        frequency = k[per_freq.argmax(0)]
        clusters = {int(f): (frequency == f).nonzero().flatten().tolist() for f in frequency.unique()}
        clusters = {f: ns for f, ns in clusters.items() if len(ns) >= 8}
        units = [
            P.group(aot, [P.NeuronRef(0, n) for n in ns], f"k={f} ({len(ns)} neurons)") for f, ns in clusters.items()
        ]
        units.append(P.group(aot, P.neuron_units(aot, layers=[0]), "all 512 neurons"))
        groups = P.patch_units(aot, clean, corrupted, logit_diff, units)
        restored = groups.normalized()

        fig, axes = plt.subplots(1, 2, figsize=(12, 3.6))
        per_neuron = heads.by_neuron(0, "normalized")
        for f, ns in clusters.items():
            axes[0].scatter(torch.full((len(ns),), f), per_neuron[ns], s=6)
        axes[0].set(xlabel="key frequency k of the neuron", ylabel="fraction restored", title="one neuron at a time")
        axes[1].barh([u.label for u in units], restored)
        axes[1].set(xlabel="fraction of logit diff restored", title="each frequency cluster patched as one unit")
        plt.tight_layout()
        plt.show()
        """,
    ),
    (
        "md",
        """
        ## One position at a time

        `per_position=True` patches each unit at each position separately. In a one-layer model only what is
        written at `=` reaches the answer, which the patching shows:
        """,
    ),
    (
        "code",
        """
        rows = [*P.head_units(aot, modules=["blocks.0.attn"]), units[-1]]  # the 4 attention heads and the whole MLP
        by_position = P.patch_units(aot, clean, corrupted, logit_diff, rows, per_position=True)
        fig, ax = plt.subplots(figsize=(4.5, 3))
        im = ax.imshow(by_position.normalized(), cmap="RdBu", vmin=-1, vmax=1)
        ax.set(xticks=range(3), xticklabels=["a", "b", "="], yticks=range(len(by_position)),
               yticklabels=[u.label for u in by_position.units], title="fraction restored")
        fig.colorbar(im)
        plt.show()
        """,
    ),
    (
        "md",
        """
        ## GELU: a neuron is several heads

        A GELU neuron is a sum of `K` shifted-logistic heads (`K = 4` by default, each neuron within `1e-4` of GELU).
        Patching a neuron means patching its `K` heads together, which is what `patch_neurons` does; one of its
        heads alone is not the neuron. To have a GELU model with a known mechanism we load the same weights with
        GELU instead of ReLU (it still computes modular addition: the neurons' pre-activations are mostly far from
        0, where the two agree). The converted model matches the original within the fit's error:
        """,
    ),
    (
        "code",
        """
        checkpoint = load_modular_addition_checkpoint()
        gelu_model = model_from_tl_state_dict(dict(checkpoint["config"], act_fn="gelu"), checkpoint["state_dict"])
        gelu_aot = lens_aot.convert(gelu_model)
        fit = gelu_aot.cfg.activation_fits[0]
        print(f"{fit.n_terms} heads per neuron, fit error ≤ {fit.max_error:.1e}, accuracy on the clean batch "
              f"{(gelu_aot(clean)[:, -1].argmax(-1) == answer).float().mean():.0%}")

        gelu_neurons = P.patch_neurons(gelu_aot, clean, corrupted, logit_diff)  # 512 patches of 4 heads each
        _, gelu_cache = gelu_model.run_with_cache(clean)


        def patch_gelu_source(n):
            def hook(act, hook):
                act = act.clone()
                act[..., n] = gelu_cache["blocks.0.mlp.hook_post"][..., n]
                return act

            out = gelu_model.run_with_hooks(corrupted, fwd_hooks=[("blocks.0.mlp.hook_post", hook)])
            return float(logit_diff(getattr(out, "logits", out)))


        gelu_source = torch.tensor([patch_gelu_source(n) for n in range(512)], dtype=torch.float64)
        gap = (gelu_neurons.by_neuron(0) - gelu_source).abs()
        print(f"max |Δmetric| over 512 neurons: {gap.max():.1e} = {gap.max() / fit.max_error:.1f} × the fit's error")
        first_terms = P.patch_heads(gelu_aot, clean, corrupted, logit_diff,
                                    heads=[gelu_aot.neuron_heads(0, n)[0] for n in range(512)])

        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
        axes[0].scatter(gelu_source, gelu_neurons.by_neuron(0), s=4)
        axes[0].set(xlabel="original: mlp.hook_post patched", ylabel="lens_aot: the neuron's 4 heads patched",
                    title=f"GELU neurons (max gap {gap.max():.0e})")
        axes[1].scatter(gelu_neurons.effect(), first_terms.effect(), s=4)
        axes[1].set(xlabel="effect of the whole neuron", ylabel="effect of its first head only",
                    title="one head of four is not the neuron")
        plt.tight_layout()
        plt.show()
        """,
    ),
    (
        "md",
        """
        ## Path patching through neurons

        In this model the residual stream goes embedding → attention heads (`blocks.0.attn`) → neuron heads
        (`blocks.0.mlp.heads`) → logits. Activation patching says the attention heads matter; path patching says
        **through what**. For each sender, `path_patch` switches the sender to its corrupted output while **freezing
        every other head at its clean output** (neuron heads included), records the receivers' inputs, then patches
        only those into a clean run (`direction="noise"`, as in the IOI paper). Receivers here: all 512 neurons as
        one group, through their inputs `q` and `v` together (the pre-activation), and the logits directly.
        """,
    ),
    (
        "code",
        """
        mlp = units[-1]  # the group of all 512 neuron heads
        senders = P.head_units(aot, modules=["blocks.0.attn"])
        paths = P.path_patch(aot, clean, corrupted, logit_diff, senders, [mlp, "logits"], receiver_input="qv")
        total = P.patch_heads(aot, clean, corrupted, logit_diff, modules=["blocks.0.attn"], direction="noise")
        print(paths)

        fig, ax = plt.subplots(figsize=(8.5, 3.4), layout="constrained")
        x = torch.arange(len(senders))
        for i, (values, label) in enumerate(
            ((total.effect(), "total (activation patching)"), (paths.effect()[:, 0], "via the neurons (q, v)"),
             (paths.effect()[:, 1], "direct to the logits"))
        ):
            ax.bar(x + 0.27 * (i - 1), values, width=0.27, label=label)
        ax.set(xticks=x, xticklabels=[u.label for u in senders], ylabel="effect (+ supports the answer)",
               title="corrupting one attention head (clean run): logit diff lost")
        ax.axhline(0, color="grey", lw=0.8)
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
        plt.show()
        """,
    ),
    (
        "md",
        """
        Each head's effect goes almost entirely through the neurons; its direct path to the logits is small.

        A neuron head has two inputs from the residual stream, both affine in the neuron's pre-activation `z`: its
        query `q = a·z` sets the gate `σ(q)` (for this ReLU model `a ≈ 2.8·10⁵`, so the gate is the on/off switch of
        the ReLU) and its value `v = z` is what passes through the gate. Path patching separates them: through `q`
        the corrupted head can only switch neurons on or off (each keeps its clean value), through `v` it can only
        change the values of neurons (each keeps its clean gate). Here for the 12 neurons with the largest effect:
        """,
    ),
    (
        "code",
        """
        top_neurons = [P.NeuronRef(0, e.unit.index) for e in heads.top(40) if e.unit.kind != "attention"][:12]
        fig, axes = plt.subplots(1, 3, figsize=(15, 2.9), sharey=True, layout="constrained")
        for ax, receiver_input in zip(axes, ("q", "v", "qv")):
            result = P.path_patch(aot, clean, corrupted, logit_diff, senders, top_neurons, receiver_input)
            print(f"through {receiver_input:2s}: Σ |effect| over 4 × 12 paths = {result.effect().abs().sum():.1f}")
            im = ax.imshow(result.effect(), cmap="RdBu", vmin=-2.5, vmax=2.5)
            ax.set(title=f"through {receiver_input}", xticks=range(12), yticks=range(4),
                   xticklabels=[f"N{n.neuron}" for n in top_neurons], yticklabels=[u.label for u in senders])
            ax.tick_params(axis="x", rotation=90)
        fig.colorbar(im, ax=axes, label="effect (+ supports the answer)")
        plt.show()
        """,
    ),
    (
        "md",
        """
        On these inputs the attention heads act on the neurons mostly through their values: most of the top neurons
        are on in both runs, so corrupting a head rarely flips their gates. The two paths need not add up to the
        path through `qv` (the neuron is nonlinear in `z`). Results are plain data as well:
        """,
    ),
    (
        "code",
        """
        print(result.top(3))
        print(result.to_records()[0])
        try:
            display(result.to_dataframe().sort_values("effect").head())  # needs pandas
        except ImportError:
            pass
        """,
    ),
]

CELLS: list[tuple[str, str]] = [(kind, textwrap.dedent(source).strip()) for kind, source in _RAW]
