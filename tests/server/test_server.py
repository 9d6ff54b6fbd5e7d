"""The OpenAI-compatible server, live on 127.0.0.1, driven by the real `openai` client and httpx."""

import asyncio
import json
import re
import time

import httpx
import pytest
from openai import OpenAI

from pagedkv.errors import InvalidConfigError
from pagedkv.entrypoints.server import create_app
from support.live_server import LiveServer


@pytest.fixture(scope="module")
def server():
    live = LiveServer(gguf_weights="dequantized", num_device_blocks=256, max_model_len=512)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60, max_retries=0)


def test_models_health_and_metrics(server, client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert [model.id for model in client.models.list().data] == [server.engine.model_name]
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert card["root"] == (server.engine.config.model or server.engine.model_name) and card["parent"] is None
    text = httpx.get(server.url + "/metrics").text
    for name in ("pagedkv_kv_blocks_used_device", "pagedkv_kv_usage_percent_cpu", "pagedkv_requests_waiting",
                 "pagedkv_preemptions_total", "pagedkv_prefix_cache_hit_rate", "pagedkv_time_to_first_token_seconds",
                 "pagedkv_kv_blocks_cached_cpu", 'pagedkv_cpu_prefix_cache_blocks_total{direction="reloaded"}',
                 'pagedkv_spec_decode_draft_tokens_total{outcome="accepted"}'):
        assert name in text


def vllm_samples(server) -> dict:
    """{(sample name, finished_reason label or None): value} of the vllm: metrics /metrics shows."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {(sample.name, sample.labels.get("finished_reason")): sample.value
            for family in text_string_to_metric_families(text) if family.name.startswith("vllm:")
            for sample in family.samples}


def test_vllms_metric_names_count_what_vllms_count(client, server):
    """vLLM's own metrics test's names (EXPECTED_METRICS_V1 of tests/entrypoints/serve/instrumentator/
    test_metrics.py) and its counts: per request, its prompt and generated tokens, and one step per
    token (the first with the prompt: vLLM's iteration tokens)."""
    model, tokenizer = server.engine.model_name, server.engine.tokenizer
    prompt = tokenizer.encode("Hello my name is Robert and I love magic")
    before = vllm_samples(server)
    for _ in range(3):
        client.completions.create(model=model, prompt=prompt, max_tokens=5, extra_body={"ignore_eos": True})
    after = vllm_samples(server)
    grew = lambda name, label=None: after[(name, label)] - before.get((name, label), 0)  # noqa: E731
    assert grew("vllm:prompt_tokens_total") == 3 * len(prompt) and grew("vllm:generation_tokens_total") == 15
    assert grew("vllm:request_success_total", "length") == 3
    assert grew("vllm:request_prompt_tokens_sum") == 3 * len(prompt)
    assert grew("vllm:request_generation_tokens_sum") == 15 and grew("vllm:request_params_max_tokens_sum") == 15
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_inference_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "time_per_output_token_seconds", "request_params_n", "request_prompt_tokens"):
        assert grew(f"vllm:{name}_count") == 3, name
    assert grew("vllm:inter_token_latency_seconds_count") == 3 * 4
    assert grew("vllm:request_num_preemptions_count") == 3 and grew("vllm:request_num_preemptions_sum") == 0
    assert grew("vllm:iteration_tokens_total_count") == 3 * 5  # (requests one after another: a step per token)
    assert grew("vllm:iteration_tokens_total_sum") == 3 * (len(prompt) + 5)
    names = {name for name, _ in after}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:cache_config_info", "vllm:request_success_total", "vllm:num_requests_waiting_by_reason",
                 "vllm:iteration_tokens_total_bucket"):
        assert name in names, name
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'vllm:admission_rejections_total{model_name="' in text and 'reason="max_num_queued_reqs"' in text
    assert 'kv_cache_size_tokens="4096"' in text and 'kv_cache_max_concurrency="8.0"' in text  # (256 blocks of 16; 512)
    assert after[("vllm:num_requests_running", None)] == 0 and after[("vllm:kv_cache_usage_perc", None)] == 0


@pytest.mark.parametrize("value", [0.0, 0.003, 0.07, 1.0, 5000.0])
def test_observing_many_at_once_equals_observing_each(value):
    from prometheus_client import CollectorRegistry, Histogram

    from pagedkv.entrypoints.server.metrics import observe_many

    registry = CollectorRegistry()
    once = Histogram("once", "", ["model"], buckets=(0.001, 0.01, 0.1, 1.0), registry=registry).labels("m")
    each = Histogram("each", "", ["model"], buckets=(0.001, 0.01, 0.1, 1.0), registry=registry).labels("m")
    observe_many(once, value, 37)
    for _ in range(37):
        each.observe(value)
    samples = {metric.name: {(s.name.removeprefix(metric.name), s.labels.get("le")): s.value for s in metric.samples
                             if not s.name.endswith("_created")} for metric in registry.collect()}
    assert samples["once"].keys() == samples["each"].keys()
    for key, value_once in samples["once"].items():  # (the sum: one product against 37 additions)
        assert value_once == pytest.approx(samples["each"][key], rel=1e-12), key


def test_token_counters_and_request_latency_histograms(client, server):
    names = ("pagedkv_prompt_tokens_total", "pagedkv_generation_tokens_total",
             "pagedkv_e2e_request_latency_seconds_count", "pagedkv_request_queue_time_seconds_count")
    before = {name: server.metric(name) for name in names}
    out = client.completions.create(model=server.engine.model_name, prompt="Count: one, two,", max_tokens=5, n=2,
                                    temperature=0)
    after = {name: server.metric(name) for name in names}
    assert after["pagedkv_prompt_tokens_total"] - before["pagedkv_prompt_tokens_total"] == out.usage.prompt_tokens
    assert (after["pagedkv_generation_tokens_total"] - before["pagedkv_generation_tokens_total"]
            == out.usage.completion_tokens)
    assert after["pagedkv_e2e_request_latency_seconds_count"] == before["pagedkv_e2e_request_latency_seconds_count"] + 1
    assert after["pagedkv_request_queue_time_seconds_count"] == before["pagedkv_request_queue_time_seconds_count"] + 1


def test_streamed_usage_and_token_counters_count_every_step(client, server):
    """Streams carry what is new each step (delta outputs): the usage chunk and the generation
    counter count the tokens of every step, as a non-streamed answer's usage does."""
    model = server.engine.model_name
    args = dict(model=model, prompt="Count: one, two,", max_tokens=7, n=2, temperature=0)
    full = client.completions.create(**args)
    before = server.metric("pagedkv_generation_tokens_total")
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    after = server.metric("pagedkv_generation_tokens_total")
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == after - before
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    texts = ["".join(c.text for chunk in chunks for c in chunk.choices if c.index == i) for i in range(2)]
    assert texts == [choice.text for choice in full.choices]


def test_continuous_usage_stats_give_usage_so_far_in_every_chunk(client, server):
    """vLLM's stream_options.continuous_usage_stats: each chunk carries the usage so far."""
    args = dict(model=server.engine.model_name, prompt="Count: one, two,", max_tokens=6, temperature=0,
                extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(stream=True, **args, stream_options={
        "include_usage": True, "continuous_usage_stats": True}))
    with_text = [chunk for chunk in chunks if chunk.choices]
    assert all(chunk.usage is not None for chunk in chunks)
    counts = [chunk.usage.completion_tokens for chunk in with_text]
    assert counts == sorted(counts) and counts[-1] == chunks[-1].usage.completion_tokens == 6
    assert {chunk.usage.prompt_tokens for chunk in chunks} == {chunks[-1].usage.prompt_tokens}
    plain = list(client.completions.create(stream=True, **args, stream_options={"include_usage": True}))
    assert [chunk.usage is not None for chunk in plain] == [False] * (len(plain) - 1) + [True]


@pytest.fixture(scope="module")
def flagged_server():
    """A server with the options that are off by default."""
    live = LiveServer(num_device_blocks=32, max_model_len=128, app_options={
        "enable_force_include_usage": True, "enable_tokenizer_info_endpoint": True,
        "enable_prompt_tokens_details": True, "enable_per_request_metrics": True, "return_tokens_as_token_ids": True,
        "enable_request_id_headers": True, "enable_sagemaker_sessions": True})
    yield live
    live.stop()


def test_force_include_usage_puts_usage_in_every_chunk(flagged_server):
    """--enable-force-include-usage: a stream that did not ask for usage gets it in every chunk
    (the counts so far) and ends with it, as vLLM's flag does."""
    from pagedkv.entrypoints.cli import build_parser

    flags = build_parser().parse_args(["serve", "--enable-force-include-usage", "--enable-tokenizer-info-endpoint"])
    assert flags.enable_force_include_usage and flags.enable_tokenizer_info_endpoint
    forced = OpenAI(base_url=flagged_server.url + "/v1", api_key="unused", timeout=60, max_retries=0)
    chunks = list(forced.completions.create(model=flagged_server.engine.model_name, prompt="Hi", max_tokens=3,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 3 and not chunks[-1].choices
    counts = [chunk.usage.completion_tokens for chunk in chunks]
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0  # (--enable-prompt-tokens-details)
    chat = list(forced.chat.completions.create(model=flagged_server.engine.model_name, max_tokens=3, stream=True,
                                               messages=[{"role": "user", "content": "Hi"}]))
    assert chat[0].choices[0].delta.role == "assistant" and chat[0].usage.completion_tokens == 0
    assert all(chunk.usage is not None and chunk.usage.prompt_tokens == chat[0].usage.prompt_tokens for chunk in chat)
    assert counts == sorted(counts) and all(chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens for chunk in chunks)


def test_per_request_metrics_time_a_one_choice_reply(flagged_server, server):
    """--enable-per-request-metrics (vLLM's): a one-choice reply carries its timing, a stream on its
    usage chunk only; several choices, or the flag off, carry none."""
    from pagedkv.entrypoints.cli import build_parser

    assert build_parser().parse_args(["serve", "--enable-per-request-metrics"]).enable_per_request_metrics
    model, messages = flagged_server.engine.model_name, [{"role": "user", "content": "Count to four."}]
    url = flagged_server.url + "/v1/chat/completions"
    started = time.monotonic()
    whole = httpx.post(url, json={"model": model, "messages": messages, "max_tokens": 4, "min_tokens": 4},
                       timeout=60).json()
    elapsed_ms = (time.monotonic() - started) * 1000
    metrics = whole["metrics"]
    assert set(metrics) == {"time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms",
                            "tokens_per_second"}
    assert all(value >= 0 for value in metrics.values())
    assert metrics["queue_time_ms"] + metrics["time_to_first_token_ms"] + metrics["generation_time_ms"] <= elapsed_ms
    assert metrics["mean_itl_ms"] == pytest.approx(metrics["generation_time_ms"] / 3)
    inference_s = (metrics["time_to_first_token_ms"] + metrics["generation_time_ms"]) / 1000
    assert metrics["tokens_per_second"] == pytest.approx(4 / inference_s, rel=1e-3)

    forced = OpenAI(base_url=flagged_server.url + "/v1", api_key="unused", timeout=60, max_retries=0)
    chunks = list(forced.chat.completions.create(model=model, messages=messages, max_tokens=1, stream=True))
    assert all("metrics" not in (chunk.model_extra or {}) for chunk in chunks[:-1])
    last = chunks[-1].model_extra["metrics"]
    assert chunks[-1].usage is not None and "mean_itl_ms" not in last and last["time_to_first_token_ms"] >= 0

    two = httpx.post(flagged_server.url + "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2,
                                                                   "n": 2}, timeout=60).json()
    plain = httpx.post(server.url + "/v1/completions", json={"model": server.engine.model_name, "prompt": "Hi",
                                                             "max_tokens": 2}, timeout=60).json()
    assert "metrics" not in two and "metrics" not in plain


def test_logprobs_list_each_token_first_and_the_flag_names_every_request_by_id(flagged_server, server):
    """vLLM's order: a token's top_logprobs start with the token itself; --return-tokens-as-token-ids
    names every request's tokens "token_id:<id>"."""
    from pagedkv.entrypoints.cli import build_parser

    assert build_parser().parse_args(["serve", "--return-tokens-as-token-ids"]).return_tokens_as_token_ids
    body = {"prompt": "Say 'Hello, world!'", "echo": True, "temperature": 0, "max_tokens": 6, "logprobs": 1}
    plain = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]
    flagged = httpx.post(flagged_server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    for logprobs in (plain, flagged["logprobs"]):
        assert logprobs["tokens"][1:] == [next(iter(top)) for top in logprobs["top_logprobs"][1:]]
    ids = [int(token.removeprefix("token_id:")) for token in flagged["logprobs"]["tokens"]]
    assert flagged_server.engine.tokenizer.decode(ids, skip_special_tokens=True) == flagged["text"]
    chat = httpx.post(flagged_server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "logprobs": True}).json()["choices"][0]
    assert all(entry["token"].startswith("token_id:") for entry in chat["logprobs"]["content"])


def test_request_id_headers_echo_the_clients_or_make_one(flagged_server, server):
    from pagedkv.entrypoints.cli import build_parser

    assert build_parser().parse_args(["serve", "--enable-request-id-headers"]).enable_request_id_headers
    made = httpx.get(flagged_server.url + "/health", timeout=10).headers.get("x-request-id", "")
    assert len(made) == 32 and int(made, 16) >= 0
    assert httpx.get(flagged_server.url + "/health", headers={"X-Request-Id": "Custom"},
                     timeout=10).headers["x-request-id"] == "Custom"
    refused = httpx.post(flagged_server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": -1}, timeout=10)
    assert refused.status_code == 400 and len(refused.headers["x-request-id"]) == 32
    assert "x-request-id" not in httpx.get(server.url + "/health", timeout=10).headers


def test_tokenizer_info_and_token_strings(flagged_server, server):
    """vLLM's /tokenizer_info (only where enabled), /tokenize's return_token_strs, usage's details."""
    info = httpx.get(flagged_server.url + "/tokenizer_info", timeout=10).json()
    tokenizer = flagged_server.engine.tokenizer
    assert info["tokenizer_class"] == type(tokenizer).__name__ and info["chat_template"] == tokenizer.chat_template
    assert httpx.get(server.url + "/tokenizer_info", timeout=10).status_code == 404
    body = {"prompt": "Hello there, naïve café", "return_token_strs": True}
    answer = httpx.post(server.url + "/tokenize", json=body, timeout=30).json()
    assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(answer["tokens"]) and len(answer["tokens"]) > 3
    assert httpx.post(server.url + "/tokenize", json={"prompt": "Hi"}, timeout=30).json()["token_strs"] is None
    # (and usage without prompt_tokens_details unless --enable-prompt-tokens-details, as vLLM)
    answer = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=30).json()
    assert set(answer["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}


def test_streamed_samples_come_one_choice_per_chunk(client, server):
    """As vLLM streams n > 1: each chunk carries one choice, so clients that read choices[0] see
    every sample's text and its one finish_reason."""
    model = server.engine.model_name
    streams = {
        "completions": client.completions.create(model=model, prompt="What is an LLM?", max_tokens=12, n=3,
                                                 temperature=1.0, seed=42, stream=True),
        "chat": client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=12, n=3, temperature=1.0, seed=42, stream=True),
    }
    for name, stream in streams.items():
        chunks = list(stream)
        assert all(len(chunk.choices) == 1 for chunk in chunks), name
        ends = sorted(chunk.choices[0].index for chunk in chunks if chunk.choices[0].finish_reason is not None)
        assert ends == [0, 1, 2], name


def test_sagemakers_ping_and_invocations(server):
    """vLLM's SageMaker routes: /ping is /health; /invocations serves a body as the first route
    whose request it is."""
    for method in ("GET", "POST"):
        assert httpx.request(method, server.url + "/ping", timeout=10).json() == {"status": "ok"}
    invoke = lambda body: httpx.post(server.url + "/invocations", json=body, timeout=60)  # noqa: E731
    chat = invoke({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).json()
    assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] >= 1
    assert invoke({"prompt": "Hi", "max_tokens": 2}).json()["object"] == "text_completion"
    embedded = invoke({"input": "Hi"}).json()["data"][0]["embedding"]
    assert len(embedded) == server.engine.model_info.hidden_size
    refused = invoke({"what": "nothing"})
    assert refused.status_code == 400 and "ChatCompletionRequest" in refused.json()["error"]["message"]
    assert invoke({"prompt": "Hi", "max_tokens": 0}).status_code == 400
    plain = invoke({"prompt": "Hi", "max_tokens": 2, "logprobs": False}).json()  # (a chat client's "no logprobs")
    assert plain["object"] == "text_completion" and plain["choices"][0]["logprobs"] is None
    assert invoke({"prompt": "Hi", "max_tokens": 2, "logprobs": True}).status_code == 400


def test_sagemaker_sessions_open_serve_and_close(flagged_server, server):
    """SageMaker's stateful sessions (where enabled): NEW_SESSION announces an id and its expiry,
    invocations naming it are served, CLOSE ends it; what the standard refuses is refused with its
    statuses and words."""
    from pagedkv.entrypoints.cli import build_parser

    assert build_parser().parse_args(["serve", "--enable-sagemaker-sessions"]).enable_sagemaker_sessions
    url, header = flagged_server.url + "/invocations", "X-Amzn-SageMaker-Session-Id"
    opened = httpx.post(url, json={"requestType": "NEW_SESSION"}, timeout=10)
    session_id, expires = opened.headers["X-Amzn-SageMaker-New-Session-Id"].split(";")
    assert opened.status_code == 200 and expires.strip().startswith("Expires=20")
    served = httpx.post(url, headers={header: session_id}, json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert served.status_code == 200 and served.json()["object"] == "text_completion"
    unknown = httpx.post(url, headers={header: "nope"}, json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert unknown.status_code == 400 and "session not found" in unknown.json()["error"]["message"]
    assert httpx.post(url, json={"requestType": "NEW_SESSION", "extra": 1}, timeout=10).status_code == 400
    bad_close = httpx.post(url, headers={header: session_id}, json={"requestType": "CLOSE", "extra": 1}, timeout=10)
    assert bad_close.status_code == 400
    headless = httpx.post(url, json={"requestType": "CLOSE"}, timeout=10)
    assert headless.status_code == 424 and "invalid session_id" in headless.json()["error"]["message"]
    closed = httpx.post(url, headers={header: session_id}, json={"requestType": "CLOSE"}, timeout=10)
    assert closed.status_code == 200 and closed.headers["X-Amzn-SageMaker-Closed-Session-Id"] == session_id
    again = httpx.post(url, headers={header: session_id}, json={"requestType": "CLOSE"}, timeout=10)
    assert again.status_code == 400 and "session not found" in again.json()["error"]["message"]
    off = httpx.post(server.url + "/invocations", json={"requestType": "NEW_SESSION"}, timeout=10)
    assert off.status_code == 400 and "stateful sessions not enabled" in off.json()["error"]["message"]


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


def tokenize(server, text: str) -> list[int]:
    response = httpx.post(server.url + "/tokenize", json={"prompt": text}, timeout=30)
    assert response.status_code == 200
    return response.json()["tokens"]


def test_tokenize_detokenize_and_version(client, server):
    prompt = "The three primary colors are"
    body = httpx.post(server.url + "/tokenize", json={"prompt": prompt}, timeout=30).json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 512
    used = client.completions.create(model=server.engine.model_name, prompt=prompt, max_tokens=1).usage
    assert body["count"] == used.prompt_tokens  # what the engine itself counts
    back = httpx.post(server.url + "/detokenize", json={"tokens": body["tokens"]}, timeout=30).json()
    assert back == {"prompt": prompt}
    messages = [{"role": "user", "content": "Name a fruit."}]
    chat = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=30).json()
    reply = client.chat.completions.create(model=server.engine.model_name, messages=messages, max_tokens=1)
    assert chat["count"] == reply.usage.prompt_tokens
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [10**9]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    neither = httpx.post(server.url + "/tokenize", json={}, timeout=30)
    assert neither.status_code == 400
    assert httpx.get(server.url + "/version").json()["version"]


def test_vllm_extra_sampling_parameters_and_logit_bias(client, server):
    model = server.engine.model_name
    forced = tokenize(server, " banana")
    assert len(forced) == 1
    biased = client.completions.create(model=model, prompt="My favourite colour is", max_tokens=3, temperature=0,
                                       logit_bias={str(forced[0]): 100})
    assert biased.choices[0].text == " banana" * 3
    # ignore_eos + min_tokens: exactly max_tokens; top_k=1 is greedy whatever the temperature.
    extra = dict(top_k=1, min_p=0.05, repetition_penalty=1.0, ignore_eos=True, min_tokens=6)
    sampled = client.completions.create(model=model, prompt="Hello", max_tokens=6, temperature=1.3, seed=3,
                                        extra_body=extra)
    greedy = client.completions.create(model=model, prompt="Hello", max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert sampled.choices[0].text == greedy.choices[0].text and sampled.usage.completion_tokens == 6
    # A stop token id ends the completion without being part of its text.
    first = client.completions.create(model=model, prompt="Hello", max_tokens=1, temperature=0).choices[0].text
    [first_id] = tokenize(server, first)
    stopped = client.completions.create(model=model, prompt="Hello", max_tokens=6, temperature=0,
                                        extra_body={"stop_token_ids": [first_id]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == ""
    kept = client.completions.create(model=model, prompt="Hello", max_tokens=6, temperature=0,
                                     extra_body={"stop_token_ids": [first_id], "include_stop_str_in_output": True})
    assert kept.choices[0].text == first
    text = greedy.choices[0].text
    stop_string = text[2:4]
    end = text.find(stop_string) + len(stop_string)
    cut = client.completions.create(model=model, prompt="Hello", max_tokens=6, temperature=0, stop=[stop_string],
                                    extra_body={"include_stop_str_in_output": True})
    assert cut.choices[0].text == text[:end] and cut.choices[0].finish_reason == "stop"
    beams = client.completions.create(model=model, prompt="Hello", max_tokens=4, n=2, temperature=0,
                                      extra_body={"use_beam_search": True})
    assert len(beams.choices) == 2 and beams.choices[0].text != beams.choices[1].text
    streamed_beams = list(client.completions.create(model=model, prompt="Hello", max_tokens=4, n=2, temperature=0,
                                                    stream=True, extra_body={"use_beam_search": True}))
    assert [[c.text for chunk in streamed_beams for c in chunk.choices if c.index == i] for i in range(2)] == [
        [choice.text] for choice in beams.choices]  # (the final beams, at once: they change until the end)


def test_batched_prompts_echo_and_streamed_logprobs(client, server):
    model = server.engine.model_name
    prompts = ["The capital of France is", "One, two, three,"]
    singles = [client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0, logprobs=2).choices[0]
               for p in prompts]
    batch = client.completions.create(model=model, prompt=prompts, max_tokens=8, temperature=0, n=2, logprobs=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [singles[0].text] * 2 + [singles[1].text] * 2
    assert batch.usage.prompt_tokens == sum(len(tokenize(server, p)) for p in prompts)
    assert batch.usage.completion_tokens == 2 * sum(len(c.logprobs.tokens) for c in singles)
    # Token prompts, batched, give the same choices.
    token_batch = client.completions.create(model=model, prompt=[tokenize(server, p) for p in prompts],
                                            max_tokens=8, temperature=0)
    assert [c.text for c in token_batch.choices] == [c.text for c in singles]
    # Streamed: the same text and the same logprobs, spread over the chunks.
    texts, tokens, token_logprobs, offsets = ["", ""], [[], []], [[], []], [[], []]
    for chunk in client.completions.create(model=model, prompt=prompts, max_tokens=8, temperature=0, logprobs=2,
                                           stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.logprobs is not None:
                tokens[choice.index] += choice.logprobs.tokens
                token_logprobs[choice.index] += choice.logprobs.token_logprobs
                offsets[choice.index] += choice.logprobs.text_offset
    for i, single in enumerate(singles):
        assert texts[i] == single.text and tokens[i] == single.logprobs.tokens
        assert token_logprobs[i] == pytest.approx(single.logprobs.token_logprobs, abs=1e-4)
        assert offsets[i] == single.logprobs.text_offset
    echoed = client.completions.create(model=model, prompt=prompts, max_tokens=8, temperature=0, echo=True)
    assert [c.text for c in echoed.choices] == [p + s.text for p, s in zip(prompts, singles)]
    streamed_echo = ["", ""]
    for chunk in client.completions.create(model=model, prompt=prompts, max_tokens=8, temperature=0, echo=True,
                                           stream=True):
        for choice in chunk.choices:
            streamed_echo[choice.index] += choice.text
    assert streamed_echo == [c.text for c in echoed.choices]


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(client, server):
    """lm-evaluation-harness's loglikelihood request: token prompts, echo, logprobs=1, max_tokens=1."""
    model = server.engine.model_name
    prompts = [tokenize(server, "The capital of France is Paris"), tokenize(server, "Two plus two is four")]
    out = client.completions.create(model=model, prompt=prompts, max_tokens=1, temperature=0, logprobs=1, echo=True)
    for choice, token_ids in zip(out.choices, prompts):
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(token_ids) + 1 and logprobs.token_logprobs[0] is None
        assert all(value <= 0 for value in logprobs.token_logprobs[1:])
        assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
        # The last prompt token's score equals the sampler's logprob for it after the shorter
        # prompt (forced there by logit_bias; logprobs are under the unbiased distribution).
        forced = client.completions.create(model=model, prompt=token_ids[:-1], max_tokens=1, temperature=0,
                                           logprobs=0, logit_bias={str(token_ids[-1]): 100})
        assert forced.choices[0].logprobs.token_logprobs[0] == pytest.approx(
            logprobs.token_logprobs[len(token_ids) - 1], abs=1e-3)
    streamed = []
    for chunk in client.completions.create(model=model, prompt=prompts[0], max_tokens=1, temperature=0, logprobs=1,
                                           echo=True, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed += choice.logprobs.token_logprobs
    assert streamed[0] is None
    assert streamed[1:] == pytest.approx(out.choices[0].logprobs.token_logprobs[1:], abs=1e-4)


def test_chat_streams_logprobs(client, server):
    args = dict(model=server.engine.model_name, messages=[{"role": "user", "content": "Name a fruit."}],
                max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    full = client.chat.completions.create(**args).choices[0].logprobs.content
    streamed = []
    for chunk in client.chat.completions.create(stream=True, **args):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [entry.token for entry in streamed] == [entry.token for entry in full] and full
    assert [entry.logprob for entry in streamed] == pytest.approx([entry.logprob for entry in full], abs=1e-4)
    assert [[top.token for top in entry.top_logprobs] for entry in streamed] == \
        [[top.token for top in entry.top_logprobs] for entry in full]
    for entry in full:  # greedy: the sampled token and the next most likely, most likely first
        assert [top.token for top in entry.top_logprobs][:1] == [entry.token] and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token


def test_logprob_token_ids_report_the_named_tokens_and_the_sampled_one(client, server):
    model, prompt = server.engine.model_name, "The capital of France is"
    natural = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, logprobs=20)
    ranked = sorted(natural.choices[0].logprobs.top_logprobs[0].items(), key=lambda item: -item[1])
    ids = {text: tokenize(server, text) for text, _ in ranked}
    second, tenth = [(ids[text][0], value) for text, value in (ranked[1], ranked[9]) if len(ids[text]) == 1]
    far = 40000  # (far below the top 20)
    named = [second[0], far, tenth[0]]
    extra = {"logprob_token_ids": named, "return_tokens_as_token_ids": True}
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, logprobs=5,
                                      extra_body=extra).choices[0].logprobs
    top = whole.top_logprobs[0]
    sampled = whole.tokens[0]
    assert set(top) == {f"token_id:{t}" for t in named} | {sampled}  # (not the top 5)
    assert top[f"token_id:{second[0]}"] == pytest.approx(second[1], abs=1e-4)
    assert top[f"token_id:{tenth[0]}"] == pytest.approx(tenth[1], abs=1e-4)
    assert top[f"token_id:{far}"] < tenth[1]

    # Chat lists them all, whatever top_logprobs says, streamed or not; a sampled token outside
    # the set is listed too.
    args = dict(model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=1, temperature=0,
                logprobs=True, extra_body={**extra, "logprob_token_ids": [100, 5000], "allowed_token_ids": [42]})
    entry = client.chat.completions.create(top_logprobs=1, **args).choices[0].logprobs.content[0]
    assert entry.token == "token_id:42"
    assert {top.token for top in entry.top_logprobs} == {"token_id:42", "token_id:100", "token_id:5000"}
    streamed = [top.token for chunk in client.chat.completions.create(stream=True, **args)
                if chunk.choices and chunk.choices[0].logprobs for content in chunk.choices[0].logprobs.content
                for top in content.top_logprobs]
    assert sorted(streamed) == sorted(top.token for top in entry.top_logprobs)


def test_prompt_ids_forwarded_in_kv_transfer_params_stand_for_the_messages(client, server):
    """vLLM's decode-side token reuse: a router forwards the prefill stage's prompt ids in
    kv_transfer_params, and the reply is to them, not to the request's own messages."""
    model = server.engine.model_name
    first = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello, how are you?"}],
                                           max_tokens=6, temperature=0, extra_body={"return_token_ids": True})
    forwarded = {"kv_transfer_params": {"prompt_token_ids": first.prompt_token_ids}, "return_token_ids": True}
    args = dict(model=model, messages=[{"role": "user", "content": "unrelated"}], max_tokens=6, temperature=0)
    reused = client.chat.completions.create(extra_body=forwarded, **args)
    assert reused.prompt_token_ids == first.prompt_token_ids
    assert reused.choices[0].message.content == first.choices[0].message.content
    streamed = list(client.chat.completions.create(stream=True, extra_body=forwarded, **args))
    assert streamed[0].prompt_token_ids == first.prompt_token_ids
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices) == \
        first.choices[0].message.content
    for bad in ([1, 10**9], [], "1 2"):
        body = {**args, "kv_transfer_params": {"prompt_token_ids": bad}}
        response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["param"] == "kv_transfer_params"


def test_token_ids_whole_and_streamed_as_vllm_returns_them(client, server):
    """vLLM's return_token_ids: the prompt's ids and each choice's (end-of-sequence token
    included), whole and streamed (the prompt's in the first chunk only); null when not asked."""
    model, tokenizer = server.engine.model_name, server.engine.tokenizer
    messages = [{"role": "user", "content": "Name a fruit."}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                          extra_body={"return_token_ids": True})
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(chat.prompt_token_ids) == prompt
    assert tokenizer.decode(chat.choices[0].token_ids, skip_special_tokens=True) == chat.choices[0].message.content
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, extra_body={"return_token_ids": True}))
    assert chunks[0].prompt_token_ids == chat.prompt_token_ids
    assert all("prompt_token_ids" not in chunk.model_dump() for chunk in chunks[1:])
    assert [t for chunk in chunks[1:] for t in chunk.choices[0].token_ids] == chat.choices[0].token_ids
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=2)
    assert plain.prompt_token_ids is None and plain.choices[0].token_ids is None

    args = dict(model=model, prompt="Count: one, two,", max_tokens=6, temperature=0, logprobs=1)
    whole = client.completions.create(**args, extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True})
    choice = whole.choices[0]
    assert choice.prompt_token_ids == tokenizer.encode("Count: one, two,")
    assert [f"token_id:{t}" for t in choice.token_ids] == choice.logprobs.tokens
    assert all(key.startswith("token_id:") for top in choice.logprobs.top_logprobs for key in top)
    streamed = list(client.completions.create(**args, stream=True, extra_body={"return_token_ids": True}))
    assert streamed[0].choices[0].prompt_token_ids == choice.prompt_token_ids
    assert [t for chunk in streamed for t in chunk.choices[0].token_ids] == choice.token_ids
    assert client.completions.create(**args).choices[0].token_ids is None


def test_structured_outputs_through_response_format_and_guided_fields(client, server):
    model = server.engine.model_name
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]}
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Which city is the capital of France? Answer in JSON."}],
        max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert set(json.loads(reply.choices[0].message.content)) == {"city"}
    picked = client.completions.create(model=model, prompt="Is the sky blue? Answer:", max_tokens=5, n=3,
                                       temperature=1.0, seed=5, extra_body={"guided_choice": ["yes", "no"]})
    assert {choice.text for choice in picked.choices} <= {"yes", "no"}
    digits = client.completions.create(model=model, prompt="Pick a number:", max_tokens=8, temperature=0,
                                       extra_body={"structured_outputs": {"regex": "[0-9]{2}"}})
    assert re.fullmatch("[0-9]{2}", digits.choices[0].text)
    for body, message in (({"guided_regex": "(unclosed"}, "structured_outputs regex is invalid"),
                          ({"response_format": {"type": "xml"}}, "response_format"),
                          ({"guided_regex": "a", "guided_choice": ["a"]}, "exactly one of")):
        response = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", **body}, timeout=30)
        assert response.status_code == 400 and message in response.json()["error"]["message"]


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 30}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
    "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


def test_tool_calls_for_a_named_or_required_tool_choice(client, server):
    model = server.engine.model_name
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER, TIME], max_tokens=40,
                                           temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message = named.choices[0].message
    [call] = message.tool_calls
    assert message.content is None and call.function.name == "get_weather" and call.id.startswith("call_")
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    required = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER, TIME], max_tokens=60,
                                              temperature=0.8, seed=2, tool_choice="required")
    assert required.choices[0].finish_reason == "tool_calls" and required.choices[0].message.tool_calls
    for call in required.choices[0].message.tool_calls:
        arguments = json.loads(call.function.arguments)
        assert (call.function.name, set(arguments)) in (("get_weather", {"city"}), ("get_time", {"zone"}))
    streamed = [delta_call for chunk in client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], max_tokens=40, temperature=0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
        if chunk.choices for delta_call in (chunk.choices[0].delta.tool_calls or [])]
    assert [(c.function.name, c.function.arguments) for c in streamed] == [(call.function.name, call.function.arguments)
                                                                            for call in message.tool_calls]
    # A follow-up turn carrying the call and its result is accepted.
    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]
    reply = client.chat.completions.create(model=model, messages=history, tools=[WEATHER], max_tokens=8, temperature=0)
    assert reply.choices[0].message.content


def test_required_tools_with_defs_and_a_named_call_cut_by_max_tokens(client, server):
    """vLLM's cases: tool schemas that refer to their own $defs work under "required" (the
    definitions move to the combined schema's root); a named call cut off by max_tokens is still
    the call (finish_reason "length"), not content."""
    model = server.engine.model_name
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    place = {"type": "function", "function": {"name": "get_forecast", "parameters": {
        "type": "object", "properties": {"where": {"$ref": "#/$defs/place"}}, "required": ["where"],
        "$defs": {"place": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"]}}}}}
    required = client.chat.completions.create(model=model, messages=messages, tools=[place, WEATHER], max_tokens=80,
                                              temperature=0, tool_choice="required")
    for call in required.choices[0].message.tool_calls:
        arguments = json.loads(call.function.arguments)
        assert isinstance((arguments["where"]["city"] if call.function.name == "get_forecast" else arguments["city"]),
                          str)
    clash = dict(TIME, function=dict(TIME["function"], parameters=dict(TIME["function"]["parameters"],
                                                                       **{"$defs": {"place": {"type": "string"}}})))
    response = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "messages": messages, "tools": [place, clash], "tool_choice": "required", "max_tokens": 5})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"
    cut = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=3, temperature=0,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = cut.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments.startswith("{")


def test_chat_continues_the_final_message_echoes_it_and_takes_custom_roles(client, server):
    """vLLM's continue_final_message (the prompt ends inside the last assistant message), echo
    (that message's text before the reply) and roles beyond OpenAI's five."""
    model, tokenizer = server.engine.model_name, server.engine.tokenizer
    messages = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "My favourite fruit is"}]
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0, extra_body={
        "continue_final_message": True, "add_generation_prompt": False, "echo": True})
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert prompt.rstrip().endswith("My favourite fruit is")
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0,
                                      extra_body={"add_special_tokens": False})
    assert reply.choices[0].message.content == "My favourite fruit is" + plain.choices[0].text
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model=model, messages=messages, max_tokens=6, temperature=0, stream=True, extra_body={
            "continue_final_message": True, "add_generation_prompt": False, "echo": True}) if chunk.choices)
    assert streamed == reply.choices[0].message.content
    response = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "messages": messages, "continue_final_message": True, "max_tokens": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "continue_final_message"
    narrated = client.chat.completions.create(model=model, max_tokens=2, messages=[
        {"role": "narrator", "content": "A quiet morning."}, {"role": "user", "content": "Hi"}])
    assert narrated.choices[0].message.content is not None


def test_prompt_logprobs_in_completions_and_chat(client, server):
    """vLLM's prompt_logprobs: per prompt token (the first has none) the token and the k most
    likely, keyed by id, with rank and decoded text; the token's own logprob is what echo's
    logprobs give it."""
    model, tokenizer = server.engine.model_name, server.engine.tokenizer
    prompt = "The capital of France is Paris"
    answer = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": model, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2}).json()
    entries, ids = answer["choices"][0]["prompt_logprobs"], tokenizer.encode(prompt)
    assert len(entries) == len(ids) and entries[0] is None
    echoed = client.completions.create(model=model, prompt=prompt, max_tokens=1, echo=True, logprobs=2)
    for position, (token_id, entry) in enumerate(zip(ids[1:], entries[1:]), 1):
        assert str(token_id) in entry and entry[str(token_id)]["decoded_token"] == tokenizer.decode([token_id])
        assert entry[str(token_id)]["logprob"] == pytest.approx(echoed.choices[0].logprobs.token_logprobs[position],
                                                                abs=1e-3)
        top = sorted((candidate for candidate in entry.values() if candidate["rank"] is not None),
                     key=lambda candidate: candidate["rank"])
        assert [candidate["rank"] for candidate in top][:2] == [1, 2] and len(entry) in (2, 3)
        assert top[0]["logprob"] >= top[1]["logprob"]
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 1}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 3
    assert client.completions.create(model=model, prompt=prompt, max_tokens=1).choices[0].prompt_logprobs is None


def test_a_request_id_names_the_reply_and_suffix_is_refused(client, server):
    """vLLM's request_id: the reply's id is "cmpl-" / "chatcmpl-" and it, whole or streamed, and two
    requests may give the same one; OpenAI's suffix is a 400, as vLLM answers it."""
    model = server.engine.model_name
    replies = [client.completions.create(model=model, prompt="Hi", max_tokens=2, extra_body={"request_id": "job-7"})
               for _ in range(2)]
    assert [reply.id for reply in replies] == ["cmpl-job-7"] * 2
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                          extra_body={"request_id": "job-7"})
    assert chat.id == "chatcmpl-job-7"
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                            stream=True, extra_body={"request_id": "job-8"})
    assert {chunk.id for chunk in stream} == {"chatcmpl-job-8"}
    assert client.completions.create(model=model, prompt="Hi", max_tokens=2).id.startswith("cmpl-")
    refused = httpx.post(server.url + "/v1/completions", timeout=60,
                         json={"model": model, "prompt": "Hi", "suffix": "!", "max_tokens": 2})
    assert refused.status_code == 400 and "suffix is not currently supported" in refused.text


def test_hermes_tool_calls_are_parsed_in_auto_mode():
    from pagedkv.entrypoints.server.tools import ToolCalling

    tools = ToolCalling.from_request([WEATHER, TIME], "auto")
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
            '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>')
    content, calls, reason = tools.parse(text, "stop")
    assert content.startswith("Let me check.") and reason == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"})]
    assert tools.parse("Just text.", "stop") == ("Just text.", [], "stop")
    assert ToolCalling.from_request([WEATHER], "none") is None


def test_streamed_auto_tool_calls_hold_back_the_tagged_text():
    from pagedkv.outputs import CompletionOutput, RequestOutput
    from pagedkv.entrypoints.server.responses import ReplyOptions, ResponseBuilder
    from pagedkv.entrypoints.server.tools import ToolCalling

    steps = ["Let me", "Let me check. <tool", "Let me check. <tool_call>{\"name\": \"get_wea",
             'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>']

    async def outputs():  # (what is new each step: the server streams delta outputs)
        for step, text in enumerate(steps):
            last = step == len(steps) - 1
            completion = CompletionOutput(index=0, text=text[len(steps[step - 1]) if step else 0:], token_ids=[step],
                                          finish_reason="stop" if last else None)
            yield 0, RequestOutput("r", "p", [1, 2], [completion], finished=last)

    async def collect():
        builder = ResponseBuilder(tokenizer=None, model_name="m")
        tools = ToolCalling.from_request([WEATHER], "auto")
        return [json.loads(chunk[6:]) async for chunk in builder.stream_chunks(
            "r", outputs(), 1, 0, ReplyOptions(chat=True, tools=tools))
            if chunk.startswith("data: {")]

    chunks = asyncio.run(collect())[1:]  # (after the role chunk)
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
    assert "".join(delta.get("content", "") for delta in deltas) == "Let me check. "  # (the text before the tag)
    [call] = deltas[-1]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("chat", [True, False])
def test_a_finished_sample_ends_once_while_the_others_stream(chat):
    """n = 2: sample 0 ends at the first step and stays in its request's later (delta) outputs,
    with nothing new; its finish_reason goes out once."""
    from pagedkv.outputs import CompletionOutput, RequestOutput
    from pagedkv.entrypoints.server.responses import ReplyOptions, ResponseBuilder

    async def outputs():
        for step in range(3):
            first = CompletionOutput(index=0, text="a" if step == 0 else "", token_ids=[1] if step == 0 else [],
                                     finish_reason="length")
            second = CompletionOutput(index=1, text="b", token_ids=[2], finish_reason="stop" if step == 2 else None)
            yield 0, RequestOutput("r", "p", [1, 2], [first, second], finished=step == 2)

    async def collect():
        builder = ResponseBuilder(tokenizer=None, model_name="m")
        return [json.loads(chunk[6:]) async for chunk in builder.stream_chunks(
            "r", outputs(), 1, 0, ReplyOptions(chat=chat, n=2)) if chunk.startswith("data: {")]

    choices = [choice for chunk in asyncio.run(collect()) for choice in chunk["choices"]]
    ends = [(choice["index"], choice["finish_reason"]) for choice in choices if choice["finish_reason"]]
    assert ends == [(0, "length"), (1, "stop")]
    text = "content" if chat else "text"
    assert "".join(c.get("delta", c).get(text) or "" for c in choices if c["index"] == 1) == "bbb"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ],
)
def test_bad_tool_requests_get_400(server, body, param):
    request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
    response = httpx.post(server.url + "/v1/chat/completions", json=request, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_a_batch_with_a_bad_prompt_queues_nothing(server):
    body = {"prompt": ["Hello there", "word " * 600], "max_tokens": 50}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert server.metric("pagedkv_requests_running") == 0 and server.metric("pagedkv_requests_waiting") == 0
    assert server.metric("pagedkv_kv_blocks_used_device") == 0


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "hi", "max_tokens": -3}, "max_tokens"),
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "word " * 600}, "prompt"),
        ({"max_tokens": 3}, "prompt"),
        ({"prompt": [], "max_tokens": 3}, "prompt"),
        ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {"1": 500}}, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"prompt": "hi", "stop_token_ids": [99999999], "min_tokens": 2}, "stop_token_ids"),
        ({"prompt": "hi", "top_k": -7}, "top_k"),
        ({"prompt": "hi", "priority": 2}, "priority"),
        ({"prompt": "hi", "logprob_token_ids": [5]}, "logprob_token_ids"),
        ({"prompt": "hi", "logprobs": 1, "logprob_token_ids": [5], "use_beam_search": True}, "logprob_token_ids"),
        ({"prompt": "hi", "logprobs": 1, "logprob_token_ids": [99999999]}, "logprob_token_ids"),
        ({"prompt": "hi", "logprobs": 1, "logprob_token_ids": list(range(129))}, "logprob_token_ids"),
    ],
)
def test_bad_requests_get_400_with_the_error_json(server, body, param):
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"
    if str(body.get("prompt", "")).startswith("word"):
        assert "max_model_len=512" in error["message"]


def test_missing_and_out_of_vocabulary_prompts_answer_in_vllms_words(server):
    """(vLLM's tests match these messages.)"""
    for body, words in (({"prompt_embeds": []}, "Either prompt or prompt_embeds must be provided and non-empty."),
                        ({}, "Either prompt or prompt_embeds must be provided and non-empty."),
                        ({"prompt": [5, 999999]}, "out of vocabulary")):
        response = httpx.post(server.url + "/v1/completions", json={"max_tokens": 3, **body}, timeout=30)
        assert response.status_code == 400 and words in response.json()["error"]["message"], response.text
        assert response.json()["error"]["param"] == "prompt"


def test_malformed_json_and_unknown_model(server):
    response = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=10,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "error" in response.json()
    response = httpx.post(server.url + "/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=10)
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    assert httpx.get(server.url + "/health").status_code == 200


def test_disconnect_mid_stream_frees_blocks(server):
    # (ignore_eos: the stream is surely still running when the client leaves)
    body = {"prompt": "Count from one to one thousand:", "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"]:
                    # (checked here, connected: leaving the loop closes the connection, as a
                    # client that goes away does)
                    deadline = time.monotonic() + 5  # (the metrics read the engine loop's last stats snapshot)
                    while server.metric("pagedkv_kv_blocks_used_device") == 0:
                        assert time.monotonic() < deadline, "a running stream holds no blocks"
                        time.sleep(0.05)
                    break
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
        # A batch larger than the waiting queue could never be queued at once: not 503 ("retry
        # later") but 400 naming the limit; a batch that fits is served.
        response = httpx.post(live.url + "/v1/completions", timeout=60, json={"prompt": [prompt] * 5, "max_tokens": 2})
        assert response.status_code == 400 and "max_waiting_requests=4" in response.json()["error"]["message"]
        response = httpx.post(live.url + "/v1/completions", timeout=60, json={"prompt": [prompt] * 4, "max_tokens": 2})
        assert response.status_code == 200 and len(response.json()["choices"]) == 4
        for extra in ({}, {"use_beam_search": True}):  # more samples or beams than can ever run together
            response = httpx.post(live.url + "/v1/completions", timeout=60,
                                  json={"prompt": prompt, "max_tokens": 2, "n": 5, **extra})
            assert response.status_code == 400 and response.json()["error"]["param"] == "n"
            assert "max_num_seqs=4" in response.json()["error"]["message"]
    finally:
        live.stop()


def test_health_is_503_once_the_engine_loop_is_gone():
    live = LiveServer(num_device_blocks=32, max_model_len=128)
    try:
        assert httpx.get(live.url + "/health").status_code == 200
        live.engine_loop.stop()
        response = httpx.get(live.url + "/health")
        assert response.status_code == 503
        refused = httpx.post(live.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert refused.status_code == 503 and "stopped" in refused.json()["error"]["message"]
    finally:
        live.stop()


def test_a_custom_chat_template_renders_the_messages():
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
    live = LiveServer(chat_template=template, num_device_blocks=32, max_model_len=128)
    try:
        messages = [{"role": "user", "content": "Name a fruit."}]
        body = httpx.post(live.url + "/tokenize", json={"messages": messages}, timeout=30).json()
        assert body["tokens"] == live.engine.tokenizer.encode("[user] Name a fruit.\n[assistant] ")
        reply = httpx.post(live.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 3}, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == body["count"]
    finally:
        live.stop()


def test_an_api_key_guards_the_v1_routes():
    live = LiveServer(api_key="s3cret", num_device_blocks=32, max_model_len=128)
    try:
        body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            response = httpx.post(live.url + "/v1/completions", json=body, headers=headers, timeout=30)
            assert response.status_code == 401, headers
            assert response.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(live.url + "/v1/models", timeout=10).status_code == 401
        for probe in ("/health", "/ping"):  # probes need no key
            assert httpx.get(live.url + probe, timeout=10).status_code == 200
        for path, json_body in (("/tokenize", {"prompt": "Hello"}), ("/detokenize", {"tokens": [1, 2]}),
                                ("/classify", {"input": "Hello"}), ("/invocations", {"prompt": "Hi", "max_tokens": 1})):
            # (every other route asks for the key)
            assert httpx.post(live.url + path, json=json_body, timeout=10).status_code == 401, path
            response = httpx.post(live.url + path, json=json_body, headers={"Authorization": "Bearer s3cret"}, timeout=30)
            assert response.status_code != 401, path
        assert httpx.get(live.url + "/metrics", timeout=10).status_code == 401
        with pytest.raises(InvalidConfigError, match="api_key must be a non-empty string"):
            create_app(live.engine, api_key="")  # (PAGEDKV_API_KEY="" once served with no authentication)
        assert httpx.post(live.url + "/reset_prefix_cache", timeout=10).status_code == 401
        response = httpx.post(live.url + "/reset_prefix_cache", headers={"Authorization": "Bearer s3cret"}, timeout=30)
        assert response.status_code == 200 and response.json() == {"status": "ok"}
        client = OpenAI(base_url=live.url + "/v1", api_key="s3cret", timeout=60, max_retries=0)
        assert len(client.completions.create(model=client.models.list().data[0].id, **body).choices[0].text) > 0
        assert live.metric("pagedkv_kv_blocks_used_device") == 0
    finally:
        live.stop()


def test_priority_field_reaches_the_scheduler():
    live = LiveServer(scheduling_policy="priority", num_device_blocks=32, max_model_len=128)
    try:
        body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0}
        plain = httpx.post(live.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        for priority in (-5, 7):
            response = httpx.post(live.url + "/v1/completions", json={**body, "priority": priority}, timeout=60)
            assert response.status_code == 200 and response.json()["choices"][0]["text"] == plain
        response = httpx.post(live.url + "/v1/completions", json={**body, "priority": "high"}, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == "priority"
    finally:
        live.stop()


def test_embeddings_endpoint(client, server, smollm2_hf_model):
    import base64
    import struct

    import torch

    model = client.models.list().data[0].id
    texts = ["Hello", "Paging is how the KV cache grows."]
    result = client.embeddings.create(model=model, input=texts)
    assert [item.index for item in result.data] == [0, 1]
    assert result.usage.prompt_tokens == sum(len(tokenize(server, text)) for text in texts)
    for text, item in zip(texts, result.data):
        with torch.inference_mode():
            hidden = smollm2_hf_model.model(torch.tensor([tokenize(server, text)])).last_hidden_state[0, -1]
        expected = torch.nn.functional.normalize(hidden.float(), dim=-1)
        torch.testing.assert_close(torch.tensor(item.embedding), expected, atol=1e-4, rtol=1e-3)
    body = {"input": tokenize(server, texts[1]), "encoding_format": "base64"}
    encoded = httpx.post(server.url + "/v1/embeddings", json=body, timeout=60).json()["data"][0]["embedding"]
    raw = base64.b64decode(encoded)
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(result.data[1].embedding, abs=1e-6)
    for bad, param in (({"input": []}, "input"), ({"input": "hi", "dimensions": 7}, "dimensions"),
                       ({"input": "word " * 600}, "input")):
        response = httpx.post(server.url + "/v1/embeddings", json=bad, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, bad
    assert server.metric("pagedkv_kv_blocks_used_device") == 0


def test_cohere_v2_embed_gives_the_embeddings_in_each_type_asked_for(client, server):
    import base64
    import struct

    import numpy as np

    texts = ["Hello", "Paging is how the KV cache grows."]
    reference = [item.embedding for item in client.embeddings.create(model=server.engine.model_name, input=texts).data]
    body = {"texts": texts, "embedding_types": ["float", "binary", "ubinary", "base64"]}
    answer = httpx.post(server.url + "/v2/embed", json=body, timeout=60).json()
    typed = answer["embeddings"]
    assert answer["response_type"] == "embeddings_by_type" and answer["texts"] == texts
    assert answer["meta"]["billed_units"]["input_tokens"] == sum(len(tokenize(server, text)) for text in texts)
    assert np.allclose(typed["float"], reference, atol=1e-6)
    bits = [np.unpackbits(np.array(row, dtype=np.uint8)).tolist() for row in typed["ubinary"]]
    assert bits == [[int(value >= 0) for value in vector] for vector in reference]
    assert [[value + 128 for value in row] for row in typed["binary"]] == typed["ubinary"]
    raw = base64.b64decode(typed["base64"][1])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(reference[1], abs=1e-6)
    inputs = {"inputs": [{"content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}]}
    assert httpx.post(server.url + "/v2/embed", json=inputs, timeout=60).json()["embeddings"]["float"][0] == \
        pytest.approx(reference[0], abs=1e-6)
    long_text = "word " * 600
    cut = httpx.post(server.url + "/v2/embed", json={"texts": [long_text]}, timeout=60).json()
    assert cut["meta"]["billed_units"]["input_tokens"] == 512  # (truncate END: cut to max_model_len)
    for bad, param in (({"texts": [long_text], "truncate": "NONE"}, "texts"), ({"texts": []}, "body"),
                       ({"texts": ["a"], "images": ["b"]}, "body"), ({"images": ["x"]}, "images"),
                       ({"texts": ["a"], "output_dimension": 7}, "output_dimension")):
        response = httpx.post(server.url + "/v2/embed", json=bad, timeout=60)
        assert response.status_code == 400, (bad, response.text)
    assert server.metric("pagedkv_kv_blocks_used_device") == 0


def test_truncation_allowed_tokens_and_bad_words_fields(server):
    body = {"prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": 4, "temperature": 0}
    response = httpx.post(server.url + "/v1/completions", json={**body, "truncate_prompt_tokens": 3}, timeout=60).json()
    assert response["usage"]["prompt_tokens"] == 3
    # (vLLM's truncation_side: which end is cut; token ids come back with return_token_ids)
    ids = {"prompt": list(range(10, 18)), "max_tokens": 1, "truncate_prompt_tokens": 4, "return_token_ids": True}
    for side, kept in (("left", list(range(14, 18))), ("right", list(range(10, 14))), (None, list(range(14, 18)))):
        answer = httpx.post(server.url + "/v1/completions", json={**ids, "truncation_side": side}, timeout=60).json()
        assert answer["choices"][0]["prompt_token_ids"] == kept, (side, answer)
    allowed = server.engine.tokenizer.encode(" yes no", add_special_tokens=False)
    response = httpx.post(server.url + "/v1/completions", json={**body, "allowed_token_ids": allowed}, timeout=60)
    text = response.json()["choices"][0]["text"]
    assert set(server.engine.tokenizer.encode(text, add_special_tokens=False)) <= set(allowed)
    response = httpx.post(server.url + "/v1/completions", json={**body, "bad_words": [""]}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "bad_words"


def test_a_stopped_server_lets_its_engine_go():
    """Nothing keeps a finished app's engine alive (FastAPI caches route functions, whose
    closures would otherwise hold it): tests and embedding stacks build many apps per process."""
    import gc
    import weakref

    live = LiveServer(num_device_blocks=16, max_model_len=64)
    httpx.post(live.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    engine = weakref.ref(live.engine)
    live.stop()
    del live
    gc.collect()
    assert engine() is None
