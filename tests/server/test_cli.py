"""The command line: --help documents every engine option; serve shuts down cleanly on SIGTERM."""

import dataclasses
import json
import signal
import threading
import time

import httpx
import pytest

from pagedkv.entrypoints.cli import build_parser, main
from pagedkv.config import EngineConfig
from support.live_server import served


def test_help_documents_every_engine_option_with_its_default():
    for command in ("serve", "generate"):
        subparser = build_parser()._subparsers._group_actions[0].choices[command]
        text = subparser.format_help()
        for field in dataclasses.fields(EngineConfig):
            flag = "--" + field.name.replace("_", "-")
            assert flag in text, flag
        assert "(default: 16)" in text and "(default: auto)" in text


def test_max_logprobs_flag_reaches_the_engine_config():
    from pagedkv.entrypoints.cli import engine_config

    for given, expected in ((None, 20), ("5", 5), ("-1", -1)):  # (vLLM's default; -1: the vocabulary size)
        flags = ["serve"] + (["--max-logprobs", given] if given is not None else [])
        assert engine_config(build_parser().parse_args(flags)).max_logprobs == expected


def test_generate_prints_generations(capsys):
    from pagedkv.entrypoints.cli import main

    assert main(["generate", "The sky is", "--max-tokens", "4", "--num-device-blocks", "64"]) == 0
    out = capsys.readouterr().out
    assert ">>> The sky is" in out and "generated tokens" in out


def test_generate_with_a_json_schema_file(capsys, tmp_path):
    from pagedkv.entrypoints.cli import main

    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"color": {"type": "string", "maxLength": 12}}, "required": ["color"]}')
    assert main(["generate", "Name a color in JSON:", "--max-tokens", "24", "--num-device-blocks", "64",
                 "--json-schema", str(schema)]) == 0
    line = capsys.readouterr().out.split(">>> Name a color in JSON:\n", 1)[1].splitlines()[0]
    assert list(json.loads(line)) == ["color"]


def test_serve_answers_and_exits_zero_on_sigterm():
    with served() as (url, process, _):
        response = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=60)
        assert response.status_code == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0


def test_sigterm_drains_then_ends_streams_with_abort_and_answers_the_rest_503():
    """Requests that finish within --shutdown-grace-seconds are answered; after it, a stream ends
    with finish_reason "abort" and [DONE], a non-streamed request gets an error; no tracebacks."""
    headers = {"Authorization": "Bearer k"}
    with served("--shutdown-grace-seconds", "2", env={"PAGEDKV_API_KEY": "k"}) as (url, process, output):
        body = {"prompt": "Count to a thousand:", "max_tokens": 400, "ignore_eos": True}
        answers = {}

        def post(name: str, request_body: dict) -> None:
            answers[name] = httpx.post(url + "/v1/completions", json=request_body, headers=headers, timeout=60)

        whole = threading.Thread(target=post, args=("whole", body))
        short = threading.Thread(target=post, args=("short", {**body, "max_tokens": 4}))
        whole.start()
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, headers=headers,
                          timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            short.start()
            time.sleep(0.2)
            process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        whole.join(60)
        short.join(60)
        assert process.wait(timeout=60) == 0
        output.seek(0)
        log = output.read()
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "abort"
    assert answers["short"].status_code == 200
    assert answers["whole"].status_code == 503 and answers["whole"].json()["error"]["code"] == "shutting_down"
    assert "Traceback" not in log, log


def test_an_empty_api_key_is_a_configuration_error(capsys, monkeypatch):
    monkeypatch.setenv("PAGEDKV_API_KEY", "")
    assert main(["serve", "--num-device-blocks", "16"]) == 2
    assert "api_key must be a non-empty string" in capsys.readouterr().err


@pytest.mark.parametrize("text, expected", [
    ("sql=/adapters/sql", ("sql", "/adapters/sql")),
    ('{"name": "sql", "path": "/adapters/sql"}', ("sql", {"path": "/adapters/sql", "base_model_name": None})),
    ('{"name": "sql", "path": "/a", "base_model_name": "llama"}', ("sql", {"path": "/a", "base_model_name": "llama"})),
])
def test_lora_modules_take_vllms_two_forms(text, expected):
    from pagedkv.entrypoints.cli import parse_lora_module

    assert parse_lora_module(text) == expected


@pytest.mark.parametrize("text", ["sql", "=/a", '{"name": "sql"}', '{"name": "sql", "path": 3}', "{not json",
                                  '{"name": "s", "path": "/a", "base_model_name": 1}'])
def test_a_bad_lora_module_is_refused_by_name(text):
    from pagedkv.entrypoints.cli import parse_lora_module

    with pytest.raises(ValueError, match="--lora-modules"):
        parse_lora_module(text)


@pytest.mark.parametrize("flags", [
    ["--structured-outputs-config.backend", "xgrammar"], ["--structured-outputs-config", '{"backend": "auto"}'],
    ["--trust-remote-code", "--disable-log-stats", "--disable-log-requests", "--show-hidden-metrics-for-version",
     "0.32"],
])
def test_vllm_flags_without_effect_here_are_accepted(flags):
    from pagedkv.entrypoints.cli import build_parser

    assert build_parser().parse_args(["serve", *flags]).structured_outputs_backend == "xgrammar"


@pytest.mark.parametrize("flags, in_reasoning", [
    ([], False), (["--structured-outputs-config", '{"backend": "auto", "enable_in_reasoning": true}'], True),
    (["--structured-outputs-config", '{"enable_in_reasoning": false}'], False),
    (["--structured-outputs-config.enable_in_reasoning"], True),
])
def test_vllms_enable_in_reasoning_is_read(flags, in_reasoning):
    from pagedkv.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", *flags])
    assert (args.structured_outputs_config.get("enable_in_reasoning", False) or args.structured_outputs_in_reasoning) \
        is in_reasoning


@pytest.mark.parametrize("value", ["guidance", '{"backend": "outlines"}', "{bad", '{"enable_in_reasoning": "yes"}',
                                   "[1]"])
def test_a_structured_outputs_backend_other_than_xgrammar_is_refused(value, capsys):
    from pagedkv.entrypoints.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--structured-outputs-config", value])
    assert "structured-outputs-config" in capsys.readouterr().err


def test_serve_on_a_unix_socket_behind_a_root_path(tmp_path):
    """--uds: the server answers on a Unix socket, not on host and port; --root-path: routes answer
    with the prefix and without it (a proxy may strip it or not, as vLLM's), /openapi.json names
    it, and /health needs no key under either; vLLM's $VLLM_API_KEY sets the key;
    --request-header-timeout: a request head that stops arriving gets 408 and its connection closes."""
    import os
    import socket
    import subprocess
    import sys

    path = str(tmp_path / "pagedkv.sock")
    process = subprocess.Popen([sys.executable, "-m", "pagedkv.entrypoints.cli", "serve", "--uds", path, "--root-path", "/behind/proxy",
                                "--num-device-blocks", "32", "--max-model-len", "128", "--request-header-timeout", "1"],
                               env={**os.environ, "PYTHONUNBUFFERED": "1", "VLLM_API_KEY": "k"}, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=path), base_url="http://pagedkv", timeout=60) as client:
            deadline = time.monotonic() + 180
            while True:
                assert process.poll() is None and time.monotonic() < deadline, "server did not come up"
                try:
                    if os.path.exists(path) and client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
            assert client.get("/behind/proxy/health").status_code == 200
            key = {"Authorization": "Bearer k"}
            for prefix in ("", "/behind/proxy"):
                assert client.get(prefix + "/v1/models").status_code == 401
                answer = client.post(prefix + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=key)
                assert answer.json()["usage"]["completion_tokens"] >= 1
            assert client.get("/openapi.json", headers=key).json()["servers"] == [{"url": "/behind/proxy"}]
        with socket.socket(socket.AF_UNIX) as connection:
            connection.connect(path)
            connection.settimeout(30)
            started = time.monotonic()
            connection.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # (the head never ends)
            received = b""
            while chunk := connection.recv(4096):
                received += chunk
            assert received.startswith(b"HTTP/1.1 408") and time.monotonic() - started < 10
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
