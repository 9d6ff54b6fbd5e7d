"""Pair scores (LLM.score, the server's /score and /rerank): a cross-encoder's sigmoid of each pair
encoded together, or the cosine similarity of two embeddings, against HF transformers on tiny
random checkpoints."""

import httpx
import pytest
import torch
from support.tiny_models import hf_scores, tiny_classifier
from support.live_server import LiveServer

from pagedkv import LLM

QUERY = "w10 w11 w12 w13"
DOCUMENTS = ["w10 w11 w12 w14", "w200 w201", "w13 w12 w11 w10 w9 w8", "w50"]


def hf_unit_embedding(model, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        hidden = model.model(torch.tensor([token_ids])).last_hidden_state[0, -1].float()
    return torch.nn.functional.normalize(hidden, dim=-1)


@pytest.fixture(scope="module")
def embedding_model(tmp_path_factory):
    """A tiny Llama scored through its embeddings: (HF model, directory)."""
    from support.checkpoints import save_tiny_checkpoint
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                         pad_token_id=0, bos_token_id=1, eos_token_id=2)).eval()
    return model, save_tiny_checkpoint(tmp_path_factory.mktemp("embedder"), model)


def test_a_cross_encoder_scores_each_pair_encoded_together(tmp_path):
    model, directory = tiny_classifier(tmp_path, "llama", num_labels=1)
    llm = LLM(directory, dtype="float32", num_device_blocks=64)
    outputs = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    assert len(outputs) == len(DOCUMENTS)
    for document, output in zip(DOCUMENTS, outputs):
        pair = llm.tokenizer(QUERY, document)["input_ids"]
        assert len(pair) > len(llm.tokenizer.encode(QUERY)) > 0
        assert output.prompt_token_ids == pair == llm.tokenizer.encode(QUERY) + llm.tokenizer.encode(document)
        assert output.outputs.score == pytest.approx(torch.sigmoid(hf_scores(model, pair)).item(), abs=1e-5)


def test_an_embedding_model_scores_the_cosine_of_two_embeddings(embedding_model):
    model, directory = embedding_model
    llm = LLM(directory, dtype="float32", num_device_blocks=64)
    firsts = [QUERY, "w7 w8", "w9"]
    outputs = llm.score(firsts, DOCUMENTS[:3], use_tqdm=False)  # pair by pair
    for first, second, output in zip(firsts, DOCUMENTS[:3], outputs):
        left, right = (hf_unit_embedding(model, llm.tokenizer.encode(text)) for text in (first, second))
        assert output.outputs.score == pytest.approx((left @ right).item(), abs=1e-5)
    assert llm.score("w5", "w5", use_tqdm=False)[0].outputs.score == pytest.approx(1.0, abs=1e-5)
    with pytest.raises(ValueError, match="give one text_1, or as many as text_2"):
        llm.score(firsts, DOCUMENTS, use_tqdm=False)
    with pytest.raises(ValueError, match="non-empty strings"):
        llm.score(QUERY, [], use_tqdm=False)


def test_score_and_rerank_endpoints(embedding_model):
    model, directory = embedding_model
    server = LiveServer(model=directory, num_device_blocks=64)
    try:
        scores = httpx.post(server.url + "/score", json={"text_1": QUERY, "text_2": DOCUMENTS}, timeout=60).json()
        assert [item["index"] for item in scores["data"]] == [0, 1, 2, 3]
        encode = server.engine.tokenizer.encode
        query = hf_unit_embedding(model, encode(QUERY))
        expected = [(query @ hf_unit_embedding(model, encode(document))).item() for document in DOCUMENTS]
        assert [item["score"] for item in scores["data"]] == pytest.approx(expected, abs=1e-5)
        assert scores["usage"]["prompt_tokens"] == sum(len(encode(text)) for text in [QUERY, *DOCUMENTS])
        for route in ("/rerank", "/v1/rerank", "/v2/rerank"):
            body = {"query": QUERY, "documents": DOCUMENTS, "top_n": 2}
            ranked = httpx.post(server.url + route, json=body, timeout=60).json()["results"]
            best = sorted(range(4), key=lambda index: -expected[index])[:2]
            assert [result["index"] for result in ranked] == best
            assert [result["document"]["text"] for result in ranked] == [DOCUMENTS[index] for index in best]
            assert [result["relevance_score"] for result in ranked] == pytest.approx([expected[i] for i in best],
                                                                                   abs=1e-5)
        bad = httpx.post(server.url + "/score", json={"text_1": ["w5", "w6"], "text_2": DOCUMENTS}, timeout=60)
        assert bad.status_code == 400 and "as many as text_2" in bad.json()["error"]["message"]
        assert server.metric("pagedkv_kv_blocks_used_device") == 0
    finally:
        server.stop()


def test_a_classifier_of_several_labels_does_not_score(tmp_path):
    _, directory = tiny_classifier(tmp_path, num_labels=3)
    llm = LLM(directory, dtype="float32", num_device_blocks=32)
    with pytest.raises(ValueError, match="3 labels"):
        llm.score(QUERY, DOCUMENTS, use_tqdm=False)
