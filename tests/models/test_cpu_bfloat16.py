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


@pytest.mark.parametrize("make, raw", [("tiny_llama", True), ("tiny_qwen2", True), ("tiny_granite", True),
                                       ("tiny_gemma2", False), ("tiny_cohere", False)])
def test_greedy_logits_have_the_float32_logits_argmax(tmp_path, make, raw):
    """`compute_greedy_logits` (greedy steps' LM head) is the bfloat16 LM-head output where the
    float32 logits add nothing but the widening and a positive scale (Granite's), else the float32
    logits themselves (Gemma 2's soft cap, Cohere's scale); either way its rows' argmax is the
    float32 logits'."""
    import support.tiny_models as tiny_models
    from support.checkpoints import save_tiny_checkpoint

    from pagedkv.loader import load

    hf_model = getattr(tiny_models, make)(*(() if make != "tiny_cohere" else (False,)))
    model = load(save_tiny_checkpoint(tmp_path, hf_model), None, None, torch.bfloat16, torch.device("cpu"), None).model
    hidden = torch.randn(64, hf_model.config.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.inference_mode():
        greedy, logits = model.compute_greedy_logits(hidden), model.compute_logits(hidden)
    assert greedy.dtype == (torch.bfloat16 if raw else torch.float32)
    assert torch.equal(greedy.float().argmax(-1), logits.argmax(-1))


def test_greedy_steps_choose_from_bfloat16_logits_what_float32_logits_give(tiny_qwen2_dir, monkeypatch):
    """A bfloat16 engine's all-greedy steps take their argmax from the LM head's bfloat16 output
    (no float32 copy); the tokens equal those of the same engine made to read float32 logits, and
    a step with a row that asks for logprobs reads float32 logits."""
    from pagedkv.models.llama import LlamaForCausalLM

    greedy_dtypes = []
    original = LlamaForCausalLM.compute_greedy_logits

    def spy(self, hidden):
        logits = original(self, hidden)
        greedy_dtypes.append(logits.dtype)
        return logits

    prompts = [[5 + i, 17, 3 * i + 9, 40] for i in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def generate(params_list):
        llm = LLM(tiny_qwen2_dir, dtype="bfloat16", num_device_blocks=64, max_model_len=128)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params_list, use_tqdm=False)
        return [list(output.outputs[0].token_ids) for output in outputs]

    monkeypatch.setattr(LlamaForCausalLM, "compute_greedy_logits", spy)
    from_bfloat16 = generate(greedy)
    assert greedy_dtypes and set(greedy_dtypes) == {torch.bfloat16}
    greedy_dtypes.clear()
    with_logprobs = generate([greedy] * 5 + [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)])
    assert not greedy_dtypes  # (the logprobs row is in every step: float32 logits throughout)
    monkeypatch.setattr(LlamaForCausalLM, "compute_greedy_logits", LlamaForCausalLM.compute_logits)
    assert from_bfloat16 == generate(greedy) == with_logprobs
