"""Resident memory of `pagedkv serve` (the embedded SmolLM2) over rounds of concurrent streamed chat
requests: does it creep (a leak) or level off? Prints the server's RSS after start-up and after
each round, with each round's time and its non-200 answers.

    python benches/server_rss.py [--rounds 8] [--streams 300] [--max-tokens 8]
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import sys
import time

import httpx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from support.live_server import served  # noqa: E402


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 1e6


async def one_stream(client: httpx.AsyncClient, url: str, model: str, index: int, max_tokens: int):
    body = {"model": model, "messages": [{"role": "user", "content": f"Say something about {index}."}],
            "max_tokens": max_tokens, "stream": True, "temperature": 1.0}
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as answer:
            async for _ in answer.aiter_lines():
                pass
        return answer.status_code
    except httpx.HTTPError as error:
        return type(error).__name__


async def one_round(url: str, streams: int, max_tokens: int) -> list:
    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits) as client:
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        return await asyncio.gather(*(one_stream(client, url, model, i, max_tokens) for i in range(streams)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--streams", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    with served("--max-num-seqs", "64") as (url, process, _):
        print(f"{args.streams} streams a round, max_tokens {args.max_tokens}; server RSS after start-up "
              f"{rss_mb(process.pid):.0f} MB", flush=True)
        for number in range(1, args.rounds + 1):
            started = time.monotonic()
            codes = asyncio.run(one_round(url, args.streams, args.max_tokens))
            failed = [code for code in codes if code != 200]
            print(f"round {number}: {time.monotonic() - started:.0f} s, {len(failed)} not 200 "
                  f"{sorted(set(map(str, failed))) if failed else ''}, RSS {rss_mb(process.pid):.0f} MB", flush=True)


if __name__ == "__main__":
    main()
