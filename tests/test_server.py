"""The OpenAI-compatible server, live on 127.0.0.1, driven by the real `openai` client and httpx."""

import asyncio
import json
import re
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from openai import OpenAI

from pagedkv.config import EngineConfig
from pagedkv.engine import LLMEngine
from pagedkv.server import create_app


class LiveServer:
    def __init__(self, **engine_options):
        self.engine = LLMEngine(EngineConfig(dtype="float32", **engine_options))
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        config = uvicorn.Config(create_app(self.engine), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


@pytest.fixture(scope="module")
def server():
    live = LiveServer(num_device_blocks=256, max_model_len=512)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60, max_retries=0)


def test_models_health_and_metrics(server, client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert [model.id for model in client.models.list().data] == [server.engine.model_name]
    text = httpx.get(server.url + "/metrics").text
    for name in ("pagedkv_kv_blocks_used_device", "pagedkv_kv_usage_percent_cpu", "pagedkv_requests_waiting",
                 "pagedkv_preemptions_total", "pagedkv_prefix_cache_hit_rate", "pagedkv_time_to_first_token_seconds"):
        assert name in text


def test_completions_streamed_equals_non_streamed(client, server):
    model = server.engine.model_name
    args = dict(model=model, prompt="The three primary colors are", max_tokens=24, temperature=0)
    full = client.completions.create(**args)
    assert 0 < full.usage.completion_tokens <= 24 and full.usage.prompt_tokens > 0 and full.choices[0].finish_reason in ("length", "stop")
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(stream=True, **args) if chunk.choices)
    assert streamed == full.choices[0].text and streamed


def test_chat_streamed_equals_non_streamed(client, server):
    args = dict(model=server.engine.model_name, messages=[{"role": "user", "content": "Name a fruit."}],
                max_tokens=16, temperature=0)
    full = client.chat.completions.create(**args)
    pieces = [chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(stream=True, **args)
              if chunk.choices]
    assert "".join(pieces) == full.choices[0].message.content
    assert full.choices[0].message.role == "assistant"


def test_sampling_options_and_logprobs(client, server):
    out = client.completions.create(model=server.engine.model_name, prompt="Hello", max_tokens=5, n=2,
                                    temperature=0.9, seed=1, logprobs=2, stop=["\n\n"], presence_penalty=0.5,
                                    frequency_penalty=0.5, top_p=0.95)
    assert len(out.choices) == 2
    assert len(out.choices[0].logprobs.token_logprobs) == len(out.choices[0].logprobs.tokens)
    assert out.usage.completion_tokens <= 10


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "hi", "max_tokens": -3}, "max_tokens"),
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "word " * 600}, "prompt"),
        ({"max_tokens": 3}, "prompt"),
    ],
)
def test_bad_requests_get_400_with_the_error_json(server, body, param):
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"
    if body.get("prompt", "").startswith("word"):
        assert "max_model_len=512" in error["message"]


def test_malformed_json_and_unknown_model(server):
    response = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=10,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "error" in response.json()
    response = httpx.post(server.url + "/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=10)
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    assert httpx.get(server.url + "/health").status_code == 200


def test_disconnect_mid_stream_frees_blocks(server):
    body = {"prompt": "Count from one to one thousand:", "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"]:
                    break
            assert server.metric("pagedkv_kv_blocks_used_device") > 0
    # The client is gone: the request is aborted and its blocks are freed.
    deadline = time.monotonic() + 20
    while server.metric("pagedkv_kv_blocks_used_device") > 0 or server.metric("pagedkv_requests_running") > 0:
        assert time.monotonic() < deadline, "blocks of a dropped stream were not freed"
        time.sleep(0.2)


def test_overload_gives_503_or_correct_completions_and_frees_everything():
    live = LiveServer(num_device_blocks=8, max_model_len=64, max_num_seqs=4, max_waiting_requests=4,
                      enable_prefix_caching=False)
    try:
        prompt = "List some animals:"
        reference = httpx.post(live.url + "/v1/completions", timeout=60,
                               json={"prompt": prompt, "max_tokens": 6, "temperature": 0}).json()["choices"][0]["text"]

        async def one(http):
            body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": True}
            async with http.stream("POST", live.url + "/v1/completions", json=body) as response:
                if response.status_code == 503:
                    assert response.headers["retry-after"]
                    error = json.loads(await response.aread())["error"]
                    assert error["code"] == "overloaded"
                    return "503", None
                assert response.status_code == 200
                text, done = "", False
                async for line in response.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        text += "".join(choice["text"] for choice in json.loads(line[6:])["choices"])
                assert done
                return "ok", text

        async def flood():
            limits = httpx.Limits(max_connections=200)
            async with httpx.AsyncClient(timeout=120, limits=limits) as http:
                return await asyncio.wait_for(asyncio.gather(*(one(http) for _ in range(200))), 300)

        results = asyncio.run(flood())
        statuses = [status for status, _ in results]
        assert statuses.count("503") > 0 and statuses.count("ok") > 0
        assert all(text == reference for status, text in results if status == "ok")
        assert live.metric("pagedkv_kv_blocks_used_device") == 0
        assert live.metric("pagedkv_requests_running") == 0 and live.metric("pagedkv_requests_waiting") == 0
        assert httpx.get(live.url + "/health").status_code == 200
    finally:
        live.stop()
