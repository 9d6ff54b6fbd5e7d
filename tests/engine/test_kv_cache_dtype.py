"""Float8 KV caches (`kv_cache_dtype="fp8"` / "fp8_e4m3" / "fp8_e5m2", vLLM's option).

The Rust CPU kernels read float8 codes themselves (rust/cpu_kernels/fp8.rs); torch's own float8 conversion in
the reference backend is their oracle. Against the exact float32 model a float8 cache is lossy,
so quality is checked as in test_cpu_bfloat16.py: every token the engine chose must be nearly the
float32 model's best at its position.
"""

import pytest
import torch

import pagedkv.attention.cpu as cpu_attention
from pagedkv import LLM, EngineConfig, InvalidConfigError, SamplingParams
from pagedkv.attention import AttentionMetadata
from pagedkv.attention.torch_ref import decode_batch, paged_attention_ref, to_cache_dtype, write_kv
from pagedkv.runner.kv_cache import KVCache

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
PROMPTS = [
    "Hello",
    "The quick brown fox",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived",
    "1, 2, 3, 4, 5,",
    "Paris is the capital of",
]


def random_caches(dtype, num_blocks=24, num_kv_heads=3, block_size=16, head_dim=64, seed=0):
    """Block-major [num_blocks, 2, Hkv, bs, D] cache (K and V interleaved, as the engine's) of
    values up to ~8, converted to `dtype`."""
    generator = torch.Generator().manual_seed(seed)
    cache = torch.randn((num_blocks, 2, num_kv_heads, block_size, head_dim), generator=generator) * 3
    cache = to_cache_dtype(cache, dtype)
    return cache[:, 0], cache[:, 1]


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_every_code_is_read_as_torch_reads_it(dtype):
    # A context of one token: the output is that token's V row exactly (its softmax weight is 1).
    codes = torch.arange(256, dtype=torch.uint8).view(dtype)
    finite = codes[codes.float().isfinite()]
    key_cache, value_cache = random_caches(dtype, num_blocks=8, num_kv_heads=1, head_dim=64)
    rows = finite.float()
    padded = torch.cat([rows, torch.zeros((-len(rows)) % 64)]).view(-1, 64)
    value_cache[: len(padded), 0, 0] = padded.to(dtype)
    query = torch.randn(len(padded), 1, 64)
    tables = torch.arange(len(padded), dtype=torch.int32).view(-1, 1)
    contexts = torch.ones(len(padded), dtype=torch.int32)
    out = cpu_attention.paged_decode_attention(query, key_cache, value_cache, tables, contexts, 0.125)
    assert torch.equal(out[:, 0], padded)


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_rust_kernels_match_the_reference_on_float8_caches(dtype):
    key_cache, value_cache = random_caches(dtype, num_blocks=40)
    generator = torch.Generator().manual_seed(1)
    tables = torch.randperm(40, generator=generator, dtype=torch.int32)[:36].view(3, 12)
    contexts = torch.tensor([1, 77, 190], dtype=torch.int32)
    query = torch.randn(3, 9, 64, generator=generator)
    out = cpu_attention.paged_decode_attention(query, key_cache, value_cache, tables, contexts, 0.125)
    want = decode_batch(query.double(), key_cache, value_cache, tables, contexts, 190, 0.125)
    assert (out.double() - want).abs().max() < 1e-5 * want.abs().max()

    # Prefill chunks after cached prefixes of 0, 40 and 3 tokens, through the whole backend.
    new_tokens, contexts = [77, 150, 9], [77, 190, 12]
    starts = [0, 77, 227, 236]
    query = torch.randn(starts[-1], 9, 64, generator=generator, dtype=torch.float64)
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32), context_lens=torch.tensor(contexts, dtype=torch.int32),
        block_tables=tables, slot_mapping=torch.zeros(0, dtype=torch.int64), max_query_len=max(new_tokens),
        max_context_len=max(contexts), num_decode_tokens=0, query_start_loc_host=starts, context_lens_host=contexts,
    )
    want = paged_attention_ref(query, key_cache, value_cache, metadata, 0.125)
    got = cpu_attention.CpuAttentionBackend().forward(query.float(), key_cache, value_cache, metadata, 0.125)
    assert (got.double() - want).abs().max() < 1e-5 * want.abs().max()


def test_writes_round_to_nearest_and_saturate():
    key_cache, value_cache = (torch.zeros(2, 1, 4, 2, dtype=torch.float8_e5m2) for _ in range(2))
    key = torch.tensor([[[1e6, -1e6]], [[0.3, float("inf")]]])
    write_kv(key_cache, value_cache, key, key, torch.tensor([1, 6]))
    assert key_cache[0, 0, 1].float().tolist() == [57344.0, -57344.0]
    assert key_cache[1, 0, 2].float().tolist() == [0.3125, 57344.0]


# Largest margins seen on these prompts: e4m3 0.63 nats, e5m2 (one mantissa bit fewer) 1.2; an
# attention bug costs 1-15 nats on most prompts (test_cpu_bfloat16.py).
@pytest.mark.parametrize("kv_cache_dtype,max_margin", [("fp8", 1.0), ("fp8_e5m2", 2.0)])
def test_float8_cache_chooses_what_the_float32_model_would(smollm2_hf_model, kv_cache_dtype, max_margin, monkeypatch):
    cache_dtypes = []
    rust_decode = cpu_attention.paged_decode_attention

    def spy(query, key_cache, *rest):
        cache_dtypes.append(key_cache.dtype)
        return rust_decode(query, key_cache, *rest)

    monkeypatch.setattr(cpu_attention, "paged_decode_attention", spy)
    # (dequantized weights: the float32 model's own products, so the cache is the only difference)
    llm = LLM(dtype="float32", gguf_weights="dequantized", kv_cache_dtype=kv_cache_dtype, max_model_len=1024,
              kv_cache_memory_bytes=16 << 20)
    block_bytes = 30 * 2 * 3 * 16 * 64  # one byte per element: a quarter of a float32 block
    assert llm.engine.runner.num_device_blocks == (16 << 20) // block_bytes
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)

    expected_dtype = torch.float8_e5m2 if kv_cache_dtype == "fp8_e5m2" else torch.float8_e4m3fn
    assert cache_dtypes and set(cache_dtypes) == {expected_dtype}
    for output in outputs:
        prompt, generated = output.prompt_token_ids, list(output.outputs[0].token_ids)
        with torch.inference_mode():
            logits = smollm2_hf_model(torch.tensor([prompt + generated])).logits[0].float()
        log_probs = logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)].log_softmax(-1)
        margins = log_probs.max(-1).values - log_probs[torch.arange(len(generated)), torch.tensor(generated)]
        assert margins.max().item() < max_margin, (output.outputs[0].text, margins.tolist())


def test_float8_engine_attention_equals_the_torch_reference_through_chunks_prefix_hits_and_preemption(monkeypatch):
    """Every attention call of a float8 engine, on its real caches, against torch's reading of
    the same float8 codes: prompts split into chunks, a shared cached prefix, and a pool small
    enough to preempt. (Whole outputs are no test here: a float8 cache turns a 1e-6 change in one
    attention output into other codes downstream, which moves next-token logprobs by ~0.3 nats
    on this model, so two correct kernels can pick different near-tied tokens.)"""
    errors = []
    rust_forward = cpu_attention.CpuAttentionBackend.forward

    def checked(self, query, key_cache, value_cache, metadata, scale, sliding_window=None, logit_softcap=None,
                sinks=None):
        assert sliding_window is None and logit_softcap is None and sinks is None  # SmolLM2: plain attention
        out = rust_forward(self, query, key_cache, value_cache, metadata, scale)
        want = paged_attention_ref(query.double(), key_cache, value_cache, metadata, scale)
        errors.append(((out.double() - want).abs().max() / want.abs().max()).item())
        return out

    monkeypatch.setattr(cpu_attention.CpuAttentionBackend, "forward", checked)
    shared = "You are a helpful assistant. Answer briefly and precisely. " * 6
    prompts = [shared + question for question in ("What is 2+2?", "Name a color.", "Count to five.")] + PROMPTS[:3]
    llm = LLM(dtype="float32", kv_cache_dtype="fp8", attention_backend="cpu", max_model_len=512,
              max_num_batched_tokens=64, num_device_blocks=18, swap_space_bytes=8 << 20)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    stats = llm.engine.scheduler.stats()
    assert stats["num_preemptions_swap"] + stats["num_preemptions_recompute"] > 0 and stats["prefix_cache_hits"] > 0
    assert all(len(output.outputs[0].token_ids) == 32 for output in outputs)
    assert len(errors) > 30 * 20 and max(errors) < 1e-5


def test_float8_blocks_swap_and_copy_bit_exactly():
    cache = KVCache(2, 3, 64, 16, num_device_blocks=6, num_cpu_blocks=4, dtype=torch.float8_e4m3fn, device="cpu")
    codes = torch.randint(0, 256, cache.device_cache.shape, dtype=torch.uint8)
    cache.device_cache.view(torch.uint8).copy_(codes)  # every code, NaNs included
    cache.swap_out([(1, 0), (2, 1), (5, 3)])
    cache.swap_in([(0, 4), (1, 0), (3, 3)])
    cache.copy_blocks([(4, 2)])
    device = cache.device_cache.view(torch.uint8)
    for block, source in [(4, 1), (0, 2), (3, 5), (2, 1)]:
        assert torch.equal(device[block], codes[source])


def test_invalid_kv_cache_dtype_is_a_clear_error():
    with pytest.raises(InvalidConfigError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_torch_dtype() == torch.float8_e4m3fn
    assert EngineConfig(dtype="float32").kv_cache_torch_dtype() == torch.float32
    assert EngineConfig(dtype="float32", kv_cache_dtype="bfloat16").kv_cache_torch_dtype() == torch.bfloat16
    with pytest.raises(InvalidConfigError, match="CPU only"):  # (the CUDA kernels pair a cache with its own type)
        EngineConfig(device="cuda", dtype="float32", kv_cache_dtype="bfloat16")
