"""Train the one-layer modular-addition transformer of Nanda et al. 2023 ("Progress measures for grokking via
mechanistic interpretability") in plain torch, and save it in TransformerLens layout for ``lens_aot.cli.demo_models``.

Setup (the paper's): p = 113, inputs ``[a, b, =]`` with ``=`` the token 113, the model predicts ``(a + b) mod p`` at
the last position. One layer, d_model 128, 4 heads of 32, d_mlp 512, ReLU, no LayerNorm, learned absolute positions,
causal attention. Full-batch AdamW (weight decay 1.0, betas (0.9, 0.98)) on 30% of the p² pairs (fixed-seed split).
As in the TransformerLens grokking demo, every bias is frozen at zero (they stay in the saved state dict, in TL
layout); the weights are initialised N(0, 0.8/√d_model) like HookedTransformer's default. The loss is computed in
float64 (the log-softmax of near-perfect logits underflows in float32 late in training).

One deviation, for CPU budget: lr 3e-3 instead of the paper's 1e-3. With seed 0 the model then memorises by step
~250 and groks at step ~2500 (test accuracy 99.9%, 100% by 2750) instead of ~10k+ steps; the 3000 default steps took
8 min with one thread on a 2-core machine shared with other jobs (``--threads 1``: two threads there were several
times slower). Training only needs the last position's logits, so it uses ``Transformer.forward_last`` (the same
function as ``forward(tokens)[:, -1]``, with less work; checked against ``forward`` on all pairs before saving).

The model class mirrors ``HookedTransformer.forward`` exactly, so training does not depend on TransformerLens::

    python scripts/train_modular_addition.py                     # writes lens_aot/data/modular_addition.pt
    python scripts/train_modular_addition.py --steps 2000 --out /tmp/ma.pt
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "lens_aot" / "data" / "modular_addition.pt"


def make_config(p: int = 113, seed: int = 0, frac_train: float = 0.3) -> dict:
    """The model config, in HookedTransformerConfig field names (plain python types only)."""
    return {
        "n_layers": 1,
        "d_model": 128,
        "n_heads": 4,
        "d_head": 32,
        "d_mlp": 512,
        "d_vocab": p + 1,
        "d_vocab_out": p,
        "n_ctx": 3,
        "act_fn": "relu",
        "normalization_type": None,
        "attention_dir": "causal",
        "positional_embedding_type": "standard",
        "p": p,
        "seed": seed,
        "frac_train": frac_train,
    }


def make_dataset(p: int) -> tuple[Int[Tensor, "p2 3"], Int[Tensor, " p2"]]:
    """All p² inputs ``[a, b, =]`` (row ``a*p + b``) and their labels ``(a + b) mod p``."""
    a = torch.arange(p).repeat_interleave(p)
    b = torch.arange(p).repeat(p)
    tokens = torch.stack([a, b, torch.full_like(a, p)], dim=1)
    return tokens, (a + b) % p


def make_split(p: int, frac_train: float, seed: int) -> Int[Tensor, " n_train"]:
    """Sorted indices (into ``make_dataset``) of the training pairs: a fixed-seed random subset."""
    perm = torch.randperm(p * p, generator=torch.Generator().manual_seed(seed))
    return perm[: int(frac_train * p * p)].sort().values


class Attention(nn.Module):
    """HookedTransformer's Attention (standard positions, causal, split heads)."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        h, m, d = cfg["n_heads"], cfg["d_model"], cfg["d_head"]
        self.W_Q = nn.Parameter(torch.empty(h, m, d))
        self.W_K = nn.Parameter(torch.empty(h, m, d))
        self.W_V = nn.Parameter(torch.empty(h, m, d))
        self.W_O = nn.Parameter(torch.empty(h, d, m))
        self.b_Q = nn.Parameter(torch.zeros(h, d))
        self.b_K = nn.Parameter(torch.zeros(h, d))
        self.b_V = nn.Parameter(torch.zeros(h, d))
        self.b_O = nn.Parameter(torch.zeros(m))
        self.d_head = d

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        q = torch.einsum("bpm,hmd->bphd", x, self.W_Q) + self.b_Q
        k = torch.einsum("bpm,hmd->bphd", x, self.W_K) + self.b_K
        v = torch.einsum("bpm,hmd->bphd", x, self.W_V) + self.b_V
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.d_head)
        n = x.shape[1]
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=1)
        pattern = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
        z = torch.einsum("bhqk,bkhd->bqhd", pattern, v)
        return torch.einsum("bqhd,hdm->bqm", z, self.W_O) + self.b_O


class MLP(nn.Module):
    """HookedTransformer's MLP with ReLU."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.W_in = nn.Parameter(torch.empty(cfg["d_model"], cfg["d_mlp"]))
        self.b_in = nn.Parameter(torch.zeros(cfg["d_mlp"]))
        self.W_out = nn.Parameter(torch.empty(cfg["d_mlp"], cfg["d_model"]))
        self.b_out = nn.Parameter(torch.zeros(cfg["d_model"]))

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        return F.relu(x @ self.W_in + self.b_in) @ self.W_out + self.b_out


class Block(nn.Module):
    """Residual block without LayerNorm: ``x + attn(x)``, then ``+ mlp(·)``."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        x = x + self.attn(x)
        return x + self.mlp(x)


class Embed(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.W_E = nn.Parameter(torch.empty(cfg["d_vocab"], cfg["d_model"]))


class PosEmbed(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.W_pos = nn.Parameter(torch.empty(cfg["n_ctx"], cfg["d_model"]))


class Unembed(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.W_U = nn.Parameter(torch.empty(cfg["d_model"], cfg["d_vocab_out"]))
        self.b_U = nn.Parameter(torch.zeros(cfg["d_vocab_out"]))


class Transformer(nn.Module):
    """A minimal HookedTransformer (no LayerNorm) whose ``state_dict`` keys are TransformerLens's."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.embed = Embed(cfg)
        self.pos_embed = PosEmbed(cfg)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg["n_layers"])])
        self.unembed = Unembed(cfg)
        std = 0.8 / math.sqrt(cfg["d_model"])  # HookedTransformer's default initializer_range
        for name, param in self.named_parameters():
            if name.rsplit(".", 1)[-1].startswith("W_"):
                nn.init.normal_(param, std=std)

    def forward(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos d_vocab_out"]:
        """Logits at every position: exactly HookedTransformer's forward for this architecture."""
        x = self.embed.W_E[tokens] + self.pos_embed.W_pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return x @ self.unembed.W_U + self.unembed.b_U

    def forward_last(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch d_vocab_out"]:
        """The same function as ``forward(tokens)[:, -1]`` (one layer only), with less work, for training.

        In one layer the last position's output depends on the other positions only through their keys and
        values, which are functions of (token, position) alone: they are computed once per vocabulary entry and
        gathered, and the query, MLP and unembedding run at the last position only.
        """
        assert len(self.blocks) == 1, "forward_last is exact for one-layer models only"
        attn, mlp = self.blocks[0].attn, self.blocks[0].mlp
        n_pos = tokens.shape[1]
        table = self.embed.W_E[:, None] + self.pos_embed.W_pos[None, :n_pos]  # [d_vocab, pos, d_model]
        k = (torch.einsum("vpm,hmd->vphd", table, attn.W_K) + attn.b_K)[tokens, torch.arange(n_pos)]
        v = (torch.einsum("vpm,hmd->vphd", table, attn.W_V) + attn.b_V)[tokens, torch.arange(n_pos)]
        x = table[tokens[:, -1], n_pos - 1]  # [batch, d_model]
        q = torch.einsum("bm,hmd->bhd", x, attn.W_Q) + attn.b_Q
        pattern = (torch.einsum("bhd,bkhd->bhk", q, k) / math.sqrt(attn.d_head)).softmax(dim=-1)
        x = x + torch.einsum("bhk,bkhd,hdm->bm", pattern, v, attn.W_O) + attn.b_O
        x = x + mlp(x)
        return x @ self.unembed.W_U + self.unembed.b_U


def loss_and_accuracy(
    logits: Float[Tensor, "batch d_vocab_out"], labels: Int[Tensor, " batch"]
) -> tuple[Tensor, float]:
    """Cross-entropy (computed in float64) and accuracy of the last-position logits."""
    last = logits.to(torch.float64)
    loss = F.cross_entropy(last, labels)
    return loss, (last.argmax(-1) == labels).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to save (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=3000, help="full-batch optimizer steps (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the init and of the train split")
    parser.add_argument("--lr", type=float, default=3e-3, help="the paper uses 1e-3 (groks ~4x later)")
    parser.add_argument("--weight-decay", type=float, default=1.0)
    parser.add_argument("--frac-train", type=float, default=0.3)
    parser.add_argument("--log-every", type=int, default=500)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (fixed for reproducibility)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    cfg = make_config(seed=args.seed, frac_train=args.frac_train)
    p = cfg["p"]
    tokens, labels = make_dataset(p)
    train_idx = make_split(p, args.frac_train, args.seed)
    test_mask = torch.ones(p * p, dtype=torch.bool)
    test_mask[train_idx] = False
    test_idx = test_mask.nonzero().squeeze(1)

    model = Transformer(cfg)
    for name, param in model.named_parameters():  # the TL grokking demo trains without biases
        param.requires_grad_(not name.rsplit(".", 1)[-1].startswith("b_"))
    optimizer = torch.optim.AdamW(
        [q for q in model.parameters() if q.requires_grad],
        lr=args.lr,
        weight_decay=args.weight_decay,
        betas=(0.9, 0.98),
    )

    history: list[dict] = []
    grokked_at = None
    start = time.perf_counter()
    for step in range(args.steps + 1):  # the metrics logged at `step` are those of the weights after `step` updates
        logits = model.forward_last(tokens[train_idx])
        train_loss, train_acc = loss_and_accuracy(logits, labels[train_idx])
        if step % args.log_every == 0 or step == args.steps:
            with torch.no_grad():
                test_loss, test_acc = loss_and_accuracy(model.forward_last(tokens[test_idx]), labels[test_idx])
            if grokked_at is None and test_acc >= 0.999:
                grokked_at = step
            elapsed = time.perf_counter() - start
            history.append(
                {
                    "step": step,
                    "train_loss": train_loss.item(),
                    "train_acc": train_acc,
                    "test_loss": test_loss.item(),
                    "test_acc": test_acc,
                }
            )
            print(
                f"step {step:6d} | train loss {train_loss.item():.3e} acc {train_acc:.4f} | "
                f"test loss {test_loss.item():.3e} acc {test_acc:.4f} | {elapsed:6.1f}s",
                flush=True,
            )
        if step < args.steps:
            optimizer.zero_grad(set_to_none=True)
            train_loss.backward()
            optimizer.step()
    runtime = time.perf_counter() - start

    with torch.no_grad():  # the full (HookedTransformer-mirroring) forward agrees with the training shortcut
        full = model(tokens)[:, -1]
        shortcut_gap = (full - model.forward_last(tokens)).abs().max().item()
        all_pairs_acc = (full.argmax(-1) == labels).float().mean().item()
    assert shortcut_gap < 1e-4, shortcut_gap
    final = history[-1]
    metrics = {
        **{k: v for k, v in final.items() if k != "step"},
        "all_pairs_acc": all_pairs_acc,
        "steps": args.steps,
        "grokked_at_step": grokked_at,  # first logged step with test accuracy ≥ 99.9%
        "runtime_s": round(runtime, 1),
        "threads": args.threads,
        "torch": str(torch.__version__),
        "history": history,
    }
    cfg_out = {**cfg, "lr": args.lr, "weight_decay": args.weight_decay, "betas": [0.9, 0.98], "biases": "frozen at 0"}
    state_dict = {k: v.detach().to(torch.float32).contiguous().clone() for k, v in model.state_dict().items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        {"config": cfg_out, "state_dict": state_dict, "train_pairs": train_idx.to(torch.int64), "metrics": metrics},
        args.out,
    )
    size_kb = args.out.stat().st_size / 1024
    print(
        f"done in {runtime:.1f}s: train acc {final['train_acc']:.4f}, test acc {final['test_acc']:.4f}, "
        f"grokked at step {grokked_at}; saved {args.out} ({size_kb:.0f} KiB)"
    )


if __name__ == "__main__":
    main()
