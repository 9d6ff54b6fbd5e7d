"""Decode steps through DecodeGraphs' static buffers give the eager engine's tokens.

Without a GPU the graphs are 'replayed' by running the forward again on the static buffers
(`replay_eagerly`) and the CUDA kernels run in the CPU emulator, so everything but the capture
itself is checked here: padding to the captured sizes, stale rows, the device-only decode
metadata. tests/gpu/test_gpu_engine.py runs real graphs.
"""

import shutil

import pytest
import torch
from support.checkpoints import save_tiny_checkpoint
from support.tiny_models import tiny_gemma3

from pagedkv import LLM, SamplingParams
from pagedkv.attention.cuda import CudaAttentionBackend
from pagedkv.runner.cuda_graphs import DecodeGraphs, graph_batch_sizes, replay_eagerly
from pagedkv.kernels import EmulatorLauncher, sources

PROMPTS = ["Hello", "The quick brown fox", "def fibonacci(n):", "Paris is the capital of", "1, 2, 3, 4, 5,"]
# Different lengths, so the batch shrinks one by one: 5 (padded to 6), 4, 3 (padded to 4), 2, 1.
MAX_TOKENS = [3, 6, 9, 12, 15]
OPTIONS = dict(dtype="float32", gguf_weights="dequantized", num_device_blocks=48, max_model_len=128, max_num_seqs=6, swap_space_bytes=0)


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(16) == [1, 2, 4, 8, 16]
    assert graph_batch_sizes(50) == [1, 2, 4, 8, 16, 32, 48, 50]


def greedy(llm):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats["num_free_device_blocks"] == stats["num_device_blocks"]
    return [out.outputs[0].token_ids for out in outputs]


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.fail("the kernel emulator needs g++ (C++20)")
    launcher = EmulatorLauncher(tmp_path_factory.mktemp("emulator"))
    code = sources.DTYPE_CODES[torch.float32]
    launcher.prepare([
        (sources.ATTENTION_SOURCE, sources.attention_kernel(code, code, 64, 16, sources.head_tile(3))),
        (sources.ATTENTION_SOURCE, sources.attention_kernel(code, code, 64, 16, sources.head_tile(2))),  # tiny Gemma 3
        (sources.ATTENTION_SOURCE, sources.reduce_kernel(code, 64)),
        (sources.CACHE_OPS_SOURCE, sources.cache_kernel(code, code)),
        (sources.CACHE_OPS_SOURCE, sources.COPY_BLOCKS_KERNEL),
    ])
    return launcher


def test_decode_graphs_give_the_eager_tokens(smollm2, emulator):
    reference = greedy(LLM(**OPTIONS, attention_backend="torch"))

    llm = LLM(**OPTIONS, attention_backend="torch")
    runner = llm.engine.runner
    runner.backend = CudaAttentionBackend(emulator)
    runner.capture_decode_graphs(capture=replay_eagerly)
    graphs = runner.decode_graphs
    assert graphs.batch_sizes == [1, 2, 4, 6]
    runner.kv_cache.device_cache.normal_()  # garbage where no step wrote: padding must not leak it
    assert greedy(llm) == reference
    used = {size for size, count in graphs.num_replays.items() if count}
    assert used == {1, 2, 4, 6}, graphs.num_replays  # 5 running sequences padded to 6, then fewer


def test_backends_that_need_host_lists_are_refused(smollm2_runner):
    runner = smollm2_runner
    with pytest.raises(ValueError, match="cannot run inside CUDA graphs"):
        DecodeGraphs(runner.model, runner.kv_cache, runner.backend, max_batch_size=4, max_model_len=64,
                     block_size=16, hidden_size=576, dtype=torch.float32, device=runner.device)


def test_decode_graphs_keep_each_kv_cache_group_s_slots_and_tables(tmp_path, emulator):
    """A model with KV-cache groups (the tiny Gemma 3: two windowed layers, window 16, and a full
    one): the graphs' static slots and tables of each group give the eager engine's tokens and
    logprobs (the tiny model's greedy tokens barely depend on the context: its logprobs do), well
    past the window, where the groups' tables differ."""
    directory = save_tiny_checkpoint(tmp_path, tiny_gemma3())
    generator = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 256, (length,), generator=generator).tolist() for length in (30, 12, 45)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3) for n in (20, 25, 30)]
    options = dict(OPTIONS, max_num_seqs=4, attention_backend="torch")

    def run(llm):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [(out.outputs[0].token_ids, [sorted(step.values()) for step in out.outputs[0].logprobs]) for out in outputs]

    reference = run(LLM(directory, **options))
    llm = LLM(directory, **options)
    runner = llm.engine.runner
    assert runner.kv_groups.num_groups == 3
    runner.backend = CudaAttentionBackend(emulator)
    runner.capture_decode_graphs(capture=replay_eagerly)
    runner.kv_cache.device_cache.normal_()
    for (tokens, logprobs), (expected_tokens, expected_logprobs) in zip(run(llm), reference):
        assert tokens == expected_tokens
        assert torch.allclose(torch.tensor(logprobs), torch.tensor(expected_logprobs), atol=1e-4)
    assert sum(runner.decode_graphs.num_replays.values()) >= 25
