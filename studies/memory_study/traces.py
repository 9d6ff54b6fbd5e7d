"""Seeded synthetic request traces: log-normal lengths with the paper's dataset means, Poisson arrivals."""

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

VOCAB_SIZE = 32000


@dataclass(frozen=True)
class TraceShape:
    """Length distributions and offered load of one synthetic dataset."""

    name: str
    mean_prompt_len: float
    mean_output_len: float
    prompt_sigma: float
    """Log-normal shape: larger means a heavier tail."""
    output_sigma: float
    requests_per_step: float
    """Poisson arrival rate; above what any system completes, so the queue never drains."""


# Means from the paper's Figure 11 (ShareGPT: 161.31 / 337.99, Alpaca: 19.31 / 58.45 tokens). The
# shapes are ours, narrow enough that redrawing the requests over max_model_len=2048 keeps the means.
SHAREGPT = TraceShape("ShareGPT", 161.31, 337.99, prompt_sigma=0.8, output_sigma=0.7, requests_per_step=0.3)
ALPACA = TraceShape("Alpaca", 19.31, 58.45, prompt_sigma=0.6, output_sigma=0.7, requests_per_step=8.0)


@dataclass(frozen=True)
class Request:
    """One request of a trace. Its final length (KV states it ever holds) is prompt + output."""

    request_id: str
    arrival_step: int
    prompt_token_ids: tuple[int, ...]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def final_len(self) -> int:
        return self.prompt_len + self.output_len


def lognormal_length(rng: random.Random, mean: float, sigma: float) -> int:
    """A positive integer length whose distribution has (before rounding) the given mean."""
    mu = math.log(mean) - sigma * sigma / 2
    return max(1, round(rng.lognormvariate(mu, sigma)))


def sample_lengths(rng: random.Random, shape: TraceShape, max_model_len: int) -> tuple[int, int]:
    """(prompt_len, output_len), redrawn until the request fits max_model_len."""
    while True:
        prompt_len = lognormal_length(rng, shape.mean_prompt_len, shape.prompt_sigma)
        output_len = lognormal_length(rng, shape.mean_output_len, shape.output_sigma)
        if prompt_len + output_len <= max_model_len:
            return prompt_len, output_len


def make_trace(shape: TraceShape, num_steps: int, max_model_len: int, seed: int) -> list[Request]:
    """Requests arriving over `num_steps` scheduler steps, in arrival order."""
    rng = random.Random(f"{shape.name}-{seed}")
    requests = []
    clock = rng.expovariate(shape.requests_per_step)
    while clock < num_steps:
        prompt_len, output_len = sample_lengths(rng, shape, max_model_len)
        prompt = tuple(rng.randrange(VOCAB_SIZE) for _ in range(prompt_len))
        requests.append(Request(f"{shape.name}-{len(requests)}", int(clock), prompt, output_len))
        clock += rng.expovariate(shape.requests_per_step)
    return requests


def mean_lengths(requests: list[Request]) -> tuple[float, float]:
    """(mean prompt length, mean output length) of a trace."""
    count = max(1, len(requests))
    return sum(r.prompt_len for r in requests) / count, sum(r.output_len for r in requests) / count


def arrivals_by_step(trace: list[Request], num_steps: int) -> Iterator[tuple[int, list[Request]]]:
    """(step, the requests arriving at that step) for every step in range(num_steps)."""
    position = 0
    for step in range(num_steps):
        start = position
        while position < len(trace) and trace[position].arrival_step <= step:
            position += 1
        yield step, trace[start:position]
