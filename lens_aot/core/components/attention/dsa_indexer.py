"""DeepSeek Sparse Attention's indexer (:class:`~lens_aot.core.spec.dsa.IndexerSpec`): which keys each query keeps.

It is carried as the source computes it (GLM-MoE-DSA, DeepSeek-V3.2; transformers' ``GlmMoeDsaIndexer``): its own
query and key projections and float32 scores, the top-k keys per query, and the result as a mask on the attention's
scores, with hooks ``hook_index_scores`` [batch, query, key] (float32; ``-inf`` where the causal or padding mask
hides the key) and ``hook_index_mask`` [batch, query, key] (True: the key is kept). The attention heads themselves
stay attention heads (:mod:`lens_aot.core.components.attention.mla_attention`); only the MLPs become neuron heads
(Huben &
Morris 2023, Theorem 3).
"""

from __future__ import annotations

from typing import TypeAlias

import torch
from jaxtyping import Bool, Float
from torch import Tensor, nn
from torch.nn import functional as F
from transformer_lens.hook_points import HookPoint

from lens_aot.core.components.norm import Norm
from lens_aot.core.components.ownership import exported_fields, own_parameters
from lens_aot.core.components.scores.rope import rotate_rope
from lens_aot.core.spec.dsa import IndexerSpec

Residual: TypeAlias = Float[Tensor, "batch pos d_model"]
QLatent: TypeAlias = Float[Tensor, "batch pos q_rank"]  # the attention's query latent, which the indexer reads too
RopeRows: TypeAlias = Float[Tensor, "batch_or_1 pos 1 rope_dim"]  # the attention's rotary cos / sin rows
Visible: TypeAlias = Bool[Tensor, "batch_or_1 1 pos pos"]  # the keys a query sees (True)


class SparseIndexer(nn.Module):
    """The indexer of one sparse-attention layer (module docstring)."""

    PARAMETERS = ("W_q", "W_k", "W_weights")
    SETTINGS = ("top_k", "rope_dim", "rope_layout", "softmax_scale", "weights_scale", "scores_dtype")

    def __init__(self, spec: IndexerSpec) -> None:
        super().__init__()
        own_parameters(self, spec, *self.PARAMETERS)
        self.k_norm = Norm(spec.k_norm)
        self.top_k, self.rope_dim, self.rope_layout = int(spec.top_k), int(spec.rope_dim), spec.rope_layout
        self.softmax_scale, self.weights_scale = float(spec.softmax_scale), float(spec.weights_scale)
        self.scores_dtype = spec.scores_dtype
        self.hook_index_scores = HookPoint()  # [batch, query, key]
        self.hook_index_mask = HookPoint()  # [batch, query, key], True where the key is kept

    def forward(self, x: Residual, q_latent: QLatent, cos: RopeRows, sin: RopeRows, visible: Visible) -> Visible:
        """The keys each query keeps, ``visible`` (causal and padding) included."""
        batch, pos, _ = x.shape
        q = torch.einsum("bpr,rhd->bphd", q_latent, self.W_q)
        k = self.k_norm(x @ self.W_k)[:, :, None, :]
        r = self.rope_dim
        q = torch.cat([rotate_rope(q[..., :r], cos, sin, self.rope_layout), q[..., r:]], dim=-1)
        k = torch.cat([rotate_rope(k[..., :r], cos, sin, self.rope_layout), k[..., r:]], dim=-1)[:, :, 0]
        dtype = self.scores_dtype
        scores = F.relu(torch.matmul(q.to(dtype), k.transpose(-1, -2).to(dtype).unsqueeze(1)) * self.softmax_scale)
        weights = F.linear(x, self.W_weights.T.contiguous()).to(dtype) * self.weights_scale  # [b, p, h]
        index = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # [b, query, key]
        index = self.hook_index_scores(index.masked_fill(~visible[:, 0], float("-inf")))
        chosen = index.topk(min(self.top_k, index.shape[-1]), dim=-1).indices
        keep = torch.zeros(index.shape, dtype=torch.bool, device=x.device).scatter(-1, chosen, True)
        keep = self.hook_index_mask(keep & visible[:, 0])
        return keep[:, None]

    def spec(self) -> IndexerSpec:
        """The :class:`IndexerSpec` this module implements."""
        settings = {name: getattr(self, name) for name in self.SETTINGS}
        return IndexerSpec(**exported_fields(self, *self.PARAMETERS), k_norm=self.k_norm.spec(), **settings)


__all__ = ["SparseIndexer"]
