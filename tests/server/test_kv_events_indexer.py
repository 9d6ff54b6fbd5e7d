"""The outside consumer, unchanged: NVIDIA Dynamo's standalone KV indexer (`python -m dynamo.indexer`,
from the ai-dynamo-runtime wheel) subscribed to live `pagedkv serve --kv-events-endpoint ...`
servers. Before each request, the indexer's overlap for its prompt equals what the server then
reports as cached for it (usage.prompt_tokens_details.cached_tokens), through shared prefixes,
eviction from a small pool into the CPU tier, aborts and a reset; and a 20-line router that sends
each request to the worker with the larger overlap hits the cache more than round-robin."""

import contextlib
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from support.live_server import served

pytest.importorskip("dynamo.indexer", reason="ai-dynamo-runtime (the test extra) is not installed")
pytest.importorskip("zmq")

BLOCK_SIZE = 16


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def indexer(workers: dict[int, int]):
    """Dynamo's indexer subscribed to each worker's KV event port; yields a query function."""
    port = free_port()
    spec = ",".join(f"{worker}=tcp://127.0.0.1:{event_port}" for worker, event_port in workers.items())
    process = subprocess.Popen(
        [sys.executable, "-m", "dynamo.indexer", "--block-size", str(BLOCK_SIZE), "--port", str(port),
         "--workers", spec, "--threads", "1"],
        env={**os.environ, "RUST_LOG": "warn"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/query"

    def overlap(token_ids: list[int]) -> dict[int, int]:
        """Each worker's cached prefix of `token_ids` in tokens, once the index has settled."""
        last, stable_since = None, time.monotonic()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            scores = httpx.post(url, json={"token_ids": token_ids, "model_name": "default"}, timeout=5).json()["scores"]
            answer = {worker: scores.get(str(worker), {}).get("0", 0) for worker in workers}
            if answer != last:
                last, stable_since = answer, time.monotonic()
            elif time.monotonic() - stable_since > 0.15:
                return answer
            time.sleep(0.05)
        return last

    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, "the indexer exited"
            assert time.monotonic() < deadline, "the indexer did not come up"
            try:
                httpx.post(url, json={"token_ids": [1], "model_name": "default"}, timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.2)
        yield overlap
    finally:
        process.kill()
        process.wait()


def kv_server_flags(event_port: int, *extra: str) -> list[str]:
    return ["--kv-events-endpoint", f"tcp://*:{event_port}", "--kv-events-replay-endpoint", f"tcp://*:{free_port()}",
            "--block-size", str(BLOCK_SIZE), "--enable-prompt-tokens-details", *extra]


def start_together(stack: contextlib.ExitStack, servers: dict) -> dict:
    """Enters the `served` contexts at once (each start loads a model: seconds); their exits go on
    `stack`, also when one fails to start. Returns each one's URL."""
    with ThreadPoolExecutor(len(servers)) as pool:
        starts = {worker: pool.submit(server.__enter__) for worker, server in servers.items()}
    urls, failure = {}, None
    for worker, start in starts.items():
        try:
            urls[worker] = start.result()[0]
            stack.push(servers[worker].__exit__)
        except Exception as error:
            failure = failure or error
    if failure is not None:
        raise failure
    return urls


def complete(url: str, prompt: list[int]) -> int:
    """Sends a prompt (token ids); returns the tokens the server says its prefix cache served."""
    reply = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0},
                       timeout=120)
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    assert usage["prompt_tokens"] == len(prompt)
    return usage["prompt_tokens_details"]["cached_tokens"]


def wait_idle(url: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        metrics = httpx.get(url + "/metrics", timeout=5).text
        busy = [line for line in metrics.splitlines()
                if line.startswith(("pagedkv_requests_running ", "pagedkv_requests_waiting ")) and float(line.split()[1])]
        if not busy:
            return
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.05)


def family_prompt(family: int, request: int, length: int = 53) -> list[int]:
    """A 40-token prefix shared by the family, then tokens of this request (never a multiple of
    the block size long: a full last block is never served from the cache, by either count)."""
    shared = [1000 + 97 * family + i for i in range(40)]
    return shared + [5000 + 31 * request + 7 * family + i for i in range(length - 40)]


def test_the_indexer_sees_exactly_what_one_server_serves_from_its_cache():
    event_port = free_port()
    # 20 device blocks: long prompts evict; a CPU tier of about 10 blocks takes what is evicted.
    flags = kv_server_flags(event_port, "--num-device-blocks", "20", "--max-model-len", "300",
                            "--enable-cpu-prefix-cache", "--swap-space-bytes", str(4 << 20), "--max-num-seqs", "4")
    with served(*flags) as (url, _, _), indexer({1: event_port}) as overlap:
        trace = []
        for round_ in range(3):
            for family in range(3):
                trace.append(("complete", family_prompt(family, round_)))
            trace.append(("complete", family_prompt(9 + round_, 0, length=150)))  # evicts most of the pool
            trace.append(("abort", family_prompt(round_, 50)))
        trace.insert(8, ("reset", None))
        checked = hits = 0
        for kind, prompt in trace:
            wait_idle(url)
            if kind == "reset":
                assert httpx.post(url + "/reset_prefix_cache", timeout=10).status_code == 200
                continue
            expected = overlap(prompt)[1]
            if kind == "abort":
                with httpx.stream("POST", url + "/v1/completions", timeout=60,
                                  json={"prompt": prompt, "max_tokens": 200, "stream": True}) as stream:
                    next(stream.iter_lines())  # (then the connection closes: the request is aborted)
                continue
            cached = complete(url, prompt)
            assert cached == expected, f"{kind} of {len(prompt)} tokens: indexer {expected}, server {cached}"
            checked += 1
            hits += cached > 0
        stats = httpx.get(url + "/metrics", timeout=5).text
        assert checked == 12 and hits >= 4, (checked, hits)
        offloaded = [line for line in stats.splitlines() if 'direction="offloaded"' in line]
        assert offloaded and float(offloaded[0].split()[-1]) > 0, "the trace never reached the CPU tier"


def test_a_router_by_indexer_overlap_beats_round_robin():
    ports = {1: free_port(), 2: free_port()}
    with contextlib.ExitStack() as stack:
        urls = start_together(stack, {worker: served(*kv_server_flags(port)) for worker, port in ports.items()})
        overlap = stack.enter_context(indexer(ports))
        # Three families in turn: round-robin sends each family to both servers, alternately.
        trace = [family_prompt(family, request) for request in range(8) for family in range(3)]
        total = sum(len(prompt) for prompt in trace)

        def run(choose) -> float:
            for url in urls.values():
                wait_idle(url)
                assert httpx.post(url + "/reset_prefix_cache", timeout=10).status_code == 200
            cached = sum(complete(urls[choose(index, prompt)], prompt) for index, prompt in enumerate(trace))
            return cached / total

        def kv_aware(index: int, prompt: list[int]) -> int:
            scores = overlap(prompt)
            best = max(scores.values())
            candidates = [worker for worker, score in scores.items() if score == best]
            return candidates[index % len(candidates)]

        round_robin_rate = run(lambda index, prompt: 1 + index % 2)
        kv_aware_rate = run(kv_aware)
        print(f"\nprefix-cache hit rate over {len(trace)} requests, 2 servers: round-robin {round_robin_rate:.3f}, "
              f"by Dynamo indexer overlap {kv_aware_rate:.3f}")
        assert kv_aware_rate > round_robin_rate
