"""EngineConfig.cpu_linear_kernel: a CPU model's linear layers and LM head at decode sizes run in
Rust (pagedkv.layers.cpu_linear); greedy outputs are the same as with torch's products."""

import pytest
import torch
from torch import nn

from pagedkv import LLM, SamplingParams
from pagedkv.layers.cpu_linear import CpuLinear, linear
from support.checkpoints import save_tiny_checkpoint
from support.tiny_models import tiny_llama, tiny_qwen3

PROMPTS = ["w5 w9 w30 w7", "w100 w101", "w3 w4 w5 w6 w7 w8 w9 w10 w11", "w200", "w42 w43 w44"]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory):
    """Tiny random Llama (untied LM head: an nn.Linear) and Qwen3 (tied: the LM head reads the embeddings)."""
    model = tiny_llama() if request.param == "llama" else tiny_qwen3()
    return save_tiny_checkpoint(tmp_path_factory.mktemp(request.param), model)


def greedy_tokens(model_dir, dtype, kernel):
    llm = LLM(model_dir, device="cpu", dtype=dtype, cpu_linear_kernel=kernel, num_device_blocks=64,
              max_model_len=128, generation_config="vllm")
    model = llm.engine.runner.model
    linear_types = {type(module) for module in model.modules() if isinstance(module, nn.Linear)}
    assert linear_types == ({CpuLinear} if kernel else {nn.Linear})
    assert (model.lm_head_linear is linear) == kernel
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)  # (decode steps of 5 rows, then fewer as prompts differ)
    llm.shutdown()
    return [output.outputs[0].token_ids for output in outputs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_tokens_are_the_same_with_the_kernel_on_and_off(model_dir, dtype):
    torch.manual_seed(0)
    assert greedy_tokens(model_dir, dtype, kernel=True) == greedy_tokens(model_dir, dtype, kernel=False)
