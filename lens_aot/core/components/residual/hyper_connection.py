"""DeepSeek-V4's manifold-constrained hyper-connections (mHC), carried exactly as transformers computes them.

:class:`HyperConnection` is ``DeepseekV4HyperConnection``: from the ``hc_mult`` residual streams it computes the
collapse weights ``pre``, the expansion weights ``post`` and the stream mix ``comb`` (Sinkhorn-projected), and returns
``(post, comb, collapsed)``; :func:`mix_streams` is the decoder layer's ``post ⊗ out + combᵀ X`` after the sublayer;
:class:`HyperHead` is ``DeepseekV4HyperHead``, the final collapse before the model's norm; :func:`expand_streams`
copies the embedding into the streams. Formulas: :mod:`lens_aot.core.spec.hyper`.

Precision, as the source: the flattened streams are cast to float32 and normed and projected (``fn``) in float32
whatever the streams' and the weights' dtype (a float64 model keeps these float32 steps). In
:class:`HyperConnection` ``scale`` multiplies in float32 (the float32 logits absorb the 0-dim scale) and ``base`` is
added in the weights' dtype, so ``pre`` / ``post`` / ``comb`` come out in the promoted dtype (float32 for float32
weights, float64 for float64 ones); :class:`HyperHead` casts ``scale`` and ``base`` to float32, so its ``pre`` is
float32. The collapse ``Σ pre · X`` runs in the promotion of ``pre`` and the streams and is cast to the streams'
dtype; :func:`mix_streams` casts ``post`` and ``comb`` to the streams' dtype first.

Hook points (TransformerLens's ``DeepseekV4HyperConnectionBridge`` names, plus ``hook_pre``): ``hook_in`` [batch,
pos, hc_mult, d_model] (the streams everything is computed from), ``hook_pre`` [batch, pos, hc_mult] (the collapse
weights), ``hook_post`` [batch, pos, hc_mult], ``hook_comb`` [batch, pos, hc_mult, hc_mult], ``hook_out`` [batch,
pos, d_model] (the collapsed sublayer input), and ``input_norm.hook_in`` / ``input_norm.hook_out`` [batch, pos,
hc_mult·d_model] (float32: the flattened streams before and after the norm, as the bridge names them).
:class:`HyperHead` (the bridge's ``hc_head``): ``hook_in``, ``hook_pre``, ``hook_out``, ``input_norm.hook_in`` /
``input_norm.hook_out``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from lens_aot.core.components.ownership import exported_fields, own_parameters
from lens_aot.core.components.source_rms_norm import unweighted_rms_norm
from lens_aot.core.spec.hyper import HyperConnectionSpec, HyperHeadSpec

__all__ = ["HyperConnection", "HyperHead", "UnweightedRMSNorm", "expand_streams", "mix_streams"]


class UnweightedRMSNorm(nn.Module):
    """``DeepseekV4UnweightedRMSNorm``: ``x · rsqrt(mean(x.float()²) + eps)`` cast to ``x``'s dtype, over the
    flattened streams [batch, pos, hc_mult·d_model] (float32 here: the connections cast before norming)."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = float(eps)
        self.hook_in = HookPoint()  # [batch, pos, hc_mult·d_model]
        self.hook_out = HookPoint()  # [batch, pos, hc_mult·d_model]

    def forward(self, x: Float[Tensor, "batch pos hc_d_model"]) -> Float[Tensor, "batch pos hc_d_model"]:
        x = self.hook_in(x)
        return self.hook_out(unweighted_rms_norm(x, self.eps))

    def extra_repr(self) -> str:
        return f"eps={self.eps}"


def expand_streams(embed: Float[Tensor, "batch pos d_model"], hc_mult: int) -> Float[Tensor, "batch pos hc d_model"]:
    """The embedding copied into ``hc_mult`` streams (``DeepseekV4Model.forward``)."""
    return embed.unsqueeze(2).expand(-1, -1, hc_mult, -1).contiguous()


def mix_streams(
    streams: Float[Tensor, "batch pos hc d_model"],
    out: Float[Tensor, "batch pos d_model"],
    post: Float[Tensor, "batch pos hc"],
    comb: Float[Tensor, "batch pos hc hc"],
) -> Float[Tensor, "batch pos hc d_model"]:
    """The streams after a sublayer: ``X'[k] = post[k] · out + Σ_j comb[j, k] · X[j]``, with ``post`` and ``comb``
    cast to the streams' dtype first (``DeepseekV4DecoderLayer.forward``)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class StreamWeights(nn.Module):
    """What :class:`HyperConnection` and :class:`HyperHead` share: per-token weights over the streams computed from
    their RMS-normed, flattened concatenation (``fn``, ``base``, ``scale``), and the hooks on the streams
    (``hook_in``), the collapse weights (``hook_pre``) and the collapsed stream (``hook_out``)."""

    PARAMETERS = ("fn", "base", "scale")

    def __init__(self, spec: HyperConnectionSpec | HyperHeadSpec) -> None:
        super().__init__()
        self.hc_mult, self.hc_eps = int(spec.hc_mult), float(spec.hc_eps)
        self.input_norm = UnweightedRMSNorm(spec.norm_eps)
        own_parameters(self, spec, *self.PARAMETERS)
        self.hook_in = HookPoint()  # [batch, pos, hc_mult, d_model]
        self.hook_pre = HookPoint()  # [batch, pos, hc_mult]
        self.hook_out = HookPoint()  # [batch, pos, d_model]


class HyperConnection(StreamWeights):
    """``DeepseekV4HyperConnection``: ``streams → (post, comb, collapsed)`` (module docstring)."""

    def __init__(self, spec: HyperConnectionSpec) -> None:
        super().__init__(spec)
        self.sinkhorn_iters = int(spec.sinkhorn_iters)
        self.hook_post = HookPoint()  # [batch, pos, hc_mult]
        self.hook_comb = HookPoint()  # [batch, pos, hc_mult, hc_mult]

    def forward(
        self, streams: Float[Tensor, "batch pos hc d_model"]
    ) -> tuple[Float[Tensor, "batch pos hc"], Float[Tensor, "batch pos hc hc"], Float[Tensor, "batch pos d_model"]]:
        streams = self.hook_in(streams)
        batch, pos = streams.shape[:2]
        hc = self.hc_mult
        flat = self.input_norm(streams.reshape(batch, pos, -1).float())
        logits = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = logits.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        pre_scale, post_scale, comb_scale = self.scale.unbind(0)
        comb_w = comb_w.view(*comb_w.shape[:-1], hc, hc)
        comb_b = comb_b.view(hc, hc)

        pre = torch.sigmoid(pre_w * pre_scale + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_scale + post_b)
        comb = torch.softmax(comb_w * comb_scale + comb_b, dim=-1) + self.hc_eps
        comb = self._sinkhorn(comb)

        pre = self.hook_pre(pre)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
        return self.hook_post(post), self.hook_comb(comb), self.hook_out(collapsed)

    def _sinkhorn(self, comb: Float[Tensor, "batch pos hc hc"]) -> Float[Tensor, "batch pos hc hc"]:
        """Columns normalised once, then rows and columns ``sinkhorn_iters − 1`` times (``+ hc_eps`` each)."""
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        return comb

    mix = staticmethod(mix_streams)  # the streams after the sublayer whose input this connection collapsed

    def spec(self) -> HyperConnectionSpec:
        """The :class:`HyperConnectionSpec` this module implements."""
        return HyperConnectionSpec(
            hc_mult=self.hc_mult,
            sinkhorn_iters=self.sinkhorn_iters,
            hc_eps=self.hc_eps,
            norm_eps=self.input_norm.eps,
            **exported_fields(self, *self.PARAMETERS),
        )

    def extra_repr(self) -> str:
        return f"hc_mult={self.hc_mult}, sinkhorn_iters={self.sinkhorn_iters}, hc_eps={self.hc_eps}"


class HyperHead(StreamWeights):
    """``DeepseekV4HyperHead``: ``Σ_i pre[i] · X[i]`` with ``pre = sigmoid(x̂ fnᵀ · scale + base) + hc_eps``."""

    def forward(self, streams: Float[Tensor, "batch pos hc d_model"]) -> Float[Tensor, "batch pos d_model"]:
        streams = self.hook_in(streams)
        flat = self.input_norm(streams.flatten(2).float())
        mixes = F.linear(flat, self.fn.float())
        pre = self.hook_pre(torch.sigmoid(mixes * self.scale.float() + self.base.float()) + self.hc_eps)
        return self.hook_out((pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype))

    def spec(self) -> HyperHeadSpec:
        """The :class:`HyperHeadSpec` this module implements."""
        return HyperHeadSpec(
            hc_mult=self.hc_mult,
            hc_eps=self.hc_eps,
            norm_eps=self.input_norm.eps,
            **exported_fields(self, *self.PARAMETERS),
        )

    def extra_repr(self) -> str:
        return f"hc_mult={self.hc_mult}, hc_eps={self.hc_eps}"
