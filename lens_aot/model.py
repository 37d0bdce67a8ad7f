"""The attention-only transformer that ``lens_aot.convert`` returns.

Layer ``l`` of the source becomes two attention-only blocks: ``blocks.{2l}`` holds the source's own heads and
``blocks.{2l+1}`` holds the **neuron heads** that replace its MLP (Theorem 3, :mod:`lens_aot.components.
neuron_attention`); a source layer without an MLP becomes one block. Every block is
``resid_post = resid_pre + attn(ln1(resid_pre))``, with TransformerLens's hook names, so ``cfg.attn_only`` is True and
``ActivationCache.decompose_resid`` sums to the last ``hook_resid_post``.
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
from lens_aot.components import Attention, Embed, NeuronAttention, Norm, PosEmbed, Unembed
from lens_aot.components.hooks import hooked
from lens_aot.errors import InputError
from lens_aot.spec import LayerSpec, ModelSpec, NormSpec, RotarySpec

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
    use_attn_result: bool = False
    use_split_qkv_input: bool = False
    use_hook_mlp_in: bool = False
    use_attn_in: bool = False
    original_architecture: str = "lens_aot.AttentionOnlyTransformer"
    source_kind: str = "HookedTransformer"
    activation_fits: dict[int, ActivationFit] = field(default_factory=dict)


class AttentionBlock(nn.Module):
    """An attention-only block: ``resid_post = resid_pre + attn(ln1(resid_pre))``."""

    def __init__(self, ln1: nn.Module, attn: nn.Module) -> None:
        super().__init__()
        self.ln1 = ln1
        self.attn = attn
        self.hook_resid_pre = HookPoint()  # [batch, pos, d_model]
        self.hook_attn_out = HookPoint()  # [batch, pos, d_model]
        self.hook_resid_post = HookPoint()  # [batch, pos, d_model]

    def forward(self, resid: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        resid = self.hook_resid_pre(resid)
        attn_out = self.hook_attn_out(self.attn(self.ln1(resid)))
        return self.hook_resid_post(resid + attn_out)


class AttentionOnlyTransformer(HookedRootModule):
    """An attention-only hooked transformer whose former MLP neurons are attention heads.

    Behaves like a TransformerLens model: ``model(tokens)``, ``run_with_cache``, ``run_with_hooks``, ``hooks()``,
    ``to_tokens`` / ``to_string`` (when the source had a tokenizer). Use :meth:`neuron_heads` and
    :meth:`head_origin` to move between source neurons and heads.
    """

    def __init__(self, spec: ModelSpec, fits: dict[int, ActivationFit]) -> None:
        super().__init__()
        attn0 = spec.layers[0].attn if spec.layers else None
        self.embed = Embed(spec.W_E)
        self.hook_embed = HookPoint()  # [batch, pos, d_model]
        if spec.positions == "standard":
            assert spec.W_pos is not None
            self.pos_embed = PosEmbed(spec.W_pos)
            self.hook_pos_embed = HookPoint()  # [batch, pos, d_model]
        blocks: list[AttentionBlock] = []
        self._block_of: list[tuple[int, int | None]] = []
        self._origin: list[tuple[Literal["attention", "neuron"], int]] = []
        for layer, layer_spec in enumerate(spec.layers):
            if layer_spec.parallel or (layer_spec.mlp is not None and layer_spec.mlp.gated):
                raise NotImplementedError("gated and parallel layers are being added")
            attn_block = len(blocks)
            blocks.append(AttentionBlock(Norm(layer_spec.ln1), Attention(layer_spec.attn, spec.causal, spec.rotary)))
            self._origin.append(("attention", layer))
            neuron_block = None
            if layer_spec.mlp is not None:
                assert layer_spec.ln2 is not None
                neuron_block = len(blocks)
                blocks.append(AttentionBlock(Norm(layer_spec.ln2), NeuronAttention(layer_spec.mlp, fits[layer])))
                self._origin.append(("neuron", layer))
            self._block_of.append((attn_block, neuron_block))
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
            source_kind=spec.source_kind,
            activation_fits=dict(fits),
        )
        self.report: Any = None  # set by lens_aot.convert
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
        for block in self.blocks[:stop_at_layer]:
            resid = block(resid)
        if stop_at_layer is not None:
            return resid
        logits = self.unembed(self.ln_final(resid))
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
        if input.ndim == 1:
            input = input[None]
        if input.ndim != 2:
            raise InputError(f"tokens must have shape [batch, pos] or [pos]; got shape {tuple(input.shape)}")
        if input.shape[1] > self.cfg.n_ctx:
            raise InputError(
                f"{input.shape[1]} tokens exceed the model's context n_ctx={self.cfg.n_ctx}; "
                f"truncate the input (e.g. tokens[:, -{self.cfg.n_ctx}:]) or split it into windows."
            )
        if input.numel() and (int(input.min()) < 0 or int(input.max()) >= self.cfg.d_vocab):
            raise InputError(
                f"token ids must lie in [0, {self.cfg.d_vocab}); got range [{int(input.min())}, {int(input.max())}]"
            )
        return input.to(self.cfg.device)

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
        neuron_blocks = [i for i, block in enumerate(self.blocks) if isinstance(block.attn, NeuronAttention)]
        eager = not compact or incl_bwd or pos_slice is not None or not return_cache_object or self.cfg.use_attn_result
        eager = eager or any(hooked(*_internal_hooks(self.blocks[i].attn)) for i in neuron_blocks)
        derived: dict[str, tuple[str, Callable[[Tensor], Tensor]]] = {}
        if not eager:
            for i in neuron_blocks:
                for hook, fn in _derivations(self.blocks[i].attn).items():
                    if wanted(f"blocks.{i}.attn.{hook}"):
                        derived[f"blocks.{i}.attn.{hook}"] = (f"blocks.{i}.attn.hook_pre", fn)
        sources = {src for src, _ in derived.values()}
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
        for name, (source, fn) in derived.items():
            lazy.derive(name, source, fn)
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

    def neuron_block(self, layer: int) -> int:
        """Index of the block holding the neuron heads of source layer ``layer``'s MLP."""
        block = self._block_of[self._layer(layer)][1]
        if block is None:
            raise ValueError(f"source layer {layer} has no MLP, so it has no neuron heads")
        return block

    def neuron_heads(self, layer: int, neuron: int) -> list[HeadRef]:
        """The heads that together compute neuron ``neuron`` of source layer ``layer``'s MLP (one per fit term)."""
        block = self.neuron_block(layer)
        attn = self.blocks[block].attn
        if not 0 <= neuron < attn.d_mlp:
            raise IndexError(f"neuron {neuron} out of range: layer {layer}'s MLP has d_mlp={attn.d_mlp}")
        k = attn.heads_per_neuron
        return [HeadRef(f"blocks.{block}.attn", neuron * k + j) for j in range(k)]

    def head_origin(self, name: str | int, head: int) -> HeadOrigin:
        """Inverse of :meth:`neuron_heads`: what head ``head`` of block ``name`` (e.g. "blocks.3.attn" or 3) was."""
        block = name if isinstance(name, int) else _block_index(name)
        kind, layer = self._origin[block]
        n_heads = self.cfg.n_heads_per_block[block]
        if not 0 <= head < n_heads:
            raise IndexError(f"head {head} out of range: block {block} has {n_heads} heads")
        if kind == "attention":
            return HeadOrigin("attention", layer, head, 0)
        k = self.blocks[block].attn.heads_per_neuron
        return HeadOrigin("neuron", layer, head // k, head % k)

    def neuron_activations(self, cache: ActivationCache | dict[str, Tensor], layer: int) -> Float[Tensor, "... d_mlp"]:
        """A source layer's MLP activations (``mlp.hook_post``), as the sum of each neuron's heads' ``hook_z``."""
        block = self.neuron_block(layer)
        z = cache[f"blocks.{block}.attn.hook_z"].squeeze(-1)
        return z.unflatten(-1, (-1, self.blocks[block].attn.heads_per_neuron)).sum(-1)

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
                total = total + block.attn.b_O
        return total

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> AttentionOnlyTransformer:
        out = super()._apply(fn, *args, **kwargs)
        if hasattr(self, "cfg"):
            self.cfg.dtype, self.cfg.device = self.W_E.dtype, self.W_E.device
        return out

    # ------------------------------------------------------------------ back to a spec
    def layer_specs(self) -> list[LayerSpec]:
        """The source layers this model implements (attention weights, norms, and MLP weights with activation)."""
        layers = []
        for attn_block, neuron_block in self._block_of:
            a = self.blocks[attn_block]
            n = None if neuron_block is None else self.blocks[neuron_block]
            layers.append(
                LayerSpec(
                    a.ln1.spec(),
                    a.attn.spec(),
                    None if n is None else n.ln1.spec(),
                    None if n is None else n.attn.spec(),
                )
            )
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
                first.rotary_cos.detach().clone(),
                first.rotary_sin.detach().clone(),
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
            W_E=self.W_E.detach().clone(),
            layers=self.layer_specs(),
            ln_final=self.final_norm_spec(),
            W_U=self.W_U.detach().clone(),
            b_U=self.unembed.b_U.detach().clone(),
            positions=self.cfg.positional_embedding_type,  # type: ignore[arg-type]
            W_pos=None if self.W_pos is None else self.W_pos.detach().clone(),
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


def _internal_hooks(attn: NeuronAttention) -> tuple[HookPoint, ...]:
    return (attn.hook_q, attn.hook_k, attn.hook_v, attn.hook_attn_scores, attn.hook_pattern, attn.hook_z)


def _derivations(attn: NeuronAttention) -> dict[str, Callable[[Tensor], Tensor]]:
    """How each neuron-head hook's value follows from ``hook_pre`` when nothing intervenes (any leading dims)."""

    def scores(pre: Tensor) -> Tensor:
        return attn.dense_scores(pre.new_zeros(()).expand(*pre.shape[:-1], attn.n_heads))

    return {
        "hook_q": attn.queries,
        "hook_k": attn.keys,
        "hook_v": attn.values,
        "hook_attn_scores": scores,
        "hook_pattern": lambda pre: attn.dense_pattern(scores(pre), -attn.queries(pre).squeeze(-1)),
        "hook_z": lambda pre: attn.self_weight(attn.queries(pre), attn.keys(pre)) * attn.values(pre),
    }


def lm_cross_entropy_loss(
    logits: Float[Tensor, "batch pos d_vocab"], tokens: Int[Tensor, "batch pos"], per_token: bool = False
) -> Float[Tensor, ""] | Float[Tensor, "batch pos_minus_1"]:
    """Next-token cross-entropy, as TransformerLens computes it."""
    log_probs = F.log_softmax(logits, dim=-1)
    predicted = log_probs[:, :-1].gather(dim=-1, index=tokens[:, 1:, None])[..., 0]
    return -predicted if per_token else -predicted.mean()


def _block_index(name: str) -> int:
    parts = name.split(".")
    if len(parts) < 2 or parts[0] != "blocks" or not parts[1].isdigit():
        raise ValueError(f"expected a block name like 'blocks.3.attn'; got {name!r}")
    return int(parts[1])
