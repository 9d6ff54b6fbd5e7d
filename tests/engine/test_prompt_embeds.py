"""Prompts given as embeddings (`{"prompt_embeds": tensor}`, vLLM's EmbedsPrompt): the model
reads them where it would look tokens up, through the first prefill, chunked prefills, prefix
cache hits and recomputes; what cannot work with them is refused before anything is queued."""

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.errors import PromptTooLongError

TEXTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a land far away, there lived a"]


def greedy(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_model(smollm2_hf_model):
    return smollm2_hf_model


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", gguf_weights="dequantized", enable_prompt_embeds=True, num_device_blocks=128, max_model_len=256)


@pytest.fixture(scope="module")
def prompts(smollm2_hf_tokenizer) -> list[list[int]]:
    return [smollm2_hf_tokenizer.encode(text) for text in TEXTS]


def random_embeds(hf_model, length: int, seed: int) -> torch.Tensor:
    """Embeddings no token has: the scale of the model's own, random directions."""
    generator = torch.Generator().manual_seed(seed)
    scale = hf_model.get_input_embeddings().weight.std()
    return torch.randn(length, hf_model.config.hidden_size, generator=generator) * scale


def hf_greedy(hf_model, embeds: torch.Tensor, max_tokens: int) -> list[int]:
    """transformers' greedy continuation of `inputs_embeds` (no end-of-sequence stop, as ignore_eos)."""
    tokens = []
    with torch.no_grad():
        out = hf_model(inputs_embeds=embeds.float()[None], use_cache=True)
        for _ in range(max_tokens):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = hf_model(input_ids=torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def test_embeddings_of_tokens_generate_what_the_tokens_do(llm, hf_model, prompts):
    table = hf_model.get_input_embeddings().weight.detach()
    by_ids = llm.generate(prompts, greedy(), use_tqdm=False)
    by_embeds = llm.generate([{"prompt_embeds": table[ids]} for ids in prompts], greedy(), use_tqdm=False)
    assert [out.outputs[0].token_ids for out in by_embeds] == [out.outputs[0].token_ids for out in by_ids]
    for out, ids in zip(by_embeds, prompts):
        assert out.prompt is None and out.prompt_token_ids == [] and out.num_prompt_tokens == len(ids)


def test_embeddings_no_token_has_generate_what_transformers_does(llm, hf_model):
    embeds = [random_embeds(hf_model, length, seed) for seed, length in enumerate((3, 20, 41))]
    outputs = llm.generate([{"prompt_embeds": e} for e in embeds], greedy(), use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == [hf_greedy(hf_model, e, 12) for e in embeds]


def test_a_batch_dimension_of_one_is_dropped_and_bfloat16_is_read(llm, hf_model):
    embeds = random_embeds(hf_model, 9, 7)
    flat = llm.generate({"prompt_embeds": embeds}, greedy(), use_tqdm=False)[0].outputs[0].token_ids
    assert llm.generate({"prompt_embeds": embeds[None]}, greedy(), use_tqdm=False)[0].outputs[0].token_ids == flat
    rounded = embeds.to(torch.bfloat16)
    got = llm.generate({"prompt_embeds": rounded}, greedy(), use_tqdm=False)[0].outputs[0].token_ids
    assert got == hf_greedy(hf_model, rounded.float(), 12)


@pytest.mark.parametrize("options", [
    dict(max_num_batched_tokens=16),  # (prefilled 16 positions a step)
    dict(num_device_blocks=6, block_size=16, preemption_mode="recompute", watermark=0.0),
    dict(num_device_blocks=6, block_size=16, preemption_mode="swap", watermark=0.0),
], ids=["chunked", "recompute", "swap"])
def test_chunked_prefills_and_preemption_keep_the_embeddings(hf_model, options):
    config = dict(dtype="float32", gguf_weights="dequantized", enable_prompt_embeds=True, max_model_len=256, swap_space_bytes=16 << 20)
    llm = LLM(**{**config, **options})
    embeds = [random_embeds(hf_model, 30 + seed, seed) for seed in range(4)]
    outputs = llm.generate([{"prompt_embeds": e} for e in embeds], greedy(16), use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == [hf_greedy(hf_model, e, 16) for e in embeds]
    stats = llm.engine.stats()
    assert stats["num_free_device_blocks"] == stats["num_device_blocks"]
    if "preemption_mode" in options:
        assert stats[f"num_preemptions_{options['preemption_mode']}"] > 0


def test_the_prefix_cache_shares_equal_embeddings_only(hf_model):
    llm = LLM(dtype="float32", gguf_weights="dequantized", enable_prompt_embeds=True, num_device_blocks=64, max_model_len=256)
    first, other = random_embeds(hf_model, 40, 1), random_embeds(hf_model, 40, 2)
    reference = llm.generate({"prompt_embeds": first}, greedy(), use_tqdm=False)[0].outputs[0].token_ids
    hits = llm.engine.stats()["prefix_cache_hits"]
    assert llm.generate({"prompt_embeds": first.clone()}, greedy(), use_tqdm=False)[0].outputs[0].token_ids == reference
    assert llm.engine.stats()["prefix_cache_hits"] > hits
    hits = llm.engine.stats()["prefix_cache_hits"]
    # The same placeholder ids, other values: nothing shared, and their own output.
    got = llm.generate({"prompt_embeds": other}, greedy(), use_tqdm=False)[0].outputs[0].token_ids
    assert llm.engine.stats()["prefix_cache_hits"] == hits
    assert got == hf_greedy(hf_model, other, 12)
    # Nor does a token-id prompt of the placeholder ids.
    llm.generate([[0] * 40], greedy(), use_tqdm=False)
    assert llm.engine.stats()["prefix_cache_hits"] == hits


def test_n_samples_share_the_prompt_and_no_placeholder_is_a_prompt_token(llm, hf_model):
    embeds = random_embeds(hf_model, 12, 3)
    reference = hf_greedy(hf_model, embeds, 12)
    both = llm.generate({"prompt_embeds": embeds}, SamplingParams(n=2, temperature=0.0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0]
    assert [sample.token_ids for sample in both.outputs] == [reference, reference]
    # What reads the prompt's tokens (penalties, logits processors) sees none: it has none.
    seen = []

    def record(prompt_token_ids, output_token_ids, logits):
        seen.append(list(prompt_token_ids))
        return logits

    params = SamplingParams(temperature=0.0, max_tokens=3, repetition_penalty=1.5, logits_processors=[record])
    llm.generate({"prompt_embeds": embeds}, params, use_tqdm=False)
    assert seen == [[], [], []]
    llm.generate([[0] * 12], params, use_tqdm=False)
    assert seen[-1] == [0] * 12


def test_what_cannot_take_embeddings_is_refused(llm, hf_model):
    embeds = random_embeds(hf_model, 5, 0)
    off = LLM(dtype="float32", gguf_weights="dequantized", num_device_blocks=32, max_model_len=64)
    with pytest.raises(ValueError, match="enable_prompt_embeds"):
        off.generate({"prompt_embeds": embeds}, greedy(), use_tqdm=False)
    refused = [
        ({"prompt_embeds": embeds[:, :-1]}, greedy(), "hidden_size"),
        ({"prompt_embeds": embeds[:0]}, greedy(), "length >= 1"),
        ({"prompt_embeds": embeds.long()}, greedy(), "floating-point"),
        ({"prompt_embeds": embeds.tolist()}, greedy(), "torch.Tensor"),
        ({"prompt_embeds": torch.full_like(embeds, float("nan"))}, greedy(), "NaN"),
        ({"prompt_embeds": embeds}, SamplingParams(max_tokens=2, prompt_logprobs=1), "not compatible"),
    ]
    for prompt, params, message in refused:
        with pytest.raises(ValueError, match=message):
            llm.generate(prompt, params, use_tqdm=False)
    with pytest.raises(PromptTooLongError):
        llm.generate({"prompt_embeds": random_embeds(hf_model, 257, 0)}, greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="generation"):
        llm.embed({"prompt_embeds": embeds}, use_tqdm=False)
    kept = llm.generate({"prompt_embeds": random_embeds(hf_model, 300, 0)},
                        SamplingParams(temperature=0.0, max_tokens=3, truncate_prompt_tokens=20), use_tqdm=False)[0]
    assert kept.num_prompt_tokens == 20
    stats = llm.engine.stats()
    assert stats["num_free_device_blocks"] == stats["num_device_blocks"]


def test_embedded_positions_inside_a_prompt_of_tokens(llm, hf_model, prompts):
    """{"prompt_token_ids", "prompt_embeds", "prompt_embeds_positions"}: some positions embedded
    (the form a chat message's embedded parts take)."""
    ids, middle = prompts[2], [3, 4, 5, 6, 7]
    table = hf_model.get_input_embeddings().weight.detach()
    by_ids = llm.generate([ids], greedy(), use_tqdm=False)[0].outputs[0].token_ids
    own = {"prompt_token_ids": ids, "prompt_embeds": table[[ids[p] for p in middle]], "prompt_embeds_positions": middle}
    assert llm.generate(own, greedy(), use_tqdm=False)[0].outputs[0].token_ids == by_ids
    rows = random_embeds(hf_model, len(middle), 9)
    spliced = table[ids].clone()
    spliced[middle] = rows
    other = {"prompt_token_ids": ids, "prompt_embeds": rows, "prompt_embeds_positions": middle}
    assert llm.generate(other, greedy(), use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(hf_model, spliced, 12)
    for positions in ([3, 4, 5, 6], [3, 3, 4, 5, 6], [3, 4, 5, 6, len(ids)]):
        with pytest.raises(ValueError, match="prompt_embeds_positions"):
            llm.generate({**other, "prompt_embeds_positions": positions}, greedy(), use_tqdm=False)
