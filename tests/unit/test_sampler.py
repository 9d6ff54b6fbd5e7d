"""Sampler: greedy, seeded sampling, top-k / top-p / min-p, logit bias, penalties, min_tokens, logprobs."""

import collections

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.runner.sampler import Sampler, SamplingRow, argmax_rows
from pagedkv.params.sampling import SamplingParams

VOCAB = 50


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def row(index=0, seed=None, prompt=(), output=(), eos=(2,), **params) -> SamplingRow:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(index, SamplingParams(**params), list(prompt), list(output), generator, frozenset(eos))


def sample_tokens(logits, make_row, draws: int) -> list[int]:
    sampler = Sampler()
    return [sampler(logits, [make_row(i)])[0].token_id for i in range(draws)]


def test_greedy_is_argmax_for_every_row():
    logits = random_logits(5)
    results = Sampler()(logits, [row(i, temperature=0) for i in range(5)])
    assert [r.token_id for r in results] == logits.argmax(-1).tolist()


def test_rows_pick_their_logits_row_in_any_order():
    logits = random_logits(4)
    results = Sampler()(logits, [row(3, temperature=0), row(0, temperature=0)])
    assert [r.token_id for r in results] == [logits[3].argmax().item(), logits[0].argmax().item()]


def test_seeded_sampling_is_reproducible_and_seeds_differ():
    logits = random_logits(1)
    first = sample_tokens(logits, lambda i: row(seed=1000 + i, temperature=1.0), 30)
    again = sample_tokens(logits, lambda i: row(seed=1000 + i, temperature=1.0), 30)
    other = sample_tokens(logits, lambda i: row(seed=5000 + i, temperature=1.0), 30)
    assert first == again
    assert first != other
    assert len(set(first)) > 1  # it really samples


def test_sampling_follows_the_softmax_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, -30.0] + [-30.0] * (VOCAB - 4)])
    counts = collections.Counter(sample_tokens(logits, lambda i: row(seed=i, temperature=1.0), 3000))
    expected = torch.softmax(logits[0], -1)[:3]
    for token in range(3):
        assert abs(counts[token] / 3000 - expected[token].item()) < 0.04
    assert set(counts) <= {0, 1, 2}


@pytest.mark.parametrize("temperature", [1e-45, 1e-6, 9.9e-6])
def test_a_temperature_below_1e_5_is_greedy(temperature):
    """vLLM's rule: dividing by such a temperature overflows the logits to infinities, and a draw
    over them would be uniform among the best tokens (or NaN)."""
    logits = random_logits(6)
    results = Sampler()(logits, [row(i, seed=i, temperature=temperature) for i in range(6)])
    assert [r.token_id for r in results] == logits.argmax(-1).tolist()
    assert SamplingParams(temperature=1e-5).temperature == 1e-5  # (from 1e-5 on, sampled as asked)


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = random_logits(6)
    greedy = logits.argmax(-1).tolist()
    sampler = Sampler()
    top_k = sampler(logits, [row(i, seed=i, temperature=1.5, top_k=1) for i in range(6)])
    top_p = sampler(logits, [row(i, seed=i, temperature=1.5, top_p=1e-6) for i in range(6)])
    assert [r.token_id for r in top_k] == greedy
    assert [r.token_id for r in top_p] == greedy


def test_top_k_keeps_only_the_k_best():
    logits = random_logits(1, seed=3)
    best3 = set(logits[0].topk(3).indices.tolist())
    tokens = sample_tokens(logits, lambda i: row(seed=i, temperature=5.0, top_k=3), 200)
    assert set(tokens) == best3


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05] + [0.0] * (VOCAB - 4))
    logits = torch.log(probs.clamp_min(1e-30))[None]
    tokens = sample_tokens(logits, lambda i: row(seed=i, temperature=1.0, top_p=0.75), 300)
    assert set(tokens) == {0, 1}
    tokens = sample_tokens(logits, lambda i: row(seed=i, temperature=1.0, top_p=0.85), 300)
    assert set(tokens) == {0, 1, 2}


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1] + [0.0] * (VOCAB - 4))
    logits = torch.log(probs.clamp_min(1e-30))[None]
    tokens = sample_tokens(logits, lambda i: row(seed=i, temperature=1.0, min_p=0.6), 300)
    assert set(tokens) == {0, 1}  # 0.2 < 0.6 * 0.4


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.zeros(1, VOCAB)
    logits[0, 3], logits[0, 4], logits[0, 5] = 2.0, -2.0, 1.9
    # Without the penalty 3 wins; seen tokens 3 (prompt) and 4 (output) are penalized HF-style.
    result = Sampler()(logits, [row(temperature=0, prompt=[3, 9], output=[4], repetition_penalty=2.0)])[0]
    assert result.token_id == 5
    penalized = logits.clone()
    Sampler._apply_penalties_and_masks(penalized[0], row(prompt=[3, 9], output=[4], repetition_penalty=2.0))
    assert penalized[0, 3].item() == 1.0 and penalized[0, 4].item() == -4.0 and penalized[0, 9].item() == 0.0
    assert penalized[0, 5].item() == pytest.approx(1.9)


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(1, VOCAB)
    penalized = logits.clone()
    params = dict(prompt=[7], output=[3, 3, 3, 4], presence_penalty=0.5, frequency_penalty=0.25)
    Sampler._apply_penalties_and_masks(penalized[0], row(**params))
    assert penalized[0, 3].item() == pytest.approx(-(0.5 + 3 * 0.25))
    assert penalized[0, 4].item() == pytest.approx(-(0.5 + 0.25))
    assert penalized[0, 7].item() == 0.0 and penalized[0, 0].item() == 0.0
    logits[0, 3] = 1.0  # would win greedily, but the penalties push it below 0
    assert Sampler()(logits, [row(temperature=0, **params)])[0].token_id not in (3, 4)


def test_logit_bias_adds_to_the_named_logits_only():
    logits = random_logits(2, seed=5)
    best = logits[0].argmax().item()
    other = (best + 1) % VOCAB
    bias = {other: 100.0, best: -100.0}
    results = Sampler()(logits, [row(0, temperature=0, logit_bias=bias, logprobs=0), row(1, temperature=0)])
    assert results[0].token_id == other
    assert results[1].token_id == logits[1].argmax().item()  # the other row is untouched
    # Logprobs stay those of the model's distribution, as for the penalties.
    assert results[0].logprob == pytest.approx(torch.log_softmax(logits[0], -1)[other].item(), abs=1e-5)
    biased = logits[0].clone()
    Sampler._apply_penalties_and_masks(biased, row(logit_bias={3: 1.5, 7: -2.0}))
    expected = logits[0].clone()
    expected[3] += 1.5
    expected[7] -= 2.0
    assert torch.equal(biased, expected)
    # Sampling sees the bias too: a -100 bias bans a token, a +100 one forces it.
    assert set(sample_tokens(logits, lambda i: row(seed=i, temperature=1.0, logit_bias={5: 100}), 20)) == {5}


@pytest.mark.parametrize(
    "params, field",
    [
        (dict(logit_bias={3: 101.0}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={"3": 1.0}), "logit_bias"),
        (dict(stop_token_ids=[-4]), "stop_token_ids"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(allowed_token_ids=[3, -1]), "allowed_token_ids"),
        (dict(bad_words=["ok", " "]), "bad_words"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
        (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
        (dict(truncate_prompt_tokens=2, truncation_side="middle"), "truncation_side"),
        (dict(logprob_token_ids=[1, -1]), "logprob_token_ids"),
        (dict(logprob_token_ids=list(range(129))), "logprob_token_ids"),
        (dict(logprob_token_ids=[1], use_beam_search=True, temperature=0), "logprob_token_ids"),
    ],
)
def test_bad_token_ids_and_biases_are_named(params, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**params)


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(1, VOCAB)
    logits[0, 2], logits[0, 9], logits[0, 11] = 10.0, 9.0, 8.0
    sampler = Sampler()
    early = row(temperature=0, eos=(2,), output=[5], min_tokens=3, stop_token_ids=[9])
    assert sampler(logits, [early])[0].token_id == 11
    reached = row(temperature=0, eos=(2,), output=[5, 5, 5], min_tokens=3, stop_token_ids=[9])
    assert sampler(logits, [reached])[0].token_id == 2


def test_logprobs_are_log_softmax_of_the_raw_logits():
    logits = random_logits(3, seed=7)
    expected = torch.log_softmax(logits, -1)
    rows = [
        row(0, temperature=0, logprobs=5),
        row(1, seed=4, temperature=0.7, top_k=10, logprobs=2, repetition_penalty=1.3, prompt=[1, 2]),
        row(2, temperature=0),
    ]
    results = Sampler()(logits, rows)
    for i, result in enumerate(results[:2]):
        assert result.logprob == pytest.approx(expected[i, result.token_id].item(), abs=1e-5)
    assert results[2].logprob is None and results[2].top_logprobs is None  # not asked for
    for i, k in ((0, 5), (1, 2)):
        top = results[i].top_logprobs
        assert len(top) == k
        values, ids = expected[i].topk(k)
        assert list(top) == ids.tolist()
        assert list(top.values()) == pytest.approx(values.tolist(), abs=1e-5)


def test_logprob_token_ids_report_those_tokens_instead_of_the_top_k():
    logits = random_logits(2, seed=3)
    expected = torch.log_softmax(logits, -1)
    named = [7, 0, 49]
    results = Sampler()(logits, [row(0, temperature=0, logprob_token_ids=named),
                                 row(1, temperature=0, logprobs=3, logprob_token_ids=[5])])
    assert list(results[0].top_logprobs) == named
    assert list(results[0].top_logprobs.values()) == pytest.approx(expected[0, named].tolist(), abs=1e-5)
    assert results[0].logprob == pytest.approx(expected[0].max().item(), abs=1e-5)
    assert list(results[1].top_logprobs) == [5]  # (they replace the top k)
    assert SamplingParams(logprob_token_ids=[1]).logprobs == 0  # (they turn logprobs on)


def test_a_mixed_batch_samples_each_row_under_its_own_settings():
    """One batch: greedy, top-k, top-p, min-p and plain rows side by side keep their own supports,
    and a seeded row draws the same token alone or in any batch."""
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1] + [0.0] * (VOCAB - 4))
    peaked = torch.log(probs.clamp_min(1e-30))
    logits = torch.stack([peaked, peaked, peaked, peaked, random_logits(1, seed=9)[0]])
    settings = [dict(temperature=0), dict(temperature=1.0, top_k=2), dict(temperature=1.0, top_p=0.65),
                dict(temperature=1.0, min_p=0.6), dict(temperature=1.0)]
    supports = [{0}, {0, 1}, {0, 1}, {0, 1}, set(range(VOCAB))]
    seen = [set() for _ in settings]
    sampler = Sampler()
    for draw in range(200):
        results = sampler(logits, [row(i, seed=draw * 10 + i, **params) for i, params in enumerate(settings)])
        for i, result in enumerate(results):
            seen[i].add(result.token_id)
    for i, support in enumerate(supports[:4]):
        assert seen[i] == support, (settings[i], seen[i])
    assert len(seen[4]) > 5  # the unfiltered row really samples the whole distribution
    alone = [sampler(logits, [row(4, seed=s, temperature=1.0)])[0].token_id for s in range(20)]
    batched = [sampler(logits, [row(0, temperature=0), row(2, seed=99, temperature=0.5, top_p=0.5),
                                row(4, seed=s, temperature=1.0)])[2].token_id for s in range(20)]
    assert alone == batched


def test_allowed_token_ids_leave_only_those_tokens():
    logits = random_logits(2, seed=9)
    allowed = [4, 17, 31]
    results = Sampler()(logits, [row(0, temperature=0, allowed_token_ids=allowed), row(1, temperature=0)])
    assert results[0].token_id == max(allowed, key=lambda t: logits[0, t].item())
    assert results[1].token_id == logits[1].argmax().item()  # the other row is untouched
    drawn = sample_tokens(logits, lambda i: row(seed=i, temperature=5.0, allowed_token_ids=allowed), 60)
    assert set(drawn) == set(allowed)  # (at temperature 5 all three come up in 60 draws)


def test_bad_words_ban_a_words_last_token_only_where_it_would_complete_the_word():
    logits = torch.zeros(1, VOCAB)
    logits[0, 7], logits[0, 8], logits[0, 9] = 10.0, 9.0, 8.0
    words = ((7,), (3, 8))  # a one-token word, and a two-token word ending in 8

    def greedy_after(output):
        return Sampler()(logits, [SamplingRow(0, SamplingParams(temperature=0), [], output, None, frozenset(),
                                              bad_words_token_ids=words)])[0].token_id

    assert greedy_after([]) == 8  # 7 is always banned; 8 only after 3
    assert greedy_after([5, 3]) == 9
    assert greedy_after([3, 5]) == 8


def test_logits_processors_see_the_history_and_replace_the_logits():
    logits = random_logits(2, seed=21)
    seen = []

    def two_args(output_ids, row_logits):
        seen.append(("two", list(output_ids), row_logits.shape))
        row_logits[11] = 1e4  # in place
        return row_logits

    def three_args(prompt_ids, output_ids, row_logits):
        seen.append(("three", list(prompt_ids), list(output_ids)))
        boosted = row_logits.clone()
        boosted[13] = 2e4  # a new tensor
        return boosted

    rows = [row(0, temperature=0, prompt=[1, 2], output=[3], logits_processors=[two_args, three_args]),
            row(1, temperature=0, logits_processors=[two_args])]
    results = Sampler()(logits, rows)
    assert [result.token_id for result in results] == [13, 11]
    assert seen == [("two", [3], (VOCAB,)), ("three", [1, 2], [3]), ("two", [], (VOCAB,))]
    with pytest.raises(ValueError, match="logits_processors"):
        SamplingParams(logits_processors=[3])


@given(
    rows=st.integers(1, 6),
    width=st.integers(1, 300),
    data=st.data(),
)
@settings(max_examples=60, deadline=None)
def test_argmax_rows_is_torch_argmax_with_ties_infinities_and_nan(rows, width, data):
    """The CPU kernel behind greedy sampling picks what torch's argmax picks: the first of equal
    values, a row's first NaN, index 0 of an all -inf row."""
    values = data.draw(st.lists(st.sampled_from([0.0, 1.5, -2.0, 7.25, float("inf"), float("-inf"), float("nan")])
                                | st.floats(-1e6, 1e6, width=32), min_size=rows * width, max_size=rows * width))
    logits = torch.tensor(values, dtype=torch.float32).reshape(rows, width)
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))


@given(rows=st.integers(1, 5), width=st.integers(1, 200), data=st.data())
@settings(max_examples=40, deadline=None)
def test_argmax_rows_of_bfloat16_rows_is_the_argmax_of_their_float32_values(rows, width, data):
    """bfloat16 rows (a bfloat16 model's LM head, read as it wrote them) give the argmax of the
    same values widened to float32, ties, infinities and NaN included."""
    values = data.draw(st.lists(st.sampled_from([0.0, 1.5, -2.0, 7.25, float("inf"), float("-inf"), float("nan")])
                                | st.floats(-1e6, 1e6, width=32), min_size=rows * width, max_size=rows * width))
    logits = torch.tensor(values, dtype=torch.float32).reshape(rows, width).bfloat16()
    assert torch.equal(argmax_rows(logits), logits.float().argmax(dim=-1))


def test_plain_greedy_rows_are_sampled_from_bfloat16_logits_and_others_from_float32():
    """A batch of plain greedy rows takes the argmax of logits of any dtype; a row that reads
    more than the argmax (logprobs, min_tokens, a bias) sends the batch to float32."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(3, VOCAB, generator=generator).bfloat16()
    plain = [row(i, temperature=0) for i in range(3)]
    assert all(r.plain_greedy for r in plain)
    assert [result.token_id for result in Sampler()(logits, plain)] == logits.float().argmax(-1).tolist()
    for params in (dict(logprobs=1), dict(min_tokens=2, stop_token_ids=[5]), dict(logit_bias={3: 1.0}),
                   dict(temperature=0.5)):
        mixed = plain[:2] + [row(2, **{"temperature": 0, **params})]
        assert not mixed[2].plain_greedy
        results = Sampler()(logits, mixed)
        assert [result.token_id for result in results[:2]] == logits[:2].float().argmax(-1).tolist()


def test_plain_sampled_rows_draw_from_bfloat16_logits_what_their_widening_draws():
    """Rows that change nothing in their logits (temperature, top-k, top-p, min-p) are drawn from
    logits of the model's dtype as they are: the same tokens as from the float32 widening."""
    logits = (torch.randn(8, 3000, generator=torch.Generator().manual_seed(2)) * 4).bfloat16()
    settings = [dict(temperature=0.8), dict(temperature=1.2, top_k=20), dict(temperature=0.7, top_p=0.9),
                dict(temperature=1.0, top_k=50, top_p=0.8, min_p=0.05)]

    def rows():
        return [row(i, seed=10 + i, **settings[i % 4]) for i in range(8)]

    narrow, wide = rows(), rows()
    for _ in range(20):
        assert ([r.token_id for r in Sampler()(logits, narrow)]
                == [r.token_id for r in Sampler()(logits.float(), wide)])


def test_float16_logits_of_plain_rows_are_drawn_by_the_cpu_kernel_as_their_widening():
    """The runner hands plain rows the model's dtype; float16 (which the kernel does not read) is
    widened for the kernel: the same tokens as from float32 logits."""
    logits = (torch.randn(6, 3000, generator=torch.Generator().manual_seed(4)) * 3).half()

    def rows():
        return [row(i, seed=i, temperature=0.9, top_k=[0, 30][i % 2], top_p=0.9) for i in range(6)]

    narrow, wide = rows(), rows()
    for _ in range(10):
        assert Sampler().sample(logits, narrow).token_ids == Sampler().sample(logits.float(), wide).token_ids


def test_seeded_rows_draw_their_generators_stream_whatever_the_batch():
    """A seeded row's uniform numbers are its generator's single draws in order (prefetched on
    the CPU), with unseeded rows around it or not."""
    from pagedkv.runner.sampler import _uniform_draws

    batch = [row(0, seed=3, temperature=1.0), row(1, temperature=1.0), row(2, seed=4, temperature=1.0)]
    alone = row(0, seed=4, temperature=1.0)
    references = [torch.Generator().manual_seed(seed) for seed in (3, 4)]
    for step in range(150):
        drawn = _uniform_draws(batch, torch.device("cpu"))
        expected = [torch.rand((), generator=generator).item() for generator in references]
        assert [drawn[0].item(), drawn[2].item()] == expected, step
        assert 0.0 <= drawn[1].item() < 1.0
        assert _uniform_draws([alone], torch.device("cpu")).item() == expected[1]


def test_argmax_rows_of_vocabulary_wide_rows_and_views():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 49152, generator=generator)
    logits[5, 100] = logits[5, 40000] = logits[5].max() + 1  # a tie far apart: the first wins
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
    view = logits[:, 1000:]  # (not contiguous: torch's path)
    assert torch.equal(argmax_rows(view), view.argmax(dim=-1))
    assert argmax_rows(torch.empty(0, 10)).shape == (0,)


def reference_biases_and_penalties(logits: torch.Tensor, row: SamplingRow) -> None:
    """The per-row form (the sampler's before penalties were batched), for one 1-D row."""
    params = row.params
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias))
        logits[ids] += torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype)
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)))
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and row.output_token_ids:
        ids, counts = torch.tensor(row.output_token_ids).unique(return_counts=True)
        logits[ids] -= params.frequency_penalty * counts.to(logits.dtype) + params.presence_penalty


tokens = st.lists(st.integers(0, VOCAB - 1), max_size=12)
penalized_rows = st.lists(st.fixed_dictionaries({
    "prompt": st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
    "steps": st.lists(tokens, min_size=1, max_size=3),  # output tokens added before each sampling step
    "repetition_penalty": st.sampled_from([1.0, 1.3, 0.7]),
    "frequency_penalty": st.sampled_from([0.0, 0.5, -1.25]),
    "presence_penalty": st.sampled_from([0.0, 0.75]),
    "logit_bias": st.one_of(st.none(), st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=4)),
}), min_size=1, max_size=5)


@given(penalized_rows)
@settings(max_examples=60, deadline=None)
def test_batched_penalties_equal_the_per_row_reference_step_after_step(specs):
    """Rows kept across steps (their token histories updated as outputs grow) penalize exactly as
    the per-row computation from the whole history does."""
    from pagedkv.runner.penalties import apply_biases_and_penalties

    rows = [row(i, prompt=spec["prompt"], **{k: v for k, v in spec.items() if k not in ("prompt", "steps")})
            for i, spec in enumerate(specs)]
    for step in range(max(len(spec["steps"]) for spec in specs)):
        for spec, sampling_row in zip(specs, rows):
            if step < len(spec["steps"]):
                sampling_row.output_token_ids.extend(spec["steps"][step])
        logits = random_logits(len(rows), seed=step)
        expected = logits.clone()
        for i, sampling_row in enumerate(rows):
            reference_biases_and_penalties(expected[i], sampling_row)
        apply_biases_and_penalties(logits, rows, list(range(len(rows))))
        assert torch.equal(logits, expected)


def test_a_logit_bias_outside_the_vocabulary_fails_its_row_alone():
    rows = [row(0, temperature=0, logit_bias={VOCAB + 5: 1.0}), row(1, temperature=0, repetition_penalty=1.2)]
    with pytest.raises(ValueError, match="vocabulary"):
        Sampler()(random_logits(2), rows)
    errors: dict = {}
    from pagedkv.runner.results import sample

    tokens = sample(Sampler(), random_logits(2), rows, [10, 11], errors).token_ids
    assert tokens[0] is None and isinstance(errors[10], ValueError) and tokens[1] is not None


def test_a_batch_that_fails_after_penalizing_in_place_resamples_from_fresh_logits():
    """In place (the runner's case without beams), a batch that raises after penalizing some rows
    samples its rows again from logits computed afresh: no row is penalized twice."""
    from pagedkv.runner.results import sample

    def fresh() -> torch.Tensor:
        logits = torch.zeros(2, VOCAB)
        logits[0, 3], logits[0, 5] = 2.0, 1.5  # penalized once, 3 still wins (2 / 1.2 > 1.5); twice, 5 would
        return logits

    def failing(output_token_ids, logits):
        raise RuntimeError("processor failed")

    rows = [row(0, temperature=0, prompt=[3], repetition_penalty=1.2), row(1, temperature=0, logits_processors=[failing])]
    errors: dict = {}
    tokens = sample(Sampler(), fresh(), rows, [10, 11], errors, recompute_logits=fresh).token_ids
    assert tokens == [3, None] and isinstance(errors[11], RuntimeError)
    logits = fresh()[:1]
    assert Sampler()(logits, rows[:1], in_place=True)[0].token_id == 3
    assert logits[0, 3] < 2.0  # (changed in place)
    kept = fresh()[:1]
    Sampler()(kept, rows[:1])
    assert torch.equal(kept, fresh()[:1])


@given(seed=st.integers(0, 2**31), vocab=st.sampled_from([7, 50, 300, 3000]), rows=st.integers(1, 6), data=st.data())
@settings(max_examples=40, deadline=None)
def test_the_cpu_sampling_kernel_draws_what_the_torch_sampler_draws(seed, vocab, rows, data):
    """Rust's one-row-at-a-time sampling (the CPU's) against the torch ops (the GPU's): the same
    token for the same uniform number, but where float rounding puts the number on a boundary,
    and never a token the torch filters drop."""
    from pagedkv.runner.sampler import _sample_on_cpu, _sample_with_torch, packed_settings, sampling_settings

    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=generator) * data.draw(st.sampled_from([0.5, 3.0, 10.0]))
    logits[0, data.draw(st.integers(0, vocab - 1))] = float("-inf")  # (a masked token)
    params = [SamplingParams(temperature=data.draw(st.sampled_from([0.3, 1.0, 1.7])),
                             top_k=data.draw(st.sampled_from([-1, 1, 5, 40])),
                             top_p=data.draw(st.sampled_from([1.0, 0.9, 0.3])),
                             min_p=data.draw(st.sampled_from([0.0, 0.05, 0.5]))) for _ in range(rows)]
    draws = 64
    mismatches = 0
    for d in range(draws):
        uniform = torch.rand(rows, generator=generator)
        ours = _sample_on_cpu(logits.clone(), sampling_settings([packed_settings(p) for p in params]), uniform)
        theirs = _sample_with_torch(logits.clone(), params, uniform)
        probs = _sample_with_torch_kept(logits, params)
        assert bool(probs[torch.arange(rows), ours].gt(0).all()), (ours, theirs)
        mismatches += int((ours != theirs).sum())
    assert mismatches <= max(2, rows * draws // 100)


def _sample_with_torch_kept(logits: torch.Tensor, params: list) -> torch.Tensor:
    """The torch sampler's kept probabilities (its filters, no draw)."""
    from pagedkv.runner.sampler import _top_p_thresholds

    vocab = logits.shape[1]
    rows = []
    for row, p in zip(logits, params):
        scaled = row / p.temperature
        if 0 < p.top_k < vocab:
            scaled = scaled.masked_fill(scaled < scaled.topk(p.top_k).values[-1], float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if p.top_p < 1:
            probs = probs.masked_fill(probs < _top_p_thresholds(probs[None], torch.tensor([[p.top_p]]))[0], 0.0)
        rows.append(probs)
    return torch.stack(rows)
