"""Files saved before the saved format was derived from the specs' declared fields still load, bit for bit, and a save
now writes what lens_aot wrote then (issue 39: "files saved before the change load").

``tests/saved_d79ff11/<name>/`` holds two small converted models saved by lens_aot at commit d79ff11 (the last with
hand-kept field lists in ``lens_aot/io/schema.py``), with their logits on :data:`TOKENS`: ``fields`` uses the
field-level variants (QK-norm, soft-caps, window, sinks, output gate, NoPE temperature, query scaling, clipping,
sandwich norms, layer scalar, post-embedding norm, logit multiplier) and xIELU MLPs; ``kinds`` the variants with spec
types of their own (multi-head latent attention, clamped SwiGLU, a mixture of experts beside the dense MLP). They were
written by running this module as a script with that lens_aot on the path::

    PYTHONPATH=<lens_aot at d79ff11> python tests/test_io_saved_before.py tests/saved_d79ff11
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import lens_aot
from lens_aot.core.fit.clamped_swiglu import ClampedSwiGLUSpec
from lens_aot.core.fit.xielu import XIELUSpec
from lens_aot.core.spec.beside_moe import MoEBesideMLPSpec
from lens_aot.core.spec.mla import MLASpec
from lens_aot.core.spec.model_spec import ModelSpec, NormSpec, OutputGateSpec
from lens_aot.io.files import read_tensors

sys.path.insert(0, str(Path(__file__).resolve().parent))
from factories_spec import random_spec  # noqa: E402

SAVED = Path(__file__).resolve().parent / "saved_d79ff11"
SMALL: dict[str, Any] = dict(
    d_model=16, n_heads=2, n_kv=1, d_head=8, d_mlp=12, d_vocab=20, n_ctx=8, dtype=torch.float64
)
TOKENS = torch.arange(16).reshape(2, 8) % 20
VERSIONS = ("lens_aot_version", "torch_version")  # what differs between lens_aot and torch releases, not the format


def _rand(seed: int) -> Callable[..., torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return lambda *shape, scale=0.1: scale * torch.randn(*shape, generator=g, dtype=torch.float64)


def fields_model() -> ModelSpec:
    """Two layers with field-level variants of the attention, the layer and the model; xIELU MLPs."""
    r = _rand(0)
    spec = random_spec(seed=3, act_fn="xielu", gated=False, **SMALL)
    for layer in spec.layers:
        m = layer.mlp
        assert m is not None
        layer.mlp = XIELUSpec(m.W_in, m.b_in, m.W_out, m.b_out, "xielu", alpha_p=0.8, alpha_n=0.9, beta=0.5, eps=-1e-6)
    a, b = spec.layers[0].attn, spec.layers[1].attn
    assert not isinstance(a, MLASpec) and not isinstance(b, MLASpec)
    a.q_norm, a.k_norm = NormSpec("RMS", 1e-6, 1 + r(8)), NormSpec("RMS", 1e-6, 1 + r(8))
    a.scores_soft_cap, a.window, a.sinks = 5.0, 4, r(2)
    a.output_gate = OutputGateSpec(r(2, 16), "sigmoid")
    a.temperature_scale, a.temperature_floor = 0.1, 4.0
    b.query_scale_beta, b.query_scale_length, b.clip_qkv = 0.1, 4, 3.0
    spec.layers[0].ln1_post, spec.layers[0].ln2_post = (
        NormSpec("RMS", 1e-6, 1 + r(16)),
        NormSpec("RMS", 1e-6, 1 + r(16)),
    )
    spec.layers[1].layer_scalar = 0.5
    spec.embed_ln = NormSpec("LN", 1e-5, 1 + r(16), r(16))
    spec.logits_soft_cap, spec.logits_scale = 30.0, 0.25
    return spec


def kinds_model() -> ModelSpec:
    """Multi-head latent attention and a clamped SwiGLU in layer 0; a mixture of experts beside the dense MLP in 1."""
    r = _rand(1)
    spec = random_spec(seed=4, **SMALL)
    spec.layers[0].attn = MLASpec(
        W_Q=r(2, 16, 12, scale=0.3),
        W_kv_a=r(16, 12, scale=0.3),
        kv_a_norm=NormSpec("RMS", 1e-6, 1 + r(8)),
        W_K=r(2, 8, 8, scale=0.3),
        W_V=r(2, 8, 8, scale=0.3),
        W_O=r(2, 8, 16, scale=0.3),
        b_O=r(16),
        scale=0.3,
        rope_dim=4,
        cos=torch.ones(8, 4, dtype=torch.float64),
        sin=torch.zeros(8, 4, dtype=torch.float64),
    )
    dense = spec.layers[0].mlp
    assert dense is not None and not isinstance(dense, MoEBesideMLPSpec)
    spec.layers[0].mlp = ClampedSwiGLUSpec.of(dense, 1.702, 7.0)
    m = spec.layers[1].mlp
    spec.layers[1].mlp = MoEBesideMLPSpec(
        r(16, 3, scale=1.0),
        [copy.deepcopy(m) for _ in range(3)],  # type: ignore[misc]
        2,
        shared=m,  # type: ignore[arg-type]
        ln_dense_post=NormSpec("RMS", 1e-6, 1 + r(16)),
        ln_moe=NormSpec("RMS", 1e-6, 1 + r(16)),
        ln_moe_post=NormSpec("RMS", 1e-6, 1 + r(16)),
        router_norm=NormSpec("RMS", 1e-6, None),
        router_scale=1 + r(16),
        per_expert_scale=1 + r(3),
    )
    return spec


MODELS: dict[str, Callable[[], ModelSpec]] = {"fields": fields_model, "kinds": kinds_model}


def save_all(out: Path) -> None:
    """Convert and save each model under ``out`` with the lens_aot on the path, with its logits on :data:`TOKENS`."""
    for name, make in MODELS.items():
        aot = lens_aot.convert(make(), check=False)
        lens_aot.save(aot, out / name)
        with torch.no_grad():
            torch.save(aot(TOKENS), out / name / "logits.pt")


def _config(path: Path) -> str:
    """``path``'s config.json as text, its fields in the file's order, the versions blanked."""
    config = json.loads((path / "config.json").read_text())
    return json.dumps({k: None if k in VERSIONS else v for k, v in config.items()}, indent=1)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_file_saved_by_d79ff11_loads_bitwise(name: str, tmp_path: Path) -> None:
    """The saved model loads and computes the logits it computed when saved, bit for bit; saved again, it writes the
    same config and the same tensors."""
    loaded = lens_aot.load(SAVED / name)
    with torch.no_grad():
        assert torch.equal(loaded(TOKENS), torch.load(SAVED / name / "logits.pt"))
    lens_aot.save(loaded, tmp_path)
    assert _config(tmp_path) == _config(SAVED / name)  # the same fields in the same order
    _same_tensors(tmp_path, SAVED / name)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_save_now_writes_what_d79ff11_wrote(name: str, tmp_path: Path) -> None:
    """The same model converted and saved now: config.json equal text for text but the versions, tensors bitwise."""
    save_all(tmp_path)
    assert _config(tmp_path / name) == _config(SAVED / name)  # the same fields in the same order
    _same_tensors(tmp_path / name, SAVED / name)


def _same_tensors(a: Path, b: Path) -> None:
    ta, tb = (read_tensors(p, json.loads((p / "config.json").read_text())) for p in (a, b))
    assert sorted(ta) == sorted(tb)
    assert all(ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]) for k in ta)


if __name__ == "__main__":
    save_all(Path(sys.argv[1]))
