"""Top-k routers of mixture-of-experts layers, one small component per scoring rule, each computing exactly what its
source computes (the experts' neurons become heads elsewhere, :mod:`lens_aot.core.components.moe.moe_mlp`; the router
itself is kept as the source computes it, so the MoE bound of :mod:`lens_aot.core.fit.moe` holds).

Every router turns the router logits ``[tokens, n_experts]`` into

* ``scores`` (:meth:`TopKRouter.scores`, the value of ``hook_expert_weights``): the softmax over all experts
  (:class:`SoftmaxTopK`: Mixtral, Qwen2/3-MoE, OLMoE, ERNIE 4.5, TransformerLens's ``MoE``) or a sigmoid per expert
  (:class:`SigmoidTopK`: MiniMax-M2, GLM-4-MoE, AFMoE) or ``sqrt(softplus)`` per expert (:class:`SqrtSoftplusTopK`:
  DeepSeek-V4), computed in ``score_dtype`` (float32 in the Hugging Face
  sources, whatever the model dtype: a float64 model's routing is then the source's float32 routing, bit for bit);
* the chosen experts (:meth:`TopKRouter.choose`): ``torch.topk`` of ``scores + e_score_correction_bias`` (the
  correction bias steers the choice only; ERNIE 4.5, MiniMax-M2 and GLM-4-MoE have one);
* their weights: the chosen experts' ``scores`` (without the bias), renormalised to sum 1 when ``norm_topk_prob``
  (denominator ``max(Σ, norm_min)``: ERNIE 4.5 clamps at ``moe_norm_min``; GLM-4-MoE's and AFMoE's ``+ 1e-20``
  changes no float32 quotient whose sum of top-k sigmoids exceeds 1e-12, so it is not carried), then multiplied by
  ``routed_scaling_factor``.
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn
from torch.nn import functional as F

from lens_aot.core.components.ownership import exported, parameter
from lens_aot.core.spec.model_spec import MoESpec
from lens_aot.errors import InputError


def router_logits(
    x: Float[Tensor, "tokens d_model"],
    W_router: Float[Tensor, "d_model n_experts"],
    dtype: torch.dtype | None,
    bias: Float[Tensor, " n_experts"] | None = None,
) -> Float[Tensor, "tokens n_experts"]:
    """``x @ W_router (+ bias)`` (in ``dtype`` when set: GLM-4-MoE and ERNIE 4.5 compute it in float32), computed as
    every source computes it, ``F.linear`` with the ``[n_experts, d_model]`` weight in row-major layout (and the bias
    inside the same call, GPT-OSS's router), so the rounding is the source's whatever the layout ``W_router`` is
    stored in (a saved and loaded model included)."""
    if dtype is not None:
        x, W_router = x.to(dtype), W_router.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    return F.linear(x, W_router.T.contiguous(), bias)


class TopKRouter(nn.Module):
    """The choice and weights shared by every scoring rule (module docstring); subclasses define :meth:`scores`."""

    scoring = ""

    def __init__(self, spec: MoESpec) -> None:
        super().__init__()
        self.top_k = int(spec.top_k)
        self.norm_topk_prob = bool(spec.norm_topk_prob)
        self.score_dtype = spec.softmax_dtype
        self.norm_min = float(spec.norm_min)
        self.routed_scaling_factor = float(spec.routed_scaling_factor)
        bias = spec.e_score_correction_bias
        self.e_score_correction_bias = None if bias is None else parameter(bias)

    def scores(self, logits: Float[Tensor, "tokens n_experts"]) -> Float[Tensor, "tokens n_experts"]:
        raise NotImplementedError

    def _in_score_dtype(self, logits: Tensor) -> Tensor:
        return logits if self.score_dtype is None else logits.to(self.score_dtype)

    def choose(
        self, scores: Float[Tensor, "tokens n_experts"]
    ) -> tuple[Int[Tensor, "tokens top_k"], Float[Tensor, "tokens top_k"]]:
        """The chosen experts and their weights (in the scores' dtype). Ties: ``torch.topk`` on the same values as
        the source's own call."""
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        weights, indices = torch.topk(choice, self.top_k, dim=-1)
        if self.e_score_correction_bias is not None:
            weights = scores.gather(1, indices)
        if self.norm_topk_prob:
            total = weights.sum(dim=-1, keepdim=True)
            if self.norm_min:
                total = total.clamp(min=self.norm_min)
            weights = weights / total
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor
        return indices, weights

    def spec_fields(self) -> dict[str, object]:
        """The :class:`~lens_aot.core.spec.model_spec.MoESpec` fields this router implements (for ``MoEMLP.spec``)."""
        bias = self.e_score_correction_bias
        return {
            "top_k": self.top_k,
            "norm_topk_prob": self.norm_topk_prob,
            "softmax_dtype": self.score_dtype,
            "scoring": self.scoring,
            "e_score_correction_bias": None if bias is None else exported(bias),
            "norm_min": self.norm_min,
            "routed_scaling_factor": self.routed_scaling_factor,
        }


class SoftmaxTopK(TopKRouter):
    """Scores = the softmax of the router logits over all experts (Mixtral, Qwen2/3-MoE, OLMoE, ERNIE 4.5)."""

    scoring = "softmax"

    def scores(self, logits: Float[Tensor, "tokens n_experts"]) -> Float[Tensor, "tokens n_experts"]:
        return torch.softmax(self._in_score_dtype(logits), dim=-1)


class SigmoidTopK(TopKRouter):
    """Scores = a sigmoid of each expert's router logit (MiniMax-M2, GLM-4-MoE with one expert group, AFMoE, whose
    ``expert_bias`` is the correction bias and ``route_scale`` the routed scaling)."""

    scoring = "sigmoid"

    def scores(self, logits: Float[Tensor, "tokens n_experts"]) -> Float[Tensor, "tokens n_experts"]:
        return torch.sigmoid(self._in_score_dtype(logits))


class TopKThenSoftmax(TopKRouter):
    """The top-k logits, then a softmax over those k (JetMoE's ``JetMoeTopKGating``, GraniteMoe's router, GPT-OSS's):
    the softmax over the chosen logits (in ``score_dtype``: the source's ``.float()`` after its projection) scattered
    over all experts, 0 for the others, which is TransformerLens 3.9's ``GptOssMoE.hook_expert_weights``; the choice
    is its top k (the same experts in the same order: the softmax keeps the logits' order), and their weights those
    values, gathered (so they sum to 1 without renormalising). GraniteMoe casts its logits to float32 whatever the
    model dtype: with ``score_dtype`` float32 a float64 model chooses the source's experts with the source's weights,
    bit for bit."""

    scoring = "topk_softmax"

    def scores(self, logits: Float[Tensor, "tokens n_experts"]) -> Float[Tensor, "tokens n_experts"]:
        top, indices = torch.topk(self._in_score_dtype(logits), self.top_k, dim=-1)
        return torch.zeros_like(top[:, :1]).expand_as(logits).scatter(1, indices, torch.softmax(top, dim=-1))

    def choose(
        self, scores: Float[Tensor, "tokens n_experts"]
    ) -> tuple[Int[Tensor, "tokens top_k"], Float[Tensor, "tokens top_k"]]:
        weights, indices = torch.topk(scores, self.top_k, dim=-1)
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor
        return indices, weights


class TopKThenSigmoid(TopKRouter):
    """The top-k logits, then a sigmoid of each (Llama 4's ``Llama4Router``: ``topk`` of the logits in the
    activation dtype, then ``sigmoid(scores.float())`` of the chosen ones, unchosen experts' ``-inf`` giving 0, cast
    back): the scores are the logits themselves (the choice is on them, as the source's), and the chosen experts'
    weights their sigmoids in ``score_dtype``, neither renormalised nor scaled (``norm_topk_prob`` off)."""

    scoring = "topk_sigmoid"

    def scores(self, logits: Float[Tensor, "tokens n_experts"]) -> Float[Tensor, "tokens n_experts"]:
        return logits

    def choose(
        self, scores: Float[Tensor, "tokens n_experts"]
    ) -> tuple[Int[Tensor, "tokens top_k"], Float[Tensor, "tokens top_k"]]:
        top, indices = torch.topk(scores, self.top_k, dim=-1)
        # the sigmoid of the scattered [tokens, n_experts] scores, as the source lays them out (a vectorised sigmoid
        # can round an element differently by where it sits in the tensor), then the chosen ones
        scattered = torch.full_like(scores, float("-inf")).scatter(1, indices, top)
        weights = torch.sigmoid(self._in_score_dtype(scattered)).gather(1, indices)
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor
        return indices, weights


class SqrtSoftplusTopK(TopKRouter):
    """Scores = ``sqrt(softplus(logits))`` per expert (DeepSeek-V4's ``DeepseekV4TopKRouter``, ``scoring_func``
    "sqrtsoftplus"), in the activation dtype; the choice is ``torch.topk(scores + e_score_correction_bias,
    sorted=False)`` (the source's call: its unsorted order is the order the weights are summed in), the weights the
    chosen scores over their sum ``+ 1e-20``, times ``routed_scaling_factor``. Its hash-routed layers
    (``DeepseekV4HashRouter``) take the experts from a token-id table instead (:meth:`choose_from_table`)."""

    scoring = "sqrtsoftplus"

    def scores(self, logits: Float[Tensor, "tokens n_experts"]) -> Float[Tensor, "tokens n_experts"]:
        return F.softplus(self._in_score_dtype(logits)).sqrt()

    def choose(
        self, scores: Float[Tensor, "tokens n_experts"]
    ) -> tuple[Int[Tensor, "tokens top_k"], Float[Tensor, "tokens top_k"]]:
        bias = self.e_score_correction_bias
        indices = torch.topk(scores if bias is None else scores + bias, self.top_k, dim=-1, sorted=False).indices
        return indices, self.weights_of(scores, indices)

    def choose_from_table(
        self, scores: Float[Tensor, "tokens n_experts"], table: Int[Tensor, "d_vocab top_k"], tokens: Tensor
    ) -> tuple[Int[Tensor, "tokens top_k"], Float[Tensor, "tokens top_k"]]:
        """A hash-routed layer's choice: the experts ``table[token id]`` of each token, weighed as :meth:`choose`
        weighs its own."""
        indices = table[tokens.reshape(-1).to(table.device)]
        return indices, self.weights_of(scores, indices)

    def weights_of(
        self, scores: Float[Tensor, "tokens n_experts"], indices: Int[Tensor, "tokens top_k"]
    ) -> Float[Tensor, "tokens top_k"]:
        """The chosen experts' scores over their sum (``+ 1e-20``, the source's), times the routed scaling."""
        weights = scores.gather(1, indices)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor


ROUTERS: dict[str, type[TopKRouter]] = {
    "softmax": SoftmaxTopK,
    "sigmoid": SigmoidTopK,
    "topk_softmax": TopKThenSoftmax,
    "topk_sigmoid": TopKThenSigmoid,
    "sqrtsoftplus": SqrtSoftplusTopK,
}


def build_router(spec: MoESpec) -> TopKRouter:
    """The router component of ``spec.scoring``; an unknown rule is an error naming the known ones."""
    router = ROUTERS.get(spec.scoring)
    if router is None:
        raise InputError(f"unknown MoE router scoring {spec.scoring!r}; known: {sorted(ROUTERS)}")
    return router(spec)
