"""The command line (TransformerLens 3.9 and 4.x), end to end on tiny Hugging Face checkpoints saved to disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import factories_bridge
import pytest
import torch
from conftest import HAS_HOOKED_TRANSFORMER
from factories_bridge import D_MLP, D_MODEL, D_VOCAB, N_CTX, N_HEADS, N_LAYERS, _randomize_, tiny_tokenizer
from roundtrip_helpers import assert_bitwise, assert_same_model, assert_same_state

import lens_aot
from lens_aot.cli import main
from lens_aot.io import read_config

ROOT = Path(__file__).resolve().parents[1]


def save_tiny_gpt2(path: Path, seed: int = 0, activation: str = "gelu_new") -> Path:
    """A random GPT-2 (2 layers, d_model 32) and a word-level tokenizer, as save_pretrained writes them."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=D_VOCAB,
        n_positions=N_CTX,
        n_embd=D_MODEL,
        n_layer=N_LAYERS,
        n_head=N_HEADS,
        n_inner=D_MLP,
        activation_function=activation,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(cfg)
    _randomize_(model, seed)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_gpt2(tmp_path_factory.mktemp("hf") / "tiny-gpt2")


@pytest.fixture(scope="module")
def converted(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("converted") / "out"
    assert main(["convert", str(hf_dir), str(out), "--quiet"]) == 0
    return out


def boot(path: Path, dtype: torch.dtype = torch.float32):
    from transformer_lens.model_bridge import TransformerBridge

    return TransformerBridge.boot_transformers(str(path), device="cpu", dtype=dtype)


def tokens(n: int = 2, pos: int = 16) -> torch.Tensor:
    return torch.randint(0, D_VOCAB, (n, pos), generator=torch.Generator().manual_seed(5))


def run_fails(argv: list[str], status: int, capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == status
    captured = capsys.readouterr()
    return captured.out, captured.err


def test_convert_writes_a_loadable_model(hf_dir: Path, converted: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert {p.name for p in converted.iterdir()} == {"config.json", "model.safetensors", "tokenizer"}
    config = read_config(converted)
    source = config["metadata"]["source"]
    assert source == {"source": str(hf_dir), "kind": "hf-directory", "backend": "bridge", "dtype": "float32"}
    loaded = lens_aot.load(converted)
    assert_same_model(lens_aot.convert(boot(hf_dir)), loaded, tokens())  # the conversion is deterministic
    assert torch.equal(loaded.to_tokens("w1 w2"), torch.tensor([[0, 3, 4]]))


def test_convert_prints_the_report(hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["convert", str(hf_dir), str(tmp_path / "out"), "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert "lens_aot conversion of" in out and "max |Δlogit|" in out and f"saved to {tmp_path / 'out'}" in out
    assert err == ""


def test_progress_lines_when_not_a_terminal(hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["convert", str(hf_dir), str(tmp_path / "out"), "--no-check"]) == 0
    err = capsys.readouterr().err
    for step in (f"[1/3] loading {hf_dir}", "[2/3] converting", f"[3/3] saving to {tmp_path / 'out'}"):
        assert step in err


def test_convert_options(hf_dir: Path, tmp_path: Path) -> None:
    argv = ["convert", str(hf_dir), str(tmp_path / "a"), "--heads-per-neuron", "2", "--dtype", "float64"]
    assert main([*argv, "--no-check", "--quiet"]) == 0
    loaded = lens_aot.load(tmp_path / "a")
    assert loaded.cfg.dtype == torch.float64 and loaded.cfg.activation_fits[0].n_terms == 2
    assert loaded.report.max_abs_logit_error is None
    assert read_config(tmp_path / "a")["metadata"]["convert_options"]["heads_per_neuron"] == 2
    assert main(["convert", str(hf_dir), str(tmp_path / "b"), "--max-neuron-error", "1e-6", "--quiet"]) == 0
    fit = lens_aot.load(tmp_path / "b").cfg.activation_fits[0]
    assert fit.max_error <= 1e-6 and fit.n_terms > lens_aot.load(tmp_path / "a").cfg.activation_fits[0].n_terms


def test_convert_tolerance_fails_but_saves(hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, err = run_fails(["convert", str(hf_dir), str(tmp_path / "out"), "--tolerance", "1e-12", "--quiet"], 1, capsys)
    assert "exceeds --tolerance" in err and (tmp_path / "out" / "config.json").is_file()


def test_verify_passes(converted: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(converted), "--batch", "3", "--seq", "100", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "3 x 32 random" in out  # seq capped at n_ctx
    assert "identical to the converted model's" in out and "PASS" in out
    assert "the bound stated for this conversion: max(stated, 8·S + 4·R) on these tokens" in out
    stated = float(out.split("  bound           ")[1].split()[0])
    assert stated >= 1e-3  # never below the support matrix's gelu_new bound (lens_aot.core.check.faithfulness)


def save_tiny_llama(path: Path, seed: int = 0) -> Path:
    """The factories' random Llama (RMSNorm, rotary, GQA, SwiGLU) as save_pretrained writes it."""
    _, model, _ = factories_bridge.FAMILIES["llama"]()
    _randomize_(model, seed)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_verify_judges_a_gated_model_against_its_stated_bound(
    tmp_path: Path, dtype: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Gated models are verified against the bound stated for their conversion (gated row of the support matrix,
    raised only by the source's measured sensitivity and rounding), and a corrupted saved model fails it."""
    source = save_tiny_llama(tmp_path / "llama")
    assert main(["convert", str(source), str(tmp_path / "out"), "--dtype", dtype, "--quiet"]) == 0
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "out"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "the bound stated for this conversion" in out
    bound = float(out.split("  bound           ")[1].split()[0])
    err = float(out.split("  max |Δlogit|    ")[1].split()[0])
    assert err <= bound and bound >= 1e-4  # the gated row of lens_aot.core.check.faithfulness.STATED_LOGIT_ERROR
    aot = lens_aot.load(tmp_path / "out")
    with torch.no_grad():
        aot.blocks[-1].mlp.product_heads.W_out.mul_(1.01)  # a product layer 1% off
    lens_aot.save(aot, tmp_path / "bad", metadata=read_config(tmp_path / "out")["metadata"])
    out, _ = run_fails(["verify", str(tmp_path / "bad"), "--quiet"], 1, capsys)
    assert "FAIL" in out


def test_verify_fails_above_tolerance(converted: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, _ = run_fails(["verify", str(converted), "--tolerance", "1e-12", "--quiet"], 1, capsys)
    assert "FAIL" in out and "1.000e-12 (--tolerance)" in out


def test_verify_detects_another_source(converted: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = save_tiny_gpt2(tmp_path / "other", seed=1)
    out, _ = run_fails(["verify", str(converted), "--source", str(other), "--quiet"], 1, capsys)
    assert "tensors differ" in out and "FAIL" in out


def test_verify_needs_a_source(tmp_path: Path, hf_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lens_aot.save(lens_aot.convert(boot(hf_dir)), tmp_path / "plain")
    _, err = run_fails(["verify", str(tmp_path / "plain"), "--quiet"], 2, capsys)
    assert "does not record its source" in err and "--source" in err
    assert main(["verify", str(tmp_path / "plain"), "--source", str(hf_dir), "--quiet"]) == 0


def test_verify_refuses_a_mismatched_source(converted: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = str(ROOT / "lens_aot" / "data" / "modular_addition.pt")
    _, err = run_fails(["verify", str(converted), "--source", checkpoint, "--quiet"], 2, capsys)
    assert "is not the model" in err and "--source" in err


def test_verify_errors_on_a_missing_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, err = run_fails(["verify", str(tmp_path / "nope"), "--quiet"], 2, capsys)
    assert "does not exist" in err


def test_demo_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The shipped .pt checkpoint (HookedTransformer layout) converts with either TransformerLens."""
    from lens_aot.cli.demo_models import load_modular_addition

    checkpoint = ROOT / "lens_aot" / "data" / "modular_addition.pt"
    assert main(["convert", str(checkpoint), str(tmp_path / "out"), "--quiet"]) == 0
    backend = read_config(tmp_path / "out")["metadata"]["source"]["backend"]
    assert backend == ("hooked" if HAS_HOOKED_TRANSFORMER else "bridge")
    loaded = lens_aot.load(tmp_path / "out")
    reference = lens_aot.convert(load_modular_addition())
    assert_same_state(reference, loaded)
    assert loaded.report.max_abs_logit_error == reference.report.max_abs_logit_error
    ids = torch.tensor([[3, 7, 113], [100, 12, 113]])
    with torch.no_grad():
        assert_bitwise(reference(ids), loaded(ids), "logits")
    assert main(["verify", str(tmp_path / "out"), "--quiet"]) == 0


def test_demo_command(capsys: pytest.CaptureFixture[str]) -> None:
    """``lens-aot demo`` (``make demo``): the converted model answers every input as the source does, is read under
    the source's names, and a neuron head's ``hook_z`` is its neuron's ``cache["post", 0]`` entry."""
    import re

    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "accuracy source 100.00%, converted 100.00%, argmax agreement 100.00%" in out
    assert "cache['post', 0] [1, 3, 512]" in out and "cache['pattern', 0] [1, 4, 3, 3]" in out
    assert "aot.W_out [1, 512, 128]" in out
    post_err = float(re.search(r"against the source's mlp.hook_post ([0-9.e+-]+)\)", out).group(1))
    assert post_err < 1e-4  # the ReLU fit's bound, 1e-6 per neuron, plus float32 rounding 7.6e-6·(1 + |z|)
    match = re.search(r"its hook_z at '=' is ([0-9.-]+), = cache\['post', 0\]\[0, -1, \d+\] = ([0-9.-]+);", out)
    assert match and match.group(1) == match.group(2) and float(match.group(1)) > 0
    assert "blocks.0.mlp.heads (aot.neuron_heads(0, " in out


# ---------------------------------------------------------------------------------------------------------------
# Bad sources
# ---------------------------------------------------------------------------------------------------------------


def test_nonexistent_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for source in (str(tmp_path / "missing"), "./missing-model", "weights.pt"):
        _, err = run_fails(["convert", source, str(tmp_path / "out"), "--quiet"], 2, capsys)
        assert f"no such file or directory: {source}" in err
    assert not (tmp_path / "out").exists()


def test_unknown_name_offline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    for backend in ["bridge", "auto"]:
        _, err = run_fails(["convert", "no-such-org/no-such-model", str(tmp_path), "--backend", backend], 2, capsys)
        assert "could not load 'no-such-org/no-such-model'" in err
        assert "needs an internet connection" in err and "pass a local checkpoint" in err


def test_directory_that_is_not_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    _, err = run_fails(["convert", str(tmp_path / "empty"), str(tmp_path / "out"), "--quiet"], 2, capsys)
    assert "without config.json" in err


def test_converted_model_as_source(converted: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, err = run_fails(["convert", str(converted), str(tmp_path / "out"), "--quiet"], 2, capsys)
    assert "already a converted lens_aot model" in err


def test_bad_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    _, err = run_fails(["convert", str(tmp_path / "notes.txt"), str(tmp_path / "out"), "--quiet"], 2, capsys)
    assert ".txt file" in err
    torch.save({"embed.W_E": torch.zeros(3, 2)}, tmp_path / "bare.pt")
    _, err = run_fails(["convert", str(tmp_path / "bare.pt"), str(tmp_path / "out"), "--quiet"], 2, capsys)
    assert "a bare state dict has no config" in err
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    _, err = run_fails(["convert", str(tmp_path / "junk.pt"), str(tmp_path / "out"), "--quiet"], 2, capsys)
    assert "cannot be read as a torch checkpoint" in err


def test_hooked_backend_for_a_hugging_face_directory(
    hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, err = run_fails(["convert", str(hf_dir), str(tmp_path / "o"), "--backend", "hooked", "--quiet"], 2, capsys)
    assert "loads as a TransformerBridge" in err and "--backend bridge" in err


def test_output_is_a_file(hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("x")
    _, err = run_fails(["convert", str(hf_dir), str(tmp_path / "file"), "--quiet"], 2, capsys)
    assert "is a file" in err


def test_python_dash_m(hf_dir: Path, tmp_path: Path) -> None:
    """`python -m lens_aot` runs the same command line, and its exit status reaches the shell."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "lens_aot", "convert", str(hf_dir), str(tmp_path / "out"), "--tolerance", "1e-12"]
    result = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert result.returncode == 1, result.stderr
    assert "lens_aot conversion of" in result.stdout and "exceeds --tolerance" in result.stderr
    assert "[3/3] saving to" in result.stderr  # not a terminal: one line per step
    assert json.loads((tmp_path / "out" / "config.json").read_text())["metadata"]["tolerance"] == 1e-12
