"""Decode steps through DecodeGraphs' static buffers give the eager engine's tokens.

Without a GPU the graphs are 'replayed' by running the forward again on the static buffers
(`replay_eagerly`) and the CUDA kernels run in the CPU emulator, so everything but the capture
itself is checked here: padding to the captured sizes, stale rows, the device-only decode
metadata. tests/gpu/test_gpu_engine.py runs real graphs.
"""

import shutil

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.attention.cuda import CudaAttentionBackend
from pagedkv.runner.cuda_graphs import DecodeGraphs, graph_batch_sizes, replay_eagerly
from pagedkv.kernels import EmulatorLauncher, sources

PROMPTS = ["Hello", "The quick brown fox", "def fibonacci(n):", "Paris is the capital of", "1, 2, 3, 4, 5,"]
# Different lengths, so the batch shrinks one by one: 5 (padded to 6), 4, 3 (padded to 4), 2, 1.
MAX_TOKENS = [3, 6, 9, 12, 15]
OPTIONS = dict(dtype="float32", num_device_blocks=48, max_model_len=128, max_num_seqs=6, swap_space_bytes=0)


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
