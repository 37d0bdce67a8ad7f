# Two commands: `make demo` and `make test`. Each builds the virtual environment(s) it needs.
# CPU torch is installed first (pinned), so nothing pulls CUDA wheels.
PYTHON ?= python3
TORCH ?= torch==2.13.0
TL3 ?= transformer-lens==3.9.0
TL4 ?= transformer-lens==4.3.0
# SAELens supports TransformerLens 3.x only (sae-lens >= 6.52 requires transformer-lens < 4): its extra goes in the 3.9 env.
EXTRAS3 ?= test,sae
EXTRAS4 ?= test
PYTEST_ARGS ?=

.PHONY: demo test test-tl3 test-tl4 lint bench matrix clean

.venv-tl%/.ready: pyproject.toml
	rm -rf .venv-tl$*
	$(PYTHON) -m venv .venv-tl$*
	.venv-tl$*/bin/pip install -q --upgrade pip
	.venv-tl$*/bin/pip install -q "$(TORCH)"
	.venv-tl$*/bin/pip install -q "$(TL$*)" -e ".[$(EXTRAS$*)]"
	touch $@

demo: .venv-tl4/.ready
	.venv-tl4/bin/python -m lens_aot demo

lint: .venv-tl4/.ready
	.venv-tl4/bin/ruff check lens_aot tests benchmarks scripts
	.venv-tl4/bin/ruff format --check lens_aot tests benchmarks scripts

test-tl3: .venv-tl3/.ready
	.venv-tl3/bin/python -m pytest -q $(PYTEST_ARGS)

test-tl4: .venv-tl4/.ready
	.venv-tl4/bin/python -m pytest -q $(PYTEST_ARGS)

# The suite runs under TransformerLens 3.9 (HookedTransformer + TransformerBridge) and 4.3 (TransformerBridge only).
test: lint test-tl3 test-tl4

bench: .venv-tl4/.ready
	.venv-tl4/bin/python benchmarks/bench_shapes.py --shape gpt2
	.venv-tl4/bin/python benchmarks/bench_shapes.py --shape llama

# Regenerate docs/support-matrix.md: the TransformerBridge table under 4.3, the HookedTransformer table under 3.9.
matrix: .venv-tl3/.ready .venv-tl4/.ready
	.venv-tl4/bin/python -m lens_aot.matrix --write --quiet
	.venv-tl3/bin/python -m lens_aot.matrix --write --quiet

clean:
	rm -rf .venv-tl3 .venv-tl4 .pytest_cache .ruff_cache
