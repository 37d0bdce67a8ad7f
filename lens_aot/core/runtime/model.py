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

from typing import Any, Literal, TypeAlias, overload

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from lens_aot.core.components.factory import neuron_mlp
from lens_aot.core.components.ownership import exported
from lens_aot.core.components.token_ids import token_ids_in_scope
from lens_aot.core.components.transformer import SpecTransformer
from lens_aot.core.components.workspace import forward_workspace
from lens_aot.core.config import AOTConfig, converted_config_class, derived_source_fields  # noqa: F401 (AOTConfig re-exported)
from lens_aot.core.fit.activations import ActivationFit
from lens_aot.core.fit.gating import GatedFit
from lens_aot.core.fit.per_layer import per_layer_neurons
from lens_aot.core.names import flat_layout_hint
from lens_aot.core.placement import Placement
from lens_aot.core.runtime.caching import CompactCaching
from lens_aot.core.runtime.generate import generate
from lens_aot.core.runtime.head_refs import ExpertHeadOrigin, HeadOrigin, HeadRef, Sublayer  # noqa: F401 (re-exported)
from lens_aot.core.runtime.inapplicable import weight_processing_refusals
from lens_aot.core.runtime.kv_cache import KeyValueCache, positions_and_mask
from lens_aot.core.runtime.neuron_map import NeuronHeadMap
from lens_aot.core.runtime.switches import RuntimeSwitches
from lens_aot.core.runtime.tokens import Tokenizing
from lens_aot.core.runtime.weights import StackedWeights
from lens_aot.core.source_layer import source_layer
from lens_aot.core.spec.model_spec import LayerSpec, ModelSpec, NormSpec, head_shape
from lens_aot.errors import HookNameError, InputError

ReturnType = Literal["logits", "loss", "both"] | None
NeuronFits: TypeAlias = dict[int, ActivationFit | GatedFit]  # per source layer with an MLP: its neurons as heads
PerLayerFits: TypeAlias = dict[int, GatedFit] | None  # Gemma 4's per-layer-input sublayers' (None: the spec's own)


def converted_class(source_kind: str | None, base: type | None = None) -> type[AttentionOnlyTransformer]:
    """The class a converted model of a ``source_kind`` source takes: ``base`` (default
    :class:`AttentionOnlyTransformer`) as the TransformerLens layer derives it
    (:attr:`~lens_aot.core.source_layer.SourceLayer.model_class`): under 3.x also a ``HookedTransformer``
    (:func:`lens_aot.tl.hooked.model.hooked_class`: ``isinstance(aot, HookedTransformer)`` holds, the
    ``HookedTransformer`` methods that do not apply raise); under 4.x, a ``TransformerBridge`` when the source was one
    (:func:`lens_aot.tl.bridge.model.bridge_class`), else ``base`` itself."""
    chosen: type[AttentionOnlyTransformer] = source_layer().model_class(base or AttentionOnlyTransformer, source_kind)
    return chosen


class AttentionOnlyTransformer(
    NeuronHeadMap, RuntimeSwitches, CompactCaching, StackedWeights, Tokenizing, SpecTransformer
):
    """An attention-only hooked transformer whose former MLP neurons are attention heads.

    Behaves like a TransformerLens model: ``model(tokens)``, ``run_with_cache``, ``run_with_hooks``, ``hooks()``,
    ``to_tokens`` / ``to_string`` (when the source had a tokenizer), the stacked weights (``W_Q`` … ``W_out``).
    """

    @classmethod
    def build(cls, spec: ModelSpec, fits: NeuronFits, per_layer_fits: PerLayerFits = None) -> AttentionOnlyTransformer:
        """The converted model of ``spec``, of the class the TransformerLens layer gives it
        (:func:`converted_class`): what the pipeline's build step, ``io``'s load and every other construction of a
        converted model call. ``cls(spec, fits)`` itself builds a plain ``cls``."""
        return converted_class(spec.source_kind, cls)(spec, fits, per_layer_fits)

    def __init__(self, spec: ModelSpec, fits: NeuronFits, per_layer_fits: PerLayerFits = None) -> None:
        """Build from a source :class:`ModelSpec` and, per source layer with an MLP, how its neurons become heads
        (an :class:`ActivationFit` for plain MLPs, a :class:`~lens_aot.core.fit.gating.GatedFit` for gated ones);
        ``per_layer_fits``: Gemma 4's per-layer-input sublayers' (default: :func:`~lens_aot.core.fit.per_layer.
        per_layer_fits` of ``spec``)."""
        ple = per_layer_neurons(spec, per_layer_fits)
        super().__init__(spec, lambda layer, mlp: neuron_mlp(mlp, fits[layer]), ple.build)
        n_heads, d_head, n_kv = head_shape(spec.layers[0].attn if spec.layers else None)
        self.cfg = converted_config_class(spec.source_kind).of(
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
