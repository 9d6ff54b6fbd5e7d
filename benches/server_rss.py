"""Resident memory of `pagedkv serve` over rounds of concurrent streams: whether it plateaus
(an outside retest saw 1.7 -> 2.3 GB over three rounds of 300 streams and asked).

    python benches/server_rss.py [--rounds 6] [--streams 300] [--max-tokens 32] [-- serve options]

Starts the server on the embedded model, sends each round's streams at once (sampled, distinct
prompts) and prints the server's RSS after start and after each round."""

import argparse
import asyncio
import re
import subprocess
import time

import httpx


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return int(re.search(r"VmRSS:\s+(\d+)", status.read()).group(1)) / 1024


async def stream(client: httpx.AsyncClient, url: str, index: int, max_tokens: int) -> None:
    body = {"prompt": f"Story {index}: once upon a time", "max_tokens": max_tokens, "stream": True, "temperature": 0.8}
    async with client.stream("POST", url + "/v1/completions", json=body) as answer:
        async for _ in answer.aiter_lines():
            pass


async def rounds(server: subprocess.Popen, url: str, args) -> None:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=args.streams + 10)) as client:
        deadline = time.monotonic() + 300
        while True:
            try:
                if (await client.get(url + "/health")).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not start")
            await asyncio.sleep(0.5)
        print(f"after start: RSS {rss_mb(server.pid):.0f} MB", flush=True)
        for number in range(1, args.rounds + 1):
            started = time.monotonic()
            await asyncio.gather(*(stream(client, url, i, args.max_tokens) for i in range(args.streams)))
            print(f"round {number}: {args.streams} streams in {time.monotonic() - started:.0f} s, "
                  f"RSS {rss_mb(server.pid):.0f} MB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--streams", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--port", type=int, default=8931)
    parser.add_argument("serve_options", nargs="*")
    args = parser.parse_args()
    server = subprocess.Popen(["pagedkv", "serve", "--port", str(args.port), *args.serve_options],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        asyncio.run(rounds(server, f"http://127.0.0.1:{args.port}", args))
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
