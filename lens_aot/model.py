"""The attention-only transformer that ``lens_aot.convert`` returns.

Each source layer becomes attention-only blocks, in order: one holding the source's own heads, then the **neuron
heads** that replace its MLP (Theorem 3, :mod:`lens_aot.components.neuron_attention`). A plain MLP is one block of
neuron heads (so layer ``l`` is ``blocks.{2l}``, ``blocks.{2l+1}`` when every layer has one); a gated MLP is two, gate
heads then product heads (:mod:`lens_aot.gating`); a layer without an MLP is one block. Every block is
``resid_post = resid_pre + attn(ln1(resid_pre))``, with TransformerLens's hook names, so ``cfg.attn_only`` is True and
``ActivationCache.decompose_resid`` sums to the last ``hook_resid_post``. Use :meth:`attention_block`,
:meth:`neuron_blocks` and :meth:`neuron_heads` rather than index arithmetic.

Parallel layers (GPT-J, GPT-NeoX): the source's attention and MLP both read the layer's input, so the neuron blocks of
such a layer read the residual as it was *before* the layer's attention block (``blocks.{i}.hook_resid_pre`` of the
attention block), i.e. the layer is one attention layer holding both kinds of heads, laid out as consecutive blocks.
Gated models carry ``cfg.d_scratch`` extra residual channels after the source's ``d_model`` (the gate heads' outputs,
cleared by the product heads within the layer): ``hook_resid_*`` are ``[batch, pos, d_model + d_scratch]``, norms read
only the first ``d_model`` channels, and ``resid[..., :d_model]`` is the source's residual.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, overload

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens import ActivationCache, HookedRootModule
from transformer_lens.hook_points import HookPoint

from lens_aot.activations import ActivationFit
from lens_aot.cache import LazyCacheDict, NeuronHeadCache
from lens_aot.components import Attention, Embed, NeuronAttention, Norm, PosEmbed, ProductAttention, Unembed
from lens_aot.components.ownership import exported
from lens_aot.errors import InputError
from lens_aot.gating import GatedFit
from lens_aot.placement import Placement
from lens_aot.spec import LayerSpec, MLPSpec, ModelSpec, NormSpec, RotarySpec
from lens_aot.tl.hooks import hooked

ReturnType = Literal["logits", "loss", "both"] | None


class HeadRef(NamedTuple):
    """A head of the converted model: ``name`` is its attention module's hook prefix, ``head`` its index there."""

    name: str
    head: int


class HeadOrigin(NamedTuple):
    """What a head of the converted model was in the source.

    ``kind`` "attention": head ``index`` of source layer ``layer``'s attention. ``kind`` "neuron": neuron ``index`` of
    source layer ``layer``'s MLP, ``component`` the term of its activation fit that this head computes.
    """

    kind: Literal["attention", "neuron"]
    layer: int
    index: int
    component: int


@dataclass
class AOTConfig:
    """TransformerLens-style configuration of the converted model (the fields TransformerLens tools read)."""

    n_layers: int  # blocks of the converted model (2 per source layer with an MLP)
    d_model: int
    n_ctx: int
    d_vocab: int
    d_vocab_out: int
    n_heads: int  # heads of the source's attention blocks
    d_head: int
    n_key_value_heads: int | None
    n_source_layers: int
    n_heads_per_block: list[int]
    normalization_type: str | None
    positional_embedding_type: str
    attention_dir: str
    dtype: torch.dtype
    device: torch.device
    model_name: str = "unnamed"
    default_prepend_bos: bool = True
    tokenizer_prepends_bos: bool | None = None
    attn_only: bool = True
    d_mlp: int | None = None
    act_fn: str | None = None
    gated_mlp: bool = False
    parallel_attn_mlp: bool = False
    d_scratch: int = 0  # gated models: residual channels after d_model holding gate activations within a layer
    use_attn_result: bool = False
    use_split_qkv_input: bool = False
    use_hook_mlp_in: bool = False
    use_attn_in: bool = False
    original_architecture: str = "lens_aot.AttentionOnlyTransformer"
    source_kind: str = "HookedTransformer"
    activation_fits: dict[int, ActivationFit | GatedFit] = field(default_factory=dict)

    @property
    def d_resid(self) -> int:
        """Width of the residual stream: ``d_model`` plus the scratch channels of gated models."""
        return self.d_model + self.d_scratch


class AttentionBlock(nn.Module):
    """An attention-only block: ``resid_post = resid_pre + attn(ln1(resid_pre))``.

    ``parallel``: ``attn`` reads ``layer_input`` (the residual before this source layer's first block) instead of
    ``resid_pre``. ``d_model < d_resid`` (gated models): ``ln1`` reads the first ``d_model`` channels; a module with
    ``reads_scratch`` also gets the raw scratch channels; outputs narrower than the residual are placed at their
    channels (gate heads at their scratch offset, everything else at the start).
    """

    def __init__(
        self, ln1: nn.Module, attn: nn.Module, *, parallel: bool = False, d_model: int = 0, d_resid: int = 0
    ) -> None:
        super().__init__()
        self.ln1 = ln1
        self.attn = attn
        self.parallel = parallel
        self.d_model, self.d_resid = d_model, d_resid
        self.hook_resid_pre = HookPoint()  # [batch, pos, d_resid]
        self.hook_attn_out = HookPoint()  # [batch, pos, d_resid]
        self.hook_resid_post = HookPoint()  # [batch, pos, d_resid]

    def forward(
        self, resid: Float[Tensor, "batch pos d_resid"], layer_input: Float[Tensor, "batch pos d_resid"] | None = None
    ) -> Float[Tensor, "batch pos d_resid"]:
        resid = self.hook_resid_pre(resid)
        read = layer_input if self.parallel and layer_input is not None else resid
        if self.d_resid <= self.d_model:
            out = self.attn(self.ln1(read))
        else:
            x = self.ln1(read[..., : self.d_model])
            if getattr(self.attn, "reads_scratch", False):
                out = self.attn(x, resid[..., self.d_model :])
            else:
                out = self.attn(x)
                start = self.attn.scratch[0] if getattr(self.attn, "scratch", None) is not None else 0
                out = F.pad(out, (start, self.d_resid - start - out.shape[-1]))
        return self.hook_resid_post(resid + self.hook_attn_out(out))


class AttentionOnlyTransformer(HookedRootModule):
    """An attention-only hooked transformer whose former MLP neurons are attention heads.

    Behaves like a TransformerLens model: ``model(tokens)``, ``run_with_cache``, ``run_with_hooks``, ``hooks()``,
    ``to_tokens`` / ``to_string`` (when the source had a tokenizer). Use :meth:`neuron_heads` and
    :meth:`head_origin` to move between source neurons and heads.
    """

    def __init__(self, spec: ModelSpec, fits: dict[int, ActivationFit | GatedFit]) -> None:
        """Build from a source :class:`ModelSpec` and, per source layer with an MLP, how its neurons become heads
        (an :class:`ActivationFit` for plain MLPs, a :class:`~lens_aot.gating.GatedFit` for gated ones)."""
        super().__init__()
        attn0 = spec.layers[0].attn if spec.layers else None
        d_model = spec.d_model
        d_scratch = max(
            (int(ls.mlp.W_in.shape[1]) for ls in spec.layers if ls.mlp is not None and ls.mlp.gated), default=0
        )
        d_resid = d_model + d_scratch
        self.embed = Embed(spec.W_E)
        self.hook_embed = HookPoint()  # [batch, pos, d_model]
        if spec.positions == "standard":
            assert spec.W_pos is not None
            self.pos_embed = PosEmbed(spec.W_pos)
            self.hook_pos_embed = HookPoint()  # [batch, pos, d_model]
        blocks: list[AttentionBlock] = []
        self._block_of: list[tuple[int, tuple[int, ...]]] = []
        self._origin: list[tuple[Literal["attention", "neuron", "gate", "product"], int]] = []
        widths = {"d_model": d_model, "d_resid": d_resid}
        for layer, ls in enumerate(spec.layers):
            attn_block = len(blocks)
            blocks.append(AttentionBlock(Norm(ls.ln1), Attention(ls.attn, spec.causal, spec.rotary), **widths))
            self._origin.append(("attention", layer))
            neuron_blocks: list[int] = []
            if ls.mlp is not None:
                assert ls.ln2 is not None
                fit = fits[layer]
                parallel = ls.parallel
                if isinstance(fit, GatedFit) != ls.mlp.gated:
                    raise ValueError(f"layer {layer}: a gated MLP needs a GatedFit and a plain one an ActivationFit")
                if isinstance(fit, GatedFit):
                    assert ls.mlp.W_gate is not None
                    W_gate, b_gate = ls.mlp.W_gate, ls.mlp.b_gate
                    b_gate = W_gate.new_zeros(W_gate.shape[1]) if b_gate is None else b_gate
                    gate = MLPSpec(W_gate, b_gate, ls.mlp.W_out, ls.mlp.b_out, ls.mlp.act_fn)
                    heads = NeuronAttention(gate, fit.gate, scratch=(d_model, d_resid))
                    neuron_blocks.append(len(blocks))
                    blocks.append(AttentionBlock(Norm(ls.ln2), heads, parallel=parallel, **widths))
                    self._origin.append(("gate", layer))
                    scales = torch.tensor(fit.scales, dtype=spec.dtype, device=ls.mlp.W_in.device)
                    product = ProductAttention(
                        ls.mlp.W_in, ls.mlp.b_in, ls.mlp.W_out, ls.mlp.b_out, ls.mlp.b_post, scales, d_scratch
                    )
                    neuron_blocks.append(len(blocks))
                    blocks.append(AttentionBlock(Norm(ls.ln2), product, parallel=parallel, **widths))
                    self._origin.append(("product", layer))
                else:
                    neuron_blocks.append(len(blocks))
                    blocks.append(
                        AttentionBlock(Norm(ls.ln2), NeuronAttention(ls.mlp, fit), parallel=parallel, **widths)
                    )
                    self._origin.append(("neuron", layer))
            self._block_of.append((attn_block, tuple(neuron_blocks)))
        self.blocks = nn.ModuleList(blocks)
        self.ln_final = Norm(spec.ln_final)
        self.unembed = Unembed(spec.W_U, spec.b_U)
        self.tokenizer = spec.tokenizer
        mlp0 = next((ls.mlp for ls in spec.layers if ls.mlp is not None), None)
        self.cfg = AOTConfig(
            n_layers=len(blocks),
            d_model=spec.d_model,
            n_ctx=spec.n_ctx,
            d_vocab=spec.d_vocab,
            d_vocab_out=spec.d_vocab_out,
            n_heads=attn0.W_Q.shape[0] if attn0 is not None else 0,
            d_head=attn0.W_Q.shape[2] if attn0 is not None else 0,
            n_key_value_heads=attn0.W_K.shape[0] if attn0 is not None else None,
            n_source_layers=len(spec.layers),
            n_heads_per_block=[int(b.attn.n_heads) for b in blocks],
            normalization_type=spec.ln_final.kind,
            positional_embedding_type=spec.positions,
            attention_dir="causal" if spec.causal else "bidirectional",
            dtype=spec.dtype,
            device=spec.device,
            model_name=f"{spec.model_name} (attention-only)",
            default_prepend_bos=spec.default_prepend_bos,
            tokenizer_prepends_bos=spec.extra.get("tokenizer_prepends_bos"),
            d_mlp=None if mlp0 is None else int(mlp0.W_in.shape[1]),
            act_fn=None if mlp0 is None else mlp0.act_fn,
            gated_mlp=mlp0 is not None and mlp0.gated,
            parallel_attn_mlp=any(ls.parallel for ls in spec.layers),
            d_scratch=d_scratch,
            source_kind=spec.source_kind,
            activation_fits=dict(fits),
        )
        self.report: Any = None  # set by lens_aot.convert
        self._block_devices = self._devices_of_blocks()
        self.setup()

    # ------------------------------------------------------------------ forward
    @overload
    def forward(self, input: Any, return_type: Literal["logits"] = ..., **kwargs: Any) -> Tensor: ...
    @overload
    def forward(self, input: Any, return_type: ReturnType = ..., **kwargs: Any) -> Any: ...

    def forward(
        self,
        input: str | list[str] | Int[Tensor, "batch pos"] | Int[Tensor, " pos"],
        return_type: ReturnType = "logits",
        loss_per_token: bool = False,
        prepend_bos: bool | None = None,
        stop_at_layer: int | None = None,
    ) -> Any:
        """Run the model. ``return_type``: "logits" [batch, pos, d_vocab_out], "loss", "both" or None.

        ``stop_at_layer=i`` returns the residual stream before block ``i`` (TransformerLens semantics).
        """
        tokens = self._as_tokens(input, prepend_bos)
        resid = self.hook_embed(self.embed(tokens))
        if hasattr(self, "pos_embed"):
            resid = resid + self.hook_pos_embed(self.pos_embed(tokens))
        if self.cfg.d_scratch:
            resid = F.pad(resid, (0, self.cfg.d_scratch))
        layer_input = resid
        for block, device in zip(self.blocks[:stop_at_layer], self._block_devices, strict=False):
            if resid.device != device:  # a model over several devices: the residual follows the blocks
                resid, layer_input = resid.to(device), layer_input.to(device)
            if not block.parallel:
                layer_input = resid
            resid = block(resid, layer_input)
        if stop_at_layer is not None:
            return resid
        if resid.device != self.unembed.W_U.device:
            resid = resid.to(self.unembed.W_U.device)
        logits = self.unembed(self.ln_final(resid[..., : self.cfg.d_model]))
        if return_type is None:
            return None
        if return_type == "logits":
            return logits
        loss = lm_cross_entropy_loss(logits, tokens, per_token=loss_per_token)
        if return_type == "loss":
            return loss
        if return_type == "both":
            return logits, loss
        raise ValueError(f"return_type must be 'logits', 'loss', 'both' or None; got {return_type!r}")

    def _as_tokens(self, input: Any, prepend_bos: bool | None) -> Int[Tensor, "batch pos"]:
        if isinstance(input, (str, list)):
            return self.to_tokens(input, prepend_bos=prepend_bos)
        if not isinstance(input, Tensor):
            raise InputError(f"input must be a string, a list of strings or a tensor of token ids; got {type(input)}")
        if input.is_floating_point() or input.is_complex() or input.dtype == torch.bool:
            raise InputError(
                f"tokens must be an integer tensor of token ids, got dtype {input.dtype}; "
                f"use model.to_tokens(text) or tokens.long()."
            )
        if input.dtype != torch.long:
            input = input.long()  # uint8 would index as a mask, int8/int16 not at all
        if input.ndim == 1:
            input = input[None]
        if input.ndim != 2:
            raise InputError(f"tokens must have shape [batch, pos] or [pos]; got shape {tuple(input.shape)}")
        if input.shape[1] > self.cfg.n_ctx:
            raise InputError(
                f"{input.shape[1]} tokens exceed the model's context n_ctx={self.cfg.n_ctx}; "
                f"truncate the input (e.g. tokens[:, -{self.cfg.n_ctx}:]) or split it into windows."
            )
        self._check_token_range(input)
        return input.to(self.cfg.device)

    def _check_token_range(self, tokens: Int[Tensor, "batch pos"]) -> None:
        """Raise if a token id lies outside ``[0, d_vocab)`` (``W_E[tokens]`` would wrap a negative id silently).

        Without a host-device sync: tokens in host memory are read on the host (through NumPy, no device op); tokens
        already on a device are checked there with ``torch._assert_async``, which fails the forward with a device-side
        assertion instead of the named error (pass CPU tokens to get the message)."""
        if not tokens.numel():
            return
        if tokens.device.type == "cpu":
            ids = tokens.detach().numpy()
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= self.cfg.d_vocab:
                raise InputError(
                    f"token ids must lie in [0, {self.cfg.d_vocab}); got range [{low}, {high}]. Tokenize with this "
                    f"model's tokenizer (model.to_tokens(text)) or map the ids into its vocabulary."
                )
        else:
            torch._assert_async(((tokens >= 0) & (tokens < self.cfg.d_vocab)).all())

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

        With ``compact`` (the default), neuron-head entries (``hook_q/k/v/attn_scores/pattern/z`` of neuron blocks)
        are not stored: each neuron block's ``hook_pre`` is, and those entries are derived from it when read
        (:mod:`lens_aot.cache`), with the standard shapes. The cache then costs about what the source's does.
        Entries are stored eagerly instead when that would not be exact or possible: ``compact=False``,
        ``incl_bwd``, ``pos_slice``, ``use_attn_result``, ``return_cache_object=False``, or hooks already
        attached to neuron-head internals.
        """
        wanted = _names_predicate(names_filter)
        neuron_blocks = [i for i, block in enumerate(self.blocks) if hasattr(block.attn, "derivations")]
        eager = not compact or incl_bwd or pos_slice is not None or not return_cache_object or self.cfg.use_attn_result
        eager = eager or any(hooked(*self.blocks[i].attn.internal_hooks()) for i in neuron_blocks)
        derived: dict[str, tuple[tuple[str, ...], Callable[..., Tensor]]] = {}
        if not eager:
            for i in neuron_blocks:
                for hook, (inputs, fn) in self.blocks[i].attn.derivations().items():
                    if wanted(f"blocks.{i}.attn.{hook}"):
                        derived[f"blocks.{i}.attn.{hook}"] = (tuple(f"blocks.{i}.attn.{x}" for x in inputs), fn)
        sources = {src for srcs, _ in derived.values() for src in srcs}
        out, cache_dict = super().run_with_cache(
            *model_args,
            names_filter=lambda name: (wanted(name) and name not in derived) or name in sources,
            incl_bwd=incl_bwd,
            pos_slice=pos_slice,
            remove_batch_dim=remove_batch_dim,
            **kwargs,
        )
        if not return_cache_object:
            return out, cache_dict
        lazy = LazyCacheDict(cache_dict)
        for name, (inputs, fn) in derived.items():
            lazy.derive(name, inputs, fn)
        return out, NeuronHeadCache(lazy, self, has_batch_dim=not remove_batch_dim)

    def set_use_attn_result(self, use_attn_result: bool) -> None:
        """Compute per-head outputs (``hook_result``) in every block, as in TransformerLens."""
        self.cfg.use_attn_result = use_attn_result
        for block in self.blocks:
            block.attn.use_attn_result = use_attn_result

    # ------------------------------------------------------------------ neuron <-> head maps
    def attention_block(self, layer: int) -> int:
        """Index of the block holding source layer ``layer``'s attention heads."""
        return self._block_of[self._layer(layer)][0]

    def neuron_blocks(self, layer: int) -> list[int]:
        """Indices of the blocks holding the neuron heads of source layer ``layer``'s MLP, in order: one block for a
        plain MLP; gate heads then product heads for a gated one; none for a layer without an MLP."""
        return list(self._block_of[self._layer(layer)][1])

    def neuron_block(self, layer: int) -> int:
        """Index of the block whose heads write source layer ``layer``'s MLP output (gated MLPs: the product heads)."""
        blocks = self.neuron_blocks(layer)
        if not blocks:
            raise ValueError(f"source layer {layer} has no MLP, so it has no neuron heads")
        return blocks[-1]

    def neuron_heads(self, layer: int, neuron: int) -> list[HeadRef]:
        """The heads that together compute neuron ``neuron`` of source layer ``layer``'s MLP.

        Plain MLPs: one head per term of the activation's fit. Gated MLPs: the gate heads (one per term of the gate
        activation's fit, in the gate block), then the neuron's two product heads (``+``, ``−``).
        """
        blocks = self.neuron_blocks(layer)
        if not blocks:
            raise ValueError(f"source layer {layer} has no MLP, so it has no neuron heads")
        d_mlp = self.blocks[blocks[0]].attn.d_mlp
        if not 0 <= neuron < d_mlp:
            raise IndexError(f"neuron {neuron} out of range: layer {layer}'s MLP has d_mlp={d_mlp}")
        refs = []
        for block in blocks:
            k = self.blocks[block].attn.heads_per_neuron
            refs += [HeadRef(f"blocks.{block}.attn", neuron * k + j) for j in range(k)]
        return refs

    def head_origin(self, name: str | int, head: int) -> HeadOrigin:
        """Inverse of :meth:`neuron_heads`: what head ``head`` of block ``name`` (e.g. "blocks.3.attn" or 3) was.

        For a neuron head, ``component`` is its position in ``neuron_heads(layer, index)``.
        """
        block = name if isinstance(name, int) else _block_index(name)
        if not 0 <= block < len(self.blocks):
            raise IndexError(f"block {block} out of range: the model has {len(self.blocks)} blocks")
        kind, layer = self._origin[block]
        n_heads = self.cfg.n_heads_per_block[block]
        if not 0 <= head < n_heads:
            raise IndexError(f"head {head} out of range: block {block} has {n_heads} heads")
        if kind == "attention":
            return HeadOrigin("attention", layer, head, 0)
        k = self.blocks[block].attn.heads_per_neuron
        offset = self.blocks[self.neuron_blocks(layer)[0]].attn.heads_per_neuron if kind == "product" else 0
        return HeadOrigin("neuron", layer, head // k, offset + head % k)

    def neuron_activations(self, cache: ActivationCache | dict[str, Tensor], layer: int) -> Float[Tensor, "... d_mlp"]:
        """A source layer's MLP activations (``mlp.hook_post``) from its neuron heads' ``hook_z``: the sum over a
        neuron's heads (plain MLPs), or ``(2/ε)(z₊ − z₋) + b_post`` over its product heads (gated MLPs; computed
        without cancellation from the cached ``hook_pre_linear`` / ``hook_gate`` when present, see
        :meth:`ProductAttention.neuron_output`)."""
        block = self.neuron_block(layer)
        heads, name = self.blocks[block].attn, f"blocks.{block}.attn"
        z = cache[f"{name}.hook_z"]
        if isinstance(heads, ProductAttention) and f"{name}.hook_pre_linear" in cache and f"{name}.hook_gate" in cache:
            return heads.neuron_output(z, cache[f"{name}.hook_pre_linear"], cache[f"{name}.hook_gate"], dense=None)
        return heads.neuron_output(z)

    def _layer(self, layer: int) -> int:
        n = len(self._block_of)
        if not -n <= layer < n:
            raise IndexError(f"source layer {layer} out of range: the source had {n} layers")
        return layer % n

    # ------------------------------------------------------------------ tokens
    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise InputError("this model has no tokenizer (its source had none); pass token ids as a tensor")
        return self.tokenizer

    def to_tokens(
        self,
        input: str | list[str],
        prepend_bos: bool | None = None,
        padding_side: Literal["left", "right"] | None = None,
        move_to_device: bool = True,
        truncate: bool = True,
    ) -> Int[Tensor, "batch pos"]:
        """Tokenize like HookedTransformer: prepend BOS if ``prepend_bos`` (default: the source's setting)."""
        tokenizer = self._require_tokenizer()
        prepend_bos = self.cfg.default_prepend_bos if prepend_bos is None else prepend_bos
        texts = [input] if isinstance(input, str) else list(input)
        kwargs: dict[str, Any] = {"return_tensors": "pt", "padding": True}
        if truncate:
            kwargs.update(truncation=True, max_length=self.cfg.n_ctx)
        if padding_side is not None:
            kwargs["padding_side"] = padding_side
        tokenizer_adds_bos = bool(self.cfg.tokenizer_prepends_bos)
        if prepend_bos and not tokenizer_adds_bos and tokenizer.bos_token is not None:
            texts = [tokenizer.bos_token + t for t in texts]
        tokens = tokenizer(texts, **kwargs)["input_ids"]
        if tokenizer_adds_bos and not prepend_bos:
            tokens = tokens[:, 1:]
        return tokens.to(self.cfg.device) if move_to_device else tokens

    def to_string(self, tokens: Int[Tensor, "... pos"] | list[int]) -> str | list[str]:
        """Decode token ids (a batch gives a list of strings)."""
        tokenizer = self._require_tokenizer()
        if isinstance(tokens, Tensor) and tokens.ndim > 1:
            return [tokenizer.decode(t) for t in tokens]
        return tokenizer.decode(tokens)

    def to_str_tokens(self, input: str | Int[Tensor, " pos"], prepend_bos: bool | None = None) -> list[str]:
        """One string per token (for labelling plots)."""
        tokenizer = self._require_tokenizer()
        tokens = self.to_tokens(input, prepend_bos=prepend_bos)[0] if isinstance(input, str) else input.flatten()
        return [tokenizer.decode([int(t)]) for t in tokens]

    def to_single_token(self, string: str) -> int:
        """The id of a string that is exactly one token."""
        tokens = self.to_tokens(string, prepend_bos=False)[0]
        if tokens.numel() != 1:
            raise InputError(f"{string!r} is {tokens.numel()} tokens, not one")
        return int(tokens[0])

    # ------------------------------------------------------------------ weights
    @property
    def W_E(self) -> Float[Tensor, "d_vocab d_model"]:
        return self.embed.W_E

    @property
    def W_U(self) -> Float[Tensor, "d_model d_vocab_out"]:
        return self.unembed.W_U

    @property
    def W_pos(self) -> Float[Tensor, "n_ctx d_model"] | None:
        return self.pos_embed.W_pos if hasattr(self, "pos_embed") else None

    def tokens_to_residual_directions(self, tokens: Int[Tensor, "..."] | int | str) -> Float[Tensor, "... d_model"]:
        """Unembedding directions of ``tokens`` (as in TransformerLens)."""
        if isinstance(tokens, str):
            tokens = self.to_single_token(tokens)
        if isinstance(tokens, int):
            return self.W_U[:, tokens]
        return self.W_U[:, tokens].movedim(0, -1)

    def accumulated_bias(self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True) -> Tensor:
        """Sum of the output biases of blocks before ``layer`` (``mlp_input`` also adds block ``layer``'s)."""
        total = self.W_E.new_zeros(self.cfg.d_model)
        for block in self.blocks[: layer + int(mlp_input)]:
            if include_mlp_biases or isinstance(block.attn, Attention):
                total = total + block.attn.b_O[: self.cfg.d_model]
        return total

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> AttentionOnlyTransformer:
        out = super()._apply(fn, *args, **kwargs)
        if hasattr(self, "cfg"):
            self.cfg.dtype, self.cfg.device = self.W_E.dtype, self.W_E.device
            self._block_devices = self._devices_of_blocks()
        return out

    # ------------------------------------------------------------------ placement over devices
    def _devices_of_blocks(self) -> list[torch.device]:
        return [next(iter(block.parameters())).device for block in self.blocks]

    def block_layers(self) -> list[int]:
        """The source layer of each block."""
        return [layer for _, layer in self._origin]

    @property
    def placement(self) -> Placement:
        """Where the model's parts are (:mod:`lens_aot.placement`): a converted model has its source's."""
        devices = self._block_devices
        layers = tuple(devices[attn] for attn, _ in self._block_of)
        return Placement(self.W_E.device, layers, self.unembed.W_U.device)

    def place(self, placement: Placement) -> AttentionOnlyTransformer:
        """Move each source layer's blocks, the embeddings and the unembedding to ``placement``'s devices (e.g.
        ``lens_aot.placement.split_evenly(aot.cfg.n_source_layers, ["cuda:0", "cuda:1"])`` for a loaded model)."""
        if len(placement.layers) != len(self._block_of):
            raise ValueError(
                f"the placement has {len(placement.layers)} layers but the model {len(self._block_of)} source layers"
            )
        for block, layer in zip(self.blocks, self.block_layers(), strict=True):
            block.to(placement.layers[layer])
        self.embed.to(placement.embed)
        if hasattr(self, "pos_embed"):
            self.pos_embed.to(placement.embed)
        self.ln_final.to(placement.unembed)
        self.unembed.to(placement.unembed)
        self.cfg.device = self.W_E.device
        self._block_devices = self._devices_of_blocks()
        return self

    # ------------------------------------------------------------------ back to a spec
    def layer_specs(self) -> list[LayerSpec]:
        """The source layers this model implements (attention weights, norms, and MLP weights with activation)."""
        layers = []
        for attn_block, neuron_blocks in self._block_of:
            a = self.blocks[attn_block]
            ln2 = mlp = None
            parallel = False
            if neuron_blocks:
                last = self.blocks[neuron_blocks[-1]]
                ln2, parallel = last.ln1.spec(), last.parallel
                if isinstance(last.attn, ProductAttention):
                    gate = self.blocks[neuron_blocks[0]].attn
                    mlp = last.attn.spec(gate.W_in, gate.b_in, gate.act_fn)
                else:
                    mlp = last.attn.spec()
            layers.append(LayerSpec(a.ln1.spec(), a.attn.spec(), ln2, mlp, parallel))
        return layers

    def final_norm_spec(self) -> NormSpec:
        return self.ln_final.spec()

    def to_spec(self) -> ModelSpec:
        """The source model this one implements, as a :class:`ModelSpec` (tensors copied; MLPs with their original
        activation, not its fit). ``AttentionOnlyTransformer(aot.to_spec(), aot.cfg.activation_fits)`` rebuilds
        ``aot``; :class:`lens_aot.reference.MLPTransformer` (``aot.to_spec()``) runs the original computation."""
        first = self.blocks[self.attention_block(0)].attn if self._block_of else None
        rotary = None
        if first is not None and first.rotary_dim:
            rotary = RotarySpec(
                first.rotary_dim,
                exported(first.rotary_cos),
                exported(first.rotary_sin),
                first.rotary_adjacent_pairs,
            )
        extra: dict[str, Any] = {}
        if self.cfg.tokenizer_prepends_bos is not None:
            extra["tokenizer_prepends_bos"] = self.cfg.tokenizer_prepends_bos
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
            rotary=rotary,
            tokenizer=self.tokenizer,
            default_prepend_bos=self.cfg.default_prepend_bos,
            model_name=self.cfg.model_name.removesuffix(" (attention-only)"),
            source_kind=self.cfg.source_kind,
            extra=extra,
        )


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


def lm_cross_entropy_loss(
    logits: Float[Tensor, "batch pos d_vocab"], tokens: Int[Tensor, "batch pos"], per_token: bool = False
) -> Float[Tensor, ""] | Float[Tensor, "batch pos_minus_1"]:
    """Next-token cross-entropy, as TransformerLens computes it."""
    log_probs = F.log_softmax(logits, dim=-1)
    predicted = log_probs[:, :-1].gather(dim=-1, index=tokens[:, 1:, None])[..., 0]
    return -predicted if per_token else -predicted.mean()


def _block_index(name: str) -> int:
    parts = name.split(".")
    valid = len(parts) == 3 and parts[0] == "blocks" and parts[1].isdigit() and parts[2] == "attn"
    if not valid or (len(parts[1]) > 1 and parts[1].startswith("0")):
        raise ValueError(f"expected a head module name like 'blocks.3.attn' (or the block index 3); got {name!r}")
    return int(parts[1])
