"""``make demo``: convert the embedded modular-addition model and show what a neuron head does.

The converted model is read with plain TransformerLens calls (``cache["post", 0]``, ``cache["pattern", 0]``,
``aot.W_out``), as the source would be; its neuron heads (Theorem 3) through ``aot.neuron_heads``.
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor

import lens_aot
from lens_aot.cli.demo_models import load_modular_addition, modular_addition_dataset
from lens_aot.core.read import run_source
from lens_aot.core.runtime.model import AttentionOnlyTransformer


def interesting_neuron(aot: AttentionOnlyTransformer, tokens: Int[Tensor, "1 pos"], layer: int = 0) -> int:
    """The neuron of ``layer`` most active at the last position among those whose gate is shut somewhere else."""
    _, cache = aot.run_with_cache(tokens, names_filter=lambda name: name.endswith("mlp.hook_post"))
    post = cache["post", layer][0]  # [pos, d_mlp]
    mixed = (post[:-1] <= 0).any(0) & (post[-1] > 0)
    scores = torch.where(mixed, post[-1], torch.full_like(post[-1], -float("inf")))
    return int(scores.argmax())


def format_pattern(pattern: Float[Tensor, "query key"], labels: list[str]) -> str:
    """A small attention pattern as a text table (rows: queries, columns: keys, plus the bias slot's weight)."""
    width = max(6, *(len(s) for s in labels))
    header = " " * width + "".join(f"{s:>{width}}" for s in labels) + f"{'bias':>{width}}"
    rows = [header]
    for i, label in enumerate(labels):
        row = pattern[i]
        cells = "".join(f"{float(w):>{width}.3f}" for w in row)
        rows.append(f"{label:>{width}}{cells}{1 - float(row.sum()):>{width}.3f}")
    return "\n".join(rows)


def main() -> None:
    torch.manual_seed(0)
    model = load_modular_addition()
    print(f"source: {type(model).__name__} trained on (a + b) mod 113 (Nanda et al. 2023)\n")
    aot = lens_aot.convert(model)
    print(aot.report, "\n")

    tokens, labels = modular_addition_dataset()
    with torch.no_grad():
        ref = run_source(model, tokens)[:, -1]
        got = aot(tokens)[:, -1]
    print(
        f"all {len(tokens):,} inputs: max |Δlogit| {float((got - ref).abs().max()):.2e}, "
        f"accuracy source {float((ref.argmax(-1) == labels).float().mean()):.2%}, "
        f"converted {float((got.argmax(-1) == labels).float().mean()):.2%}, "
        f"argmax agreement {float((got.argmax(-1) == ref.argmax(-1)).float().mean()):.2%}\n"
    )

    example = tokens[1234:1235]
    with torch.no_grad():
        _, cache = aot.run_with_cache(example)
        _, src_cache = model.run_with_cache(example, names_filter=lambda name: name == "blocks.0.mlp.hook_post")
    post = cache["post", 0]
    print(
        f"the source's names, unchanged: cache['post', 0] {list(post.shape)} (max |Δ| against the source's "
        f"mlp.hook_post {float((post - src_cache['blocks.0.mlp.hook_post']).abs().max()):.1e}), "
        f"cache['pattern', 0] {list(cache['pattern', 0].shape)}, aot.W_out {list(aot.W_out.shape)}\n"
    )

    neuron = interesting_neuron(aot, example)
    ref_head = aot.neuron_heads(0, neuron)[0]
    pattern = cache[f"{ref_head.name}.hook_pattern"][0, ref_head.head]
    z = cache[f"{ref_head.name}.hook_z"][0, -1, ref_head.head, 0]
    a, b = int(example[0, 0]), int(example[0, 1])
    print(f"neuron {neuron} of layer 0 is head {ref_head.head} of {ref_head.name} (aot.neuron_heads(0, {neuron}));")
    print(
        f"its hook_z at '=' is {float(z):.4f}, = cache['post', 0][0, -1, {neuron}] = {float(post[0, -1, neuron]):.4f};"
    )
    print(f"and its pattern on {a} + {b} =")
    print(format_pattern(pattern, [str(a), str(b), "="]))
    print(
        "\nEach position attends only to itself, with weight σ(a·z): for this ReLU model a is large, so the weight is"
    )
    print("the neuron's gate (1 where z > 0); the rest goes to the bias slot, whose value is 0.")


if __name__ == "__main__":
    main()
