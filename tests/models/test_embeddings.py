"""Pooling requests (LLM.embed, PoolingParams): the prompt's last final hidden state, checked
against HF transformers on the embedded SmolLM2, through chunking, the prefix cache and batches
shared with generation."""

import pytest
import torch

from pagedkv import LLM, PoolingParams, SamplingParams

PROMPTS = [
    "Hello",
    "The capital of France is Paris, and the capital of Italy is Rome.",
    " ".join(f"Line {i}: the {['cat', 'dog', 'bird'][i % 3]} sat." for i in range(30)),
]


def hf_last_hidden(hf_model, token_ids: list[int]) -> torch.Tensor:
    """HF's final hidden state (after the last norm) of the last token."""
    with torch.inference_mode():
        return hf_model.model(torch.tensor([token_ids])).last_hidden_state[0, -1].float()


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", gguf_weights="dequantized", num_device_blocks=128, max_model_len=512)


def test_embeddings_are_the_last_tokens_final_hidden_state(llm, smollm2_hf_model):
    normalized = llm.embed(PROMPTS, use_tqdm=False)
    raw = llm.embed(PROMPTS, PoolingParams(normalize=False), use_tqdm=False)
    for prompt, unit, plain in zip(PROMPTS, normalized, raw):
        expected = hf_last_hidden(smollm2_hf_model, llm.tokenizer.encode(prompt))
        assert unit.prompt_token_ids == llm.tokenizer.encode(prompt) and unit.finished
        torch.testing.assert_close(torch.tensor(plain.outputs.embedding), expected, atol=2e-3, rtol=1e-3)
        unit_vector = torch.tensor(unit.outputs.embedding)
        assert unit_vector.norm().item() == pytest.approx(1.0, abs=1e-5)
        torch.testing.assert_close(unit_vector, torch.nn.functional.normalize(expected, dim=-1), atol=1e-4, rtol=1e-3)
    assert torch.tensor(normalized[0].outputs.embedding) @ torch.tensor(normalized[1].outputs.embedding) < 0.99


def test_chunks_prefix_hits_and_shared_batches_give_the_same_embedding(llm):
    reference = llm.embed(PROMPTS, use_tqdm=False)
    chunked = LLM(dtype="float32", gguf_weights="dequantized", num_device_blocks=128, max_model_len=512, max_num_batched_tokens=32)
    prompt = PROMPTS[2]
    assert len(chunked.tokenizer.encode(prompt)) > 3 * 32  # prefilled in several chunks
    first = chunked.embed(prompt, use_tqdm=False)[0]
    again = chunked.embed(prompt, use_tqdm=False)[0]  # whole blocks now come from the prefix cache
    assert again.metrics.num_prefix_hit_tokens >= 96
    for output in (first, again):
        torch.testing.assert_close(torch.tensor(output.outputs.embedding), torch.tensor(reference[2].outputs.embedding),
                                   atol=1e-4, rtol=1e-3)
    # Generation and pooling requests in the same batches: neither disturbs the other.
    greedy = SamplingParams(temperature=0, max_tokens=12)
    alone = chunked.generate([PROMPTS[1]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    engine = chunked.engine
    engine.add_request("gen", PROMPTS[1], greedy)
    engine.add_request("emb", PROMPTS[0], PoolingParams())
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((output.request_id, output) for output in engine.step() if output.finished)
    assert finals["gen"].outputs[0].token_ids == alone
    torch.testing.assert_close(torch.tensor(finals["emb"].outputs.embedding), torch.tensor(reference[0].outputs.embedding),
                               atol=1e-4, rtol=1e-3)
    stats = engine.stats()
    assert stats["num_free_device_blocks"] == stats["num_device_blocks"]
    assert stats["finished_by_reason"]["stop"] >= 1
