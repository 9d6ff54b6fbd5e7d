"""load_format="dummy": a model built from its config.json alone (no weight file in the directory),
random weights of the right shapes and dtype, through every kind of step."""

import glob
import os

import pytest
import torch

from pagedkv import LLM, SamplingParams
from support.checkpoints import save_tiny_checkpoint
from support.tiny_models import tiny_llama


@pytest.fixture(scope="module")
def config_only(tmp_path_factory):
    directory = save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-config"), tiny_llama())
    for weights in glob.glob(os.path.join(directory, "*.safetensors")):
        os.remove(weights)
    return directory


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_dummy_model_runs_every_step_kind_with_finite_weights_of_its_dtype(config_only, dtype):
    llm = LLM(config_only, load_format="dummy", dtype=dtype, num_device_blocks=24, block_size=8, max_num_seqs=4,
              max_num_batched_tokens=32, max_model_len=128, preemption_mode="recompute")
    weights = dict(llm.engine.runner.model.named_parameters())
    assert weights and all(w.dtype == getattr(torch, dtype) and torch.isfinite(w).all() for w in weights.values())
    assert any(w.abs().max() > 0 for w in weights.values()), "weights were left empty"
    # Prompts longer than the step's budget (chunked prefill), prefix hits, sampled and greedy rows,
    # n > 1 (forks) and more sequences than the pool holds at once (preemption).
    prompts = [[3 + (i * 7 + j) % 200 for j in range(40 + 9 * i)] for i in range(6)] + [[5] * 40]
    outputs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                                     SamplingParams(temperature=1.0, seed=1, n=2, max_tokens=24, ignore_eos=True)] * 3
                           + [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)], use_tqdm=False)
    assert all(len(c.token_ids) == 24 for output in outputs for c in output.outputs)
    stats = llm.engine.stats()
    assert stats["num_preemptions_recompute"] > 0 and stats["num_steps"] > 0
    again = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert again[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids  # (seeded: a second load agrees too)


def test_dummy_weights_are_the_same_in_every_load(config_only):
    first, second = (LLM(config_only, load_format="dummy", dtype="float32", num_device_blocks=8) for _ in range(2))
    for (name, a), (_, b) in zip(first.engine.runner.model.named_parameters(),
                                 second.engine.runner.model.named_parameters()):
        assert torch.equal(a, b), name


def test_a_directory_without_weights_is_an_error_unless_dummy(config_only):
    with pytest.raises(Exception):
        LLM(config_only, num_device_blocks=8)
