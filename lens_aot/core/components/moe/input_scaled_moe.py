"""A mixture of experts whose router weights scale each expert's *input* (Llama 4's ``Llama4TextMoe``)."""

from __future__ import annotations

from jaxtyping import Float
from torch import Tensor

from lens_aot.core.components.moe.moe_mlp import MoEMLP


class InputScaledMoEMLP(MoEMLP):
    """:class:`~lens_aot.core.components.moe.moe_mlp.MoEMLP` with Llama 4's routed sum: ``out = Σ_e expert_e(w_e·x) +
    shared(x)``, the chosen expert's router weight ``w_e`` (its sigmoid score; 0 where it is not chosen) multiplying
    the expert's input, as ``Llama4TextMoe.forward`` computes ``routed_in = x · router_scores`` before the experts.
    Each expert's neurons stay neuron heads (Huben & Morris 2023, Theorem 3; gated: gate heads then product heads)
    reading the scaled input, so neuron ``n`` of expert ``e`` computes ``act(w_e·(x·w_gate))·(w_e·(x·w_up))`` — the
    score inside the activation — and its output is not scaled again. An unchosen expert's input is 0, and a gated
    SiLU expert's output at 0 is exactly 0, so running it densely (while hooked) adds nothing there. Hooks: the
    experts' hooks see the scaled input's pre-activations (what the source computes); ``hook_topk_weights`` the
    weights that scale the inputs. Routing, hooks and top-k cost are :class:`MoEMLP`'s."""

    input_scaled = True

    def expert_input(
        self, x: Float[Tensor, "*batch pos d_model"], weight: Float[Tensor, "*batch pos 1"]
    ) -> Float[Tensor, "*batch pos d_model"]:
        """The expert reads its input times its router weight."""
        return x * weight

    def scaled_output(
        self, y: Float[Tensor, "*batch pos d_model"], weight: Float[Tensor, "*batch pos 1"]
    ) -> Float[Tensor, "*batch pos d_model"]:
        """The expert's output, not scaled again."""
        return y
