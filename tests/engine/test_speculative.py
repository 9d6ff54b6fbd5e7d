"""Speculative decoding by prompt lookup (num_speculative_tokens): greedy outputs are exactly those
of decoding one token at a time (and of HF transformers), through chunked prefill, the prefix
cache, preemption by swap and recompute, stop strings and max_tokens; drafts are proposed and
partly accepted."""

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.engine.ngram_proposer import propose_ngram_drafts

MAX_NEW_TOKENS = 40


@pytest.fixture(scope="module")
def prompts():
    items = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(12))
    return [
        "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,",
        items + " Item 12 is a",
        "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
        "The quick brown fox",
        "Repeat after me: the cat sat on the mat. The cat sat on the mat. The cat",
    ]


@pytest.fixture(scope="module")
def references(prompts, smollm2_hf_model, smollm2_hf_tokenizer):
    tokenizer = smollm2_hf_tokenizer
    expected = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt)
        with torch.inference_mode():
            out = smollm2_hf_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_NEW_TOKENS,
                                            pad_token_id=0)
        expected.append(out[0, len(ids):].tolist())
    return expected


def greedy(max_tokens=MAX_NEW_TOKENS, **extra):
    return SamplingParams(temperature=0, max_tokens=max_tokens, **extra)


def test_prompt_lookup_drafts():
    assert propose_ngram_drafts([1, 2, 3, 4, 5, 1, 2, 3], 3, 4, 2) == [4, 5, 1]
    assert propose_ngram_drafts([1, 2, 3, 4, 1, 2, 3, 4, 1, 2], 4, 3, 1) == [3, 4, 1, 2]  # the latest match
    assert propose_ngram_drafts([5, 6, 7, 8], 3, 3, 2) == []
    assert propose_ngram_drafts([1, 2, 9, 1, 2], 0, 3, 1) == []


@pytest.mark.parametrize("options", [
    dict(),
    dict(max_num_batched_tokens=32),  # prompts prefilled in chunks
    dict(num_device_blocks=12, max_model_len=192, preemption_mode="swap", watermark=0.0, swap_space_bytes=64 << 20),
    dict(num_device_blocks=12, max_model_len=192, preemption_mode="recompute", watermark=0.0),
])
def test_greedy_outputs_equal_one_token_at_a_time(options, prompts, references):
    settings = dict(dtype="float32", gguf_weights="dequantized", num_device_blocks=256, max_model_len=512)
    settings.update(options)
    llm = LLM(num_speculative_tokens=4, speculative_disable_by_batch_size=None, **settings)
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [output.outputs[0].token_ids for output in outputs] == references
    stats = llm.engine.stats()
    assert 0 < stats["num_accepted_draft_tokens"] < stats["num_draft_tokens"], stats
    if "preemption_mode" in options:
        assert stats[f"num_preemptions_{options['preemption_mode']}"] > 0
    assert stats["num_free_device_blocks"] == stats["num_device_blocks"]
    llm.engine.scheduler.check_invariants()


def test_stops_and_other_requests_are_unchanged(prompts, references):
    plain = LLM(dtype="float32", gguf_weights="dequantized", num_device_blocks=256, max_model_len=512)
    fast = LLM(dtype="float32", gguf_weights="dequantized", num_device_blocks=256, max_model_len=512, num_speculative_tokens=5, prompt_lookup_min=1,
               speculative_disable_by_batch_size=None)
    stop_text = plain.tokenizer.decode(references[4][:6])[-5:]
    params = [
        greedy(max_tokens=7),  # max_tokens falls inside a run of accepted drafts
        greedy(stop=[stop_text]),
        SamplingParams(temperature=0.8, seed=3, max_tokens=20),  # sampled: does not speculate
        greedy(repetition_penalty=1.3),  # penalties: does not speculate
        greedy(logprobs=2),
    ]
    batch = [prompts[0], prompts[4], prompts[1], prompts[2], prompts[3]]
    expected = plain.generate(batch, params, use_tqdm=False)
    got = fast.generate(batch, params, use_tqdm=False)
    for want, have in zip(expected, got):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
        assert have.outputs[0].text == want.outputs[0].text
        assert have.outputs[0].finish_reason == want.outputs[0].finish_reason
    assert len(got[0].outputs[0].token_ids) == 7 and got[1].outputs[0].finish_reason == "stop"
    assert fast.engine.stats()["num_accepted_draft_tokens"] > 0


def test_a_busy_engine_does_not_draft(prompts):
    llm = LLM(dtype="float32", gguf_weights="dequantized", num_device_blocks=256, max_model_len=512, num_speculative_tokens=4,
              speculative_disable_by_batch_size=3)
    engine = llm.engine
    for index in range(3):
        engine.add_request(f"busy-{index}", prompts[index], greedy())
    for _ in range(8):
        engine.step()
    assert engine.num_unfinished_requests == 3 and engine.stats()["num_draft_tokens"] == 0
    for index in range(1, 3):
        engine.abort(f"busy-{index}")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats()["num_draft_tokens"] > 0
