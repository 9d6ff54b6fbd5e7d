"""The sampler on CUDA logits (torch ops; the CPU runs the Rust kernels): the same tokens as on the
CPU for the same uniform numbers, penalties and biases bit-equal to the CPU's."""

import pytest
import torch

from pagedkv.runner.penalties import apply_biases_and_penalties
from pagedkv.runner.sampler import (Sampler, SamplingRow, _sample_on_cpu, _sample_with_torch, packed_settings,
                                     sampling_settings)
from pagedkv.params.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

VOCAB = 49152  # (SmolLM2's: rows as wide as the runner's)


def rows_of(params: list[SamplingParams], prompt_len: int = 64, output_len: int = 16) -> list[SamplingRow]:
    generator = torch.Generator().manual_seed(1)
    rows = []
    for index, p in enumerate(params):
        prompt = torch.randint(0, VOCAB, (prompt_len,), generator=generator).tolist()
        output = torch.randint(0, VOCAB, (output_len,), generator=generator).tolist()
        rows.append(SamplingRow(index, p, prompt, output, None, frozenset({2})))
    return rows


def test_cuda_sampling_draws_the_cpu_kernels_tokens():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, VOCAB, generator=generator) * 4
    params = [SamplingParams(temperature=[0.3, 0.8, 1.5][i % 3], top_k=[-1, 50, 5][i % 3 if i % 2 else 0],
                             top_p=[1.0, 0.9, 0.5][i % 3], min_p=[0.0, 0.05][i % 2]) for i in range(64)]
    mismatches = 0
    for _ in range(8):
        uniform = torch.rand(64, generator=generator)
        on_gpu = _sample_with_torch(logits.cuda(), params, uniform.cuda()).cpu()
        on_cpu = _sample_on_cpu(logits.clone(), sampling_settings([packed_settings(p) for p in params]), uniform)
        mismatches += int((on_gpu != on_cpu).sum())
    assert mismatches <= 64 * 8 // 100  # (a uniform number on a rounding boundary may tip either way)


def test_cuda_penalties_and_biases_equal_the_cpus():
    params = [SamplingParams(temperature=0, repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.5,
                             logit_bias={7: 2.5, 4000: -1.0}) for _ in range(32)]
    logits = torch.randn(32, VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    on_gpu = logits.cuda()
    apply_biases_and_penalties(on_gpu, rows_of(params), list(range(32)))
    apply_biases_and_penalties(logits, rows_of(params), list(range(32)))
    assert torch.equal(on_gpu.cpu(), logits)


def test_a_mixed_cuda_batch_matches_the_cpu_batch_where_it_is_deterministic():
    """Greedy rows (plain, penalized, biased, with logprobs) pick the same tokens and log-probabilities
    on both devices; sampled rows in the same batch draw tokens their filters keep."""
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, repetition_penalty=1.3),
              SamplingParams(temperature=0, logit_bias={11: 50.0}), SamplingParams(temperature=0, logprobs=3),
              SamplingParams(temperature=0.7, top_k=1), SamplingParams(temperature=1.0, top_p=0.9, min_p=0.1)]
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    on_cpu = Sampler()(logits.clone(), rows_of(params))
    on_gpu = Sampler()(logits.cuda(), rows_of(params))
    for i in range(5):  # (top_k=1 is greedy)
        assert on_gpu[i].token_id == on_cpu[i].token_id
    assert on_gpu[2].token_id == 11
    assert on_gpu[3].logprob == pytest.approx(on_cpu[3].logprob, abs=1e-4)
    assert on_gpu[3].top_logprobs.keys() == on_cpu[3].top_logprobs.keys()
    assert 0 <= on_gpu[5].token_id < VOCAB
