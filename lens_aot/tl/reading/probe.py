"""Record what each block piece of a TransformerBridge computes on one short input, and check a reading against it.

The structural reader (:mod:`lens_aot.tl.bridge.read`) decides what a block does from its components, shapes and
config fields. Two things cannot be read off a module without running it: how the block wires its pieces together
(sequential ``resid + attn(ln1(resid))`` then ``+ mlp(ln2(·))``, parallel with two norms, parallel with one shared
norm) and whether each piece's reading reproduces the piece. :func:`record` runs the bridge once on a few tokens
with plain PyTorch forward hooks on every block, norm, attention and MLP component (removed even when the forward
raises; hooks a user attached to the bridge's hook points are detached meanwhile and put back, and it runs in
eval mode) and keeps each
piece's last input and output; :func:`check_piece` compares a reading's output with the recorded one and names the
layer and the piece when they differ. A reading of a half-precision source (``convert``'s half path) that misses in
half is refused with :class:`~lens_aot.errors.HalfReadingError` (:func:`inexact`): ``convert`` then reads it in
float32.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from lens_aot.core.dtypes import HALF_DTYPES
from lens_aot.errors import HalfReadingError, UnsupportedArchitectureError
from lens_aot.tl.reading.half_forward import rotated_qk_in_model_dtype

# What the bridge readers support, named in every refusal of a piece (refuse_piece, pieces.bridge_refusal).
SUPPORTED = (
    "TransformerBridge architectures read by their structure (docs/families.md lists every piece) — decoder-only "
    "blocks, sequential or parallel (Falcon, Cohere, GPT-J / GPT-NeoX), pre-norm, sandwich or post norms, "
    "post-embedding LayerNorm, layer scalars and residual / embedding / attention / logit multipliers; plain or gated "
    "MLPs (fused gate-up included) with any neuron-wise activation (SiLU, ReLU, relu², each GELU form, xIELU, GPT-OSS's"
    " and DeepSeek-V4's clamped SwiGLU) and mixtures of experts (routed, hash-routed and shared experts); "
    "hyper-connections (several residual streams, DeepSeek-V4); LayerNorm / RMSNorm (incl. Gemma's 1 + w) or their "
    "parameter-free variants; learned absolute, rotary (halves or adjacent pairs, partial, per layer type; linear / "
    "dynamic NTK / llama3 / YaRN / LongRoPE) or ALiBi positions; multi-head, grouped- or multi-query, multi-head latent"
    " and DeepSeek-V4's compressed attention, causal, bidirectional, sliding-window or chunked, with QK-norm, value "
    "norms, output gates, attention sinks, score and final-logit soft-capping (QKV clipping is read on the "
    "HookedTransformer route only); in float32 or float64"
)

PIECES = ("ln1", "ln2", "attn", "mlp", "ln1_post", "ln2_post")
# Model-level pieces, recorded under layer -1 (with the bridge's logits as (-1, "logits"): input = the tokens).
MODEL_PIECES = ("embed", "pos_embed", "ln_final", "unembed")

# A structural difference (a missing residual term, a norm applied to the wrong tensor) is O(1); rounding is far
# below these. convert's own check against the whole forward then applies the certified bound. Half precision (a
# half source read in its dtype by convert, lens_aot.core.dtypes.half_reading): about four of its epsilons, as the
# source and the reading round their operations differently.
PROBE_TOLERANCE = {torch.float32: 2e-4, torch.float64: 1e-9, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@dataclass
class Call:
    """One call of a component: its first tensor input and its first tensor output."""

    input: Float[Tensor, "batch pos d_in"]
    output: Float[Tensor, "batch pos d_out"]


def _first_tensor(value: Any) -> Tensor | None:
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], Tensor):
        return value[0]
    return None


def record(
    bridge: Any, blocks: list[Any], n_pos: int, rotated_dtype: torch.dtype | None = None
) -> dict[tuple[int, str], Call]:
    """Run ``bridge`` on ``n_pos`` seeded tokens; return ``{(layer, piece): Call}`` for ``block`` and
    :data:`PIECES` (a piece absent from a block is absent from the result). ``rotated_dtype``: the rotated q and k
    cast back to it (:func:`lens_aot.tl.reading.half_forward.rotated_qk_in_model_dtype`: the half forward Hugging
    Face computes where the bridge's own cannot run)."""
    calls: dict[tuple[int, str], Call] = {}
    handles = []
    casts = ExitStack()

    def hook(key: tuple[int, str]) -> Any:
        def fn(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            x = _first_tensor(args) if args else kwargs.get("hidden_states")
            y = _first_tensor(output)
            if isinstance(x, Tensor) and isinstance(y, Tensor):
                calls[key] = Call(x.detach().clone(), y.detach().clone())

        return fn

    # Hooks a user attached to the bridge's hook points (which convert reports separately) must not change what the
    # probe sees: they are detached for this one forward and put back, whatever happens.
    from transformer_lens.hook_points import HookPoint

    detached = [
        (point, point._forward_hooks.copy(), point._forward_pre_hooks.copy())
        for point in bridge.modules()
        if isinstance(point, HookPoint) and (point._forward_hooks or point._forward_pre_hooks)
    ]
    # Likewise the probe runs in eval mode (dropout off); each module's training flag is restored afterwards.
    training = [(module, module.training) for module in bridge.modules()]
    try:
        bridge.eval()
        for point, _, _ in detached:
            point._forward_hooks.clear()
            point._forward_pre_hooks.clear()
        if rotated_dtype is not None:  # after the detaching: these hooks are the probe's own
            casts.enter_context(rotated_qk_in_model_dtype(bridge, rotated_dtype))
        for layer, block in enumerate(blocks):
            handles.append(block.register_forward_hook(hook((layer, "block")), with_kwargs=True))
            for piece in PIECES:
                component = block._modules.get(piece)
                if component is not None:
                    handles.append(component.register_forward_hook(hook((layer, piece)), with_kwargs=True))
        for piece in MODEL_PIECES:
            component = bridge._modules.get(piece)
            if component is not None:
                handles.append(component.register_forward_hook(hook((-1, piece)), with_kwargs=True))
        gen = torch.Generator().manual_seed(0)
        d_vocab = int(bridge.cfg.d_vocab)
        tokens = torch.randint(1, max(d_vocab, 2), (1, n_pos), generator=gen)
        device = next(bridge.original_model.parameters()).device
        tokens = tokens.to(device)
        with torch.no_grad():
            out = bridge(tokens, return_type="logits")
        logits = _first_tensor(getattr(out, "logits", out))
        if isinstance(logits, Tensor):
            calls[(-1, "logits")] = Call(tokens, logits.detach().clone())
    finally:
        casts.close()
        for handle in handles:
            handle.remove()
        for module, flag in training:
            module.training = flag
        for point, forward_hooks, pre_hooks in detached:
            point._forward_hooks.update(forward_hooks)
            point._forward_pre_hooks.update(pre_hooks)
    return calls


def relative_error(got: Tensor, want: Tensor) -> float:
    """``max|got − want| / max(1, max|want|)`` (inf when the shapes differ)."""
    if got.shape != want.shape:
        return float("inf")
    scale = max(1.0, float(want.abs().max()))
    return float((got.to(want.dtype) - want).abs().max()) / scale


def close(got: Tensor, want: Tensor) -> bool:
    return relative_error(got, want) <= PROBE_TOLERANCE.get(want.dtype, 2e-4)


def refuse_piece(layer: int | None, piece: str, what: str, fix: str = "") -> UnsupportedArchitectureError:
    """The error for one unsupported piece: ``layer 3 mlp: activation 'solu' ...`` (``layer`` None: a model-level
    piece such as the embedding)."""
    where = piece if layer is None else f"layer {layer} {piece}"
    fix_text = f" {fix}" if fix else ""
    return UnsupportedArchitectureError(
        f"{where}: {what}; lens_aot cannot convert that faithfully.{fix_text} Supported: {SUPPORTED}."
    )


def inexact(error: UnsupportedArchitectureError, dtype: torch.dtype) -> UnsupportedArchitectureError:
    """``error``, the refusal of a reading whose output misses the piece's beyond :data:`PROBE_TOLERANCE`, as a
    :class:`~lens_aot.errors.HalfReadingError` when the two were compared in ``dtype`` half precision (a half source
    read in its dtype, :func:`lens_aot.core.dtypes.half_reading`): its rounding may be why, and ``convert`` reads the
    source in float32 instead. In float32 / float64 it is ``error`` itself."""
    if dtype not in HALF_DTYPES:
        return error
    return HalfReadingError(f"{error} (compared in {str(dtype).removeprefix('torch.')})")


def inexact_piece(
    dtype: torch.dtype, layer: int | None, piece: str, what: str, fix: str = ""
) -> UnsupportedArchitectureError:
    """:func:`refuse_piece` of a reading that misses the recorded forward, compared in ``dtype`` (:func:`inexact`)."""
    return inexact(refuse_piece(layer, piece, what, fix), dtype)


def check_piece(layer: int, piece: str, got: Tensor, call: Call | None, what: str) -> None:
    """Refuse when a reading's output ``got`` (on the recorded input) differs from the recorded output (in half
    precision: :func:`inexact`)."""
    if call is None:
        return
    err = relative_error(got, call.output)
    if err > PROBE_TOLERANCE.get(call.output.dtype, 2e-4):
        error = refuse_piece(
            layer,
            piece,
            f"{what} does not reproduce what the source computes (relative error {err:.2e} on a probe input)",
            "This piece computes something lens_aot does not read; please report the architecture.",
        )
        raise inexact(error, call.output.dtype)
