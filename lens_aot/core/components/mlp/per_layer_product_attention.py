"""The product heads of Gemma 4's per-layer-input neurons: :class:`ProductAttention` whose linear factor is the
layer's per-layer input ``p`` instead of ``x·W_in + b_in`` (:mod:`lens_aot.core.fit.per_layer`).

Two heads per neuron, as for a gated MLP (:mod:`lens_aot.core.components.mlp.product_attention`): head ``2n`` / ``2n +
1``
has query ``±ε_n·p_n``, key 0 on itself and −1 on the bias key, value ``h_n`` (the gate heads' ``act(g_n)`` in the
sublayer's scratch) and output ``±(2/ε_n)·W_proj[n]``, so the pair writes ``(2/ε_n)·h_n·tanh(ε_n p_n/2) ≈ h_n·p_n``.
The per-layer input is an input beside the residual stream, so the TransformerLens-layout weights are over
``[resid (d_model), scratch h (d_ple), per-layer input p (d_ple)]``: ``W_Q`` reads the last block (``W_in`` is that
read map, a one-hot per neuron, computed on demand: no parameter), ``W_V`` the scratch. ``W_out`` is the source's
``W_proj`` (one parameter, registered by the sublayer under that name); there is no bias.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor
from transformer_lens.hook_points import HookPoint

from lens_aot.core.components.mlp.neuron_attention import SelfAndSlotHeads
from lens_aot.core.components.mlp.product_attention import ProductAttention
from lens_aot.core.components.ownership import parameter

__all__ = ["PerLayerProductAttention"]


class PerLayerProductAttention(ProductAttention):
    """``2·d_ple`` product heads turning ``h ≈ act(g)`` and the per-layer input ``p`` into ``(act(g) ⊙ p)·W_proj``."""

    def __init__(
        self,
        W_proj: Float[Tensor, "d_ple d_model"],
        scales: Float[Tensor, " d_ple"],
        ranges: tuple[Tensor, Tensor],
        where: str,
    ) -> None:
        """``scales``: ``ε_n``; ``ranges``: ``(U_n, H_n)``, the certified range of ``|p_n|`` and ``|h_n|``, checked
        on every forward (:meth:`ProductAttention.check_range`); ``where`` names the sublayer in that error."""
        SelfAndSlotHeads.__init__(self)
        self.where = where
        self.register_buffer("u_range", ranges[0].detach().clone().to(W_proj.dtype))
        self.register_buffer("h_range", ranges[1].detach().clone().to(W_proj.dtype))
        self.W_out = parameter(W_proj)
        self.b_post = None
        self.register_buffer("scales", scales.detach().clone().to(W_proj.dtype))
        self.d_mlp, self.d_model = W_proj.shape
        self.d_scratch = self.d_mlp
        self.n_heads = 2 * self.d_mlp
        self.hook_gate = HookPoint()  # [batch, pos, d_ple]: h ≈ act(g), read from the scratch channels
        self._declare_hooks()

    @property
    def d_resid(self) -> int:
        """``[resid, scratch, per-layer input]``."""
        return self.d_model + 2 * self.d_mlp

    @property
    def W_in(self) -> Float[Tensor, "d_resid d_ple"]:
        """The read map of the linear factor: ``u_n = p_n``, the input's channel ``d_model + d_ple + n``."""
        rows = self.W_out.new_zeros(self.d_resid, self.d_mlp)
        rows[self.d_model + self.d_mlp :] = torch.eye(self.d_mlp, dtype=rows.dtype, device=rows.device)
        return rows

    @property
    def b_in(self) -> Float[Tensor, " d_ple"]:
        return self.W_out.new_zeros(self.d_mlp)

    @property
    def W_Q(self) -> Float[Tensor, "n_heads d_resid 1"]:
        """``±ε_n`` on neuron ``n``'s per-layer-input channel."""
        return ((self.W_in * self.scales).T.repeat_interleave(2, dim=0) * self.signs[:, None])[..., None]

    @property
    def b_O(self) -> Float[Tensor, " d_model"]:
        return self.W_out.new_zeros(self.d_model)
