"""The engine on a CUDA device: same greedy tokens as the CPU reference, swap through pinned
memory on the swap stream round-trips bit-exactly, preemption does not change outputs."""

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [
    "Hello",
    "The quick brown fox",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived",
    "1, 2, 3, 4, 5,",
    "Paris is the capital of",
    " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(40)) + " The last item is",
    "Explain what a KV cache is.",
]


def model_path():
    from pagedkv.models.loader import default_model_path

    directory, name = default_model_path()
    return os.path.join(directory, name)


def greedy_tokens(**options):
    from pagedkv import LLM, SamplingParams

    llm = LLM(model_path(), dtype="float32", max_model_len=1024, **options)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    stats = llm.engine.stats()
    assert stats["num_free_device_blocks"] == stats["num_device_blocks"]
    return [out.outputs[0].token_ids for out in outputs], llm.engine


@pytest.fixture(scope="module")
def cpu_reference():
    return greedy_tokens(device="cpu", num_device_blocks=512)[0]


@pytest.mark.parametrize("backend", ["torch", "cuda"])
def test_gpu_greedy_equals_cpu_reference(cpu_reference, backend):
    tokens, _ = greedy_tokens(device="cuda", num_device_blocks=512, attention_backend=backend)
    assert tokens == cpu_reference


def test_gpu_decode_graphs_equal_cpu_reference(cpu_reference):
    tokens, engine = greedy_tokens(device="cuda", num_device_blocks=512, attention_backend="cuda", enforce_eager=False,
                                   max_num_seqs=len(PROMPTS) - 1)  # a full batch, then the remainder padded
    assert tokens == cpu_reference
    assert sum(engine.runner.decode_graphs.num_replays.values()) > 0


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_gpu_async_scheduling_equals_cpu_reference(cpu_reference, enforce_eager):
    """Steps planned while the one before runs: inputs read on the device, eager or replayed."""
    tokens, engine = greedy_tokens(device="cuda", num_device_blocks=512, attention_backend="cuda",
                                   enforce_eager=enforce_eager, async_scheduling=True, max_num_seqs=len(PROMPTS) - 1)
    assert tokens == cpu_reference
    if not enforce_eager:
        assert sum(engine.runner.decode_graphs.num_replays.values()) > 0


@pytest.mark.parametrize("backend", ["torch", "cuda"])
def test_gpu_preemption_by_swap_keeps_outputs(cpu_reference, backend):
    short = [i for i, prompt in enumerate(PROMPTS) if len(prompt) < 100]
    from pagedkv import LLM, SamplingParams

    llm = LLM(model_path(), device="cuda", dtype="float32", num_device_blocks=12, max_model_len=192,
              preemption_mode="swap", watermark=0.0, swap_space_bytes=64 << 20, attention_backend=backend)
    outputs = llm.generate([PROMPTS[i] for i in short], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == [cpu_reference[i] for i in short]
    stats = llm.engine.stats()
    assert stats["num_preemptions_swap"] > 0 and stats["num_blocks_swapped_in"] > 0


def test_swap_round_trip_is_bit_exact_on_the_swap_stream():
    from pagedkv.runner.kv_cache import KVCache

    cache = KVCache(4, 2, 64, 16, num_device_blocks=32, num_cpu_blocks=32, dtype=torch.bfloat16, device="cuda")
    assert cache.cpu_cache.is_pinned()
    cache.device_cache.copy_(torch.randn_like(cache.device_cache, dtype=torch.float32).to(torch.bfloat16))
    original = cache.device_cache.clone()
    out_pairs = [(3, 0), (7, 5), (30, 31)]
    cache.swap_out(out_pairs)
    cache.device_cache[[3, 7, 30]] = float("nan")  # the freed blocks are reused and overwritten
    in_pairs = [(0, 10), (5, 11), (31, 12)]
    cache.swap_in(in_pairs)
    cache.wait_for_swap_in()
    torch.cuda.synchronize()
    for (device_block, _), (_, back) in zip(out_pairs, in_pairs):
        assert torch.equal(cache.device_cache[back], original[device_block])


@pytest.mark.parametrize("backend", ["torch", "cuda"])
def test_copy_on_write_of_a_block_swapped_in_the_same_step(backend):
    """A group swapped back in may copy-on-write its just-swapped-in last block in the same
    step: the copy must see the swapped-in bytes, not what the device block held before.
    Hundreds of MB of swap-in ahead of it make an unordered copy read stale data."""
    from pagedkv.attention import get_backend
    from pagedkv.runner.kv_cache import KVCache

    cache = KVCache(30, 3, 64, 16, num_device_blocks=1030, num_cpu_blocks=1024, dtype=torch.float32, device="cuda")
    cache.cpu_cache.copy_(torch.randn(cache.cpu_cache.shape))
    cache.device_cache.fill_(float("nan"))
    cache.swap_in([(block, block) for block in range(1024)])  # ~740 MB
    cache.copy_blocks([(1023, 1024), (0, 1025)], get_backend(backend, "cuda"))
    torch.cuda.synchronize()
    assert torch.equal(cache.device_cache[1024].cpu(), cache.cpu_cache[1023])
    assert torch.equal(cache.device_cache[1025].cpu(), cache.cpu_cache[0])


@pytest.mark.parametrize("backend", ["torch", "cuda"])
def test_float8_cache_on_the_gpu(backend):
    """bfloat16 model, e4m3 cache, a pool small enough to swap: every request completes and
    every block comes back. (Token equality is no test for a float8 cache: see
    tests/engine/test_kv_cache_dtype.py; the kernels' values are checked in tests/kernels/test_kernels.py.)"""
    from pagedkv import LLM, SamplingParams

    llm = LLM(model_path(), device="cuda", dtype="bfloat16", kv_cache_dtype="fp8", num_device_blocks=24,
              max_model_len=512, attention_backend=backend, preemption_mode="swap", swap_space_bytes=64 << 20)
    assert llm.engine.runner.backend.name == backend
    assert llm.engine.runner.kv_cache.device_cache.dtype == torch.float8_e4m3fn
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert all(len(out.outputs[0].token_ids) == 16 for out in outputs)
    stats = llm.engine.stats()
    assert stats["num_free_device_blocks"] == stats["num_device_blocks"]


def test_lora_adapters_on_the_gpu_equal_the_cpu_engine(tmp_path):
    """Mixed adapters in one batch on the GPU give the CPU engine's greedy tokens (float32)."""
    from support.lora_adapters import write_adapter, SHAPES

    from pagedkv import LLM, LoRARequest, SamplingParams

    adapter = LoRARequest("every", 1, write_adapter(tmp_path / "every", list(SHAPES), rank=8, alpha=16, seed=1))
    loras = [None, adapter] * (len(PROMPTS) // 2)
    params = SamplingParams(temperature=0, max_tokens=16)
    results = []
    for device in ("cpu", "cuda"):
        llm = LLM(model_path(), device=device, dtype="float32", enable_lora=True, num_device_blocks=256,
                  max_model_len=1024)
        outputs = llm.generate(PROMPTS[: len(loras)], params, use_tqdm=False, lora_request=loras)
        results.append([out.outputs[0].token_ids for out in outputs])
    assert results[0] == results[1]


@pytest.mark.parametrize("architecture", ["gemma2", "gemma3", "olmo3", "qwen3_moe", "gpt_oss"])
def test_other_architectures_on_the_gpu_equal_the_cpu_engine(tmp_path, architecture):
    """A tiny random Gemma 2 (soft-capped attention logits), Gemma 3 and OLMo 3 (sliding-window
    and full layers, through the CUDA kernels' window) and Qwen3-MoE (experts, eager: no decode
    graphs) and GPT-OSS (attention sinks through the CUDA kernel, biased experts) give the CPU
    engine's greedy tokens."""
    from support.checkpoints import save_tiny_checkpoint
    from support.tiny_models import tiny_gemma2, tiny_gemma3, tiny_gpt_oss, tiny_moe_models, tiny_olmo

    from pagedkv import LLM, SamplingParams

    # Head dim 64: the CUDA kernels' smallest (the CPU tests' tiny OLMo, Qwen3-MoE and GPT-OSS use 32 and 16).
    builders = {"gemma2": tiny_gemma2, "gemma3": tiny_gemma3, "olmo3": lambda: tiny_olmo("olmo3", head_dim=64),
                "qwen3_moe": lambda: dict(tiny_moe_models(qwen3_head_dim=64))["qwen3_moe"],
                "gpt_oss": lambda: tiny_gpt_oss(head_dim=64)}
    hf_model = builders[architecture]().eval()
    directory = save_tiny_checkpoint(tmp_path, hf_model)
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (length,), generator=generator).tolist() for length in (40, 7, 70)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    results = []
    for device, backend in (("cpu", "auto"), ("cuda", "cuda")):
        llm = LLM(directory, device=device, dtype="float32", attention_backend=backend, max_num_batched_tokens=32,
                  num_device_blocks=64, enforce_eager=False)
        results.append([out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)])
    assert results[0] == results[1]


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_gpu_kv_cache_groups_equal_the_cpu_engine(tmp_path, enforce_eager):
    """A hybrid model (the tiny Gemma 3: windowed and full layers, KV-cache groups) on the CUDA
    kernels, eager and in decode graphs, under swap preemption: the CPU engine's tokens and
    logprobs."""
    from support.checkpoints import save_tiny_checkpoint
    from support.tiny_models import tiny_gemma3

    from pagedkv import LLM, SamplingParams

    directory = save_tiny_checkpoint(tmp_path, tiny_gemma3())
    generator = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 256, (length,), generator=generator).tolist() for length in (30, 12, 45, 70)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=3)

    def run(**options):
        llm = LLM(directory, dtype="float32", max_model_len=256, max_num_seqs=4, **options)
        assert llm.engine.runner.kv_groups.num_groups == 3
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return llm, [(out.outputs[0].token_ids, [sorted(step.values()) for step in out.outputs[0].logprobs])
                     for out in outputs]

    _, reference = run(device="cpu", num_device_blocks=256)
    llm, results = run(device="cuda", attention_backend="cuda", enforce_eager=enforce_eager, num_device_blocks=24,
                       preemption_mode="swap", watermark=0.0, swap_space_bytes=16 << 20)
    for (tokens, logprobs), (expected_tokens, expected_logprobs) in zip(results, reference):
        assert tokens == expected_tokens
        assert torch.allclose(torch.tensor(logprobs), torch.tensor(expected_logprobs), atol=1e-3)
    if not enforce_eager:
        assert sum(llm.engine.runner.decode_graphs.num_replays.values()) > 0
    assert llm.engine.stats()["num_preemptions_swap"] > 0
