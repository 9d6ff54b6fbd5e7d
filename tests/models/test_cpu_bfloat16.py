"""The engine in bfloat16 on the CPU (the fast CPU dtype: bf16 matmuls, half-size KV cache read
by the Rust decode attention) against the exact float32 HF model.

bf16 rounding may change a greedy choice between near-tied tokens, so token equality is not
the test. Instead the float32 model re-reads each generated text in one forward, and every
token the bf16 engine chose must be (nearly) the float32 model's best at that position. An
attention bug is no near-tie: dropping one cached token from each decode step puts choices
1-15 nats below the best on most of these prompts; correct bf16 stays within ~0.3.
"""

import pytest
import torch

import pagedkv.attention.cpu as cpu_attention
import pagedkv.config
from pagedkv import LLM, EngineConfig, SamplingParams

PROMPTS = [
    "Hello",
    "The quick brown fox",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived",
    "1, 2, 3, 4, 5,",
    "Paris is the capital of",
]
MAX_MARGIN_NATS = 0.75


def test_bfloat16_engine_chooses_what_the_float32_model_would(smollm2_hf_model, monkeypatch):
    cache_dtypes = []
    rust_decode = cpu_attention.paged_decode_attention

    def spy(query, key_cache, *rest):
        cache_dtypes.append(key_cache.dtype)
        return rust_decode(query, key_cache, *rest)

    monkeypatch.setattr(cpu_attention, "paged_decode_attention", spy)
    llm = LLM(dtype="bfloat16", max_model_len=1024, num_device_blocks=256)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)

    assert cache_dtypes and set(cache_dtypes) == {torch.bfloat16}  # decode ran in Rust on bf16 K/V
    for output in outputs:
        prompt, generated = output.prompt_token_ids, list(output.outputs[0].token_ids)
        assert len(generated) > 0
        with torch.inference_mode():
            logits = smollm2_hf_model(torch.tensor([prompt + generated])).logits[0].float()
        log_probs = logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)].log_softmax(-1)
        margins = log_probs.max(-1).values - log_probs[torch.arange(len(generated)), torch.tensor(generated)]
        assert margins.max().item() < MAX_MARGIN_NATS, (output.outputs[0].text, margins.tolist())


@pytest.mark.parametrize(
    "flags,native",
    [("fpu avx2 avx512f avx512_bf16 avx512_vnni", True), ("fpu avx2 amx_tile amx_bf16", True), ("fpu avx2 avx512f", False)],
)
def test_native_bfloat16_is_read_from_the_cpu_flags(tmp_path, flags, native):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: {flags}\n\n")
    assert pagedkv.config.cpu_has_native_bfloat16(str(cpuinfo)) is native
    assert pagedkv.config.cpu_has_native_bfloat16(str(tmp_path / "missing")) is False


@pytest.mark.parametrize("native", [True, False])
def test_auto_dtype_is_bfloat16_only_where_the_cpu_has_it(monkeypatch, native):
    monkeypatch.setattr(pagedkv.config, "cpu_has_native_bfloat16", lambda: native)
    assert EngineConfig().torch_dtype() == (torch.bfloat16 if native else torch.float32)
    assert EngineConfig(dtype="float32").torch_dtype() == torch.float32


@pytest.mark.parametrize("make, narrow_for_argmax, narrow_for_draws", [
    ("tiny_llama", True, True), ("tiny_qwen2", True, True), ("tiny_granite", True, False),
    ("tiny_gemma2", False, False), ("tiny_cohere", False, False)])
def test_narrow_logits_are_the_float32_logits_before_widening(tmp_path, make, narrow_for_argmax, narrow_for_draws):
    """`compute_narrow_logits` is the bfloat16 LM-head output where the float32 logits add nothing
    to it but the widening (then they are its widening: draws from either are the same), or, for
    an argmax alone, the widening and a positive scale (Granite's); else the float32 logits
    themselves (Gemma 2's soft cap, Cohere's scale)."""
    import support.tiny_models as tiny_models
    from support.checkpoints import save_tiny_checkpoint

    from pagedkv.models.loader import load

    hf_model = getattr(tiny_models, make)(*(() if make != "tiny_cohere" else (False,)))
    model = load(save_tiny_checkpoint(tmp_path, hf_model), None, None, torch.bfloat16, torch.device("cpu"), None).model
    hidden = torch.randn(64, hf_model.config.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.inference_mode():
        logits = model.compute_logits(hidden)
        for_argmax = model.compute_narrow_logits(hidden, order_only=True)
        for_draws = model.compute_narrow_logits(hidden)
    assert for_argmax.dtype == (torch.bfloat16 if narrow_for_argmax else torch.float32)
    assert torch.equal(for_argmax.float().argmax(-1), logits.argmax(-1))
    assert for_draws.dtype == (torch.bfloat16 if narrow_for_draws else torch.float32)
    assert torch.equal(for_draws.float(), logits)


def test_plain_steps_draw_from_bfloat16_logits_what_float32_logits_give(tiny_qwen2_dir, monkeypatch):
    """A bfloat16 engine's steps whose rows are all plain (greedy, or seeded temperature / top-k /
    top-p / min-p) read the LM head's bfloat16 output (no float32 copy); the tokens equal those of
    the same engine made to read float32 logits, and a step with a row that asks for logprobs
    reads float32 logits."""
    from pagedkv.models.llama import LlamaForCausalLM

    narrow_dtypes = []
    original = LlamaForCausalLM.compute_narrow_logits

    def spy(self, hidden, order_only=False):
        logits = original(self, hidden, order_only)
        narrow_dtypes.append(logits.dtype)
        return logits

    prompts = [[5 + i, 17, 3 * i + 9, 40] for i in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    sampled = [SamplingParams(temperature=0.9, top_k=[-1, 20][i % 2], top_p=[1.0, 0.8][i % 3 > 0],
                              min_p=[0.0, 0.05][i % 2], seed=i, max_tokens=12, ignore_eos=True) for i in range(6)]

    def generate(params_list):
        llm = LLM(tiny_qwen2_dir, dtype="bfloat16", num_device_blocks=64, max_model_len=128)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params_list, use_tqdm=False)
        return [list(output.outputs[0].token_ids) for output in outputs]

    monkeypatch.setattr(LlamaForCausalLM, "compute_narrow_logits", spy)
    from_bfloat16 = generate(greedy), generate(sampled)
    assert narrow_dtypes and set(narrow_dtypes) == {torch.bfloat16}
    narrow_dtypes.clear()
    with_logprobs = generate([greedy] * 5 + [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)])
    assert not narrow_dtypes  # (the logprobs row is in every step: float32 logits throughout)
    monkeypatch.setattr(LlamaForCausalLM, "compute_narrow_logits", lambda self, hidden, order_only=False:
                        LlamaForCausalLM.compute_logits(self, hidden))
    assert from_bfloat16 == (generate(greedy), generate(sampled))
    assert from_bfloat16[0] == with_logprobs
