"""The command line: --help documents every engine option; serve shuts down cleanly on SIGTERM."""

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from pagedkv.cli import build_parser
from pagedkv.config import EngineConfig


def test_help_documents_every_engine_option_with_its_default():
    for command in ("serve", "generate"):
        subparser = build_parser()._subparsers._group_actions[0].choices[command]
        text = subparser.format_help()
        for field in dataclasses.fields(EngineConfig):
            flag = "--" + field.name.replace("_", "-")
            assert flag in text, flag
        assert "(default: 16)" in text and "(default: auto)" in text


def test_generate_prints_generations(capsys):
    from pagedkv.cli import main

    assert main(["generate", "The sky is", "--max-tokens", "4", "--num-device-blocks", "64"]) == 0
    out = capsys.readouterr().out
    assert ">>> The sky is" in out and "generated tokens" in out


def test_generate_with_a_json_schema_file(capsys, tmp_path):
    from pagedkv.cli import main

    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"color": {"type": "string", "maxLength": 12}}, "required": ["color"]}')
    assert main(["generate", "Name a color in JSON:", "--max-tokens", "24", "--num-device-blocks", "64",
                 "--json-schema", str(schema)]) == 0
    line = capsys.readouterr().out.split(">>> Name a color in JSON:\n", 1)[1].splitlines()[0]
    assert list(json.loads(line)) == ["color"]


def test_serve_answers_and_exits_zero_on_sigterm():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "pagedkv.cli", "serve", "--port", str(port), "--num-device-blocks", "64",
         "--max-model-len", "256"],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, "server exited early"
            assert time.monotonic() < deadline, "server did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                              json={"prompt": "Hi", "max_tokens": 3}, timeout=60)
        assert response.status_code == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
