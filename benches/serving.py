"""Online serving: requests arrive over HTTP (Poisson arrivals at a given rate) and stream their
tokens from the OpenAI-compatible server; prints, per rate, request and token throughput,
time to first token, inter-token latency and end-to-end latency (median and p99, as vLLM's
benchmark_serving reports them).

The ceiling is measured in the same run on the same engine: as many requests of the same
lengths submitted all at once to `LLMEngine` directly (no HTTP, no streaming, no arrival
gaps). At the infinite rate the server's throughput as a % of that ceiling is the cost of
serving. Every run draws prompts of its own, so none is served from the prefix cache.

    python benches/serving.py                          # 48 prompts x 64 tokens, rates 1, 2, 4, inf req/s
    python benches/serving.py --rates 0.5,inf --num-prompts 100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from throughput import make_prompts  # noqa: E402  (benches/ is not a package)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))] if ordered else float("nan")


def offline_ceiling(engine, prompts, max_tokens) -> float:
    """Output tokens/s of the engine alone on the same requests, all queued at once."""
    from pagedkv import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind="final_only")
    for index, prompt in enumerate(prompts):
        engine.add_request(f"ceiling-{index}", prompt, params)
    started, generated = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            generated += len(output.outputs[0].token_ids) if output.finished else 0
    return generated / (time.perf_counter() - started)


class Server:
    def __init__(self, engine):
        import uvicorn

        from pagedkv.entrypoints.server import create_app

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        config = uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port}/v1/completions"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


async def one_request(http, url, prompt, max_tokens, delay) -> dict:
    await asyncio.sleep(delay)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    chunk_times, tokens = [], 0
    async with http.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            if payload.get("usage"):
                tokens = payload["usage"]["completion_tokens"]
            elif payload["choices"] and payload["choices"][0]["text"]:
                chunk_times.append(time.perf_counter())
    done = time.perf_counter()
    return {"ttft": chunk_times[0] - sent, "gaps": [b - a for a, b in zip(chunk_times, chunk_times[1:])],
            "e2e": done - sent, "tokens": tokens, "sent": sent, "done": done}


async def run_rate(url, prompts, max_tokens, rate, seed) -> dict:
    import httpx

    rng = random.Random(seed)
    delays, clock = [], 0.0
    for _ in prompts:
        delays.append(clock)
        clock += rng.expovariate(rate) if rate != float("inf") else 0.0
    limits = httpx.Limits(max_connections=len(prompts) + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        results = await asyncio.gather(*(one_request(http, url, p, max_tokens, d) for p, d in zip(prompts, delays)))
    elapsed = max(r["done"] for r in results) - min(r["sent"] for r in results)
    gaps = [gap for r in results for gap in r["gaps"]]
    return {
        "requests_per_s": len(results) / elapsed,
        "tokens_per_s": sum(r["tokens"] for r in results) / elapsed,
        "ttft": [r["ttft"] for r in results],
        "itl": gaps,
        "e2e": [r["e2e"] for r in results],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rates", default="1,2,4,inf", help="request rates (requests/s), comma-separated")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from pagedkv import SamplingParams
    from pagedkv.config import EngineConfig
    from pagedkv.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(device=args.device, dtype=args.dtype, max_model_len=1024,
                                    kv_cache_memory_bytes=1 << 30))

    def prompts(run: int) -> list[str]:
        # Each run gets prompts of its own (same length distribution): repeating one run's prompts
        # would let the next one skip its prefills through the prefix cache.
        ids = make_prompts(engine.tokenizer, args.num_prompts, seed=args.seed * 1000 + run)
        return [engine.tokenizer.decode(prompt) for prompt in ids]

    warm_up = SamplingParams(temperature=0, max_tokens=4)
    for index, prompt in enumerate(prompts(0)[:4]):
        engine.add_request(f"warm-up-{index}", prompt, warm_up)
    while engine.has_unfinished_requests():
        engine.step()
    ceiling = offline_ceiling(engine, prompts(1), args.max_tokens)

    rates = [float(rate) for rate in args.rates.split(",")]
    server = Server(engine)
    rows = []
    try:
        for run, rate in enumerate(rates, start=2):
            rows.append((rate, asyncio.run(run_rate(server.url, prompts(run), args.max_tokens, rate, args.seed))))
    finally:
        server.stop()

    print(f"\n{args.num_prompts} prompts x {args.max_tokens} tokens, {engine.model_name}, {args.device}, "
          f"dtype {engine.runner.dtype}, threads {__import__('torch').get_num_threads()}; "
          f"engine-only ceiling {ceiling:.1f} tokens/s (same requests, all queued at once)\n")
    print("| rate (req/s) | req/s | tokens/s | % of ceiling | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) "
          "| ITL p99 (ms) | E2E p50 (s) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for rate, r in rows:
        print(f"| {rate:g} | {r['requests_per_s']:.2f} | {r['tokens_per_s']:.1f} | {100 * r['tokens_per_s'] / ceiling:.0f}% "
              f"| {1e3 * statistics.median(r['ttft']):.0f} | {1e3 * percentile(r['ttft'], 99):.0f} "
              f"| {1e3 * statistics.median(r['itl']):.1f} | {1e3 * percentile(r['itl'], 99):.1f} "
              f"| {statistics.median(r['e2e']):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
