# Two commands: `make demo` and `make test`. Each builds the virtual environment(s) it needs.
# Also: `make docs` (the documentation site, strict, into site/) and `make notebooks` (regenerate, execute and store
# the notebooks with their outputs).
# CPU torch is installed first (pinned), so nothing pulls CUDA wheels.
# `make test` installs the tested versions in constraints/tl{3,4}.txt; `make test-newest` runs the same suite against
# the newest releases (no constraints) in separate environments (.venv-new3, .venv-new4).
PYTHON ?= python3
TORCH ?= torch==2.13.0
TL3 ?= transformer-lens==3.9.0
TL4 ?= transformer-lens==4.3.0
TL3_NEWEST ?= transformer-lens>=3.9,<4
TL4_NEWEST ?= transformer-lens>=4.3,<5
# SAELens supports TransformerLens 3.x only (sae-lens >= 6.52 requires transformer-lens < 4): its extra goes in the 3.9 env.
EXTRAS3 ?= test,sae
EXTRAS4 ?= test,docs
# EAP-IG (Hanna et al. 2024, MIB's baseline; test-only, TransformerLens 3.x only): from the wheel in ../shared/wheels
# where it exists, else from its git commit (needs network; the tests that use it skip without it).
EAP_WHEELS ?= ../shared/wheels
EAP_GIT ?= git+https://github.com/hannamw/EAP-IG@795f5607b25638935aec89aee3c1cb4bd9ed72f1
PYTEST_ARGS ?=
# circuit-tracer (test-only): the attribution graphs' JSON is validated against its own graph models. It pins
# transformers <= 4.57.3 and huggingface-hub < 1.0, so it gets an environment of its own (CPU torch first, as above);
# only JSON crosses (tests/test_attribution_graph.py runs .venv-ct/bin/python on a written file).
CIRCUIT_TRACER ?= circuit-tracer==0.5.0

.PHONY: demo test test-tl3 test-tl4 test-newest test-new3 test-new4 lint docs notebooks constraints bench matrix clean

# $(1): the environment's folder, $(2): the TransformerLens requirement, $(3): extras, $(4): pip options.
define make_venv
	rm -rf $(1)
	$(PYTHON) -m venv $(1)
	$(1)/bin/pip install -q --upgrade pip
	$(1)/bin/pip install -q "$(TORCH)"
	$(1)/bin/pip install -q $(4) "$(2)" -e ".[$(3)]"
endef

# $(1): the environment's folder, $(2): pip options. EAP-IG imports HookedTransformer, so only TransformerLens 3.x has it.
define install_eap
	if [ -d "$(EAP_WHEELS)" ]; then $(1)/bin/pip install -q $(2) --find-links "$(EAP_WHEELS)" eap==2.0.0; \
	else $(1)/bin/pip install -q $(2) "eap @ $(EAP_GIT)" || echo "EAP-IG not installed: its tests will skip"; fi
endef

.venv-tl%/.ready: pyproject.toml constraints/tl%.txt
	$(call make_venv,.venv-tl$*,$(TL$*),$(EXTRAS$*),-c constraints/tl$*.txt)
	$(if $(filter 3,$*),$(call install_eap,.venv-tl$*,-c constraints/tl$*.txt))
	touch $@

.venv-ct/.ready:
	rm -rf .venv-ct
	$(PYTHON) -m venv .venv-ct
	.venv-ct/bin/pip install -q --upgrade pip
	.venv-ct/bin/pip install -q "$(TORCH)"
	.venv-ct/bin/pip install -q "$(CIRCUIT_TRACER)"
	touch $@

.venv-new%/.ready: pyproject.toml
	$(call make_venv,.venv-new$*,$(TL$*_NEWEST),$(EXTRAS$*),)
	$(if $(filter 3,$*),$(call install_eap,.venv-new$*,))
	touch $@

demo: .venv-tl4/.ready
	.venv-tl4/bin/python -m lens_aot demo

lint: .venv-tl4/.ready
	.venv-tl4/bin/ruff check lens_aot tests benchmarks scripts
	.venv-tl4/bin/ruff format --check lens_aot tests benchmarks scripts

# The documentation site, offline: fails on any warning (broken link or reference, undocumented public API member).
docs: .venv-tl4/.ready
	NO_MKDOCS_2_WARNING=1 .venv-tl4/bin/mkdocs build --strict --quiet

# Writes notebooks/*.ipynb from scripts/make_notebooks.py, executes them, and stores them with their outputs
# (in the TransformerLens 3.9 environment, which has every optional package a notebook may need: eap, sae-lens).
notebooks: .venv-tl3/.ready
	PYTHONPATH=$(CURDIR) .venv-tl3/bin/python scripts/run_notebooks.py write

test-tl3: .venv-tl3/.ready .venv-ct/.ready
	.venv-tl3/bin/python -m pytest -q $(PYTEST_ARGS)

test-tl4: .venv-tl4/.ready .venv-ct/.ready
	.venv-tl4/bin/python -m pytest -q $(PYTEST_ARGS)

# The suite runs under TransformerLens 3.9 (HookedTransformer + TransformerBridge) and 4.3 (TransformerBridge only).
test: lint docs test-tl3 test-tl4

# Explicit rules: make applies no pattern rule to a .PHONY target, so a `test-new%` rule would leave these two no-ops.
test-new3: .venv-new3/.ready .venv-ct/.ready
	.venv-new3/bin/python -m pytest -q $(PYTEST_ARGS)

test-new4: .venv-new4/.ready .venv-ct/.ready
	.venv-new4/bin/python -m pytest -q $(PYTEST_ARGS)

# The same suite against the newest releases of every dependency (torch stays the pinned CPU build).
test-newest: test-new3 test-new4

# Rewrite the tested versions from the two test environments (after a deliberate upgrade).
constraints: .venv-tl3/.ready .venv-tl4/.ready
	for v in 3 4; do \
	  { echo "# Tested versions for the TransformerLens $$v.x environment (make test). Regenerate: make constraints"; \
	    .venv-tl$$v/bin/pip freeze --exclude-editable | grep -v -i -E '^(torch|eap|lens-aot)[= @]'; } > constraints/tl$$v.txt; \
	done

bench: .venv-tl4/.ready
	.venv-tl4/bin/python benchmarks/bench_shapes.py --shape gpt2
	.venv-tl4/bin/python benchmarks/bench_shapes.py --shape llama

# Regenerate docs/support-matrix.md: the TransformerBridge table under 4.3, the HookedTransformer table under 3.9.
matrix: .venv-tl3/.ready .venv-tl4/.ready
	.venv-tl4/bin/python -m lens_aot.matrix --write --quiet
	.venv-tl3/bin/python -m lens_aot.matrix --write --quiet
	.venv-tl3/bin/python -m lens_aot.matrix --write --quiet --backend bridge

clean:
	rm -rf .venv-tl3 .venv-tl4 .venv-new3 .venv-new4 .venv-ct .pytest_cache .ruff_cache site .cache
