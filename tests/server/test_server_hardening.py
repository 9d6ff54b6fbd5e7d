"""Every malformed request is a 4xx naming its field, never a 500 (issue #27): the hand-made
list an outside tester sent, the limits a client can hit, and the pooling routes' disconnects,
on one live server. (SmolLM2, not a tiny random checkpoint: their word-level tokenizer reads no
text, and the chat and Responses routes only take text.)"""

import asyncio
import json
import logging
import threading
import time

import httpx
import pytest

from support.live_server import LiveServer

MAX_MODEL_LEN = 128
MAX_NUM_SEQS = 4
MAX_LOGPROBS = 3


@pytest.fixture(scope="module")
def server():
    live = LiveServer(num_device_blocks=64, max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
                      max_logprobs=MAX_LOGPROBS)
    yield live
    live.stop()


def post(server, route: str, body: str) -> httpx.Response:
    """`body` is JSON text, so it can hold what json.dumps would not write (NaN, lone surrogates)."""
    return httpx.post(server.url + route, content=body.encode("utf-8", "surrogatepass"), timeout=60,
                      headers={"content-type": "application/json"})


def assert_idle_and_serving(server) -> None:
    deadline = time.monotonic() + 20
    while server.metric("pagedkv_kv_blocks_used_device") > 0 or server.metric("pagedkv_requests_running") > 0:
        assert time.monotonic() < deadline, "requests or blocks were not released"
        time.sleep(0.05)
    assert httpx.get(server.url + "/health", timeout=10).json() == {"status": "ok"}
    response = httpx.post(server.url + "/v1/completions", json={"prompt": "w5 w6", "max_tokens": 2}, timeout=60)
    assert response.status_code == 200, response.text


MESSAGES = '[{"role": "user", "content": "w5"}]'
TOOL = '{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}'
SURROGATE = '"\\ud800"'  # (JSON's escape of a lone surrogate: valid JSON, no valid text)

BAD_REQUESTS = [
    # Lone surrogates, wherever they are.
    ("/v1/completions", f'{{"prompt": {SURROGATE}}}', "prompt"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": {SURROGATE}}}]}}', "messages"),
    ("/v1/chat/completions", f'{{"messages": {MESSAGES}, "tools": [{{"type": "function", "function": '
                             f'{{"name": "f", "parameters": {{"description": {SURROGATE}}}}}}}]}}', "tools"),
    ("/v1/embeddings", f'{{"input": {SURROGATE}}}', "input"),
    ("/tokenize", f'{{"prompt": {SURROGATE}}}', "prompt"),
    ("/v1/responses", f'{{"input": {SURROGATE}}}', "input"),
    # Nested parts of the wrong type.
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}', "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": null}]}]}',
     "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": [1]}]}]}', "messages"),
    ("/v1/chat/completions", f'{{"messages": {MESSAGES}, "tools": [{{"type": "function", "function": '
                             '{"name": ["f"]}}]}', "tools"),
    ("/v1/chat/completions", f'{{"messages": {MESSAGES}, "tools": [{TOOL}], "tool_choice": '
                             '{"type": "function", "function": "f"}}', "tool_choice"),
    ("/v1/chat/completions", f'{{"messages": {MESSAGES}, "tools": [{TOOL}], "tool_choice": '
                             '{"type": "function", "function": {"name": ["f"]}}}', "tool_choice"),
    ("/v1/chat/completions", f'{{"messages": {MESSAGES}, "response_format": {{"type": "json_schema", '
                             '"json_schema": "{}"}}', "response_format"),
    ("/v1/completions", '{"prompt": "w5", "structured_outputs": {"grammar": [1]}}', "structured_outputs"),
    ("/v1/completions", '{"prompt": "w5", "structured_outputs": {"regex": "a", "color": "red"}}', "structured_outputs"),
    ("/v1/responses", '{"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}', "input"),
    ("/v1/responses", '{"input": [{"role": "user", "content": ["w5"]}]}', "input"),
    ("/v1/responses", '{"input": [{"type": ["message"]}]}', "input"),
    ("/v1/responses", '{"input": "w5", "text": {"format": []}}', "text"),
    ("/v1/responses", '{"input": "w5", "temperature": 1e999}', "temperature"),
    ("/v1/responses", '{"input": "w5", "metadata": NaN}', "metadata"),
    ("/v1/responses", '{"input": "w5", "metadata": {"a": 1}}', "metadata"),
    ("/v1/responses", '{"input": "w5", "tools": [{"type": "function", "name": "f", "parameters": {"x": NaN}}]}',
     "tools"),
    # Non-finite numbers, coerced types, values beyond what a client may ask for.
    ("/v1/completions", '{"prompt": "w5", "temperature": NaN}', "temperature"),
    ("/v1/completions", '{"prompt": "w5", "temperature": Infinity}', "temperature"),
    ("/v1/completions", '{"prompt": "w5", "repetition_penalty": NaN}', "repetition_penalty"),
    ("/v1/completions", '{"prompt": "w5", "length_penalty": -Infinity}', "length_penalty"),
    ("/v1/completions", '{"prompt": "w5", "logit_bias": {"5": NaN}}', "logit_bias"),
    ("/v1/completions", '{"prompt": "w5", "seed": 9223372036854775808}', "seed"),
    ("/v1/completions", '{"prompt": "w5", "best_of": 10000}', "best_of"),
    ("/v1/completions", '{"prompt": "w5", "stream": "yes"}', "stream"),
    ("/v1/completions", '{"prompt": "w5", "max_tokens": 2.0}', "max_tokens"),
    ("/v1/completions", '{"prompt": "w5", "n": "2"}', "n"),
    ("/v1/completions", f'{{"prompt": "w5", "max_tokens": {10**30}}}', "max_tokens"),
    ("/v1/chat/completions", f'{{"messages": {MESSAGES}, "max_completion_tokens": {MAX_MODEL_LEN}}}', "max_tokens"),
    ("/v1/responses", f'{{"input": "w5", "max_output_tokens": {MAX_MODEL_LEN}}}', "max_tokens"),
    ("/v1/completions", f'{{"prompt": "w5", "n": {MAX_NUM_SEQS + 1}}}', "n"),
    ("/v1/completions", f'{{"prompt": "w5", "logprobs": {MAX_LOGPROBS + 1}}}', "logprobs"),
    ("/v1/completions", f'{{"prompt": "w5", "echo": true, "logprobs": {MAX_LOGPROBS + 1}}}', "logprobs"),
    ("/v1/chat/completions", f'{{"messages": {MESSAGES}, "logprobs": true, "top_logprobs": {MAX_LOGPROBS + 1}}}',
     "top_logprobs"),
    ("/v1/completions", json.dumps({"prompt": "w5", "stop": [f"s{i}" for i in range(65)]}), "stop"),
    ("/v1/completions", json.dumps({"prompt": "w5", "logit_bias": {str(i): 1 for i in range(1025)}}), "logit_bias"),
    # Structured outputs that would read files or URLs, or do not compile.
    ("/v1/completions", '{"prompt": "w5", "guided_json": {"$ref": "http://127.0.0.1:1/schema.json"}}',
     "structured_outputs"),
    ("/v1/chat/completions", f'{{"messages": {MESSAGES}, "response_format": {{"type": "json_schema", "json_schema": '
                             '{"schema": {"properties": {"a": {"$ref": "file:///etc/passwd"}}}}}}', "structured_outputs"),
    ("/v1/completions", '{"prompt": "w5", "guided_grammar": "root ::= ("}', "structured_outputs"),
    ("/v1/completions", '{"prompt": "w5", "guided_json": "{not json"}', "structured_outputs"),
    # A priority beyond the scheduler's 64 bits; stream_options without a stream (vLLM refuses both).
    ("/v1/completions", f'{{"prompt": "w5", "priority": {2**63}}}', "priority"),
    ("/v1/embeddings", f'{{"input": "w5", "priority": {-2**63 - 1}}}', "priority"),
    ("/v1/completions", '{"prompt": "w5", "stream_options": {"include_usage": true}}', "stream_options"),
    ("/v1/chat/completions", f'{{"messages": {MESSAGES}, "stream": false, "stream_options": {{}}}}', "stream_options"),
]


@pytest.mark.parametrize("route, body, param", BAD_REQUESTS, ids=[f"{r}-{p}-{i}" for i, (r, _, p) in
                                                                    enumerate(BAD_REQUESTS)])
def test_a_malformed_request_is_a_400_naming_its_field(server, route, body, param):
    response = post(server, route, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert error["message"]
    if param == "seed":  # (a field's validation names pydantic's error type, as vLLM's message does)
        assert error["message"].endswith("[type=less_than_equal]"), error


def test_token_ids_outside_the_vocabulary_are_named(server):
    """As vLLM: the 400 names the ids and the vocabulary's size."""
    response = post(server, "/v1/completions", '{"prompt": "w5", "logit_bias": {"99999999": 1, "5": 1}}')
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "logit_bias", response.text
    assert "99999999" in error["message"] and str(server.engine.model_info.vocab_size) in error["message"], error


def test_a_cross_site_page_cannot_reset_the_prefix_cache(server):
    """A browser sends a page's body-less POST elsewhere without a preflight (CSRF); it names the
    page's origin, which curl and SDKs never send."""
    url = server.url + "/reset_prefix_cache"
    for headers in ({"origin": "http://elsewhere.example"}, {"sec-fetch-site": "cross-site"}):
        response = httpx.post(url, headers=headers, timeout=30)
        assert response.status_code == 403 and response.json()["error"]["type"] == "permission_error", response.text
    assert httpx.post(url, timeout=30).status_code == 200
    assert httpx.post(url, headers={"origin": server.url}, timeout=30).status_code == 200


def test_the_server_serves_after_every_malformed_request(server):
    for route, body, _ in BAD_REQUESTS:
        assert post(server, route, body).status_code == 400
    assert_idle_and_serving(server)


def test_unparsable_and_unrouted_requests_get_the_error_json(server):
    deep = '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"  # (too deep for the JSON parser)
    for route, body, status in (("/v1/completions", deep, 400), ("/v1/completions", "{not json", 400),
                                ("/v1/nothing", "{}", 404)):
        response = post(server, route, body)
        assert response.status_code == status and response.json()["error"]["message"], response.text
    response = httpx.get(server.url + "/v1/completions", timeout=10)
    assert response.status_code == 405 and response.json()["error"]["type"] == "invalid_request_error"


def test_max_tokens_within_the_context_left_is_served(server):
    prompt = [5] * (MAX_MODEL_LEN - 4)
    fits = {"prompt": prompt, "max_tokens": 4, "ignore_eos": True}
    response = httpx.post(server.url + "/v1/completions", json=fits, timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    response = httpx.post(server.url + "/v1/completions", json={**fits, "max_tokens": 5}, timeout=60)
    assert response.status_code == 400 and "context left" in response.json()["error"]["message"]


def test_logprobs_at_the_servers_maximum_are_served(server):
    completion = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "prompt": "w5 w6", "max_tokens": 2, "logprobs": MAX_LOGPROBS, "echo": True}).json()
    top = completion["choices"][0]["logprobs"]["top_logprobs"]
    assert top[0] is None and all(MAX_LOGPROBS <= len(entry) <= MAX_LOGPROBS + 1 for entry in top[1:])
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "w5"}], "max_tokens": 2, "logprobs": True,
        "top_logprobs": MAX_LOGPROBS}).json()
    for token in chat["choices"][0]["logprobs"]["content"]:  # (k candidates, the sampled token first)
        assert len(token["top_logprobs"]) == MAX_LOGPROBS and token["top_logprobs"][0]["token"] == token["token"]
    response = httpx.post(server.url + "/v1/completions", json={"prompt": "w5", "logprobs": MAX_LOGPROBS + 1},
                          timeout=60)
    message = f"logprobs must be at most {MAX_LOGPROBS} (max_logprobs), got {MAX_LOGPROBS + 1}"
    assert response.json()["error"]["message"] == message
    response = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={  # (-1: the whole vocabulary)
        "messages": [{"role": "user", "content": "w5"}], "logprobs": True, "top_logprobs": -1})
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_logprobs"
    assert "--max-logprobs -1" in response.json()["error"]["message"]


def hold_the_engine(loop, until) -> threading.Thread:
    """Keeps the engine loop thread busy (no step runs) until `until()` holds, from another thread."""
    holder = threading.Thread(target=lambda: asyncio.run(loop.call(
        lambda _: wait_until(until, "the engine was held too long", seconds=30))))
    holder.start()
    return holder


def queued_commands(loop) -> list[str]:
    """The kinds of the commands waiting for the engine loop (other tests' aborts may be among them)."""
    return [command[0] for command in list(loop._commands.queue)]


def wait_until(condition, what: str, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.mark.parametrize("route, body, num_requests", [
    ("/v1/embeddings", {"input": ["w5 w6", "w7 w8", "w9"]}, 3),
    ("/score", {"text_1": "w5", "text_2": ["w6", "w7", "w8"]}, 4),  # (an embedding model: each text embedded once)
])
def test_a_pooling_client_that_leaves_aborts_its_requests(server, route, body, num_requests, caplog):
    loop = server.engine_loop
    aborted_before = server.engine.num_finished_by_reason.get("abort", 0)
    # The engine is held until the requests are queued, then (a second hold queued behind them)
    # until the server has asked to abort them all, so that no step can finish them first.
    queued = threading.Event()
    abort, aborted_ids = loop.abort, []
    loop.abort = lambda request_id: (aborted_ids.append(request_id), abort(request_id))
    try:
        first_hold = hold_the_engine(loop, queued.is_set)
        wait_until(lambda: loop._commands.empty(), "the first hold did not start")
        client = threading.Thread(target=lambda: pytest.raises(httpx.ReadTimeout, httpx.post, server.url + route,
                                                               json=body, timeout=httpx.Timeout(30, read=0.3)))
        client.start()
        wait_until(lambda: "add" in queued_commands(loop), "the requests were not queued")
        second_hold = hold_the_engine(loop, lambda: len(aborted_ids) >= num_requests)
        wait_until(lambda: "call" in queued_commands(loop)[queued_commands(loop).index("add"):],
                   "the second hold was not queued behind the requests")
        queued.set()
        for thread in (client, first_hold, second_hold):
            thread.join()
    finally:
        del loop.abort
    wait_until(lambda: server.engine.num_finished_by_reason.get("abort", 0) == aborted_before + num_requests,
               "the pooling requests were not aborted")
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR]
    assert_idle_and_serving(server)


def test_a_full_preparation_queue_is_a_503(server):
    loop = server.engine_loop
    limit, loop._max_worker_jobs = loop._max_worker_jobs, 1
    release = threading.Event()
    try:
        occupier = threading.Thread(target=lambda: asyncio.run(loop.run_in_worker(release.wait, 30)))
        occupier.start()
        deadline = time.monotonic() + 10
        while loop._num_worker_jobs < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        response = httpx.post(server.url + "/v1/completions", json={"prompt": "w5", "max_tokens": 2}, timeout=30)
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "overloaded"
    finally:
        release.set()
        occupier.join()
        loop._max_worker_jobs = limit
    assert_idle_and_serving(server)


# -- property-based fuzzing of every operation in /openapi.json (schemathesis) -----------------
schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

FUZZ_MAX_TOKENS = 2  # (generation is not what is tested: keep each request short)
FUZZ_CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


def checked(case):
    """Calls a request and checks its answer: no 5xx, a declared status, content type and body."""
    checks = FUZZ_CHECKS
    if isinstance(case.body, dict) and case.body.get("stream") is True:
        # A streamed answer is server-sent events, which the declared JSON schema does not describe.
        checks = [check for check in checks if check is not response_schema_conformance]
    return case.call_and_validate(checks=checks, timeout=60)


def fuzz(case) -> None:
    """One generated request, checked."""
    if isinstance(case.body, dict):
        for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            case.body[field] = FUZZ_MAX_TOKENS
    checked(case)


@pytest.fixture(scope="module")
def operations(server) -> list:
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    found = [result.ok() for result in schema.get_all_operations()]
    assert len(found) > 15
    return found


CHAT = [{"role": "user", "content": "w5"}]
RERANK = {"query": "w5", "documents": ["w6 w7", "w8"], "top_n": 1}
# Requests each operation answers with 200 (the fuzzer's mostly get 400s): every field the
# answers can hold, logprobs, echo, several choices and prompts, base64 embeddings, a tool call.
SERVED_REQUESTS = {
    ("GET", "/health"): [None], ("GET", "/v1/models"): [None], ("GET", "/metrics"): [None],
    ("GET", "/version"): [None], ("GET", "/load"): [None], ("POST", "/reset_prefix_cache"): [None],
    ("POST", "/v1/completions"): [
        {"prompt": "w5 w6", "max_tokens": 2, "n": 2, "logprobs": MAX_LOGPROBS, "echo": True},
        {"prompt": [[5, 6], [7]], "max_tokens": 2, "stop": ["x"]},
        {"prompt": "w5", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}},
        {"prompt": "w5 w6", "max_tokens": 2, "prompt_logprobs": 1, "return_token_ids": True},
    ],
    ("POST", "/v1/chat/completions"): [
        {"messages": CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": 2},
        {"messages": CHAT, "max_tokens": 20, "temperature": 0, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object"}}}],
         "tool_choice": {"type": "function", "function": {"name": "f"}}},
        {"messages": CHAT, "max_tokens": 2, "stream": True},
        {"messages": CHAT, "max_tokens": 2, "prompt_logprobs": 1, "return_token_ids": True},
    ],
    ("POST", "/v1/chat/completions/batch"): [
        {"messages": [CHAT, CHAT], "max_tokens": 2, "n": 2, "logprobs": True, "top_logprobs": 2},
    ],
    ("POST", "/v1/responses"): [
        {"input": "w5", "instructions": "be brief", "max_output_tokens": 2, "metadata": {"k": "v"}},
        {"input": [{"role": "user", "content": "w5"}], "max_output_tokens": 20, "temperature": 0,
         "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
         "tool_choice": {"type": "function", "name": "f"}},
        {"input": "w5", "max_output_tokens": 2, "stream": True},
    ],
    ("POST", "/v1/decisions"): [
        {"input": "w5", "questions": [{"type": "predicate", "instructions": "w6?"},
                                      {"type": "choice", "name": "c", "instructions": "w7", "choices": [
                                          {"value": "a"}, {"value": False, "description": "no"}]},
                                      {"type": "score", "instructions": "w8", "levels": [{"label": "x"}, {"label": "y"}]}]},
    ],
    ("POST", "/v1/embeddings"): [{"input": ["w5", "w6 w7"]}, {"input": "w5", "encoding_format": "base64"}],
    ("POST", "/v2/embed"): [{"texts": ["w5", "w6 w7"], "embedding_types": ["float", "binary", "base64"]},
                            {"inputs": [{"content": [{"type": "text", "text": "w5"}]}]}],
    ("POST", "/score"): [{"text_1": "w5", "text_2": ["w6", "w7"]}],
    ("POST", "/v1/score"): [{"text_1": ["w5", "w6"], "text_2": ["w7", "w8"]}],
    ("POST", "/rerank"): [RERANK], ("POST", "/v1/rerank"): [RERANK], ("POST", "/v2/rerank"): [RERANK],
    ("POST", "/tokenize"): [{"prompt": "w5 w6"}, {"messages": CHAT}],
    ("POST", "/detokenize"): [{"tokens": [5, 6]}],
}
# Operations this server refuses whatever the body (its model is no sequence classifier), or
# without a stored response's id (tests/server/test_responses_api.py reads stored ones back and
# cancels background ones).
UNSERVED = {("POST", "/classify"), ("POST", "/v1/classify"), ("GET", "/v1/responses/{response_id}"),
            ("POST", "/v1/responses/{response_id}/cancel")}


def test_the_document_declares_every_answer(server):
    """Each JSON 200 names its model, every error status the error JSON, and no route declares
    the 422 FastAPI adds for bodies (validation errors are 400s)."""
    document = httpx.get(server.url + "/openapi.json", timeout=10).json()
    for path, operations_of_path in document["paths"].items():
        for method, operation in operations_of_path.items():
            responses = operation["responses"]
            assert "422" not in responses, (method, path)
            content = responses["200"]["content"]
            assert "$ref" in content.get("application/json", {}).get("schema", {}) or "text/plain" in content, path
            for status, response in responses.items():
                error_schema = response["content"]["application/json"]["schema"] if int(status) >= 400 else None
                assert error_schema in (None, {"$ref": "#/components/schemas/ErrorResponse"}) or path == "/health"


def test_every_operation_answers_as_its_schema_declares(operations):
    """A 200 of each operation, its body checked against the declared schema (the fuzzer's
    requests are mostly refused, and a 400 checks the error schema only)."""
    served = {(operation.method.upper(), operation.path): operation for operation in operations}
    assert set(served) == set(SERVED_REQUESTS) | UNSERVED, "an operation without a request to serve"
    for (method, path), bodies in SERVED_REQUESTS.items():
        for body in bodies:
            case = served[method, path].Case(**({} if body is None else {"body": body}))
            response = checked(case)
            assert response.status_code == 200, (method, path, body, response.text)
            if body is not None and "tool_choice" in body:  # (the tool call's part of the schema was checked)
                assert "call_" in response.text, response.text


def test_no_generated_request_is_a_server_error(operations):
    """Every operation of /openapi.json, 25 generated requests each. (schemathesis's pytest
    plugin cannot take a live server from a fixture under this pytest, so its Python API runs
    each operation's strategy under hypothesis here.)"""
    for operation in operations:
        run = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck),
                       database=None)(given(case=operation.as_strategy())(fuzz))
        try:
            run()
        except BaseException as error:
            error.add_note(f"operation: {operation.method.upper()} {operation.path}")
            raise


def test_after_fuzzing_the_server_is_healthy_and_every_block_free(server):
    assert_idle_and_serving(server)
    assert server.metric("pagedkv_kv_blocks_used_device") == 0


def test_an_internal_fault_is_a_500_with_the_error_json_and_a_logged_request_id(server, monkeypatch, caplog):
    def broken(*_):
        raise RuntimeError("a bug")

    monkeypatch.setattr("pagedkv.entrypoints.server.routes.pooling.score_pairs", broken)
    response = httpx.post(server.url + "/score", json={"text_1": "a", "text_2": "b"}, timeout=30,
                          headers={"x-request-id": "fault-1"})
    assert response.status_code == 500 and response.headers["x-request-id"] == "fault-1"
    assert response.json()["error"]["type"] == "server_error" and "fault-1" in response.json()["error"]["message"]
    assert any("fault-1" in record.getMessage() and record.exc_info for record in caplog.records)
