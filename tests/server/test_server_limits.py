"""No request, however malformed or large, stops the server serving others (issue #28): each
reproduction an outside tester found, on a live loopback server."""

import json
import re
import threading
import time

import httpx
import pytest

from pagedkv.runner.host_memory import return_freed_memory
from support.live_server import LiveServer

BODY_LIMIT = 8 << 20


@pytest.fixture(scope="module")
def server():
    live = LiveServer(num_device_blocks=64, max_model_len=256, max_num_seqs=4,
                      app_options={"max_request_body_bytes": BODY_LIMIT})
    yield live
    live.stop()


def assert_idle_and_serving(server) -> None:
    """Nothing left running or holding blocks, and a fresh request completes."""
    deadline = time.monotonic() + 20
    while server.metric("pagedkv_kv_blocks_used_device") > 0 or server.metric("pagedkv_requests_running") > 0:
        assert time.monotonic() < deadline, "requests or blocks were not released"
        time.sleep(0.1)
    assert server.engine.scheduler.num_unfinished_requests == 0
    response = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, timeout=60)
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"


def test_any_64_bit_seed_is_served(server):
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 1.0}
    texts = [httpx.post(server.url + "/v1/completions", json={**body, "seed": 2**64 - 1}, timeout=60).json()
             ["choices"][0]["text"] for _ in range(2)]
    assert texts[0] == texts[1]
    response = httpx.post(server.url + "/v1/completions", json={**body, "seed": 2**64}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "seed"
    assert_idle_and_serving(server)


@pytest.mark.parametrize("field", ["bad_words", "stop"])
def test_a_lone_surrogate_is_a_400_that_leaves_the_server_serving(server, field):
    for _ in range(5):  # (max_num_seqs=4: each used to leave an orphan holding a running slot)
        body = json.dumps({"prompt": "Hello", "max_tokens": 3, field: ["\ud800"]})  # (JSON escapes it)
        response = httpx.post(server.url + "/v1/completions", content=body, timeout=60,
                              headers={"content-type": "application/json"})
        assert response.status_code == 400 and response.json()["error"]["param"] == field
    body = json.dumps({"prompt": "Hi \udfff there", "max_tokens": 3})
    response = httpx.post(server.url + "/v1/completions", content=body, timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert_idle_and_serving(server)


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return int(re.search(r"VmRSS:\s+(\d+) kB", status.read()).group(1)) * 1024


def test_an_oversize_body_gets_413_without_being_held(server):
    oversize = b'{"prompt": "' + b"a" * (6 * BODY_LIMIT) + b'"}'
    chunk = b"a" * (1 << 20)
    return_freed_memory()
    before = rss_bytes()  # (the server runs in this process; the client's bodies exist already)
    response = httpx.post(server.url + "/tokenize", content=oversize, timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    chunked = (chunk for _ in range(6 * BODY_LIMIT // len(chunk)))  # no Content-Length: counted as it arrives
    response = httpx.post(server.url + "/v1/completions", content=chunked, timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 413 and "max_request_body_bytes" in response.json()["error"]["message"]
    return_freed_memory()  # (what was freed is not held: glibc may keep it for reuse, and RSS with it)
    assert rss_bytes() - before < 2 * BODY_LIMIT  # (each body was 6x the bound)
    assert_idle_and_serving(server)


def test_health_answers_while_megabytes_are_tokenized(server):
    text = "All work and no play makes Jack a dull boy. " * (5_000_000 // 45)  # 5 MB
    result = {}
    tokenizing = threading.Thread(target=lambda: result.update(response=httpx.post(
        server.url + "/tokenize", json={"prompt": text}, timeout=300)))
    tokenizing.start()
    time.sleep(0.5)  # (parsed and in the tokenizer by now)
    latencies = []
    with httpx.Client(timeout=10) as http:
        for _ in range(10):
            started = time.monotonic()
            assert http.get(server.url + "/health").status_code == 200
            latencies.append(time.monotonic() - started)
            time.sleep(0.05)
    assert tokenizing.is_alive(), "tokenizing finished too soon to show anything"
    assert max(latencies) < 0.1, latencies
    # A prompt far longer than the context is refused before it is tokenized.
    started = time.monotonic()
    response = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": text}], "max_tokens": 2})
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert time.monotonic() - started < 5
    tokenizing.join(300)
    assert result["response"].status_code == 200


def test_an_abandoned_non_streaming_request_is_aborted(server):
    body = {"prompt": "Count to a thousand:", "max_tokens": 200, "ignore_eos": True}
    for _ in range(3):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    assert_idle_and_serving(server)
