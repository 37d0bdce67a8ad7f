"""Gemma 4's per-layer input embeddings (PLE) as plain tensors: the model-level inputs and each layer's sublayer.

``transformers``' ``Gemma4TextModel`` computes, once per forward from the input tokens ``t`` and the main (scaled)
embedding ``e = W_E[t]``::

    token = W_E_ple[t] · s_e                                  (embed_tokens_per_layer, s_e = sqrt(d_ple))
    proj  = norm((e @ W_proj) · s_p)   per layer [d_ple]      (per_layer_model_projection, s_p = d_model^-½,
                                                               per_layer_projection_norm)
    P     = (proj + token) · s_i       [batch, pos, n_layers, d_ple]   (s_i = 2^-½)

and each ``Gemma4TextDecoderLayer`` ends (after the MLP, before the layer scalar) with
``resid += post_norm(W_proj(act(resid @ W_gate) ⊙ P[:, :, l]))``. Beyond the paper: the sublayer's neurons are gated
neurons whose linear factor is ``P[:, :, l]`` (:mod:`lens_aot.core.fit.per_layer`,
:mod:`lens_aot.core.components.mlp.per_layer_neurons`); the reference keeps it dense
(:mod:`lens_aot.core.components.residual.per_layer_sublayer`).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxtyping import Float
from torch import Tensor

from lens_aot.core.spec.fields import saved
from lens_aot.core.spec.model_spec import NormSpec

__all__ = ["PerLayerInputsSpec", "PerLayerSublayerSpec"]


@dataclass
class PerLayerInputsSpec:
    """The model-level per-layer inputs (module docstring): ``W_E`` packs the layers, ``[d_vocab, n_layers·d_ple]``."""

    W_E: Float[Tensor, "d_vocab n_layers_d_ple"] = saved("tensor")
    # s_e, the source's buffer at its own precision, cast to W_E's dtype at the lookup as the source does
    # (:func:`~lens_aot.core.spec.model_spec.scaled_rows`)
    embed_scale: float = saved("float")
    W_proj: Float[Tensor, "d_model n_layers_d_ple"] = saved("tensor")
    proj_scale: float = saved("float")  # s_p
    norm: NormSpec = saved("norm")  # over d_ple
    input_scale: float = saved("float")  # s_i
    n_layers: int = saved("int")

    @property
    def d_ple(self) -> int:
        return int(self.W_E.shape[1]) // self.n_layers


@dataclass
class PerLayerSublayerSpec:
    """``resid += post_norm(act(resid @ W_gate) ⊙ p) @ W_proj`` (``p`` the layer's per-layer input)."""

    W_gate: Float[Tensor, "d_model d_ple"] = saved("tensor")
    W_proj: Float[Tensor, "d_ple d_model"] = saved("tensor")
    act_fn: str = saved("activation")
    post_norm: NormSpec = saved("norm")
