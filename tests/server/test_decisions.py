"""/v1/decisions (OpenAI's Decisions API, as vLLM serves it), live."""

import math

import httpx
import pytest

from pagedkv.entrypoints.server.decisions import LABELS, label_token_ids, question_prompt, ChoiceQuestion
from support.live_server import LiveServer

TEXT = "The package arrived with a broken screen."
QUESTIONS = [
    {"type": "predicate", "instructions": "Is the screen broken?"},
    {"type": "choice", "name": "department", "instructions": "Which department should handle this?",
     "choices": [{"value": "returns"}, {"value": "billing", "description": "payments"}, {"value": True}]},
    {"type": "score", "name": "damage", "instructions": "Rate the damage.",
     "levels": [{"label": "undamaged"}, {"label": "scratched"}, {"label": "broken"}]},
]


@pytest.fixture(scope="module")
def live():
    server = LiveServer(gguf_weights="dequantized", num_device_blocks=128, max_model_len=512)
    yield server
    server.stop()


def decide(live, **body) -> httpx.Response:
    return httpx.post(live.url + "/v1/decisions", json={"input": TEXT, "questions": QUESTIONS, **body}, timeout=60)


def test_labels_are_one_token_each_after_the_chat_prompt(live):
    tokenizer = live.engine.tokenizer
    probe = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True)
    ids = label_token_ids(tokenizer, tokenizer.encode(probe, add_special_tokens=False))
    assert [tokenizer.decode([token]) for token in ids] == list(LABELS) and len(set(ids)) == len(LABELS)


def test_each_answer_is_the_labels_next_token_probabilities(live):
    body = decide(live).json()
    assert set(body) == {"model", "answers", "usage"} and body["model"] == live.engine.model_name
    predicate, choice, score = body["answers"]
    assert predicate["type"] == "predicate" and predicate["name"] is None and 0 <= predicate["probability"] <= 1
    assert [p["value"] for p in choice["probabilities"]] == ["returns", "billing", True]
    assert sum(p["probability"] for p in choice["probabilities"]) == pytest.approx(1)
    assert choice["choice"] == max(choice["probabilities"], key=lambda p: p["probability"])["value"]
    assert [p["label"] for p in score["probabilities"]] == ["undamaged", "scratched", "broken"]
    assert score["score"] == pytest.approx(sum(p["value"] * p["probability"] for p in score["probabilities"]))
    assert 0 < choice["confidence"] <= max(p["probability"] for p in choice["probabilities"])
    usage = body["usage"]
    assert usage["output_tokens"] == 3 and usage["total_tokens"] == usage["input_tokens"] + 3

    # The same read through the chat API: the labels' logprobs at the reply's first token.
    tokenizer = live.engine.tokenizer
    labels = [tokenizer.encode(label, add_special_tokens=False)[0] for label in "ABC"]
    prompt = question_prompt(TEXT, ChoiceQuestion.model_validate(QUESTIONS[1]))
    chat = httpx.post(live.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": prompt}], "max_tokens": 1, "temperature": 0, "logprobs": True,
        "logprob_token_ids": labels, "return_tokens_as_token_ids": True}).json()
    read = {entry["token"]: entry["logprob"] for entry in chat["choices"][0]["logprobs"]["content"][0]["top_logprobs"]}
    values = [read[f"token_id:{token}"] for token in labels]
    total = sum(math.exp(value) for value in values)
    assert [p["probability"] for p in choice["probabilities"]] == \
        pytest.approx([math.exp(value) / total for value in values], abs=1e-4)
    assert live.metric("pagedkv_kv_blocks_used_device") == 0


@pytest.mark.parametrize("body, param, words", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "text input only"),
    ({"joint": True}, "joint", "joint"),
    ({"questions": [{"type": "choice", "instructions": "?", "choices": [{"value": "a"}, {"value": "a"}]}]},
     "questions", "distinct"),
    ({"questions": [{"type": "predicate", "instructions": "?", "name": None}]}, "questions", "name"),
    ({"questions": [QUESTIONS[0]] * 65}, "questions", "65"),
    ({"questions": [{"type": "score", "instructions": "?", "levels": [{"label": "x"}]}]}, "questions", "2"),
    ({"extra": 1}, "extra", "Extra inputs"),
    ({"input": "word " * 200_000}, "input", "max_model_len"),
])
def test_bad_decision_requests_are_a_400_naming_the_field(live, body, param, words):
    response = decide(live, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
