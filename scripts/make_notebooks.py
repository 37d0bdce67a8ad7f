"""The notebooks of notebooks/, as code: ``NOTEBOOKS`` maps a file name to its cells, ``[(kind, source), ...]`` with
``kind`` "md" or "code".

Notebooks are kept as code here so that they stay reviewable and ruff-checked. ``make notebooks``
(``scripts/run_notebooks.py write``) builds each one, executes it and stores it in notebooks/ with its outputs;
tests/test_notebooks.py re-executes them in ``make test`` and fails when a stored copy lacks outputs, holds an error
or has drifted from these sources. A new notebook: add ``NOTEBOOKS["name.ipynb"] = [...]`` at the end of this file
(or a scripts/notebook_<name>.py defining ``CELLS``), then run ``make notebooks``. A notebook that needs a module
not installed with every TransformerLens version (``eap``: TransformerLens 3.9 only) names it in ``REQUIRES``
(``REQUIRES["name.ipynb"] = ["eap"]``): the tests skip that notebook's execution where the module is missing.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

REQUIRES: dict[str, list[str]] = {}  # notebook -> modules its execution needs beyond lens_aot's test extra

NOTEBOOKS: dict[str, list[tuple[str, str]]] = {
    "quickstart.ipynb": [
        (
            "md",
            "# lens_aot quickstart\n\n"
            "`lens_aot.convert(model)` turns every MLP neuron of a TransformerLens model into an attention head of "
            "internal dimension 1 that attends to itself and to a bias slot (Huben & Morris 2023, Theorem 3). The "
            "result is numbered, hooked and weighted like its source, so TransformerLens calls written for the "
            "source run unchanged; the new **neuron heads** have ordinary hook points of their own.\n\n"
            "We use the small model shipped with lens_aot: one layer trained on `(a + b) mod 113`, as in "
            "Nanda et al. 2023.",
        ),
        (
            "code",
            "import matplotlib.pyplot as plt\nimport torch\n\nimport lens_aot\n"
            "from lens_aot.cli.demo_models import load_modular_addition, modular_addition_dataset\n"
            "from lens_aot.core.read import run_source\n\n"
            "model = load_modular_addition()\naot = lens_aot.convert(model)\nprint(aot.report)",
        ),
        ("md", "## Agreement with the original\nThe converted model's logits on all 113² inputs against the source's."),
        (
            "code",
            "tokens, labels = modular_addition_dataset()\nwith torch.no_grad():\n"
            "    ref = run_source(model, tokens)[:, -1]\n    got = aot(tokens)[:, -1]\n"
            "print(f'max |Δlogit| = {(got - ref).abs().max():.2e}')\n"
            "print(f'accuracy: source {(ref.argmax(-1) == labels).float().mean():.2%}, '\n"
            "      f'converted {(got.argmax(-1) == labels).float().mean():.2%}')\n"
            "fig, ax = plt.subplots(figsize=(4, 4))\n"
            "ax.scatter(ref[:500].flatten(), got[:500].flatten(), s=1)\n"
            "ax.set(xlabel='source logit', ylabel='converted logit', title='500 inputs × 113 logits')\nplt.show()",
        ),
        (
            "md",
            "## The source's names, unchanged\nLayer `l` of the source is `blocks.{l}` of the converted model: "
            "`cache['post', 0]` is the MLP's activation (now computed by neuron heads), `cache['pattern', 0]` the "
            "source heads' pattern, `aot.W_out` the MLP's output weights, all with the source's shapes and values "
            "(within the conversion's bound).",
        ),
        (
            "code",
            "example = tokens[1234:1235]\nname = 'blocks.0.mlp.hook_post'\nwith torch.no_grad():\n"
            "    logits, cache = aot.run_with_cache(example)\n"
            "    _, src_cache = model.run_with_cache(example, names_filter=lambda n: n == name)\n"
            "post = cache['post', 0]  # [batch, pos, d_mlp]\n"
            "error = float((post - src_cache[name]).abs().max())\n"
            "print('post', tuple(post.shape), 'max |Δ| vs the source:', error)\n"
            "print('pattern', tuple(cache['pattern', 0].shape), 'W_out', tuple(aot.W_out.shape))\n"
            "print('layers', aot.cfg.n_layers, 'd_mlp', aot.cfg.d_mlp)\n"
            "assert post.shape == src_cache[name].shape and error < 1e-4\n"
            "assert cache['pattern', 0].shape == (1, aot.cfg.n_heads, 3, 3) and aot.cfg.n_layers == 1",
        ),
        (
            "md",
            "## One neuron, as a head\n`aot.neuron_heads(layer, neuron)` gives the heads that compute a neuron "
            "(here one: ReLU needs one head per neuron). Its pattern has TransformerLens's `[batch, head, query, key]` "
            "shape: each position attends only to itself, with weight σ(a·z) (for this ReLU model a is large, so the "
            "weight is the ReLU gate), and the rest goes to the bias slot. Its `hook_z` is the neuron's "
            "`cache['post', 0]` entry, and its output matrix `W_O` is the neuron's row of `aot.W_out`.",
        ),
        (
            "code",
            "neuron = int(post[0, -1].argmax())\n"
            "ref_head = aot.neuron_heads(0, neuron)[0]\nprint(ref_head, aot.head_origin(*ref_head))\n"
            "pattern = cache[f'{ref_head.name}.hook_pattern'][0, ref_head.head]\nprint(pattern)\n"
            "z = cache[f'{ref_head.name}.hook_z'][0, :, ref_head.head, 0]\n"
            "print('its activation (hook_z) =', z, '= cache[\"post\", 0]:', post[0, :, neuron])\n"
            "W_O = aot.head_module(ref_head.name).W_O[ref_head.head, 0]\n"
            "print('W_O equals aot.W_out[0, neuron]:', torch.equal(W_O, aot.W_out[0, neuron]))\n"
            "assert torch.equal(z, post[0, :, neuron]) and torch.equal(W_O, aot.W_out[0, neuron])",
        ),
        (
            "md",
            "## The neuron's activation over every input\n`cache['post', 0]` at the `=` position, over the whole "
            "(a, b) grid: the periodic structure Nanda et al. found in MLP neurons, read off an attention head.",
        ),
        (
            "code",
            "with torch.no_grad():\n"
            "    _, cache = aot.run_with_cache(tokens, names_filter=lambda name: name.endswith('mlp.hook_post'))\n"
            "grid = cache['post', 0][:, -1, neuron].reshape(113, 113)\n"
            "fig, axes = plt.subplots(1, 2, figsize=(9, 4))\n"
            "axes[0].imshow(pattern.detach(), cmap='Blues', vmin=0, vmax=1)\n"
            "axes[0].set(title=f'pattern of head {ref_head.head}', xlabel='key', ylabel='query')\n"
            "axes[0].set_xticks(range(3), ['a', 'b', '=']), axes[0].set_yticks(range(3), ['a', 'b', '='])\n"
            "im = axes[1].imshow(grid.detach(), cmap='RdBu_r')\n"
            "axes[1].set(title=f'neuron {neuron}: cache[\"post\", 0] at \"=\"', xlabel='b', ylabel='a')\n"
            "fig.colorbar(im)\nplt.show()",
        ),
        (
            "md",
            "## circuitsvis\nNeuron-head patterns are ordinary `[head, query, key]` tensors, so circuitsvis renders "
            "them as they are (the weight missing from each row went to the bias slot).",
        ),
        (
            "code",
            "import circuitsvis as cv\n\nheads = [aot.neuron_heads(0, n)[0].head for n in range(8)]\n"
            "_, cache = aot.run_with_cache(example)\n"
            "patterns = cache[f'{ref_head.name}.hook_pattern'][0, heads]  # [head, query, key]\n"
            "cv.attention.attention_patterns(tokens=['a', 'b', '='], attention=patterns)",
        ),
    ],
}


def _load_cells(module_file: str) -> list[tuple[str, str]]:
    """``CELLS`` of a sibling script that holds one long notebook's cells."""
    spec = importlib.util.spec_from_file_location(module_file, Path(__file__).resolve().parent / module_file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CELLS


# Longer notebooks live in their own scripts: scripts/notebook_<name>.py defines CELLS for notebooks/<name>.ipynb.
for _path in sorted(Path(__file__).resolve().parent.glob("notebook_*.py")):
    NOTEBOOKS[_path.stem.removeprefix("notebook_") + ".ipynb"] = _load_cells(_path.name)


# ==================================================================================================== circuit discovery
def circuit_discovery_cells() -> list[tuple[str, str]]:
    """notebooks/circuit_discovery.ipynb: discover -> evaluate -> faithfulness curve -> draw, at both granularities,
    on the shipped modular-addition model (runs in well under a minute on a laptop CPU)."""
    return [
        (
            "md",
            "# Circuits whose nodes are neurons\n\n"
            "A converted model makes every MLP neuron an attention head with its own input, so a circuit can have "
            "single neurons as nodes. This notebook discovers a circuit with EAP-IG over clean/corrupted pairs, "
            "evaluates it (every edge outside the circuit carries its sender's corrupted output, EAP-IG's "
            "`evaluate_graph` semantics), draws MIB's faithfulness curve, draws the circuit, and compares neuron "
            "circuits with EAP-IG's usual MLP-level circuits on the same task. Graphs use EAP-IG's node names and "
            "JSON layout.",
        ),
        (
            "code",
            "import torch\n\nimport lens_aot\nfrom lens_aot.circuits import (Graph, compare_granularities, discover, "
            "evaluate,\n                               evaluate_baseline, faithfulness_curve)\n"
            "from lens_aot.cli.demo_models import load_modular_addition, modular_addition_dataset\n\n"
            "aot = lens_aot.convert(load_modular_addition())\n"
            "tokens, labels = modular_addition_dataset()          # [a, b, =] -> (a + b) mod 113\n"
            "g = torch.Generator().manual_seed(0)\n"
            "idx = torch.randperm(len(tokens), generator=g)[:64]\n"
            "clean, answer = tokens[idx], labels[idx]\n"
            "corrupted = clean.clone()                            # another b: the answer changes\n"
            "corrupted[:, 1] = (clean[:, 1] + torch.randint(1, 113, (64,), generator=g)) % 113\n"
            "data = [(clean, corrupted, answer)]                  # one batch of 64 pairs\n\n\n"
            "def metric(logits, labels):  # one value per example: log-probability of the clean answer\n"
            "    return logits[:, -1].log_softmax(-1).gather(-1, labels[:, None])[:, 0]\n\n\n"
            "base = evaluate_baseline(aot, data, metric)\n"
            "print(f'clean {base.clean.mean():.2f}, corrupted {base.corrupted.mean():.2f}')",
        ),
        ("md", "## Discover (neuron granularity) and evaluate"),
        (
            "code",
            "graph = discover(aot, data, metric, method='EAP-IG', granularity='neuron', steps=3, top_nodes=128)\n"
            "print(graph, {k: graph.cfg[k] for k in ('method', 'top_nodes', 'neurons_scored', 'neurons_kept')})\n"
            "graph.apply_topn(300)\n"
            "print(graph.count(), f'metric with the circuit: {evaluate(aot, graph, data, metric).mean():.2f}')",
        ),
        ("md", "## Faithfulness at several circuit sizes (MIB's f, CPR and CMD)"),
        (
            "code",
            "curve = faithfulness_curve(aot, graph, data, metric, n_edges=[50, 100, 200, 400, 800])\n"
            "print(f'CPR {curve.cpr:.3f}, CMD {curve.cmd:.3f}')\ncurve.plot()\ncurve.to_dataframe()",
        ),
        ("md", "## Draw a small circuit (grown greedily from the logits)"),
        (
            "code",
            "graph.apply_greedy(30)  # 30 edges grown from the logits, then pruned: those that reach no input are "
            "dropped\ngraph.draw(title=f'modular addition: {graph.n_edges} edges, neuron granularity')",
        ),
        (
            "code",
            "import tempfile\nfrom pathlib import Path\n\n"
            "path = Path(tempfile.mkdtemp()) / 'circuit.json'\n"
            "graph.to_json(path)                                  # EAP-IG's layout\n"
            "Graph.from_json(path, model=aot).count() == graph.count()",
        ),
        ("md", "## Neurons against whole MLPs, side by side"),
        (
            "code",
            "cmp = compare_granularities(aot, data, metric, 'EAP', n_edges=[8, 32, 128, 512], top_nodes=128)"
            "\nprint(cmp.summary())\ncmp.plot()\ncmp.to_dataframe()",
        ),
        ("code", "cmp.shares  # which neurons carry each MLP's share of |score|"),
    ]


NOTEBOOKS["circuit_discovery.ipynb"] = circuit_discovery_cells()
