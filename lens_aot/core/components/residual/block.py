"""One source layer: attention, then the MLP (or both reading the layer's input, in parallel layers), with
TransformerLens's block hook points. Shared by the converted model (``mlp`` is a
:class:`~lens_aot.core.components.mlp.neuron_mlp.NeuronMLP` of neuron heads) and the reference model (``mlp`` is a plain
:class:`~lens_aot.core.components.mlp.mlp.MLP`), so both are numbered and hooked exactly like their source.
"""

from __future__ import annotations

from typing import Any

from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from lens_aot.core.components.attention.attention import Attention
from lens_aot.core.components.norm import Norm
from lens_aot.core.components.residual.layer_scalar import LayerScalar
from lens_aot.core.spec.model_spec import LayerSpec


class TransformerBlock(nn.Module):
    """``resid_mid = resid_pre + attn(ln1(resid_pre))``, ``resid_post = resid_mid + mlp(ln2(resid_mid))``; parallel
    layers: ``resid_post = resid_pre + attn(ln1(resid_pre)) + mlp(ln2(resid_pre))``; no MLP: ``resid_pre + attn``.

    Hooks (all [batch, pos, d_model] unless noted): ``hook_resid_pre``, ``hook_attn_out``, ``hook_resid_mid``
    (sequential layers with an MLP), ``hook_mlp_out``, ``hook_resid_post``; with the model's switches on,
    ``hook_attn_in`` / ``hook_q_input`` / ``hook_k_input`` / ``hook_v_input`` [batch, pos, head, d_model]
    (``use_attn_in`` / ``use_split_qkv_input``) and ``hook_mlp_in`` (``use_hook_mlp_in``).

    Norm placements (:class:`~lens_aot.core.spec.model_spec.LayerSpec`): sandwich norms ``ln1_post`` / ``ln2_post``
    (Gemma 2/3)
    normalize the sublayer's output before ``hook_attn_out`` / ``hook_mlp_out``; ``post_norm`` (OLMo-2) moves
    ``ln1`` / ``ln2`` from the sublayer's input to its output, as TransformerLens does (same module names).
    Gemma 4's per-layer-input sublayer (:mod:`.per_layer_sublayer`) adds to the stream after the MLP; a layer
    scalar (Gemma 4, :mod:`.layer_scalar`) multiplies the residual stream before ``hook_resid_post``.

    ``residual_multiplier`` ``m`` (a half-precision Granite layer, ``resid + m·sublayer``,
    ``LayerSpec.residual_multiplier``): each sublayer's output is multiplied by the number ``m`` before
    ``hook_attn_out`` / ``hook_mlp_out``, as the source multiplies its ``o_proj`` / ``down_proj`` output, so both hooks
    are the scaled contributions; the attention multiplies its output (and each head's ``hook_result``) itself
    (``Attention.result_scale``), and every neuron-head MLP inside the MLP (each expert's) scales its output heads'
    ``hook_result`` (``NeuronMLP.result_scale``), so every ``hook_result`` is a scaled contribution too, as on
    TransformerLens's ``ScaledResidualBlockBridge``; analyses read what a module writes through
    :func:`~.writes.written` (``W_O·m``, ``W_out·m``). Float32 and float64 models hold ``m`` folded into the weights.
    """

    # TransformerLens 4's readout tools (``tools.analysis.logit_lens``) read a block's output as the residual stream
    # only when its component says so: ``hook_resid_post`` is the whole residual stream here, as in a source block.
    hook_out_is_single_residual_stream: bool = True

    def __init__(
        self,
        ln1: Norm,
        attn: Attention,
        ln2: Norm | None = None,
        mlp: nn.Module | None = None,
        parallel: bool = False,
        ln1_post: Norm | None = None,
        ln2_post: Norm | None = None,
        post_norm: bool = False,
        layer_scalar: float | None = None,
        per_layer: nn.Module | None = None,
        residual_multiplier: float | None = None,
    ) -> None:
        super().__init__()
        self.residual_multiplier = None if residual_multiplier is None else float(residual_multiplier)
        if residual_multiplier is not None:
            if not isinstance(attn, Attention) or type(attn).write_out is not Attention.write_out:
                raise ValueError(
                    f"a residual multiplier on a {type(attn).__name__} (only the standard attention carries one; "
                    "no source has it with another)"
                )
            attn.result_scale = self.residual_multiplier
            for module in mlp.modules() if mlp is not None else ():
                if hasattr(module, "result_scale"):  # neuron-head MLPs, every expert's, and their output heads
                    module.result_scale = self.residual_multiplier
        self.parallel = parallel
        self.post_norm = post_norm
        self.use_attn_in = self.use_split_qkv_input = self.use_hook_mlp_in = False
        self.hook_resid_pre = HookPoint()
        self.ln1 = ln1
        self.hook_attn_in = HookPoint()
        self.hook_q_input = HookPoint()
        self.hook_k_input = HookPoint()
        self.hook_v_input = HookPoint()
        self.attn = attn
        if ln1_post is not None:
            self.ln1_post = ln1_post
        self.hook_attn_out = HookPoint()
        if mlp is not None:
            assert ln2 is not None
            self.ln2 = ln2
            self.mlp = mlp
            if ln2_post is not None:
                self.ln2_post = ln2_post
            self.hook_mlp_in = HookPoint()
            self.hook_mlp_out = HookPoint()
            if not parallel:
                self.hook_resid_mid = HookPoint()
        if per_layer is not None:  # Gemma 4's per-layer-input sublayer (components/residual/per_layer_sublayer.py)
            self.per_layer = per_layer
        if layer_scalar is not None:
            self.layer_scalar = LayerScalar(layer_scalar)
        self.hook_resid_post = HookPoint()

    @property
    def has_mlp(self) -> bool:
        return hasattr(self, "mlp")

    @property
    def mlp_reads_residual(self) -> bool:
        return bool(getattr(self.mlp, "reads_residual", False))

    def forward(
        self,
        resid_pre: Float[Tensor, "batch pos d_model"],
        shortformer_pos_embed: Float[Tensor, "batch pos d_model"] | None = None,
        **attn_kwargs: Any,
    ) -> Float[Tensor, "batch pos d_model"]:
        """``attn_kwargs`` (attention mask, KV-cache entry, positions) go to the attention; ``shortformer_pos_embed``
        (shortformer positions) is added to its normalized query and key inputs, as in TransformerLens."""
        resid_pre = self.hook_resid_pre(resid_pre)
        q_in, k_in, v_in = self._attention_inputs(resid_pre)
        if shortformer_pos_embed is not None:
            pos = shortformer_pos_embed if q_in.ndim == 3 else shortformer_pos_embed[:, :, None, :]
            q_in, k_in = q_in + pos, k_in + pos
        attn_out = self.attn(q_in, k_in, v_in, **attn_kwargs)
        if hasattr(self, "ln1_post"):
            attn_out = self.ln1_post(attn_out)
        if self.post_norm:
            attn_out = self.ln1(attn_out)
        attn_out = self.hook_attn_out(attn_out)
        if not self.has_mlp:
            return self._resid_post(resid_pre + attn_out)
        if self.parallel:
            mlp_out = self._mlp_out(self._mlp_input(resid_pre))
            return self._resid_post(resid_pre + attn_out + mlp_out)
        resid_mid = self.hook_resid_mid(resid_pre + attn_out)
        mlp_out = self._mlp_out(self._mlp_input(resid_mid))
        return self._resid_post(resid_mid + mlp_out)

    def _resid_post(self, resid: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        """``hook_resid_post`` of the layer's output, after the per-layer-input sublayer and times the layer scalar
        when there are ones."""
        resid = self.per_layer(resid) if hasattr(self, "per_layer") else resid
        return self.hook_resid_post(self.layer_scalar(resid) if hasattr(self, "layer_scalar") else resid)

    def _mlp_out(self, mlp_in: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        """``hook_mlp_out(mlp(ln2(x)))``, with ``ln2_post`` after the MLP (sandwich) or ``ln2`` there (post-norm)."""
        if self.post_norm:
            return self.hook_mlp_out(self.ln2(self.mlp(mlp_in)))
        # Gemma 4's mixture of experts beside the dense MLP also reads the raw residual
        # (components/moe/moe_beside_mlp.py)
        out = self.mlp(self.ln2(mlp_in), mlp_in) if self.mlp_reads_residual else self.mlp(self.ln2(mlp_in))
        if self.residual_multiplier is not None:  # a half-precision Granite's (x·W_out)·m, as its source computes
            out = out * self.residual_multiplier
        if hasattr(self, "ln2_post"):
            out = self.ln2_post(out)
        return self.hook_mlp_out(out)

    def _attention_inputs(self, resid: Float[Tensor, "batch pos d_model"]) -> tuple[Tensor, Tensor, Tensor]:
        """The normalized query, key and value inputs, per head when ``use_attn_in`` / ``use_split_qkv_input``."""
        ln1 = (lambda x: x) if self.post_norm else self.ln1
        if not (self.use_attn_in or self.use_split_qkv_input):
            x = ln1(resid)
            return x, x, x

        def per_head(n_heads: int) -> Tensor:
            # one real copy per head (never an expanded view), so an in-place write to one head's slice changes that
            # head only, as in TransformerLens
            return resid[:, :, None, :].repeat(1, 1, n_heads, 1)

        if self.use_attn_in:
            x = ln1(self.hook_attn_in(per_head(self.attn.n_heads)))
            n_kv = self.attn.n_heads if self.attn.ungroup else self.attn.n_kv
            if n_kv == self.attn.n_heads:
                return x, x, x
            # grouped-query attention (TransformerLens 4's bridges allow it): keys and values read the first n_kv
            # heads' copies, as PositionEmbeddingsAttentionBridge does
            kv = x[:, :, :n_kv]
            return x, kv, kv
        q = self.hook_q_input(per_head(self.attn.n_heads))
        n_kv = self.attn.n_heads if self.attn.ungroup else self.attn.n_kv
        k = self.hook_k_input(per_head(n_kv))
        v = self.hook_v_input(per_head(n_kv))
        return ln1(q), ln1(k), ln1(v)

    def _mlp_input(self, resid: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        return self.hook_mlp_in(resid.clone()) if self.use_hook_mlp_in else resid

    def layer_spec(self) -> LayerSpec:
        """The source layer this block implements (MLPs with their original activation)."""
        variants = dict(
            ln1_post=self.ln1_post.spec() if hasattr(self, "ln1_post") else None,
            ln2_post=self.ln2_post.spec() if hasattr(self, "ln2_post") else None,
            post_norm=self.post_norm,
            layer_scalar=self.layer_scalar.scalar if hasattr(self, "layer_scalar") else None,
            per_layer=self.per_layer.spec() if hasattr(self, "per_layer") else None,
            residual_multiplier=self.residual_multiplier,
        )
        if not self.has_mlp:
            return LayerSpec(self.ln1.spec(), self.attn.spec(), None, None, self.parallel, **variants)
        return LayerSpec(self.ln1.spec(), self.attn.spec(), self.ln2.spec(), self.mlp.spec(), self.parallel, **variants)
