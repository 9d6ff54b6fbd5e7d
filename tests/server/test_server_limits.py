"""No request, however malformed or large, stops the server serving others (issue #28): each
reproduction an outside tester found, on a live loopback server."""

import gc
import json
import re
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from pagedkv.runner.host_memory import return_freed_memory
from support.live_server import LiveServer

BODY_LIMIT = 8 << 20
BODY_PAUSE = 1.0


@pytest.fixture(scope="module")
def server():
    live = LiveServer(num_device_blocks=64, max_model_len=256, max_num_seqs=4,
                      app_options={"max_request_body_bytes": BODY_LIMIT, "request_body_pause_seconds": BODY_PAUSE,
                                   "enable_server_load_tracking": True})
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


def test_any_signed_64_bit_seed_is_served(server):
    """vLLM's seed range, [-2**63, 2**63); beyond it a 400 naming the bound crossed."""
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 1.0}
    for seed in (2**63 - 1, -(2**63)):
        texts = [httpx.post(server.url + "/v1/completions", json={**body, "seed": seed}, timeout=60).json()
                 ["choices"][0]["text"] for _ in range(2)]
        assert texts[0] == texts[1]
    for seed, bound in ((2**63, "less_than_equal"), (-(2**63) - 1, "greater_than_equal")):
        response = httpx.post(server.url + "/v1/completions", json={**body, "seed": seed}, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == "seed"
        assert bound in response.json()["error"]["message"]
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


def raw_request(server, head: bytes, body: bytes, wait: float) -> tuple[bytes, float]:
    """Sends a request's head and (part of) its body by hand; (the answer, seconds until it came)."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait) as connection:
        started, answer = time.monotonic(), b""  # before the send: the server's pause starts once the bytes arrive
        connection.sendall(head + b"\r\n\r\n" + body)
        while b"\r\n\r\n" not in answer:
            part = connection.recv(65536)
            if not part:
                break
            answer += part
        return answer, time.monotonic() - started


def test_a_body_that_stops_arriving_gets_408_and_others_are_served(server):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100"
    held = []
    thread = threading.Thread(target=lambda: held.append(raw_request(server, head, b'{"prompt": "w', 30)))
    thread.start()
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # (while that body is pending)
    thread.join()
    answer, seconds = held[0]
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert BODY_PAUSE <= seconds < BODY_PAUSE + 10
    assert_idle_and_serving(server)


@pytest.fixture(params=["h11", "httptools"])
def framing_server(request):
    """The body bounds alone, around an app that answers 200, under each of uvicorn's HTTP parsers
    (httptools is what `uvicorn[standard]` installs; h11 refuses two framings itself)."""
    import uvicorn
    from starlette.responses import PlainTextResponse

    from pagedkv.entrypoints.server.body_limit import BodySizeLimit

    async def app(scope, receive, send):
        if scope["type"] == "http":
            await PlainTextResponse("ok")(scope, receive, send)

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = uvicorn.Config(BodySizeLimit(app, max_bytes=1 << 20), host="127.0.0.1", port=port, http=request.param,
                            log_level="warning", lifespan="off")
    live = uvicorn.Server(config)
    thread = threading.Thread(target=live.run, daemon=True)
    thread.start()
    while not live.started:
        time.sleep(0.01)

    class Address:
        url = f"http://127.0.0.1:{port}"

    yield Address
    live.should_exit = True
    thread.join()


def test_a_request_framed_two_ways_is_refused(framing_server):
    """Content-Length and Transfer-Encoding together: which one a proxy in front believed is
    unknowable, so the rest of the connection could be another request (smuggling)."""
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 6\r\nTransfer-Encoding: chunked")
    answer, _ = raw_request(framing_server, head, b"0\r\n\r\n", 30)
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    answer, _ = raw_request(framing_server, head.replace(b"\r\nTransfer-Encoding: chunked", b""), b"{}    ", 30)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


def test_health_answers_while_megabytes_are_rendered_then_refused(server):
    """5 MB of chat text: rendered through the chat template on the worker pool (/health answers
    meanwhile), then refused before it is tokenized; /tokenize refuses it at once (a text that
    long cannot fit the context), where it returned millions of tokens."""
    text = "All work and no play makes Jack a dull boy. " * (5_000_000 // 45)  # 5 MB
    result = {}
    chatting = threading.Thread(target=lambda: result.update(response=httpx.post(
        server.url + "/v1/chat/completions", timeout=300,
        json={"messages": [{"role": "user", "content": text}], "max_tokens": 2})))
    chatting.start()
    time.sleep(0.3)  # (parsed and in the template by now)
    latencies = []
    with httpx.Client(timeout=10) as http:
        for _ in range(10):
            started = time.monotonic()
            assert http.get(server.url + "/health").status_code == 200
            latencies.append(time.monotonic() - started)
            time.sleep(0.05)
    assert max(latencies) < 0.1, latencies
    chatting.join(300)
    response = result["response"]
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    started = time.monotonic()
    response = httpx.post(server.url + "/tokenize", json={"prompt": text}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert time.monotonic() - started < 5
    assert httpx.post(server.url + "/tokenize", json={"prompt": "w5 w6"}, timeout=10).json()["count"] > 0


@pytest.mark.parametrize("route, field", [("/v1/completions", "prompt"), ("/v1/embeddings", "input")])
def test_megabytes_of_token_ids_are_parsed_and_checked_off_the_event_loop(server, route, field, monkeypatch):
    """A large body is parsed and validated on a worker thread, never on the loop (it stalled
    /health and every stream 6-18 s); a bad value deep in it is still refused by name."""
    from pagedkv.entrypoints.server import protocol

    checked_on = []  # (the threads the request model's validation ran on)
    check = protocol.check_json_values
    monkeypatch.setattr(protocol, "check_json_values",
                        lambda body: (checked_on.append(threading.current_thread()), check(body))[1])
    # 800,000 ids, ~4 MB, under the body limit, as 3,200 prompts that fit max_model_len (longer ones
    # are refused before parsing: the next test); the request is refused for its priority.
    token_ids = [list(range(100, 350))] * 3_200
    body = {field: token_ids, "priority": "high"}
    response = httpx.post(server.url + route, json=body, timeout=120)
    assert response.status_code == 400 and response.json()["error"]["param"] == "priority"
    assert checked_on and server.thread not in checked_on  # (uvicorn's loop runs on server.thread)
    bad = dict(body, **{field: token_ids[:-1] + [token_ids[-1][:-1] + [float("nan")]]})
    response = httpx.post(server.url + route, content=json.dumps(bad), timeout=120,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["param"] == field
    small = httpx.post(server.url + route, content=json.dumps(body)[:1000], timeout=60,
                       headers={"content-type": "application/json"})
    response = httpx.post(server.url + route, content=json.dumps(body)[:-1], timeout=120,  # (cut: not JSON)
                          headers={"content-type": "application/json"})
    assert response.status_code == small.status_code == 400
    error, small_error = response.json()["error"], small.json()["error"]
    assert error["message"].endswith(": JSON decode error [type=json_invalid]") and small_error["message"].endswith(": JSON decode error [type=json_invalid]")
    assert {**error, "message": ""} == {**small_error, "message": ""}  # (the same answer, but for the position)


def test_detokenize_takes_at_most_max_model_len_tokens(server):
    """As vLLM's: the bound /tokenize has (it returned the text of any number of ids)."""
    response = httpx.post(server.url + "/detokenize", json={"tokens": [100] * 257}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert response.json()["error"]["message"] == "tokens has 257 tokens, more than max_model_len=256"
    assert httpx.post(server.url + "/detokenize", json={"tokens": [100] * 256}, timeout=60).status_code == 200


@pytest.fixture(scope="module")
def default_limits_server(tiny_qwen2_dir):
    """A tiny model behind the default body limit (32 MB)."""
    live = LiveServer(model=tiny_qwen2_dir, num_device_blocks=64, max_model_len=256)
    yield live
    live.stop()


# (The client posts from a process of its own, on a bare socket: in this one, its thread would take
# turns at the GIL with the server's and the test would time both; httpx's import alone is ~0.3 s
# of CPU on a machine the other test worker also uses.)
POST_FILE = """import socket, sys
host, port, path, file = sys.argv[1:]
body = open(file, "rb").read()
with socket.create_connection((host, int(port))) as connection:
    connection.sendall(f"POST {path} HTTP/1.1\\r\\nHost: x\\r\\nContent-Type: application/json\\r\\n"
                       f"Content-Length: {len(body)}\\r\\nConnection: close\\r\\n\\r\\n".encode() + body)
    answer = b"".join(iter(lambda: connection.recv(65536), b""))
head, _, text = answer.partition(b"\\r\\n\\r\\n")
print(head.split()[1].decode(), text.decode())"""


@pytest.mark.parametrize("route, field", [("/v1/completions", "prompt"), ("/v1/embeddings", "input"),
                                          ("/detokenize", "tokens"), ("/v1/completions", None)])
def test_health_answers_within_100_ms_while_30_mb_of_token_ids_are_refused(default_limits_server, route, field,
                                                                              tmp_path, monkeypatch):
    """30 MB of token ids: parsing them holds the GIL for a second wherever it runs in the server,
    so they are screened in a child process and refused there (too long for max_model_len), never
    parsed in the server; a body cut short (field None) is refused there as not JSON. (The heap so
    far is frozen, as `pagedkv serve` freezes its startup heap: a full collection of this test
    process's heap, many engines and all of torch, pauses it 0.3 s. A second try is allowed for
    the 100 ms: on 2 cores shared with another test worker, the OS alone can hold a thread that
    long; the stall of parsing here was 0.1-0.25 s in every try, and the parse is counted too.)"""
    from pagedkv.entrypoints.server.json_body import OffLoopJSONRoute

    parsed = []
    parse = OffLoopJSONRoute._parse_and_validate
    monkeypatch.setattr(OffLoopJSONRoute, "_parse_and_validate",
                        lambda self, body: (parsed.append(len(body)), parse(self, body))[1])
    server = default_limits_server
    ids = json.dumps(list(range(100, 200)) * 60_000)  # 6M ids, ~24 MB
    body = (f'{{"{field}": {ids}, "model": "{" " * (30_000_000 - len(ids))}"}}' if field
            else f'{{"prompt": {ids}'.ljust(30_000_000)).encode()  # (cut: no closing brace)
    assert 29e6 < len(body) < 32 << 20
    (tmp_path / "body.json").write_bytes(body)
    host, port = server.url.removeprefix("http://").split(":")
    for _ in range(2):
        posting = subprocess.Popen([sys.executable, "-c", POST_FILE, host, port, route, str(tmp_path / "body.json")],
                                   stdout=subprocess.PIPE, text=True)
        latencies = []
        gc.collect()
        gc.freeze()
        try:
            with httpx.Client(timeout=10) as http:
                while posting.poll() is None:
                    started = time.monotonic()
                    assert http.get(server.url + "/health").status_code == 200
                    latencies.append(time.monotonic() - started)
                    time.sleep(0.02)
        finally:
            gc.unfreeze()
        status, _, text = posting.communicate()[0].partition(" ")
        assert status == "400", text[:300]
        error = json.loads(text)["error"]
        if field:
            assert error["code"] == "context_length_exceeded" and error["param"] == field
            assert error["message"] == f"{field} has 6000000 tokens, more than max_model_len=256"
        else:
            assert error["message"].endswith(": JSON decode error [type=json_invalid]")
        assert not parsed  # (refused by the screen: never parsed in the server)
        if len(latencies) >= 5 and max(latencies) < 0.1:
            break
    assert len(latencies) >= 5 and max(latencies) < 0.1, latencies


def test_an_abandoned_non_streaming_request_is_aborted(server):
    body = {"prompt": "Count to a thousand:", "max_tokens": 200, "ignore_eos": True}
    for _ in range(3):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    assert_idle_and_serving(server)


def test_load_counts_requests_in_flight_and_orca_headers_report_the_cache(server):
    """vLLM's GET /load (requests in flight on the engine's routes, a stream until its last byte)
    and its ORCA header `endpoint-load-metrics` for requests that ask for it."""
    def load() -> int:
        return httpx.get(server.url + "/load", timeout=10).json()["server_load"]

    assert load() == 0
    body = {"prompt": "Count to a thousand:", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert load() == 1
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as second:
            second_lines = second.iter_lines()  # (held: a dropped line iterator closes its connection)
            assert next(line for line in second_lines if line.startswith("data: "))
            assert load() == 2
    deadline = time.monotonic() + 20
    while load() != 0:
        assert time.monotonic() < deadline, "left streams were still counted"
        time.sleep(0.1)
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": -1}).status_code == 400
    assert load() == 0

    plain = {"prompt": "Hello", "max_tokens": 2}
    answer = httpx.post(server.url + "/v1/completions", json=plain, timeout=60)
    assert "endpoint-load-metrics" not in answer.headers
    answer = httpx.post(server.url + "/v1/completions", json=plain, timeout=60,
                        headers={"endpoint-load-metrics-format": "text"})
    fields = dict(part.split("=") for part in answer.headers["endpoint-load-metrics"].removeprefix("TEXT ").split(", "))
    assert set(fields) == {"named_metrics.kv_cache_usage_perc", "named_metrics.num_requests_waiting"}
    assert 0.0 <= float(fields["named_metrics.kv_cache_usage_perc"]) <= 1.0
    answer = httpx.post(server.url + "/v1/chat/completions", timeout=60, headers={"endpoint-load-metrics-format": "JSON"},
                        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    report = json.loads(answer.headers["endpoint-load-metrics"].removeprefix("JSON "))
    assert set(report["named_metrics"]) == {"kv_cache_usage_perc", "num_requests_waiting"}
    answer = httpx.post(server.url + "/v1/completions", json=plain, timeout=60,
                        headers={"endpoint-load-metrics-format": "binary"})
    assert answer.status_code == 200 and "endpoint-load-metrics" not in answer.headers


def test_repetition_detection_ends_a_reply_that_repeats_itself():
    """vLLM's repetition_detection: a greedy reply held to one token ends once that token has come
    min_count times (finish_reason "repetition", stop_reason "repetition_detected"), not before
    min_tokens; without it the reply runs to max_tokens; bad values are a 400."""
    from support.live_server import LiveServer

    live = LiveServer(num_device_blocks=32, max_model_len=128)
    try:
        token = live.engine.tokenizer.encode(" yes", add_special_tokens=False)[0]
        body = {"prompt": "Say yes:", "max_tokens": 12, "temperature": 0, "allowed_token_ids": [token],
                "return_token_ids": True}
        detect = {"max_pattern_size": 2, "min_count": 4}

        def complete(**extra) -> dict:
            return httpx.post(live.url + "/v1/completions", json={**body, **extra}, timeout=60).json()

        plain = complete()["choices"][0]
        assert plain["finish_reason"] == "length" and len(plain["token_ids"]) == 12
        ended = complete(repetition_detection=detect)["choices"][0]
        assert (ended["finish_reason"], ended["stop_reason"]) == ("repetition", "repetition_detected")
        assert ended["token_ids"] == [token] * 4 and ended["text"] == " yes" * 4
        later = complete(repetition_detection=detect, min_tokens=6)["choices"][0]
        assert later["finish_reason"] == "repetition" and len(later["token_ids"]) == 6
        stopped = complete(stop_token_ids=[token])["choices"][0]  # (stop_reason: what ended it, as vLLM)
        assert (stopped["finish_reason"], stopped["stop_reason"]) == ("stop", token)
        bad = httpx.post(live.url + "/v1/completions", timeout=60,
                         json={**body, "repetition_detection": {"max_pattern_size": 2, "min_count": 1}})
        assert bad.status_code == 400 and "min_count must be >= 2" in bad.text
    finally:
        live.stop()
