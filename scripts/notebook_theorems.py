"""Cells of notebooks/theorems.ipynb: the paper's constructions measured (merged into scripts/make_notebooks.py).

``CELLS`` is a list of ``("md" | "code", source)`` pairs. The notebook reproduces the authors' checks (random
standard-normal matrices, n_ctx 20, d_model 30, d_mlp 120) for every construction in :mod:`lens_aot.constructions`,
in float64 and float32, sweeps Ω for Theorem 9, finds the smallest Ω that reaches a tolerance, shows why float32
needs the penalty form, and runs the whole-model standard-mask mode (:mod:`lens_aot.constructions.standard_mask`).
It runs in a few seconds on a CPU.
"""

from __future__ import annotations

import textwrap

_RAW: list[tuple[str, str]] = [
    (
        "md",
        """
        # The paper's theorems, measured

        Huben & Morris (2023) build MLPs out of attention heads: a neuron is one head that attends to itself and a
        **bias token** (Theorem 3), a linear map is a few heads that attend only to themselves (Theorem 7), an
        entrywise SiLU is one head per channel (Theorem 8), and any mask can be moved into `W_QK` with a large `Ω` and
        one-hot position channels (Theorem 9). `lens_aot.constructions` implements each over plain tensors, in the
        paper's full-matrix notation `head(X) = softmax(X W_QK Xᵀ + M) X W_OV`.

        We repeat the authors' checks (standard-normal matrices, `n_ctx = 20`, `d_model = 30`, `d_mlp = 120`; they
        ask for every entry within 1e-10) in float64 and float32, then look at how the error depends on `Ω`.
        """,
    ),
    (
        "code",
        """
        import dataclasses
        import math

        import matplotlib.pyplot as plt
        import torch
        import torch.nn.functional as F

        from lens_aot import constructions as C

        torch.set_num_threads(1)  # many tiny matrices: threads would cost more than they save
        N_CTX, D_MODEL, D_MLP = 20, 30, 120  # the authors' sizes
        gen = torch.Generator().manual_seed(0)


        def randn(*shape):
            return torch.randn(*shape, generator=gen, dtype=torch.float64)


        X = randn(N_CTX, D_MODEL)
        W_in, b_in, W_out, b_out = randn(D_MODEL, D_MLP), randn(D_MLP), randn(D_MLP, D_MODEL), randn(D_MODEL)
        W_QK, W_OV, W = randn(D_MODEL, D_MODEL), randn(D_MODEL, D_MODEL), randn(D_MODEL, D_MODEL)
        random_mask = C.mask_matrix("causal", N_CTX) & (randn(N_CTX, N_CTX) > 0) | torch.eye(N_CTX, dtype=torch.bool)


        def max_err(a, b):
            return float((a.double() - b.double()).abs().max())
        """,
    ),
    (
        "md",
        """
        ## With explicit masks: exact up to rounding

        Each construction against the direct computation (float64 inputs; the float32 column runs the same heads
        in float32). `run_heads(..., omega)` moves every head's mask into its weights (`C.pseudo_mask`, Theorem 9),
        so the heads use the plain causal mask; `omega=None` keeps the explicit masks.
        """,
    ),
    (
        "code",
        """
        def run_heads(heads, Y, omega, dtype):
            \"""Sum of the heads' outputs on Y in `dtype`; with `omega`, every mask moves into the weights.\"""
            if omega is not None:
                heads = [C.pseudo_mask(h, Y.shape[-2], omega) for h in heads]
                out = C.apply_heads(C.with_positions(Y).to(dtype), [h.to(dtype) for h in heads])
                return out[..., : Y.shape[-1]]
            return C.apply_heads(Y.to(dtype), [h.to(dtype) for h in heads])


        Y = C.with_bias_token(X)
        causal = C.additive_mask(C.mask_matrix("causal", N_CTX))
        mlp = F.silu(X @ W_in + b_in) @ W_out + b_out
        neuron = C.neuron_head_with_bias_token(W_in[:, 0], b_in[0], W_out[0])
        silu_heads = C.entrywise_activation_heads(D_MODEL + 2, range(D_MODEL))

        CONSTRUCTIONS = {  # name → error(Ω, dtype); Ω None: explicit masks
            "neuron (Thm 3)": lambda omega, dtype: max_err(
                C.without_bias_token(run_heads([neuron], Y, omega, dtype)),
                F.silu(X @ W_in[:, 0] + b_in[0])[:, None] * W_out[0],
            ),
            "MLP, 121 heads (Thm 3)": lambda omega, dtype: max_err(
                C.without_bias_token(run_heads(C.mlp_as_heads(W_in, b_in, W_out, b_out), Y, omega, dtype)), mlp
            ),
            "linear map, 4 heads of 8 (Thm 7)": lambda omega, dtype: max_err(
                run_heads(C.linear_map_heads(W, 8), X, omega, dtype), X @ W
            ),
            "entrywise SiLU (Thm 8)": lambda omega, dtype: max_err(
                C.without_bias_token(Y.to(dtype) + run_heads(silu_heads, Y, omega, dtype)), F.silu(X)
            ),
        }
        explicit = {
            dtype: [error(None, dtype) for error in CONSTRUCTIONS.values()] for dtype in (torch.float64, torch.float32)
        }
        print(f"{'construction, explicit masks':34s} {'float64':>9s} {'float32':>9s}")
        for i, name in enumerate(CONSTRUCTIONS):
            print(f"{name:34s} {explicit[torch.float64][i]:9.1e} {explicit[torch.float32][i]:9.1e}")
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for shift, (dtype, errs) in zip((-0.2, 0.2), explicit.items()):
            ax.bar([i + shift for i in range(len(errs))], errs, width=0.4, label=str(dtype))
        ax.set_xticks(range(len(CONSTRUCTIONS)), list(CONSTRUCTIONS), rotation=15, fontsize=8)
        ax.set(yscale="log", ylabel="max |error|", title="explicit masks: the error is the dtype's rounding")
        ax.axhline(1e-10, color="grey", ls="--", lw=1)
        ax.legend()
        plt.show()
        """,
    ),
    (
        "md",
        """
        ## Theorem 9: every mask in the weights

        Now every head runs under the plain causal mask only; its own mask lives in `W_QK` as `−Ω` between the
        one-hot positions of a query and a key it must not see. Two more constructions need `Ω` by nature: an
        original head tweaked so the bias token changes nothing (`C.head_ignoring_bias_token`), and the authors'
        three-sublayer MLP (linear in to hidden channels, entrywise SiLU, linear out, all pseudo-masked). A generic
        head with standard-normal `W_QK` and a random mask shows how the needed `Ω` grows with the spread of the
        head's own scores (here ±100).
        """,
    ),
    (
        "code",
        """
        OMEGAS = [1, 3, 10, 30, 100, 300, 1e3, 1e4, 1e5]


        def three_sublayer_error(omega, dtype):
            m = C.three_sublayer_mlp(W_in, b_in, W_out, b_out, N_CTX, omega, d_head=32)
            R = m.embed(X).to(dtype)
            for heads in m.sublayers:
                R = R + C.apply_heads(R, [h.to(dtype) for h in heads])
            return max_err(m.read(R), X + mlp)


        def ignoring_bias_error(omega, dtype):  # an original head under the causal mask, bias token added
            head = C.head_ignoring_bias_token(W_QK, W_OV, omega).to(dtype)
            return max_err(C.without_bias_token(head(Y.to(dtype))), C.attention_head(X, W_QK, W_OV, causal))


        def random_head_error(omega, dtype):  # standard-normal W_QK (scores ±100), a random mask
            head = C.Head(W_QK, W_OV, random_mask)
            return max_err(run_heads([head], X, omega, dtype), head(X))


        SWEPT = CONSTRUCTIONS | {
            "original head, bias token ignored": ignoring_bias_error,
            "three-sublayer MLP": three_sublayer_error,
            "random head, random mask": random_head_error,
        }
        errors = {
            dtype: {name: [error(omega, dtype) for omega in OMEGAS] for name, error in SWEPT.items()}
            for dtype in (torch.float64, torch.float32)
        }
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
        for ax, (dtype, table) in zip(axes, errors.items()):
            for name, errs in table.items():
                ax.loglog(OMEGAS, [max(e, 1e-18) for e in errs], marker="o", label=name)
            ax.set(title=f"{dtype}: heads under the causal mask only", xlabel="Ω", ylabel="max |error|")
        axes[0].axhline(1e-10, color="grey", ls="--", lw=1)
        axes[1].legend(fontsize=8)
        plt.show()
        """,
    ),
    (
        "md",
        """
        ### The smallest Ω that reaches a tolerance

        The tolerance is 1e-10 in float64 (the authors') and, in float32, twice the construction's own float32 floor
        (its error at `Ω = 1e5`, where nothing leaks): below that floor no `Ω` can help. Found by bisection on
        `log Ω`; the authors used `Ω = 1000`, our tests `Ω = 1000` too.
        """,
    ),
    (
        "code",
        """
        def smallest_omega(error, dtype, tol, lo=1.0, hi=1e5):
            \"""The smallest Ω (within 3%) at which the error is ≤ tol, by bisection on log Ω.\"""
            if error(hi, dtype) > tol:
                return math.inf
            while hi / lo > 1.03:
                mid = math.sqrt(lo * hi)
                lo, hi = (lo, mid) if error(mid, dtype) <= tol else (mid, hi)
            return hi


        print(f"{'construction':34s} {'Ω, fp64 ≤ 1e-10':>16s} {'fp32 floor':>11s} {'Ω, fp32 ≤ 2·floor':>18s}")
        for name, error in SWEPT.items():
            floor = error(1e5, torch.float32)
            omega64 = smallest_omega(error, torch.float64, 1e-10)
            omega32 = smallest_omega(error, torch.float32, 2 * floor)
            print(f"{name:34s} {omega64:16.0f} {floor:11.1e} {omega32:18.0f}")
        """,
    ),
    (
        "md",
        """
        ## Why float32 needs care: rounding of large scores

        The paper writes the pseudo-mask as `+Ω·Λ` (`+Ω` on allowed keys). Softmax does not care about a shift, so
        `−Ω` on *forbidden* keys is the same head, but the rounding differs: `s + Ω` keeps only `ulp(Ω)` of an
        allowed score `s`, and float32's `ulp(1000)` is 6e-5 (float64's is 1e-13). With the penalty form the allowed
        scores are computed exactly and only forbidden scores, whose weight is ≈ 0, are rounded. A head with O(1)
        scores and values, so the errors read as relative errors:
        """,
    ),
    (
        "code",
        """
        small = C.Head(W_QK / D_MODEL, W_OV / math.sqrt(D_MODEL), random_mask)
        reference = small(X)
        OMEGAS_FP = [10, 30, 100, 300, 1e3, 3e3, 1e4, 3e4, 1e5]


        def form_error(omega, dtype, reward):
            head = C.pseudo_mask(small, N_CTX, omega, reward_allowed=reward).to(dtype)
            return max_err(head(C.with_positions(X).to(dtype))[:, :D_MODEL], reference)


        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        for dtype, ls in ((torch.float64, "-"), (torch.float32, "--")):
            for reward, label in ((False, "−Ω on forbidden keys (lens_aot)"), (True, "+Ω on allowed keys (paper)")):
                errs = [max(form_error(o, dtype, reward), 1e-18) for o in OMEGAS_FP]
                ax.loglog(OMEGAS_FP, errs, ls=ls, marker="o", label=f"{label}, {str(dtype)[6:]}")
        eps32 = torch.finfo(torch.float32).eps
        ax.loglog(OMEGAS_FP, [o * eps32 / 8 for o in OMEGAS_FP], color="grey", lw=1, label="Ω·ε(float32)/8")
        ax.set(xlabel="Ω", ylabel="max |error|", title="pseudo-masks in float32: penalise, don't reward")
        ax.legend(fontsize=7)
        plt.show()
        one = torch.tensor(1000.0)
        print(f"float32 ulp(1000) = {float(one.nextafter(2 * one) - one):.1e}")
        """,
    ),
    (
        "md",
        """
        ## A whole model with standard masks only

        `lens_aot.constructions.standard_mask.to_standard_mask_model(spec)` does all of this to a whole transformer: the
        bias token is prepended internally, one-hot position channels are appended to the residual, and every head
        (the source's own and one per MLP neuron) runs under the source's causal mask. LayerNorm stays exact: the
        extra channels add a known constant to the norm's statistics, which a compensating epsilon cancels. Here a
        random 2-layer SiLU transformer, written as a `ModelSpec` and computed directly from it for reference.
        """,
    ),
    (
        "code",
        """
        from lens_aot.core.spec.model_spec import AttentionSpec, LayerSpec, MLPSpec, ModelSpec, NormSpec
        from lens_aot.constructions.standard_mask import to_standard_mask_model


        def random_spec(norm, d=32, n_heads=4, d_mlp=64, n_layers=2, vocab=50, n_ctx=24):
            \"""A random SiLU transformer as a float64 ModelSpec.\"""
            g = torch.Generator().manual_seed(0)

            def r(*shape, scale=1.0):
                return scale * torch.randn(*shape, generator=g, dtype=torch.float64)

            def ln():
                return NormSpec(norm, 1e-5, 1 + r(d, scale=0.1), r(d, scale=0.1)) if norm else NormSpec(None)

            dh, s = d // n_heads, d**-0.5

            def layer():
                qkv = [r(n_heads, d, dh, scale=s) for _ in range(3)]
                biases = [r(n_heads, dh, scale=0.1) for _ in range(3)]
                attn = AttentionSpec(*qkv, r(n_heads, dh, d, scale=s), *biases, r(d, scale=0.1), math.sqrt(dh))
                mlp = MLPSpec(r(d, d_mlp, scale=s), r(d_mlp, scale=0.1), r(d_mlp, d, scale=d_mlp**-0.5), r(d), "silu")
                return LayerSpec(ln(), attn, ln(), mlp)

            layers = [layer() for _ in range(n_layers)]
            W_E, W_pos, W_U = r(vocab, d, scale=0.3), r(n_ctx, d, scale=0.3), r(d, vocab, scale=s)
            return ModelSpec(d, n_ctx, vocab, vocab, True, W_E, layers, ln(), W_U, r(vocab), W_pos=W_pos)


        def source_logits(spec, tokens):
            \"""The source transformer computed directly from its spec (causal attention, SiLU MLPs).\"""

            def norm(n, x):
                if n.kind is None:
                    return x
                x = x - x.mean(-1, keepdim=True)
                return x / (x.pow(2).mean(-1, keepdim=True) + n.eps).sqrt() * n.w + n.b

            pos = tokens.shape[1]
            future = torch.ones(pos, pos, dtype=torch.bool).triu(1)
            x = spec.W_E[tokens] + spec.W_pos[:pos]
            for layer in spec.layers:
                a, h = layer.attn, norm(layer.ln1, x)
                weights = ((a.W_Q, a.b_Q), (a.W_K, a.b_K), (a.W_V, a.b_V))
                q, k, v = (torch.einsum("bpd,hde->bphe", h, w) + b for w, b in weights)
                scores = torch.einsum("bqhe,bkhe->bhqk", q, k).masked_fill(future, -math.inf) / a.attn_scale
                z = torch.einsum("bhqk,bkhe->bqhe", scores.softmax(-1), v)
                x = x + torch.einsum("bqhe,hed->bqd", z, a.W_O) + a.b_O
                m = layer.mlp
                x = x + F.silu(norm(layer.ln2, x) @ m.W_in + m.b_in) @ m.W_out + m.b_out
            return norm(spec.ln_final, x) @ spec.W_U + spec.b_U


        def cast(obj, dtype):
            \"""The same spec with every tensor in `dtype`.\"""
            if isinstance(obj, torch.Tensor):
                return obj.to(dtype)
            if dataclasses.is_dataclass(obj):
                fields = {f.name: cast(getattr(obj, f.name), dtype) for f in dataclasses.fields(obj)}
                return dataclasses.replace(obj, **fields)
            return [cast(o, dtype) for o in obj] if isinstance(obj, list) else obj
        """,
    ),
    (
        "code",
        """
        tokens = torch.randint(0, 50, (4, 24), generator=torch.Generator().manual_seed(1))
        OMEGAS_MODEL = [1, 3, 10, 30, 100, 300, 1e3, 1e4, 1e6, 1e8]
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        for norm in ("LN", None):
            spec = random_spec(norm)
            reference = source_logits(spec, tokens)
            for dtype, ls in ((torch.float64, "-"), (torch.float32, "--")):
                errs = []
                for omega in OMEGAS_MODEL:
                    with torch.no_grad():
                        logits = to_standard_mask_model(cast(spec, dtype), omega)(tokens)
                    errs.append(max(max_err(logits, reference), 1e-18))
                ax.loglog(OMEGAS_MODEL, errs, ls=ls, marker="o", label=f"{norm or 'no norm'}, {str(dtype)[6:]}")
                print(f"{norm or 'no norm':8s} {str(dtype):14s} max |Δlogit| at the default Ω = 1e6: {errs[-2]:.1e}")
        ax.set(xlabel="Ω", ylabel="max |Δlogit|", title="whole model, every head under the causal mask only")
        ax.legend(fontsize=8)
        plt.show()
        model = to_standard_mask_model(random_spec("LN"))
        print(f"heads per block {model.cfg.n_heads_per_block}, residual width {model.cfg.d_model}, "
              f"largest weight on a forbidden key at the default Ω: {model.mask_leak(tokens):.1e}")
        """,
    ),
]

CELLS: list[tuple[str, str]] = [(kind, textwrap.dedent(source).strip()) for kind, source in _RAW]
