"""The converted model's TransformerLens run-time switches (``use_attn_result``, ``use_split_qkv_input``,
``use_attn_in``, ``use_hook_mlp_in``, ``ungroup_grouped_query_attention``, ``use_fused_neurons``): their setters, and
their values carried to the blocks and head modules before each forward."""

from __future__ import annotations

from typing import Any

from torch import nn

from lens_aot.core.fit.per_layer import neuron_parts
from lens_aot.errors import InputAssertionError


class RuntimeSwitches:
    """Mixin for a model with ``cfg``, ``embed`` and ``blocks`` (each a
    :class:`~lens_aot.core.components.residual.block.TransformerBlock`) whose head modules it lists as
    ``_head_modules()``."""

    cfg: Any
    embed: Any
    blocks: Any
    _head_modules: Any

    def _carry_switches(self, switches: dict[str, bool]) -> None:
        """Turn on the TransformerLens run-time switches the source had on (``use_attn_result``,
        ``use_split_qkv_input``, ``ungroup_grouped_query_attention``, ...: :data:`lens_aot.tl.config_fields.SWITCHES`),
        through the same setters a user calls, so the converted model has the hooks each creates under the source's
        names."""
        for name, value in switches.items():
            if not value:
                continue
            setter = getattr(self, f"set_{name}", None)
            if callable(setter):
                setter(True)
            else:
                setattr(self.cfg, name, True)

    def set_use_attn_result(self, use_attn_result: bool) -> None:
        """Compute per-head outputs (``hook_result``) in every head module, neuron heads included."""
        self.cfg.use_attn_result = use_attn_result
        for _, module in self._head_modules():
            module.use_attn_result = use_attn_result

    def set_use_split_qkv_input(self, use_split_qkv_input: bool) -> None:
        """Give each head its own copy of the attention input (``hook_q_input`` / ``hook_k_input`` /
        ``hook_v_input``, [batch, pos, head, d_model]), as in TransformerLens."""
        self.cfg.use_split_qkv_input = use_split_qkv_input
        for block in self.blocks:
            block.use_split_qkv_input = use_split_qkv_input

    def set_use_attn_in(self, use_attn_in: bool) -> None:
        """Give each head its own copy of the attention input (``hook_attn_in``), as in TransformerLens. With
        grouped-query attention only for a TransformerBridge's conversion (TransformerLens 4's bridges allow it, keys
        and values then reading the first ``n_key_value_heads`` copies; a HookedTransformer refuses it)."""
        if use_attn_in and self.cfg.n_key_value_heads is not None and self.cfg.source_kind != "TransformerBridge":
            raise InputAssertionError(
                "use_attn_in does not work with grouped-query attention (as on a HookedTransformer); use "
                "set_use_split_qkv_input(True) for per-head query, key and value inputs"
            )
        self.cfg.use_attn_in = use_attn_in
        for block in self.blocks:
            block.use_attn_in = use_attn_in

    def set_use_hook_mlp_in(self, use_hook_mlp_in: bool) -> None:
        """Run ``blocks.{l}.hook_mlp_in`` (a copy of the MLP's input), as in TransformerLens."""
        if use_hook_mlp_in and self.cfg.attn_only:
            raise InputAssertionError(
                "hook_mlp_in needs MLP layers, and this model's source has none (attn_only): leave use_hook_mlp_in off"
            )
        self.cfg.use_hook_mlp_in = use_hook_mlp_in
        for block in self.blocks:
            block.use_hook_mlp_in = use_hook_mlp_in

    def set_ungroup_grouped_query_attention(self, ungroup_grouped_query_attention: bool) -> None:
        """Give grouped-query attention one key and value per query head (``hook_k`` / ``hook_v``, and with split
        input ``hook_k_input`` / ``hook_v_input``, then have ``n_heads`` heads), as in TransformerLens; setting
        ``cfg.ungroup_grouped_query_attention`` directly does the same."""
        self.cfg.ungroup_grouped_query_attention = ungroup_grouped_query_attention

    def _sync_switches(self) -> None:
        """Apply ``cfg.use_*`` to the blocks (as on a HookedTransformer); drop the last forward's per-layer inputs."""
        self.embed.new_forward()  # Gemma 4: each forward computes its own (components/residual/per_layer_inputs.py)
        cfg = self.cfg
        for block in self.blocks:
            _switch(block, "use_split_qkv_input", cfg.use_split_qkv_input)
            _switch(block, "use_attn_in", cfg.use_attn_in)
            _switch(block, "use_hook_mlp_in", cfg.use_hook_mlp_in and block.has_mlp)
            _switch(block.attn, "ungroup", cfg.ungroup_grouped_query_attention)
            _switch(block.attn, "use_attn_result", cfg.use_attn_result)
            for part in neuron_parts(block):  # the MLP, and Gemma 4's per-layer-input sublayer
                _switch(getattr(block, part), "use_fused", cfg.use_fused_neurons)
                for _, heads in getattr(block, part).head_modules():
                    _switch(heads, "use_attn_result", cfg.use_attn_result)

    def set_use_fused_neurons(self, use_fused_neurons: bool) -> None:
        """Skip the neuron heads' per-head tensors (``hook_q/k/v/z``) while none of them is hooked, computing each
        activation in closed form: faster, but tools that wrap modules instead of hooking them (nnsight) then do not
        see those hook points run. Hooks attached by TransformerLens or ``register_forward_hook`` still work."""
        self.cfg.use_fused_neurons = use_fused_neurons
        for block in self.blocks:
            for part in neuron_parts(block):
                getattr(block, part).use_fused = use_fused_neurons


def _switch(module: nn.Module, name: str, value: Any) -> None:
    """``setattr(module, name, value)`` only where it changes (``nn.Module.__setattr__`` takes microseconds, and a
    forward syncs the switches of every head module: hundreds per layer in a mixture of 64 experts)."""
    if getattr(module, name, None) != value:
        setattr(module, name, value)
