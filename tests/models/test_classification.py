"""Sequence-classification checkpoints (`*ForSequenceClassification`: classifiers and reward
models): LLM.classify and the server's /classify against HF transformers' own classification
models on tiny random checkpoints, through chunked prefill and the prefix cache."""

import httpx
import pytest
import torch
from support.live_server import LiveServer

from pagedkv import LLM, PoolingParams, SamplingParams
from pagedkv.entrypoints.server.openapi import ClassificationList
from support.tiny_models import tiny_classifier, hf_scores


def prompts(lengths, seed: int = 5) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (length,), generator=generator).tolist() for length in lengths]


def test_classify_gives_hf_class_probabilities_through_chunks_and_prefix_hits(tmp_path):
    model, directory = tiny_classifier(tmp_path, id2label={0: "negative", 1: "neutral", 2: "positive"})
    llm = LLM(directory, dtype="float32", max_num_batched_tokens=32, num_device_blocks=64)
    batch = prompts((70, 9, 33))  # the first prefills in three chunks
    outputs = llm.classify(batch, use_tqdm=False)
    for prompt, output in zip(batch, outputs):
        assert output.prompt_token_ids == prompt and output.outputs.num_classes == 3
        torch.testing.assert_close(torch.tensor(output.outputs.probs), torch.softmax(hf_scores(model, prompt), -1),
                                   atol=1e-5, rtol=1e-4)
    again = llm.classify(batch[0], use_tqdm=False)[0]  # its whole blocks come from the prefix cache now
    assert again.metrics.num_prefix_hit_tokens >= 64
    torch.testing.assert_close(torch.tensor(again.outputs.probs), torch.tensor(outputs[0].outputs.probs))
    raw = llm.classify(batch[1], PoolingParams(task="classify", use_activation=False), use_tqdm=False)[0]
    torch.testing.assert_close(torch.tensor(raw.outputs.probs), hf_scores(model, batch[1]), atol=1e-5, rtol=1e-4)
    assert llm.engine.scheduler.stats()["num_free_device_blocks"] == llm.engine.scheduler.stats()["num_device_blocks"]

    with pytest.raises(ValueError, match="sequence classifier"):
        llm.generate(batch[1], SamplingParams(max_tokens=4), use_tqdm=False)
    embedding = llm.embed(batch[1], use_tqdm=False)[0].outputs.embedding  # the hidden state is still there
    assert len(embedding) == 64


@pytest.mark.parametrize("model_type, num_labels, problem_type, activation", [
    ("qwen2", 1, None, torch.sigmoid),  # a reward model's one score
    ("llama", 4, "multi_label_classification", torch.sigmoid),
    ("llama", 2, "regression", lambda scores: scores),
])
def test_the_activation_follows_the_labels_and_the_problem_type(tmp_path, model_type, num_labels, problem_type,
                                                               activation):
    options = {"problem_type": problem_type} if problem_type else {}
    model, directory = tiny_classifier(tmp_path, model_type, num_labels, **options)
    llm = LLM(directory, dtype="float32", num_device_blocks=32)
    [prompt] = prompts((21,))
    probs = torch.tensor(llm.classify(prompt, use_tqdm=False)[0].outputs.probs)
    torch.testing.assert_close(probs, activation(hf_scores(model, prompt)), atol=1e-5, rtol=1e-4)


def test_classify_on_a_generative_model_is_refused(tiny_qwen2_dir):
    llm = LLM(tiny_qwen2_dir, dtype="float32", num_device_blocks=32)
    with pytest.raises(ValueError, match="sequence-classification checkpoint"):
        llm.classify([5, 6, 7], use_tqdm=False)
    with pytest.raises(ValueError, match="task='embed'"):
        llm.embed([5, 6, 7], PoolingParams(task="classify"), use_tqdm=False)
    with pytest.raises(ValueError, match="task must be one of"):
        PoolingParams(task="score")


def test_classify_endpoint(tmp_path):
    model, directory = tiny_classifier(tmp_path, id2label={0: "negative", 1: "neutral", 2: "positive"})
    server = LiveServer(model=directory, num_device_blocks=64)
    try:
        batch = prompts((12, 30))
        for route in ("/classify", "/v1/classify"):
            answer = httpx.post(server.url + route, json={"input": batch}, timeout=60).json()
            ClassificationList.model_validate(answer, strict=True)  # (its declared schema: see server/openapi.py)
            assert [item["index"] for item in answer["data"]] == [0, 1]
            assert answer["usage"]["prompt_tokens"] == 42
            for prompt, item in zip(batch, answer["data"]):
                expected = torch.softmax(hf_scores(model, prompt), -1)
                torch.testing.assert_close(torch.tensor(item["probs"]), expected, atol=1e-5, rtol=1e-4)
                assert item["num_classes"] == 3
                assert item["label"] == ("negative", "neutral", "positive")[int(expected.argmax())]
        raw = httpx.post(server.url + "/classify", json={"input": batch[0], "use_activation": False}, timeout=60).json()
        torch.testing.assert_close(torch.tensor(raw["data"][0]["probs"]), hf_scores(model, batch[0]), atol=1e-5,
                                   rtol=1e-4)
        refused = httpx.post(server.url + "/v1/completions", json={"prompt": batch[0], "max_tokens": 2}, timeout=60)
        assert refused.status_code == 400 and "sequence classifier" in refused.json()["error"]["message"]
        assert httpx.post(server.url + "/classify", json={"input": []}, timeout=60).status_code == 400
        assert server.metric("pagedkv_kv_blocks_used_device") == 0
    finally:
        server.stop()
