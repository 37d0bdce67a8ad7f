"""Modules of the attention-only model, one per file, hook points declared beside the computation they expose."""

from lens_aot.core.components.attention.attention import Attention
from lens_aot.core.components.embed import Embed, PosEmbed, Unembed
from lens_aot.core.components.mlp.mlp import MLP
from lens_aot.core.components.mlp.neuron_attention import NeuronAttention
from lens_aot.core.components.mlp.neuron_mlp import NeuronMLP
from lens_aot.core.components.mlp.product_attention import ProductAttention
from lens_aot.core.components.norm import Norm

__all__ = [
    "MLP",
    "Attention",
    "Embed",
    "NeuronAttention",
    "NeuronMLP",
    "Norm",
    "PosEmbed",
    "ProductAttention",
    "Unembed",
]
