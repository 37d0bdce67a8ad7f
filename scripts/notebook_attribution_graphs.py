"""Cells of notebooks/attribution_graphs.ipynb: one prompt's attribution graph over the model's own neurons.

``CELLS`` is a list of ``("md" | "code", source)`` pairs (merged into scripts/make_notebooks.py). On the shipped
modular-addition model (one ReLU layer, Nanda et al. 2023's Fourier neurons) the graph of ``17 + 95`` is exact with
every neuron in it; its strongest edges into the answer's logit are neurons of the key frequencies; pruning keeps a
few dozen of them, and the graph's predicted effect of removing them is set against the model's. Then a random
Llama-shaped model: gated neurons (two inputs each), rotary positions, grouped-query attention. A few seconds on a
CPU.
"""

from __future__ import annotations

import textwrap

_RAW: list[tuple[str, str]] = [
    (
        "md",
        """
        # Attribution graphs over the model's own neurons

        circuit-tracer's attribution graphs explain one prompt as direct effects between transcoder features, with
        the attention patterns and norm scales frozen; the transcoders approximate the MLPs, so every graph carries
        error nodes. A converted model's neurons are the source model's own (Huben & Morris 2023, Theorem 3), so
        `lens_aot.circuits.attribution_graph` draws the same graph over them: no transcoder, no error node, and with
        every neuron in the graph `adjacency.sum(1) + constant == inputs` exactly ([docs](../attribution-graphs.md)).

        First the shipped modular-addition model (one ReLU layer trained on `(a + b) mod 113`; its neurons read one
        Fourier frequency each, Nanda et al. 2023), on the prompt `17 + 95 =`.
        """,
    ),
    (
        "code",
        """
        import tempfile
        from pathlib import Path

        import matplotlib.pyplot as plt
        import torch

        import lens_aot
        from lens_aot import viz
        from lens_aot.circuits import attribution_graph
        from lens_aot.cli.demo_models import MODULAR_ADDITION_P as P, load_modular_addition, modular_addition_dataset

        model = load_modular_addition(dtype=torch.float64)
        aot = lens_aot.convert(model)
        a, b = 17, 95
        prompt = torch.tensor([a, b, P])  # [a, b, =]
        graph = attribution_graph(aot, prompt, target=(a + b) % P, max_nodes=None)  # every active neuron
        print(graph)
        print("replacement score", graph.replacement_score, "| completeness score", graph.completeness_score)
        """,
    ),
    (
        "md",
        """
        ## Exact

        Every target's input (a neuron's pre-activation, the logit) is the sum of its incoming edges and its
        constant (the biases), to float64 rounding; the error (what nodes left out would write) is zero.
        `inputs` are the converted model's own values.
        """,
    ),
    (
        "code",
        """
        A = graph.dense()
        rebuilt = A.sum(1) + graph.constant
        targets = graph.is_target
        print(f"max |Σ edges + constant − input| = {float((rebuilt - graph.inputs)[targets].abs().max()):.2e} "
              f"over {int(targets.sum())} targets; max |error| = {float(graph.error.abs().max())}")
        with torch.no_grad():
            logits = aot(prompt[None])[0, -1]
        print("answer logit", float(logits[(a + b) % P]), "= graph input", float(graph.inputs[-1]))
        """,
    ),
    (
        "md",
        """
        ## The strongest edges into the answer are Fourier neurons

        Each neuron's best frequency from its activation at `=` over all `113²` inputs
        (`viz.frequency_shares_2d`), and the direct edges into the answer's logit summed per frequency: the key
        frequencies carry them.
        """,
    ),
    (
        "code",
        """
        tokens, _ = modular_addition_dataset()
        with torch.no_grad():
            _, cache = aot.run_with_cache(tokens, names_filter="blocks.0.mlp.hook_post")
        post = cache["blocks.0.mlp.hook_post"][:, -1]  # [p², d_mlp]
        best_freq = viz.frequency_shares_2d(post.reshape(P, P, -1)).argmax(dim=1)

        answer = graph.nodes[-1]
        for name, weight in graph.incoming(answer, k=8):
            node = graph.node(name)
            freq = int(best_freq[node.index]) if node.kind == "neuron" else None
            print(f"{name:>14}  edge {weight:+8.3f}  activation {float(graph.activations[graph.index(name)]):7.3f}  "
                  f"frequency {freq}")

        row = A[-1]
        per_freq = torch.zeros(P // 2 + 1, dtype=torch.float64)
        for i in graph.kind_mask("neuron").nonzero()[:, 0].tolist():
            per_freq[int(best_freq[graph.node(i).index])] += row[i].abs()
        fig, ax = plt.subplots(figsize=(7, 2.6))
        ax.bar(range(len(per_freq)), per_freq)
        ax.set(xlabel="neuron's best frequency k", ylabel="Σ |edge| into the answer",
               title=f"direct edges into {answer}, per frequency")
        plt.show()
        """,
    ),
    (
        "md",
        """
        ## Pruned as circuit-tracer prunes

        `prune(node_threshold, edge_threshold)` keeps the nodes holding 80% of the influence on the logit, then
        the edges holding 98% of the edge influence. What the removed nodes wrote moves into `error`, so the
        identity still holds, and the replacement and completeness scores drop below 1.
        """,
    ),
    (
        "code",
        """
        small = graph.prune(node_threshold=0.8, edge_threshold=0.98)
        print(small)
        print("scores", [round(s, 3) for s in small.scores])
        drift = (small.dense().sum(1) + small.constant + small.error - small.inputs)[small.is_target].abs().max()
        print(f"max |Σ edges + constant + error − input| = {float(drift):.2e}")
        """,
    ),
    (
        "md",
        """
        ## Predicted against actual

        `verify` removes nodes (their outputs set to zero) and reports the change of the logit: **direct** (their
        edges alone), **predicted** by the graph (patterns and norm scales frozen, the graph's neurons recomputed
        through their own activation), and **actual**, the converted model with nothing frozen.
        """,
    ),
    (
        "code",
        """
        top = [name for name, _ in graph.incoming(answer, k=10) if name.startswith("m")]
        freq_of = {name: int(best_freq[graph.node(name).index]) for name in top}
        cluster = [name for name in top if freq_of[name] == freq_of[top[0]]]
        check = graph.verify(aot, [top[:1], top[:3], cluster, ["emb@0"]])
        check
        """,
    ),
    (
        "md",
        """
        ## Viewing

        `to_json` writes circuit-tracer's graph JSON (its frontend and Neuronpedia read it); `index=True` also keeps
        the folder's `graph-metadata.json`, which circuit-tracer's local frontend lists.
        """,
    ),
    (
        "code",
        """
        folder = Path(tempfile.mkdtemp())
        path = small.to_json(folder / "modular-17-95.json", index=True)
        data = small.to_dict()
        print(path.name, "|", len(data["nodes"]), "nodes,", len(data["links"]), "links |", sorted(data["metadata"]))
        """,
    ),
    (
        "md",
        """
        `show()` draws the same graph in lens_aot's own page, here in the notebook and offline (`to_html(path)` writes
        it as one file): nodes by layer and position, a node's links highlighted on hover or click with its label,
        activation and top edges beside, and the pruning thresholds adjustable.
        """,
    ),
    ("code", "small.show()"),
    (
        "md",
        """
        ## A random Llama-shaped model: gated neurons, rotary, grouped-query attention

        A gated neuron `silu(gate) · linear` has two inputs: its gate pre-activation is its row of `adjacency`
        (and `inputs`, `constant`), its linear branch its row of `adjacency_linear` (`inputs_linear`,
        `constant_linear`). Both rows are exact. Here 2 layers, 4 query heads sharing 2 key-value heads, rotary
        positions, random weights, float64; the graph keeps 300 neurons, so the rest is error.
        """,
    ),
    (
        "code",
        """
        from transformers import LlamaConfig, LlamaForCausalLM

        from lens_aot.tl.build import bridge_from_hf_module

        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             tie_word_embeddings=False, initializer_range=0.2)
        hf = LlamaForCausalLM(config).eval().to(torch.float64)
        hf.set_attn_implementation("eager")
        source = bridge_from_hf_module(hf, "LlamaForCausalLM", hf_config=config, model_name="llama")
        llama = lens_aot.convert(source)
        prompt = torch.tensor([3, 14, 15, 92, 65, 35, 89, 79])
        gated = attribution_graph(llama, prompt, max_nodes=300)
        print(gated)
        for branch in (False, True):
            A = gated.dense(linear=branch)
            const = gated.constant_linear if branch else gated.constant
            err = gated.error_linear if branch else gated.error
            inputs = gated.inputs_linear if branch else gated.inputs
            drift = (A.sum(1) + const + err - inputs)[gated.is_target].abs().max()
            print(f"{'linear' if branch else 'gate'} branch: max |Σ edges + constant + error − input| = "
                  f"{float(drift):.1e} (a float32 norm step of the source: docs)")
        print("scores with 300 neurons:", [round(s, 3) for s in gated.scores])
        neuron = next(name for name, _ in gated.incoming(gated.nodes[-1], k=5) if name.startswith("m"))
        i = gated.index(neuron)
        print(neuron, "gate input", round(float(gated.inputs[i]), 4), "| linear input",
              round(float(gated.inputs_linear[i]), 4), "| activation", round(float(gated.activations[i]), 4))
        print("its largest inputs (both branches, in activation units):", gated.incoming(neuron, k=4))
        """,
    ),
]

CELLS: list[tuple[str, str]] = [(kind, textwrap.dedent(source).strip()) for kind, source in _RAW]
