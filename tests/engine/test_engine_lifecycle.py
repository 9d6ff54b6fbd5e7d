"""Engines that clean up after themselves: created, used and dropped in one process (as notebook and
test users do), tensor-parallel or not, they leave no process, thread or file descriptor behind,
memory goes back, and the next engine starts."""

import gc
import os
import threading

import pytest
import torch

from pagedkv import LLM, AsyncLLM, LLMEngine, SamplingParams

from support.tiny_models import save_biased_tiny_llama


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> str:
    return save_biased_tiny_llama(tmp_path_factory.mktemp("tiny_llama_lifecycle"))


GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9] * 3}, {"prompt_token_ids": [30 + i for i in range(40)]}]


def child_processes() -> list[int]:
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    if int(stat.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                        children.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return children


def leftovers() -> dict:
    """What a dropped engine could leave: processes, threads (Python's and the OS's), descriptors."""
    gc.collect()
    return {"processes": len(child_processes()), "python threads": threading.active_count(),
            "os threads": len(os.listdir("/proc/self/task")), "file descriptors": len(os.listdir("/proc/self/fd"))}


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def generate_and_drop(model_dir: str, tensor_parallel_size: int) -> list:
    llm = LLM(model_dir, dtype="float32", tensor_parallel_size=tensor_parallel_size, num_device_blocks=64)
    tokens = [list(output.outputs[0].token_ids) for output in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    del llm  # (no shutdown: dropping the last reference must be enough)
    return tokens


def test_tensor_parallel_engines_dropped_in_a_loop_leave_nothing_behind(tiny_llama_dir):
    reference = generate_and_drop(tiny_llama_dir, 1)
    for index in range(3):
        assert generate_and_drop(tiny_llama_dir, 2) == reference
        if index == 0:  # (what torch makes once per process, its thread pools and a pipe, is made by now)
            baseline, first_rss = leftovers(), resident_bytes()
        assert leftovers() == baseline
        assert resident_bytes() <= 1.1 * first_rss, (resident_bytes(), first_rss)
    assert generate_and_drop(tiny_llama_dir, 1) == reference
    assert leftovers() == baseline
    assert resident_bytes() <= 1.1 * first_rss


def test_the_startup_heap_is_frozen_while_an_engine_runs_and_thawed_after(tiny_llama_dir):
    """As vLLM: once built, the engine freezes the process's heap, so a full garbage collection
    mid-generation scans only what came after (it scanned ~400k objects, 0.2 s); shutdown thaws it."""
    engine = LLMEngine(model=tiny_llama_dir, dtype="float32", num_device_blocks=64)
    try:
        assert gc.get_freeze_count() > 10_000  # (torch's modules and the engine's objects at least)
        engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, GREEDY)
        while engine.has_unfinished_requests():
            engine.step()
        assert len(gc.get_objects()) < 0.1 * gc.get_freeze_count()  # (what a full collection still scans)
    finally:
        engine.shutdown()
    assert gc.get_freeze_count() == 0


def test_engines_are_context_managers_and_shutdown_is_idempotent(tiny_llama_dir):
    baseline = leftovers()
    with LLM(tiny_llama_dir, dtype="float32", tensor_parallel_size=2, num_device_blocks=64) as llm:
        first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.shutdown()  # (again: nothing happens)
    assert leftovers() == baseline
    with LLMEngine(model=tiny_llama_dir, dtype="float32", num_device_blocks=64) as engine:
        engine.add_request("r", PROMPTS[0], GREEDY)
        while engine.has_unfinished_requests():
            engine.step()
    assert engine.runner.model is None and engine.runner.kv_cache is None  # (their memory went back)
    with pytest.raises(Exception, match="shut down"):
        engine.step()
    with AsyncLLM(tiny_llama_dir, dtype="float32", tensor_parallel_size=2, num_device_blocks=64) as async_llm:
        assert async_llm.is_running
    assert not async_llm.is_running
    assert leftovers() == baseline
    assert [list(o.outputs[0].token_ids) for o in first] == generate_and_drop(tiny_llama_dir, 1)


def test_a_dropped_async_engine_stops_its_loop_and_ranks(tiny_llama_dir):
    baseline = leftovers()
    async_llm = AsyncLLM(tiny_llama_dir, dtype="float32", tensor_parallel_size=2, num_device_blocks=64)
    assert leftovers()["processes"] == baseline["processes"] + 1
    del async_llm
    assert leftovers() == baseline


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_memory_returns_after_shutdown(tiny_llama_dir):
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with LLM(tiny_llama_dir, device="cuda", dtype="bfloat16") as llm:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert torch.cuda.memory_allocated() > before
    assert torch.cuda.memory_allocated() == before
