"""No request can wedge the engine: admission is all or nothing (a refused request leaves the
scheduler as it was) and an error while stepping one request aborts that request alone. Runs on
the tiny random Qwen2 (prompts as token ids: its word-level tokenizer reads no text)."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv import InvalidConfigError, OverloadedError, SamplingParams
from pagedkv.config import EngineConfig
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.request_state import RequestState

PROMPT = [3, 4, 5, 6, 7]


@pytest.fixture(scope="module")
def engine(tiny_qwen2_dir):
    return LLMEngine(EngineConfig(model=tiny_qwen2_dir, dtype="float32", num_device_blocks=48, max_model_len=128,
                                  max_num_seqs=8, max_waiting_requests=16))


def run_until_idle(engine: LLMEngine, max_steps: int = 500) -> dict:
    """Steps until nothing is left; the final output of every request that finished."""
    finals = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finals
        for output in engine.step():
            assert_books_agree(engine)
            if output.finished:
                finals[output.request_id] = output
    raise AssertionError(f"requests still unfinished after {max_steps} steps: {sorted(engine.requests)}")


def assert_books_agree(engine: LLMEngine) -> None:
    """The scheduler holds exactly the engine's live requests, and every block is accounted for."""
    engine.scheduler.check_invariants()
    assert engine.scheduler.num_unfinished_requests == len(engine.requests)
    assert all(engine.requests.get(request.request_id) is request for request, _ in engine.seq_owner.values())
    if not engine.requests:
        stats = engine.stats()
        assert stats["num_free_device_blocks"] == stats["num_device_blocks"]
        assert stats["num_free_cpu_blocks"] == stats["num_cpu_blocks"]


def completes(engine: LLMEngine, request_id: str = "probe") -> list[int]:
    """A fresh valid request runs to its end (what every check below ends with)."""
    engine.add_request(request_id, PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    [output] = run_until_idle(engine).values()
    assert output.outputs[0].finish_reason == "length"
    return output.outputs[0].token_ids


@pytest.mark.parametrize("seed", [0, 2**44, 2**63 - 1, 2**63, 2**64 - 1, -(2**63)])
def test_every_64_bit_seed_samples_reproducibly(engine, seed):
    params = SamplingParams(seed=seed, n=2, max_tokens=4, ignore_eos=True)
    runs = []
    for attempt in range(2):
        engine.add_request(f"seed-{seed}-{attempt}", PROMPT, params)
        [output] = run_until_idle(engine).values()
        runs.append([completion.token_ids for completion in output.outputs])
    assert runs[0] == runs[1] and len(runs[0]) == 2


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_seeds_beyond_64_bits_are_refused_by_name(seed):
    with pytest.raises(ValueError, match="^seed must be a 64-bit integer"):
        SamplingParams(seed=seed)


@pytest.mark.parametrize("field, build", [
    ("bad_words", lambda: SamplingParams(bad_words=["ok", "\ud800"])),
    ("stop", lambda: SamplingParams(stop=["x\udfff"])),
])
def test_lone_surrogates_in_sampling_text_are_refused_by_name(field, build):
    with pytest.raises(ValueError, match=f"^{field} must be valid Unicode text"):
        build()


def refusals():
    """Requests refused at admission: (prompt, params) and the error's first word."""
    return [
        ("w3 \ud800 w4", SamplingParams(), "prompt"),
        ([3, 999], SamplingParams(), "prompt"),
        (PROMPT, SamplingParams(stop_token_ids=[300]), "stop_token_ids"),
        (PROMPT, SamplingParams(n=9), "n"),
        (PROMPT, SamplingParams(logprobs=21), "logprobs"),  # (beyond the default max_logprobs=20)
        (PROMPT, SamplingParams(structured_outputs={"regex": "(unclosed"}), "structured_outputs"),
        ("w3 " * 10_000, SamplingParams(), "prompt"),  # (refused before it is tokenized)
        (PROMPT * 30, SamplingParams(), "prompt"),
    ]


def test_a_refused_request_leaves_the_engine_unchanged_and_the_next_one_completes(engine):
    reference = completes(engine)
    engine.add_request("running", PROMPT, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    before = engine.stats()
    for prompt, params, first_word in refusals():
        with pytest.raises(ValueError, match=f"^{first_word}"):
            engine.add_request("refused", prompt, params)
        assert_books_agree(engine)
        assert "refused" not in engine.requests
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("running", PROMPT, SamplingParams())
    after = engine.stats()
    assert {key: after[key] for key in ("num_running", "num_waiting", "num_free_device_blocks")} == \
        {key: before[key] for key in ("num_running", "num_waiting", "num_free_device_blocks")}
    finals = run_until_idle(engine)
    assert finals["running"].outputs[0].finish_reason == "length"
    assert completes(engine) == reference


def test_logprobs_beyond_max_logprobs_are_refused_by_name_and_at_it_served(engine, monkeypatch):
    monkeypatch.setattr(engine.config, "max_logprobs", 3)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=rf"^{name} must be at most 3 \(max_logprobs\), got 4$"):
            engine.add_request("refused", PROMPT, SamplingParams(**{name: 4}))
        assert_books_agree(engine)
    engine.add_request("at-max", PROMPT, SamplingParams(logprobs=3, prompt_logprobs=3, max_tokens=2))
    [output] = run_until_idle(engine).values()
    # (top 3 candidates, and the chosen token beside them where it is not one of them)
    assert all(3 <= len(entry) <= 4 for entry in output.outputs[0].logprobs + output.prompt_logprobs[1:])
    vocab_size = engine.runner.vocab_size
    monkeypatch.setattr(engine.config, "max_logprobs", -1)  # (-1: as many as the vocabulary has)
    with pytest.raises(ValueError, match=rf"^logprobs must be at most {vocab_size} \(the vocabulary size\)"):
        engine.add_request("refused", PROMPT, SamplingParams(logprobs=vocab_size + 1))
    for logprobs in (vocab_size, -1):  # (-1: vLLM's "the whole vocabulary")
        engine.add_request("whole-vocabulary", PROMPT, SamplingParams(logprobs=logprobs, max_tokens=1))
        [output] = run_until_idle(engine).values()
        assert len(output.outputs[0].logprobs[0]) == vocab_size
    monkeypatch.setattr(engine.config, "max_logprobs", 3)
    with pytest.raises(ValueError, match=r"^prompt_logprobs must be at most 3 \(max_logprobs\), got -1 \(the whole"):
        engine.add_request("refused", PROMPT, SamplingParams(prompt_logprobs=-1))


@pytest.mark.parametrize("max_logprobs", [-2, 1.5, None])
def test_max_logprobs_is_an_integer_from_minus_one(max_logprobs):
    with pytest.raises(InvalidConfigError, match="^max_logprobs must be an integer >= 0, or -1"):
        EngineConfig(max_logprobs=max_logprobs)


def test_a_request_whose_building_raises_anything_is_never_registered(engine, monkeypatch):
    """The bug of issue #28: the scheduler had the sequence before its generator and bad-word
    tokens were built, and nothing removed it when they raised."""
    def broken(*args):
        raise TypeError("tokenizer exploded")

    monkeypatch.setattr(engine.input_processor, "bad_words_token_ids", broken)
    for _ in range(engine.config.max_num_seqs + 1):  # (each orphan used to keep a running slot)
        with pytest.raises(TypeError):
            engine.add_request("broken", PROMPT, SamplingParams(bad_words=["w3"]))
        assert_books_agree(engine)
    monkeypatch.undo()
    completes(engine)


def processor_failing_at(num_generated: int):
    """A logits processor that raises once the sequence has `num_generated` tokens."""
    def processor(output_token_ids, logits):
        if len(output_token_ids) == num_generated:
            raise RuntimeError("processor bug")
        return logits

    return processor


def test_an_error_in_one_request_aborts_it_alone(engine, monkeypatch):
    reference = completes(engine, "alone")
    record_token = RequestState.record_token

    def failing_record_token(self, seq, token_id, *args):
        if self.request_id == "record-fails" and len(seq.output_token_ids) == 1:
            raise RuntimeError("bookkeeping bug")
        return record_token(self, seq, token_id, *args)

    monkeypatch.setattr(RequestState, "record_token", failing_record_token)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("processor-fails", PROMPT, SamplingParams(max_tokens=8, logits_processors=[processor_failing_at(2)]))
    # (logprobs: its every token is booked by record_token, not appended as plain requests' most are)
    engine.add_request("record-fails", PROMPT, SamplingParams(n=2, max_tokens=8, ignore_eos=True, logprobs=1))
    engine.add_request("healthy", PROMPT, greedy)
    finals = run_until_idle(engine)
    assert finals["healthy"].outputs[0].token_ids == reference
    assert [c.finish_reason for c in finals["processor-fails"].outputs] == ["abort"]
    assert len(finals["processor-fails"].outputs[0].token_ids) == 2
    assert {c.finish_reason for c in finals["record-fails"].outputs} == {"abort"}
    assert_books_agree(engine)
    assert completes(engine) == reference


# -- the watchdog: random valid and invalid requests, the books checked after every operation --

valid_params = st.builds(
    lambda beams, temperature, **fields: SamplingParams(use_beam_search=beams, temperature=0.0 if beams else temperature,
                                                        **fields),
    beams=st.booleans(),
    temperature=st.sampled_from([0.0, 0.8]),
    n=st.integers(1, 3),
    seed=st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1)),
    max_tokens=st.integers(1, 12),
    stop_token_ids=st.lists(st.integers(0, 255), max_size=2),
    logprobs=st.one_of(st.none(), st.integers(0, 3)),
    prompt_logprobs=st.one_of(st.none(), st.just(1)),
)
prompts = st.lists(st.integers(3, 255), min_size=1, max_size=40)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), prompts, valid_params),
        st.tuples(st.just("refused"), st.sampled_from(range(len(refusals())))),
        st.tuples(st.just("failing"), prompts, st.integers(0, 3)),
        st.tuples(st.just("abort"), st.integers(0, 20)),
        st.tuples(st.just("step"), st.integers(1, 3)),
    ),
    max_size=12,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(operations)
def test_watchdog_no_sequence_of_requests_wedges_the_engine(engine, script):
    added = []
    for index, operation in enumerate(script):
        kind, *arguments = operation
        request_id = f"r{index}"
        if kind == "add":
            prompt, params = arguments
            try:
                engine.add_request(request_id, prompt, params)
                added.append(request_id)
            except OverloadedError:  # (refused cleanly: the waiting queue is full)
                pass
        elif kind == "refused":
            prompt, params, _ = refusals()[arguments[0]]
            with pytest.raises(ValueError):
                engine.add_request(request_id, prompt, params)
        elif kind == "failing":
            prompt, fail_at = arguments
            processor = processor_failing_at(fail_at)
            engine.add_request(request_id, prompt, SamplingParams(max_tokens=6, logits_processors=[processor]))
            added.append(request_id)
        elif kind == "abort" and added:
            engine.abort(added[arguments[0] % len(added)])
        elif kind == "step":
            for _ in range(arguments[0]):
                engine.step()
        assert_books_agree(engine)
    run_until_idle(engine)
    assert_books_agree(engine)
    completes(engine)
