"""Servers for tests: `LiveServer` (the app in this process, on a free port) and `served`
(`pagedkv serve` in a subprocess)."""

import contextlib
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

import httpx
import uvicorn

from pagedkv.config import EngineConfig
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.entrypoints.server import create_app


class LiveServer:
    def __init__(self, chat_template=None, api_key=None, lora_modules=None, allow_runtime_lora_updating=False,
                 reasoning_parser=None, tool_call_parser="hermes", app_options=None, **engine_options):
        self.engine = LLMEngine(EngineConfig(dtype="float32", **engine_options))
        self.api_key = api_key
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        config = uvicorn.Config(create_app(self.engine, chat_template=chat_template, api_key=api_key, lora_modules=lora_modules,
                                           allow_runtime_lora_updating=allow_runtime_lora_updating,
                                           reasoning_parser=reasoning_parser, tool_call_parser=tool_call_parser,
                                           **(app_options or {})),
                                host="127.0.0.1", port=self.port, log_level="warning")
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

    @property
    def engine_loop(self):
        """The engine loop the app's AsyncLLM drives (tests hold it, stop it, read its queues)."""
        return self.server.config.app.state.serving.client._loop

    def metric(self, name: str) -> float:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        text = httpx.get(self.url + "/metrics", headers=headers, timeout=10).text
        return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


@contextlib.contextmanager
def served(*flags: str, env: Optional[dict] = None):
    """`pagedkv serve` (the embedded SmolLM2) in a subprocess on a free port: yields (its URL, the
    process, its output file) once /health answers; kills it if it is still running after."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryFile("w+") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "pagedkv.entrypoints.cli", "serve", "--port", str(port), "--num-device-blocks", "64",
             "--max-model-len", "512", *flags],
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, stdout=output, stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                assert process.poll() is None, "server exited early"
                assert time.monotonic() < deadline, "server did not come up"
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.5)
            yield url, process, output
        finally:
            if process.poll() is None:
                process.kill()
