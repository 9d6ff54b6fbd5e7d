"""The engine books most tokens of plain requests by appending them (RequestState.plain_booking,
`record_token`'s common case inlined): every request ends exactly as when `record_token` books
each token, whatever ends it (EOS, a stop token after min_tokens, max_tokens, max_model_len), with
n > 1 and in asynchronous steps. Runs on the tiny random Qwen2 (EOS is token 2)."""

from typing import Optional

import pytest

from pagedkv import SamplingParams
from pagedkv.config import EngineConfig
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.request_state import RequestState

MAX_MODEL_LEN = 48


def run(tiny_qwen2_dir: str, requests: list[tuple[list[int], SamplingParams]], async_scheduling: bool,
        engine: Optional[LLMEngine] = None) -> dict:
    """Each request's final (token ids, finish reason, stop reason) of every sample."""
    engine = engine or new_engine(tiny_qwen2_dir, async_scheduling)
    for index, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{index}", prompt, params)
    finals = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = [(c.token_ids, c.finish_reason, c.stop_reason) for c in output.outputs]
    assert not engine.has_unfinished_requests()
    engine.scheduler.check_invariants()
    return finals


def new_engine(tiny_qwen2_dir: str, async_scheduling: bool) -> LLMEngine:
    return LLMEngine(EngineConfig(model=tiny_qwen2_dir, dtype="float32", num_device_blocks=64,
                                  max_model_len=MAX_MODEL_LEN, max_num_seqs=8, async_scheduling=async_scheduling))


def workload(reference: dict) -> list[tuple[list[int], SamplingParams]]:
    """Requests whose stop tokens are tokens the model does generate (taken from `reference`, the
    unconstrained run), some only allowed to stop after min_tokens."""
    requests = []
    for index in range(10):
        prompt = [(index * 17 + position) % 200 + 3 for position in range(4 + index * 3)]
        generated = reference[f"r{index}"][0][0]
        params = dict(max_tokens=6 + index * 3, ignore_eos=index % 2 == 0, temperature=0, seed=index)
        if index % 3 == 1:
            params.update(stop_token_ids=[generated[2], generated[5]], min_tokens=4)
        if index % 4 == 3:
            params.update(temperature=0.9, n=2)
        if index == 9:
            params.update(max_tokens=200)  # (max_model_len ends it)
        requests.append((prompt, SamplingParams(**params)))
    return requests


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_plain_booking_ends_every_request_as_record_token_does(tiny_qwen2_dir, monkeypatch, async_scheduling):
    free = [([(index * 17 + position) % 200 + 3 for position in range(4 + index * 3)],
             SamplingParams(max_tokens=8, ignore_eos=True, temperature=0)) for index in range(10)]
    requests = workload(run(tiny_qwen2_dir, free, async_scheduling=False))
    plain = run(tiny_qwen2_dir, requests, async_scheduling)
    monkeypatch.setattr(RequestState, "allow_plain_booking", lambda self, *args: None)
    booked = run(tiny_qwen2_dir, requests, async_scheduling)
    assert plain == booked
    reasons = {(reason, stop_reason is not None) for outputs in plain.values() for _, reason, stop_reason in outputs}
    assert {("length", False), ("stop", True)} <= reasons  # (the workload reaches both ends)


class RefusingOnce:
    """The engine's scheduler, whose `refuse_at`-th call of `refused` (`update`: a step's closing
    call) for more than one sequence raises, changing nothing."""

    def __init__(self, scheduler, refused: str, refuse_at: int):
        self._scheduler, self._refused, self._calls, self._refuse_at = scheduler, refused, 0, refuse_at
        self.refused = False

    def __getattr__(self, name):
        attribute = getattr(self._scheduler, name)
        if name != self._refused:
            return attribute

        def closing_call(seq_ids, *args, **kwargs):
            if len(seq_ids) + len(kwargs.get("fill_seq_ids") or ()) > 1:
                self._calls += 1
                if self._calls == self._refuse_at:
                    self.refused = True
                    raise RuntimeError(f"{name} refused")
            return attribute(seq_ids, *args, **kwargs)
        return closing_call


@pytest.mark.parametrize("refused, async_scheduling", [("update", False), ("update", True)])
def test_a_refused_closing_call_books_the_step_one_sequence_at_a_time(tiny_qwen2_dir, refused, async_scheduling):
    """Every token reaches the scheduler all the same: the outputs are the same, and so are the
    blocks the prefix cache holds (a generated token left a placeholder would change their hashes)."""
    prompts = [[(index * 17 + position) % 200 + 3 for position in range(20 + index)] for index in range(6)]
    requests = [(prompt, SamplingParams(max_tokens=18, ignore_eos=True, temperature=0)) for prompt in prompts]

    def outputs_and_cached_tokens(engine: LLMEngine) -> tuple[dict, list[int]]:
        finals = run(tiny_qwen2_dir, requests, async_scheduling, engine)
        hits = []
        for index, prompt in enumerate(prompts):  # (each whole sequence again: its full blocks are cached)
            engine.add_request(f"again{index}", prompt + finals[f"r{index}"][0][0], SamplingParams(max_tokens=1))
            while engine.has_unfinished_requests():
                for output in engine.step():
                    hits.append(output.metrics.num_prefix_hit_tokens)
        return finals, hits

    reference = outputs_and_cached_tokens(new_engine(tiny_qwen2_dir, async_scheduling))
    assert min(reference[1]) >= 32  # (blocks of generated tokens are among them)
    engine = new_engine(tiny_qwen2_dir, async_scheduling)
    engine.scheduler = refusing = RefusingOnce(engine.scheduler, refused, refuse_at=3)
    assert outputs_and_cached_tokens(engine) == reference
    assert refusing.refused


class CountingReports:
    """The engine's scheduler, recording each call that reports a step's results back."""

    REPORTS = ("update", "fork", "append_token", "accept_drafts", "finish_sequence", "fill_placeholders")

    def __init__(self, scheduler):
        self._scheduler, self.calls = scheduler, []

    def __getattr__(self, name):
        attribute = getattr(self._scheduler, name)
        if name not in self.REPORTS:
            return attribute

        def report(*args, **kwargs):
            self.calls.append((name, kwargs))
            return attribute(*args, **kwargs)
        return report


def test_a_step_reports_its_tokens_drafts_forks_beams_and_finishes_in_one_call(tiny_qwen2_dir):
    """The step closes with one scheduler call whatever it booked: n > 1 samples forking at their
    first token, beams forking and ending, verified drafts, finished sequences."""
    engine = LLMEngine(EngineConfig(model=tiny_qwen2_dir, dtype="float32", num_device_blocks=64,
                                    max_model_len=MAX_MODEL_LEN, max_num_seqs=16, num_speculative_tokens=3,
                                    prompt_lookup_min=1))
    engine.scheduler = counting = CountingReports(engine.scheduler)
    repeating = [5, 6, 7, 8] * 4
    engine.add_request("drafts", repeating, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    engine.add_request("samples", [9, 10, 11], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=6))
    engine.add_request("beams", [12, 13, 14, 15], SamplingParams(n=2, use_beam_search=True, beam_width=3,
                                                                 temperature=0, max_tokens=5))
    engine.add_request("short", [16, 17], SamplingParams(max_tokens=1))
    reported = {"forks": 0, "accepted_drafts": 0, "draft_token_ids": 0, "finished": 0}
    finals = {}
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        counting.calls = []
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        assert [name for name, _ in counting.calls] == ["update"], counting.calls
        (_, kwargs), = counting.calls
        for part in reported:
            reported[part] += bool(kwargs.get(part))
        engine.scheduler.check_invariants()
    assert sorted(finals) == ["beams", "drafts", "samples", "short"]
    assert len(finals["samples"].outputs) == 3 and len(finals["beams"].outputs) == 2
    assert all(reported.values()), reported
