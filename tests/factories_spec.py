"""Random :class:`~lens_aot.core.spec.model_spec.ModelSpec` s built directly (no TransformerLens model class), for both
TL
majors."""

from __future__ import annotations

import torch

from lens_aot.core.spec.model_spec import AttentionSpec, LayerSpec, MLPSpec, ModelSpec, NormSpec, RotarySpec


def rotary_tables(n_ctx: int, rotary_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-NeoX-layout cos/sin tables [n_ctx, rotary_dim] (float64)."""
    inv = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = torch.arange(n_ctx, dtype=torch.float64)[:, None] * inv
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def random_spec(
    *,
    norm: str | None = "RMS",
    positions: str = "rotary",
    act_fn: str = "silu",
    gated: bool = True,
    parallel: bool = False,
    dtype: torch.dtype = torch.float32,
    n_layers: int = 2,
    d_model: int = 32,
    n_heads: int = 4,
    n_kv: int = 2,
    d_head: int = 8,
    d_mlp: int = 48,
    d_vocab: int = 50,
    n_ctx: int = 24,
    biases: bool = True,
    seed: int = 0,
) -> ModelSpec:
    """A Llama-shaped (by default: RMSNorm, rotary, GQA, SwiGLU) source with O(1) activations."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype)

    def norm_spec() -> NormSpec:
        if norm is None:
            return NormSpec(None)
        w = (1.0 + rand(d_model, scale=0.2)) if norm in ("LN", "RMS") else None
        b = rand(d_model, scale=0.2) if norm == "LN" else None
        return NormSpec(norm, 1e-5, w, b)  # type: ignore[arg-type]

    def bias(*shape: int) -> torch.Tensor:
        return rand(*shape, scale=0.2) if biases else torch.zeros(*shape, dtype=dtype)

    layers = []
    for _ in range(n_layers):
        attn = AttentionSpec(
            rand(n_heads, d_model, d_head, scale=d_model**-0.5),
            rand(n_kv, d_model, d_head, scale=d_model**-0.5),
            rand(n_kv, d_model, d_head, scale=d_model**-0.5),
            rand(n_heads, d_head, d_model, scale=(n_heads * d_head) ** -0.5),
            bias(n_heads, d_head),
            bias(n_kv, d_head),
            bias(n_kv, d_head),
            bias(d_model),
            attn_scale=d_head**0.5,
        )
        mlp = MLPSpec(
            rand(d_model, d_mlp, scale=d_model**-0.5),
            bias(d_mlp),
            rand(d_mlp, d_model, scale=d_mlp**-0.5),
            bias(d_model),
            act_fn,
            W_gate=rand(d_model, d_mlp, scale=d_model**-0.5) if gated else None,
            b_gate=bias(d_mlp) if gated else None,
            b_post=bias(d_mlp) if gated else None,
        )
        ln1 = norm_spec()
        layers.append(LayerSpec(ln1, attn, ln1 if parallel and norm is None else norm_spec(), mlp, parallel))
    rotary = None
    if positions == "rotary":
        cos, sin = rotary_tables(n_ctx, d_head)
        rotary = RotarySpec(d_head, cos.to(dtype), sin.to(dtype))
    return ModelSpec(
        d_model=d_model,
        n_ctx=n_ctx,
        d_vocab=d_vocab,
        d_vocab_out=d_vocab,
        causal=True,
        W_E=rand(d_vocab, d_model),
        layers=layers,
        ln_final=norm_spec(),
        W_U=rand(d_model, d_vocab, scale=d_model**-0.5),
        b_U=bias(d_vocab),
        positions=positions,  # type: ignore[arg-type]
        W_pos=rand(n_ctx, d_model, scale=0.3) if positions == "standard" else None,
        rotary=rotary,
        model_name=f"random-{norm}-{positions}-{act_fn}{'-gated' if gated else ''}{'-parallel' if parallel else ''}",
        source_kind="ModelSpec",
    )
