"""vLLM's batched chat (/v1/chat/completions/batch): each conversation answered as the same
request's chat completion would answer it, in one response; its options (n, echo, logprobs,
response_format) apply per conversation; streaming and empty conversations are 400s."""

import json

import httpx
import pytest
from openai import OpenAI

CONVERSATIONS = [[{"role": "user", "content": "Name a color."}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}],
                 [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "One,"}]]


@pytest.fixture(scope="module")
def live():
    from support.live_server import LiveServer

    server = LiveServer(gguf_weights="dequantized", num_device_blocks=256, max_model_len=512)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live):
    return OpenAI(base_url=live.url + "/v1", api_key="unused", timeout=120, max_retries=0)


def batch(live, **body) -> httpx.Response:
    return httpx.post(live.url + "/v1/chat/completions/batch", json={"max_tokens": 8, "temperature": 0, **body},
                      timeout=120)


def test_each_conversation_gets_its_own_chat_completion(live, client):
    model = client.models.list().data[0].id
    options = dict(add_generation_prompt=False, continue_final_message=True, echo=True)
    singles = [client.chat.completions.create(model=model, messages=conversation, max_tokens=8, temperature=0,
                                              extra_body=options if conversation[-1]["role"] == "assistant" else {})
               for conversation in CONVERSATIONS]
    # (the third continues its assistant turn: a batch shares its options, so it gets a batch of its own)
    answer = batch(live, model=model, messages=CONVERSATIONS[:2])
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["object"] == "chat.completion" and [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in body["choices"]] == [s.choices[0].message.content for s in singles[:2]]
    assert body["usage"]["prompt_tokens"] == sum(s.usage.prompt_tokens for s in singles[:2])
    echoed = batch(live, messages=[CONVERSATIONS[2], CONVERSATIONS[2]], **options).json()
    assert [c["message"]["content"] for c in echoed["choices"]] == [singles[2].choices[0].message.content] * 2
    assert echoed["choices"][0]["message"]["content"].startswith("One,")


def test_options_apply_to_every_conversation(live):
    two = batch(live, messages=CONVERSATIONS[:2], n=2, temperature=1.0, seed=7).json()
    assert [c["index"] for c in two["choices"]] == [0, 1, 2, 3]
    with_logprobs = batch(live, messages=CONVERSATIONS[:2], logprobs=True, top_logprobs=2,
                          return_tokens_as_token_ids=True).json()
    for choice in with_logprobs["choices"]:
        entries = choice["logprobs"]["content"]
        assert entries and all(entry["token"].startswith("token_id:") for entry in entries)
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"]}
    shaped = batch(live, messages=CONVERSATIONS[:2], max_tokens=30,
                   response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}).json()
    for choice in shaped["choices"]:
        assert json.loads(choice["message"]["content"])["answer"] in ("yes", "no")


def test_streams_and_empty_conversations_are_400s(live):
    for body, field in ((dict(messages=CONVERSATIONS[:1], stream=True), "stream"), (dict(messages=[[]]), "messages"),
                        (dict(messages=[]), "messages"), (dict(messages=CONVERSATIONS[0]), "messages")):
        answer = batch(live, **body)
        assert answer.status_code == 400, (body, answer.text)
        assert answer.json()["error"]["param"] == field, answer.text
