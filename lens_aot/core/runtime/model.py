"""The attention-only transformer that ``lens_aot.convert`` returns, numbered and hooked like its source.

``blocks.{l}`` is source layer ``l`` (:class:`~lens_aot.core.components.residual.block.TransformerBlock`): the source's
own heads
(``attn``), then its MLP as **neuron heads** (``mlp``, a :class:`~lens_aot.core.components.mlp.neuron_mlp.NeuronMLP`:
Theorem 3's heads in ``mlp.heads``; gated MLPs: ``mlp.gate_heads`` and ``mlp.product_heads``). Every hook point of
the source exists under the same name, with the same shape and (within the conversion's bound) the same value:
``hook_embed``, ``blocks.{l}.hook_resid_pre/mid/post``, ``attn.hook_q/k/v/attn_scores/pattern/z/result``,
``mlp.hook_pre/hook_post``, ``hook_attn_out``, ``hook_mlp_out``, the norms' hooks, so ``cfg.n_layers``,
``cache["resid_pre", l]`` and an SAE at ``blocks.8.hook_resid_pre`` mean what they mean on the source. The neuron
heads add their own: ``blocks.{l}.mlp.heads.hook_q/k/v/attn_scores/pattern/z/result``.

The paper's view, one sequence of attention-only sub-layers, is an ordering: :meth:`sublayers` lists the head
modules (attention, then the MLP's neuron heads, layer by layer). Use :meth:`neuron_heads` and :meth:`head_origin`
to move between source neurons and heads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, overload

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens import ActivationCache, HookedRootModule
from transformer_lens.hook_points import HookPoint

from lens_aot.core.components.factory import neuron_mlp
from lens_aot.core.components.moe.moe_mlp import MoEMLP
from lens_aot.core.components.ownership import exported
from lens_aot.core.components.token_ids import token_ids_in_scope
from lens_aot.core.components.transformer import SpecTransformer
from lens_aot.core.components.workspace import forward_workspace
from lens_aot.core.config import AOTConfig, derived_source_fields
from lens_aot.core.fit.activations import ActivationFit
from lens_aot.core.fit.gating import GatedFit
from lens_aot.core.fit.per_layer import neuron_parts, per_layer_heads, per_layer_neurons
from lens_aot.core.names import Expert, flat_layout_hint, module_expert, parse_module
from lens_aot.core.placement import Placement
from lens_aot.core.runtime.cache import LazyCacheDict, NeuronHeadCache
from lens_aot.core.runtime.generate import generate
from lens_aot.core.runtime.head_refs import ExpertHeadOrigin, HeadOrigin, HeadRef, Sublayer  # noqa: F401 (re-exported)
from lens_aot.core.runtime.inapplicable import weight_processing_refusals
from lens_aot.core.runtime.kv_cache import KeyValueCache, positions_and_mask
from lens_aot.core.runtime.tokens import Tokenizing
from lens_aot.core.runtime.weights import StackedWeights
from lens_aot.core.source_layer import source_layer
from lens_aot.core.spec.model_spec import LayerSpec, ModelSpec, NormSpec, head_shape
from lens_aot.errors import HookNameError, IndexRangeError, InputAssertionError, InputError
from lens_aot.hooks import hooked

ReturnType = Literal["logits", "loss", "both"] | None


def converted_class(source_kind: str | None, base: type | None = None) -> type[AttentionOnlyTransformer]:
    """The class a converted model of a ``source_kind`` source takes: ``base`` (default
    :class:`AttentionOnlyTransformer`) as the TransformerLens layer derives it
    (:attr:`~lens_aot.core.source_layer.SourceLayer.model_class`): under 3.x also a ``HookedTransformer``
    (:func:`lens_aot.tl.hooked.model.hooked_class`: ``isinstance(aot, HookedTransformer)`` holds, the
    ``HookedTransformer`` methods that do not apply raise); under 4.x, a ``TransformerBridge`` when the source was one
    (:func:`lens_aot.tl.bridge.model.bridge_class`), else ``base`` itself."""
    chosen: type[AttentionOnlyTransformer] = source_layer().model_class(base or AttentionOnlyTransformer, source_kind)
    return chosen


class AttentionOnlyTransformer(StackedWeights, Tokenizing, SpecTransformer):
    """An attention-only hooked transformer whose former MLP neurons are attention heads.

    Behaves like a TransformerLens model: ``model(tokens)``, ``run_with_cache``, ``run_with_hooks``, ``hooks()``,
    ``to_tokens`` / ``to_string`` (when the source had a tokenizer), the stacked weights (``W_Q`` … ``W_out``).
    """

    @classmethod
    def build(
        cls,
        spec: ModelSpec,
        fits: dict[int, ActivationFit | GatedFit],
        per_layer_fits: dict[int, GatedFit] | None = None,
    ) -> AttentionOnlyTransformer:
        """The converted model of ``spec``, of the class the TransformerLens layer gives it
        (:func:`converted_class`): what the pipeline's build step, ``io``'s load and every other construction of a
        converted model call. ``cls(spec, fits)`` itself builds a plain ``cls``."""
        return converted_class(spec.source_kind, cls)(spec, fits, per_layer_fits)

    def __init__(
        self,
        spec: ModelSpec,
        fits: dict[int, ActivationFit | GatedFit],
        per_layer_fits: dict[int, GatedFit] | None = None,
    ) -> None:
        """Build from a source :class:`ModelSpec` and, per source layer with an MLP, how its neurons become heads
        (an :class:`ActivationFit` for plain MLPs, a :class:`~lens_aot.core.fit.gating.GatedFit` for gated ones);
        ``per_layer_fits``: Gemma 4's per-layer-input sublayers' (default: :func:`~lens_aot.core.fit.per_layer.
        per_layer_fits` of ``spec``)."""
        ple = per_layer_neurons(spec, per_layer_fits)
        super().__init__(spec, lambda layer, mlp: neuron_mlp(mlp, fits[layer]), ple.build)
        n_heads, d_head, n_kv = head_shape(spec.layers[0].attn if spec.layers else None)
        self.cfg = AOTConfig.of(
            spec,
            n_heads=n_heads,
            d_head=d_head,
            n_key_value_heads=None if n_kv == n_heads else n_kv,
            model_name=f"{spec.model_name} (attention-only)",
            default_prepend_bos=spec.default_prepend_bos,
            tokenizer_prepends_bos=spec.extra.get("tokenizer_prepends_bos"),
            rotary_dim=None if spec.rotary is None else spec.rotary.rotary_dim,
            source_kind=spec.source_kind,
            activation_fits=dict(fits),
            per_layer_fits=ple.fits,
            source_config=dict(spec.extra.get("source_config", {})),
        )
        for name, value in derived_source_fields(spec).items():  # where the source had no config of its own
            if name not in self.cfg.source_config:
                setattr(self.cfg, name, value)
        self.report: Any = None  # set by lens_aot.convert
        # converted name -> source name of the parameters that are the source's own tensors (share_weights=True)
        self.shared_parameters: dict[str, str] = {}
        self.compatibility_mode = bool(spec.extra.get("compatibility_mode", False))  # the source bridge's
        self._block_devices = self._devices_of_blocks()
        self.hook_tokens = HookPoint()  # [batch, pos]; runs with cfg.use_hook_tokens, as TransformerLens's
        self.setup()
        self._carry_switches(spec.extra.get("switches", {}))

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

    def setup(self) -> None:
        """TransformerLens's hook registry, with lookups of a missing hook name explaining the source-aligned
        numbering (a name from lens_aot 0.1's flat layout gets :class:`HookNameError`)."""
        super().setup()
        self.mod_dict = _HookNames(self.mod_dict, len(self.blocks))
        # TransformerLens 4 names the per-head attention inputs under ``attn`` (``blocks.{l}.attn.hook_q_input``:
        # direct path patching, edge attribution patching), TransformerLens 3's HookedTransformer under the block
        # (``blocks.{l}.hook_q_input``): both names address the block's one hook point, as on a TransformerBridge.
        self.hook_aliases_: dict[str, str] = {
            f"blocks.{layer}.attn.{hook}": f"blocks.{layer}.{hook}"
            for layer in range(len(self.blocks))
            for hook in ("hook_q_input", "hook_k_input", "hook_v_input", "hook_attn_in")
        }
        for alias, name in self.hook_aliases_.items():
            self.mod_dict[alias] = self.hook_dict[alias] = self.mod_dict[name]

    # ------------------------------------------------------------------ forward
    @overload
    def forward(self, input: Any, return_type: Literal["logits"] = ..., **kwargs: Any) -> Tensor: ...
    @overload
    def forward(self, input: Any, return_type: ReturnType = ..., **kwargs: Any) -> Any: ...

    def forward(
        self,
        input: str | list[str] | Int[Tensor, "batch pos"] | Int[Tensor, " pos"] | Float[Tensor, "batch pos d_model"],
        return_type: ReturnType = "logits",
        loss_per_token: bool = False,
        prepend_bos: bool | None = None,
        padding_side: Literal["left", "right"] | None = None,
        start_at_layer: int | None = None,
        tokens: Int[Tensor, "batch pos"] | None = None,
        stop_at_layer: int | None = None,
        attention_mask: Int[Tensor, "batch pos"] | None = None,
        past_kv_cache: KeyValueCache | None = None,
        shortformer_pos_embed: Float[Tensor, "batch pos d_model"] | None = None,
    ) -> Any:
        """Run the model. ``return_type``: "logits" [batch, pos, d_vocab_out], "loss", "both" or None.

        TransformerLens semantics: ``stop_at_layer=l`` returns the residual stream before block ``l``;
        ``start_at_layer=l`` takes ``input`` as the residual stream before block ``l`` (``tokens`` for the loss);
        ``attention_mask`` (1 token, 0 padding) and ``padding_side`` handle padded batches, left padding included
        (positions count from each sequence's first token); ``past_kv_cache`` (a
        :class:`~lens_aot.core.runtime.kv_cache.
        KeyValueCache`) continues from cached keys and values (both concern the source's attention alone). Run in
        pieces as ACDC does: ``resid, tokens, shortformer_pos_embed, mask = aot.input_to_embed(x)``, then
        ``aot(resid, start_at_layer=0, tokens=tokens, shortformer_pos_embed=shortformer_pos_embed,
        attention_mask=mask)`` (``shortformer_pos_embed`` is None unless the source has shortformer positions).
        """
        self._sync_switches()
        if start_at_layer is None:
            resid, tokens, shortformer_pos_embed, mask = self.input_to_embed(
                input, prepend_bos, padding_side, attention_mask, past_kv_cache
            )
        else:
            resid = input
            mask = attention_mask
        self._check_shortformer_pos_embed(shortformer_pos_embed)
        # token ids reach the pieces that read them (DeepSeek-V4's hash routing, components/token_ids.py)
        with forward_workspace(), token_ids_in_scope(tokens):  # neuron heads' unobserved tensors reuse one buffer
            for layer in range(len(self.blocks))[start_at_layer:stop_at_layer]:
                block, device = self.blocks[layer], self._block_devices[layer]
                if resid.device != device:  # a model over several devices: the residual follows the blocks
                    resid = resid.to(device)
                entry = None if past_kv_cache is None else past_kv_cache[layer]
                if shortformer_pos_embed is None:
                    resid = block(resid, past_kv_cache_entry=entry, attention_mask=mask)
                else:  # shortformer positions: added to each attention's query and key inputs
                    pos = shortformer_pos_embed.to(resid.device)
                    resid = block(resid, past_kv_cache_entry=entry, attention_mask=mask, shortformer_pos_embed=pos)
        if stop_at_layer is not None:
            return resid
        if resid.device != self.unembed.W_U.device:
            resid = resid.to(self.unembed.W_U.device)
        logits = self.logits(resid)
        if return_type is None:
            return None
        if return_type == "logits":
            return logits
        if tokens is None:
            raise InputError("the loss needs the tokens: pass tokens=... with start_at_layer")
        loss_mask = None if mask is None else mask[:, -tokens.shape[1] :]
        loss = lm_cross_entropy_loss(logits, tokens, loss_mask, per_token=loss_per_token)
        if return_type == "loss":
            return loss
        if return_type == "both":
            return logits, loss
        raise ValueError(f"return_type must be 'logits', 'loss', 'both' or None; got {return_type!r}")

    def input_to_embed(
        self,
        input: str | list[str] | Int[Tensor, "batch pos"] | Int[Tensor, " pos"],
        prepend_bos: bool | None = None,
        padding_side: Literal["left", "right"] | None = None,
        attention_mask: Int[Tensor, "batch pos"] | None = None,
        past_kv_cache: KeyValueCache | None = None,
    ) -> tuple[Tensor, Int[Tensor, "batch pos"], Float[Tensor, "batch pos d_model"] | None, Tensor | None]:
        """The residual stream before block 0, as ``HookedTransformer.input_to_embed``: ``(residual, tokens,
        shortformer_pos_embed, attention_mask)``, to pass on as ``aot(residual, start_at_layer=0, tokens=tokens,
        shortformer_pos_embed=shortformer_pos_embed, attention_mask=attention_mask)``. Runs ``hook_tokens`` (with
        ``cfg.use_hook_tokens``), ``hook_embed`` and ``hook_pos_embed``; ``attention_mask`` is None where no mask is
        needed (no padding, no key-value cache), and with a key-value cache covers the cached positions too."""
        tokens = self._as_tokens(input, prepend_bos, padding_side)
        bos = self.cfg.default_prepend_bos if prepend_bos is None else prepend_bos
        offset, mask = positions_and_mask(tokens, attention_mask, past_kv_cache, padding_side, self.tokenizer, bos)
        if getattr(self.cfg, "use_hook_tokens", False):
            tokens = self.hook_tokens(tokens)
        resid = self.hook_embed(self.embed(tokens))
        shortformer = None
        if hasattr(self, "pos_embed"):
            pos = self.hook_pos_embed(self.pos_embed(tokens, offset, mask))
            if self.shortformer:
                shortformer = pos
            else:
                resid = resid + pos
        return self.streams(resid), tokens, shortformer, mask  # streams: DeepSeek-V4's hc_mult streams

    def _check_shortformer_pos_embed(self, shortformer_pos_embed: Tensor | None) -> None:
        if shortformer_pos_embed is not None and not self.shortformer:
            raise InputError(
                "shortformer_pos_embed applies only to a model with shortformer positions (this one's are "
                f"{self.cfg.positional_embedding_type!r}); pass None"
            )

    def loss_fn(
        self,
        logits: Float[Tensor, "batch pos d_vocab"],
        tokens: Int[Tensor, "batch pos"],
        attention_mask: Int[Tensor, "batch pos"] | None = None,
        per_token: bool = False,
    ) -> Tensor:
        """Next-token cross-entropy, as ``HookedTransformer.loss_fn``."""
        return lm_cross_entropy_loss(logits, tokens, attention_mask, per_token=per_token)

    def generate(self, input: Any = "", max_new_tokens: int = 10, **kwargs: Any) -> Any:
        """Generate tokens like ``HookedTransformer.generate`` (greedy or sampled, with a key-value cache by
        default; see :func:`lens_aot.core.runtime.generate.generate`)."""
        return generate(self, input, max_new_tokens, **kwargs)

    # ------------------------------------------------------------------ caching
    def run_with_cache(  # type: ignore[override]
        self,
        *model_args: Any,
        names_filter: str | list[str] | Callable[[str], bool] | None = None,
        incl_bwd: bool = False,
        pos_slice: Any = None,
        return_cache_object: bool = True,
        remove_batch_dim: bool = False,
        compact: bool = True,
        **kwargs: Any,
    ) -> tuple[Any, ActivationCache | dict[str, Tensor]]:
        """Run and cache activations, returning an ``ActivationCache`` like HookedTransformer does.

        With ``compact`` (the default), neuron-head entries (``blocks.{l}.mlp.<heads>.hook_q/k/v/attn_scores/
        pattern/z``) are not stored: each MLP's ``hook_pre`` (gated: and ``hook_pre_linear``, ``hook_gate``) is, and
        those entries are derived from it when read (:mod:`lens_aot.core.runtime.cache`), with the standard shapes. The
        cache
        then
        costs about what the source's does. Entries are stored eagerly instead when that would not be exact or
        possible: ``compact=False``, ``incl_bwd``, ``pos_slice``, ``use_attn_result``,
        ``return_cache_object=False``, or hooks already attached to neuron-head internals.
        """
        wanted = _AliasedPredicate(_names_predicate(names_filter), self.hook_aliases_)
        mlps = [(f"blocks.{i}.{a}", getattr(b, a)) for i, b in enumerate(self.blocks) for a in neuron_parts(b)]
        eager = not compact or incl_bwd or pos_slice is not None or not return_cache_object or self.cfg.use_attn_result
        eager = eager or any(hooked(*mlp.internal_hooks()) for _, mlp in mlps)
        derived: dict[str, tuple[tuple[str, ...], Callable[..., Tensor]]] = {}
        if not eager:
            for prefix, mlp in mlps:
                for hook, (inputs, fn) in mlp.derivations().items():
                    if wanted(f"{prefix}.{hook}"):
                        derived[f"{prefix}.{hook}"] = (tuple(f"{prefix}.{x}" for x in inputs), fn)
        sources = {src for srcs, _ in derived.values() for src in srcs}
        # HookedRootModule's (a dict of entries): not HookedTransformer's, which wraps them in its own cache object
        out, cache_dict = HookedRootModule.run_with_cache(
            self,
            *model_args,
            names_filter=lambda name: (wanted(name) and name not in derived) or name in sources,
            incl_bwd=incl_bwd,
            pos_slice=pos_slice,
            remove_batch_dim=remove_batch_dim,
            **kwargs,
        )
        for alias, name in self.hook_aliases_.items():
            if name in cache_dict and wanted.by_alias(alias):
                cache_dict[alias] = cache_dict[name]
        if not return_cache_object:
            return out, cache_dict
        lazy = LazyCacheDict(cache_dict)
        for name, (inputs, fn) in derived.items():
            if all(x in cache_dict for x in inputs):  # not for layers that did not run (stop_at_layer)
                lazy.derive(name, inputs, fn)
        return out, NeuronHeadCache(lazy, self, has_batch_dim=not remove_batch_dim)

    # ------------------------------------------------------------------ TransformerLens's switches
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

    # ------------------------------------------------------------------ neuron <-> head maps
    def sublayers(self) -> list[Sublayer]:
        """The head modules in the paper's flat order (layer 0's attention, its MLP's neuron heads, layer 1, ...)."""
        out: list[Sublayer] = []
        for layer, block in enumerate(self.blocks):
            out.append(Sublayer(len(out), f"blocks.{layer}.attn", "attention", layer))
            if block.has_mlp:
                for attr, _ in block.mlp.head_modules():
                    name = f"blocks.{layer}.mlp.{attr}"
                    out.append(Sublayer(len(out), name, parse_module(name).kind, layer))
        return out

    def sublayer(self, key: str | int) -> Sublayer:
        """A sub-layer by its head-module name or its index in :meth:`sublayers`."""
        subs = self.sublayers()
        if isinstance(key, int):
            if not -len(subs) <= key < len(subs):
                raise IndexRangeError(f"sub-layer {key} out of range: the model has {len(subs)} sub-layers")
            return subs[key]
        for sub in subs:
            if sub.name == key:
                return sub
        parse_module(key)  # a malformed name: say what the forms are
        raise InputError(f"{key!r} is not a head module of this model; aot.sublayers() lists them")

    def head_module(self, name: str) -> nn.Module:
        """The module holding the heads named ``name`` (``blocks.3.attn``, ``blocks.3.mlp.heads``, ...)."""
        layer, kind = parse_module(name)
        block = self.blocks[self._layer(layer)]
        if kind == "attention":
            return block.attn
        try:  # mlp.heads, mlp.experts.{e}.heads of a mixture of experts, or Gemma 4's per_layer.gate_heads
            return block.get_submodule(name.split(".", 2)[2])
        except AttributeError:
            raise InputError(f"{name!r} is not a head module of this model; aot.sublayers() lists them") from None

    def _head_modules(self) -> list[tuple[str, nn.Module]]:
        return [(sub.name, self.head_module(sub.name)) for sub in self.sublayers()]

    def neuron_modules(self, layer: int) -> list[str]:
        """Names of the modules holding source layer ``layer``'s neuron heads, in order: ``mlp.heads`` for a plain
        MLP; ``mlp.gate_heads`` then ``mlp.product_heads`` for a gated one; none for a layer without an MLP."""
        block = self.blocks[self._layer(layer)]
        if not block.has_mlp:
            return []
        return [f"blocks.{layer % len(self.blocks)}.mlp.{attr}" for attr, _ in block.mlp.head_modules()]

    def neuron_module(self, layer: int) -> str:
        """The module whose heads write source layer ``layer``'s MLP output (gated MLPs: the product heads)."""
        names = self.neuron_modules(layer)
        if not names:
            raise ValueError(f"source layer {layer} has no MLP, so it has no neuron heads")
        return names[-1]

    def neuron_heads(
        self, layer: int, neuron: int, expert: Expert = None, sublayer: Literal["mlp", "per_layer"] = "mlp"
    ) -> list[HeadRef]:
        """The heads that together compute neuron ``neuron`` of source layer ``layer``'s MLP (``sublayer=
        "per_layer"``: of Gemma 4's per-layer-input sublayer, ``blocks.{l}.per_layer``, gated, labels ``L{l}P{n}``).

        Plain MLPs: one head per term of the activation's fit. Gated MLPs: the gate heads (one per term of the gate
        activation's fit), then the neuron's two product heads (``+``, ``−``). Mixture-of-experts layers: neuron
        ``neuron`` of expert ``expert`` (an index, or ``"shared"`` for the shared expert), whose heads' output is
        scaled by the expert's router weight at each position.
        """
        block = self.blocks[self._layer(layer)]
        if sublayer != "mlp":
            return per_layer_heads(block, layer % len(self.blocks), neuron, expert, sublayer)
        if not block.has_mlp:
            raise ValueError(f"source layer {layer} has no MLP, so it has no neuron heads")
        prefix = f"blocks.{layer % len(self.blocks)}.mlp"
        if isinstance(block.mlp, MoEMLP):
            if expert is None:
                raise InputError(
                    f"source layer {layer}'s MLP is a mixture of {block.mlp.n_experts} experts: name the expert, "
                    f"aot.neuron_heads({layer}, {neuron}, expert=e) with e in 0..{block.mlp.n_experts - 1}"
                    + (" or 'shared'" if hasattr(block.mlp, "shared_expert") else "")
                )
            return [HeadRef(f"{prefix}.{attr}", head) for attr, head in block.mlp.neuron_heads(neuron, expert)]
        if expert is not None:
            raise InputError(f"source layer {layer}'s MLP is not a mixture of experts; leave expert unset")
        if not 0 <= neuron < block.mlp.d_mlp:
            raise IndexRangeError(
                f"neuron {neuron} out of range: layer {layer}'s MLP has d_mlp={block.mlp.d_mlp} (neurons 0 .. "
                f"{block.mlp.d_mlp - 1})"
            )
        return [HeadRef(f"{prefix}.{attr}", head) for attr, head in block.mlp.neuron_heads(neuron)]

    def head_origin(self, name: str, head: int) -> HeadOrigin | ExpertHeadOrigin:
        """Inverse of :meth:`neuron_heads`: what head ``head`` of module ``name`` (e.g. "blocks.3.mlp.heads") was.

        For a neuron head, ``component`` is its position in ``neuron_heads(layer, index)`` (``expert``: of that
        expert, for a module of a mixture-of-experts layer such as "blocks.3.mlp.experts.5.gate_heads").
        """
        layer, kind = parse_module(name)
        module = self.head_module(name)
        if not 0 <= head < module.n_heads:
            raise IndexRangeError(
                f"head {head} out of range: {name} has {module.n_heads} heads (0 .. {module.n_heads - 1})"
            )
        if kind == "attention":
            return HeadOrigin("attention", layer, head, 0)
        k = module.heads_per_neuron
        if ".per_layer." in name:  # Gemma 4's per-layer-input neurons (core/components/mlp/per_layer_neurons.py)
            offset = self.blocks[layer].per_layer.gate_heads.heads_per_neuron if kind == "product" else 0
            return HeadOrigin("per_layer", layer, head // k, offset + head % k)
        expert = module_expert(name)
        mlp = self.blocks[layer].mlp if expert is None else self.blocks[layer].mlp.expert(expert)
        offset = mlp.gate_heads.heads_per_neuron if kind == "product" else 0
        if expert is None:
            return HeadOrigin("neuron", layer, head // k, offset + head % k)
        return ExpertHeadOrigin("neuron", layer, head // k, offset + head % k, expert)

    def neuron_activations(self, cache: ActivationCache | dict[str, Tensor], layer: int) -> Float[Tensor, "... d_mlp"]:
        """A source layer's MLP activations: ``cache["post", layer]`` (``blocks.{l}.mlp.hook_post``)."""
        self.neuron_module(layer)  # raises for a layer without an MLP
        return cache[f"blocks.{layer % len(self.blocks)}.mlp.hook_post"]

    def _layer(self, layer: int) -> int:
        n = len(self.blocks)
        if not -n <= layer < n:
            raise IndexRangeError(f"source layer {layer} out of range: the source had {n} layers")
        return layer % n

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> AttentionOnlyTransformer:
        out = super()._apply(fn, *args, **kwargs)
        if hasattr(self, "cfg"):
            self.cfg.dtype, self.cfg.device = self.W_E.dtype, self.W_E.device
            self._block_devices = self._devices_of_blocks()
        return out

    # ------------------------------------------------------------------ placement over devices
    def _devices_of_blocks(self) -> list[torch.device]:
        return [next(iter(block.parameters())).device for block in self.blocks]

    @property
    def placement(self) -> Placement:
        """Where the model's parts are (:mod:`lens_aot.core.placement`): a converted model has its source's."""
        return Placement(self.W_E.device, tuple(self._block_devices), self.unembed.W_U.device)

    def place(self, placement: Placement) -> AttentionOnlyTransformer:
        """Move each layer, the embeddings and the unembedding to ``placement``'s devices (e.g.
        ``lens_aot.core.placement.split_evenly(aot.cfg.n_layers, ["cuda:0", "cuda:1"])`` for a loaded model)."""
        if len(placement.layers) != len(self.blocks):
            raise ValueError(
                f"the placement has {len(placement.layers)} layers but the model has {len(self.blocks)} source layers"
            )
        for block, device in zip(self.blocks, placement.layers, strict=True):
            block.to(device)
        self.embed.to(placement.embed)
        if hasattr(self, "pos_embed"):
            self.pos_embed.to(placement.embed)
        for module in self.output_modules():  # ln_final, the prediction head if any, unembed
            module.to(placement.unembed)
        self.cfg.device = self.W_E.device
        self._block_devices = self._devices_of_blocks()
        return self

    # ------------------------------------------------------------------ back to a spec
    def layer_specs(self) -> list[LayerSpec]:
        """The source layers this model implements (attention weights, norms, and MLP weights with activation)."""
        return [block.layer_spec() for block in self.blocks]

    def final_norm_spec(self) -> NormSpec:
        """The final norm (``ln_final``) as a :class:`NormSpec` (its kind, epsilon and weights)."""
        return self.ln_final.spec()

    def to_spec(self) -> ModelSpec:
        """The source model this one implements, as a :class:`ModelSpec` (tensors copied; MLPs with their original
        activation, not its fit). ``AttentionOnlyTransformer.build(aot.to_spec(), aot.cfg.activation_fits)`` rebuilds
        ``aot``; :class:`lens_aot.core.check.reference.MLPTransformer` (``aot.to_spec()``) runs the original
        computation."""
        # the model's rotary tables: those of a layer without its own (``rotary_base_local``)
        attns = [block.attn for block in self.blocks]
        first = next((a for a in attns if not a.own_rotary), attns[0] if attns else None)
        rotary = None
        if first is not None and first.rotary_dim:
            rotary = first.rotary_spec()
        extra: dict[str, Any] = {}
        if self.cfg.tokenizer_prepends_bos is not None:
            extra["tokenizer_prepends_bos"] = self.cfg.tokenizer_prepends_bos
        if self.cfg.source_config:
            extra["source_config"] = dict(self.cfg.source_config)
        if self.compatibility_mode:
            extra["compatibility_mode"] = True
        unread = getattr(self.pos_embed, "W_pos_unread", None) if hasattr(self, "pos_embed") else None  # OPT's rows
        return ModelSpec(
            d_model=self.cfg.d_model,
            n_ctx=self.cfg.n_ctx,
            d_vocab=self.cfg.d_vocab,
            d_vocab_out=self.cfg.d_vocab_out,
            causal=self.cfg.attention_dir == "causal",
            W_E=exported(self.W_E),
            layers=self.layer_specs(),
            ln_final=self.final_norm_spec(),
            W_U=exported(self.W_U),
            b_U=exported(self.unembed.b_U),
            positions=self.cfg.positional_embedding_type,  # type: ignore[arg-type]
            W_pos=None if self.W_pos is None else exported(self.W_pos),
            W_pos_unread=None if unread is None else exported(unread),
            rotary=rotary,
            tokenizer=self.tokenizer,
            default_prepend_bos=self.cfg.default_prepend_bos,
            model_name=self.cfg.model_name.removesuffix(" (attention-only)"),
            source_kind=self.cfg.source_kind,
            extra=extra,
            **self.variant_specs(),
        )


# TransformerLens 3.9's weight processing (process_weights_, fold_layer_norm, ...) raises an InputError naming what
# to do instead, under any TransformerLens (under 3.x the HookedTransformer-derived class refuses them alike)
for _name, _refused in weight_processing_refusals().items():
    setattr(AttentionOnlyTransformer, _name, _refused)


def _switch(module: nn.Module, name: str, value: Any) -> None:
    """``setattr(module, name, value)`` only where it changes (``nn.Module.__setattr__`` takes microseconds, and a
    forward syncs the switches of every head module: hundreds per layer in a mixture of 64 experts)."""
    if getattr(module, name, None) != value:
        setattr(module, name, value)


def _names_predicate(names_filter: str | list[str] | Callable[[str], bool] | None) -> Callable[[str], bool]:
    """TransformerLens's ``names_filter`` forms (None, a name, a list of names, a predicate) as a predicate."""
    if names_filter is None:
        return lambda name: True
    if isinstance(names_filter, str):
        return lambda name: name == names_filter
    if isinstance(names_filter, (list, tuple, set)):
        allowed = set(names_filter)
        return lambda name: name in allowed
    return names_filter


class _AliasedPredicate:
    """A ``names_filter`` over canonical hook names: an alias (``blocks.{l}.attn.hook_q_input``) is never cached
    under its own name by TransformerLens (one hook point, one ``hook.name``); wanting it wants its hook point, and
    :meth:`by_alias` says which aliases to add to the cache afterwards."""

    def __init__(self, wanted: Callable[[str], bool], aliases: dict[str, str]) -> None:
        self.wanted, self.aliases = wanted, aliases
        self.via_alias = {name for alias, name in aliases.items() if wanted(alias)}

    def __call__(self, name: str) -> bool:
        return name not in self.aliases and (self.wanted(name) or name in self.via_alias)

    def by_alias(self, alias: str) -> bool:
        return self.wanted(alias)


def lm_cross_entropy_loss(
    logits: Float[Tensor, "batch pos d_vocab"],
    tokens: Int[Tensor, "batch pos"],
    attention_mask: Int[Tensor, "batch pos"] | None = None,
    per_token: bool = False,
) -> Float[Tensor, ""] | Float[Tensor, "batch pos_minus_1"]:
    """Next-token cross-entropy, as TransformerLens computes it (padding positions, and those before a padding
    position, are left out when ``attention_mask`` is given)."""
    log_probs = F.log_softmax(logits, dim=-1)
    predicted = log_probs[:, :-1].gather(dim=-1, index=tokens[:, 1:, None])[..., 0]
    if attention_mask is None:
        return -predicted if per_token else -predicted.mean()
    keep = torch.logical_and(attention_mask[:, :-1], attention_mask[:, 1:])
    predicted = predicted.masked_fill(~keep, 0.0)
    return -predicted if per_token else -predicted.sum() / keep.sum()


class _HookNames(dict):
    """``mod_dict`` whose missing names explain the source-aligned numbering when they look like lens_aot 0.1's."""

    def __init__(self, modules: dict[str, nn.Module], n_layers: int) -> None:
        super().__init__(modules)
        self.n_layers = n_layers

    def __missing__(self, name: str) -> nn.Module:
        hint = flat_layout_hint(name, self.n_layers) if isinstance(name, str) else None
        raise HookNameError(hint or f"{name!r} is not a hook point or module of this model")
