"""Sampler: logits -> next tokens with temperature, top-k, top-p, min-p, logit bias, penalties,
min_tokens, structured-output grammars, per-request seeds and logprobs. Every row is sampled in
one batch whatever its settings: a per-row loop costs a few kernel launches (on the CPU, a pass
over the vocabulary) per row."""

from __future__ import annotations

import inspect
import struct
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Optional

import torch

from pagedkv_core import _core
from pagedkv.runner.penalties import apply_biases_and_penalties
from pagedkv.params.sampling import SamplingParams
from pagedkv.params.structured_output import grammar_applies, mask_disallowed_tokens
from pagedkv.kernels.transfer import to_device


@dataclass
class SamplingRow:
    """One sequence to sample for: which logits row, its settings and its history."""

    logits_index: int
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: Optional[torch.Generator]
    eos_token_ids: frozenset[int]
    matcher: object = None  # xgrammar GrammarMatcher of a structured-output sequence
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # the request's bad_words, tokenized
    token_history: object = None  # penalties.TokenHistory, made when a penalty first needs it

    def __post_init__(self) -> None:
        # (what never changes: checked and packed once, not per step)
        params = self.params
        self.plain_settings = (params.logprobs is None and self.matcher is None and not params.logit_bias
                               and params.repetition_penalty == 1.0 and not params.presence_penalty
                               and not params.frequency_penalty and params.allowed_token_ids is None
                               and not self.bad_words_token_ids and not params.logits_processors)
        # min_tokens bans the stop tokens and EOS until the sequence has that many tokens
        self.bans_until_min_tokens = params.min_tokens > 0 and bool(
            params.stop_token_ids or (not params.ignore_eos and self.eos_token_ids))
        self.always_plain = self.plain_settings and not self.bans_until_min_tokens
        self.greedy = params.temperature == 0
        self.plain_greedy = self.greedy and params.min_tokens == 0 and self.plain_settings
        self.settings = packed_settings(params)
        self._uniforms: list[float] = []  # the next draws of a CPU generator, prefetched

    def next_uniform(self) -> float:
        """The next uniform number of this row's CPU generator: drawn 64 at a time (on the CPU,
        torch.rand(n) is the n numbers that n single draws give, so the stream is the same)."""
        if not self._uniforms:
            self._uniforms = torch.rand(64, generator=self.generator).tolist()
            self._uniforms.reverse()
        return self._uniforms.pop()


def packed_settings(params: SamplingParams) -> bytes:
    """The sampling kernel's per-row settings: float32 temperature, top_k (0: all), top_p, min_p."""
    return struct.pack("4f", params.temperature, max(params.top_k, 0), params.top_p, params.min_p)


@dataclass
class SampleResult:
    token_id: int
    logprob: Optional[float]  # under the raw model distribution; None unless the row asked for logprobs
    top_logprobs: Optional[dict[int, float]]


@dataclass
class SampledTokens:
    """A batch's draws by row (columns, not an object per row): the token ids, and for the rows
    that asked for logprobs, (the token's logprob, its top logprobs or None)."""

    token_ids: list[int]
    logprobs: dict[int, tuple[float, Optional[dict[int, float]]]] = field(default_factory=dict)


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow], in_place: bool = False) -> list[SampleResult]:
        """`sample`'s draws as one result per row, in order."""
        sampled = self.sample(logits, rows, in_place)
        no_logprobs = (None, None)
        return [SampleResult(token, *sampled.logprobs.get(i, no_logprobs)) for i, token in enumerate(sampled.token_ids)]

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow], in_place: bool = False) -> SampledTokens:
        """logits [N, vocab] (float32, or the model's dtype where every row `is_plain`); one token
        per row, in order. `in_place`: the caller has no further use for `logits`, which
        penalties and masks may then change instead of a copy (50 MB at 256 rows of a 49k
        vocabulary)."""
        logits = _rows_of(logits, rows)
        if all_plain_greedy(rows):  # (the common step: nothing to check per row)
            return SampledTokens(argmax_rows(logits).tolist())
        if all_plain(rows):  # (nothing changes the logits: drawn in their dtype)
            return SampledTokens(_draw(logits, rows).tolist())
        logits = logits.float()  # (no copy where they are float32, as the runner gives them for such rows)
        raw_logits = logits
        # Log-probabilities are under the raw model distribution, for the rows that asked (as in
        # vLLM: computing them costs a pass over every row's vocabulary).
        wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        # Copy the [N, vocab] logits only when some row changes them (they are large) and the
        # originals are still wanted (by the caller, or for logprobs).
        adjusted = [i for i, row in enumerate(rows) if changes_logits(row)]
        if adjusted:
            if not in_place or wanted:
                logits = logits.clone()
            apply_biases_and_penalties(logits, rows, adjusted)  # (all rows at once)
            for i in adjusted:
                self._apply_masks(logits[i], rows[i])
            matchers = {i: rows[i].matcher for i in adjusted if rows[i].matcher is not None}
            if matchers:
                mask_disallowed_tokens(logits, matchers)

        tokens = _draw(logits, rows)

        sampled = SampledTokens(tokens.tolist())
        if wanted:
            index = to_device(torch.tensor(wanted), logits.device)
            logprobs = torch.log_softmax(raw_logits[index], dim=-1)
            values = logprobs.gather(1, tokens[index][:, None]).squeeze(1).tolist()
            for j, i in enumerate(wanted):
                top, named = None, rows[i].params.logprob_token_ids
                if named:
                    top = dict(zip(named, logprobs[j][to_device(torch.tensor(named), logprobs.device)].tolist()))
                elif rows[i].params.logprobs:
                    top_values, top_ids = logprobs[j].topk(rows[i].params.logprobs)
                    top = dict(zip(top_ids.tolist(), top_values.tolist()))
                sampled.logprobs[i] = (values[j], top)
        return sampled

    def sample_tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The rows' tokens as a tensor on the logits' device, nothing copied to the host (the
        asynchronous step's): for rows that `is_plain`, the same tokens as `__call__`."""
        logits = _rows_of(logits, rows)
        return argmax_rows(logits) if all_plain_greedy(rows) else _draw(logits, rows)

    @staticmethod
    def _apply_penalties_and_masks(logits: torch.Tensor, row: SamplingRow) -> None:
        """Everything `row` changes in its (1-D) logits, in place."""
        apply_biases_and_penalties(logits[None], [row], [0])
        Sampler._apply_masks(logits, row)

    @staticmethod
    def _apply_masks(logits: torch.Tensor, row: SamplingRow) -> None:
        """What follows the biases and penalties (penalties.py) in a row's (1-D) logits: allowed
        tokens, logits processors, bad words, min_tokens."""
        params = row.params
        if params.allowed_token_ids is not None:
            allowed = to_device(torch.tensor(params.allowed_token_ids), logits.device)
            kept = logits[allowed]
            logits.fill_(float("-inf"))
            logits[allowed] = kept
        for processor in params.logits_processors or ():
            arguments = (list(row.output_token_ids), logits)
            if _takes_prompt(processor):
                arguments = (list(row.prompt_token_ids), *arguments)
            result = processor(*arguments)
            if result is not logits:
                logits.copy_(result)
        banned_words = _banned_by_bad_words(row.bad_words_token_ids, row.output_token_ids)
        if banned_words:
            logits[to_device(torch.tensor(banned_words), logits.device)] = float("-inf")
        if len(row.output_token_ids) < params.min_tokens and not grammar_applies(row.matcher):  # (a grammar decides the end)
            banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(row.eos_token_ids))
            if banned:
                logits[to_device(torch.tensor(sorted(banned)), logits.device)] = float("-inf")


def is_plain(row: SamplingRow) -> bool:
    """Whether the row's token depends on its logits and settings alone (greedy, or temperature,
    top-k, top-p and min-p, seeded or not), whatever tokens the sequence has that the host has
    not booked yet: no penalties, biases, masks, processors or grammar, and no log-probabilities
    to report. (min_tokens counts the booked tokens: one short of the truth at most, it then
    says "not plain" one step too long, never too early.)"""
    return row.plain_settings and not (row.bans_until_min_tokens and len(row.output_token_ids) < row.params.min_tokens)


def all_plain(rows: list[SamplingRow]) -> bool:
    """Whether every row `is_plain` (`always_plain` rows are, without a call)."""
    return all(map(_always_plain, rows)) or all(row.always_plain or is_plain(row) for row in rows)


def all_plain_greedy(rows: list[SamplingRow]) -> bool:
    """Whether every row is greedy and `is_plain` for good (`SamplingRow.plain_greedy`): its
    token is the argmax of its logits, which may then be the model's dtype, scaled or not
    (`compute_narrow_logits(order_only=True)`), rather than float32."""
    return all(map(_plain_greedy, rows))


# (a step reads these of every row: map over attrgetter runs in C, ~4x less than a generator)
_always_plain, _plain_greedy, _greedy = attrgetter("always_plain"), attrgetter("plain_greedy"), attrgetter("greedy")
_logits_index, _generator = attrgetter("logits_index"), attrgetter("generator")


def _rows_of(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The logits rows of `rows`, in order (`logits` itself when they are its rows already)."""
    indices = list(map(_logits_index, rows))
    if logits.shape[0] != len(rows) or indices != list(range(len(rows))):
        logits = logits[to_device(torch.tensor(indices), logits.device)]
    return logits


def _draw(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """One token per row of logits [N, vocab] (row i is rows[i]'s, float32 or the model's dtype):
    argmax for greedy rows."""
    greedy_rows = list(map(_greedy, rows))
    if all(greedy_rows):
        return argmax_rows(logits)
    if not any(greedy_rows):  # (no [N, vocab] gathers in the two common cases)
        return _sample(logits, rows)
    greedy = [i for i, is_greedy in enumerate(greedy_rows) if is_greedy]
    sampled = [i for i, is_greedy in enumerate(greedy_rows) if not is_greedy]
    tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    index = to_device(torch.tensor(greedy), logits.device)
    tokens[index] = argmax_rows(logits[index])
    index = to_device(torch.tensor(sampled), logits.device)
    tokens[index] = _sample(logits[index], [rows[i] for i in sampled])
    return tokens


# The logits dtypes the CPU kernels (argmax, sampling) read, by their names there.
_CPU_KERNEL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value (the first of equals), as `logits.argmax(-1)`. On
    the CPU, float32 and bfloat16 rows go to the Rust kernel (rust/cpu_kernels/argmax.rs) on
    torch's threads: torch's argmax is ~8x slower on rows as wide as a vocabulary, numpy's runs on
    one thread (a greedy step at 256 sequences of a 49k vocabulary, 2 cores: torch ~16 ms, numpy
    ~2 ms)."""
    dtype = _CPU_KERNEL_DTYPES.get(logits.dtype)
    if (dtype is not None and logits.device.type == "cpu" and logits.dim() == 2 and logits.shape[1] > 0
            and logits.is_contiguous()):
        out = torch.empty(logits.shape[0], dtype=torch.long)
        _core.argmax_rows_cpu(out.data_ptr(), logits.data_ptr(), tuple(logits.shape), torch.get_num_threads(), dtype)
        return out
    return logits.argmax(dim=-1)


def _takes_prompt(processor) -> bool:
    """Whether a logits processor has vLLM's three-argument form (prompt ids first)."""
    return len(inspect.signature(processor).parameters) == 3


def _banned_by_bad_words(bad_words: tuple[tuple[int, ...], ...], output_token_ids: list[int]) -> list[int]:
    """The last token of every bad word whose other tokens end the output so far (vLLM's rule:
    a one-token word is always banned; a longer one only where it would be completed)."""
    banned = []
    for word in bad_words:
        prefix = word[:-1]
        if not prefix or (len(output_token_ids) >= len(prefix) and tuple(output_token_ids[-len(prefix):]) == prefix):
            banned.append(word[-1])
    return banned


def changes_logits(row: SamplingRow) -> bool:
    """Whether `_apply_penalties_and_masks` or a grammar would change this row's logits."""
    params = row.params
    if row.matcher is not None or params.logit_bias or params.repetition_penalty != 1.0:
        return True
    if params.allowed_token_ids is not None or row.bad_words_token_ids or params.logits_processors:
        return True
    if (params.presence_penalty or params.frequency_penalty) and row.output_token_ids:
        return True
    return len(row.output_token_ids) < params.min_tokens and bool(
        params.stop_token_ids or (not params.ignore_eos and row.eos_token_ids)
    )


# Top-p first looks among this many best tokens; rows whose top-p set is larger are sorted whole.
_TOP_P_CANDIDATES = 256


def _sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """One token per row of logits [M, vocab] under each row's temperature, top-k, min-p, top-p
    and generator; a seeded row draws the same token whatever else is in the batch."""
    device, vocab = logits.device, logits.shape[-1]
    uniform = _uniform_draws(rows, device)
    if device.type == "cpu" and vocab > 0:
        if logits.dtype not in _CPU_KERNEL_DTYPES:  # (float16: the kernel reads float32 or bfloat16)
            logits = logits.float()
        return _sample_on_cpu(logits.contiguous(), sampling_settings([row.settings for row in rows]), uniform)
    return _sample_with_torch(logits.float(), [row.params for row in rows], uniform)


def _uniform_draws(rows: list[SamplingRow], device: torch.device) -> torch.Tensor:
    """The inverse-CDF draw's uniform number for each row, from the row's own generator when
    seeded (prefetched on the CPU: a torch.rand call per row costs ~3 us)."""
    uniform = torch.rand(len(rows), device=device)
    generators = list(map(_generator, rows))
    if generators.count(None) == len(rows):
        return uniform
    seeded = [i for i, generator in enumerate(generators) if generator is not None]
    if device.type == "cpu" and all(generators[i].device.type == "cpu" for i in seeded):
        uniform[seeded] = torch.tensor([rows[i].next_uniform() for i in seeded])
        return uniform
    for i in seeded:
        generator = generators[i]
        uniform[i] = torch.rand((), generator=generator, device=generator.device).to(device)
    return uniform


def sampling_settings(packed: list[bytes]) -> torch.Tensor:
    """[rows, 4] float32 settings for the kernel from each row's `packed_settings`."""
    return torch.frombuffer(bytearray(b"".join(packed)), dtype=torch.float32).view(len(packed), 4)


def _sample_with_torch(logits: torch.Tensor, params: list[SamplingParams], uniform: torch.Tensor) -> torch.Tensor:
    """`_sample` in torch ops (GPUs; the CPU kernel's reference in tests). Each filter is one
    per-row threshold applied in place to the whole batch (rows without the filter get a threshold
    that keeps everything): no per-row loop, no [M, vocab] copies."""
    device, vocab = logits.device, logits.shape[-1]

    def per_row(values) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=torch.float32), device)[:, None]

    logits = logits / per_row([p.temperature for p in params])
    if any(0 < p.top_k < vocab for p in params):
        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        best = logits.topk(max(k for k in ks if k < vocab), dim=-1).values
        kth = best.gather(1, to_device(torch.tensor([min(k, best.shape[1]) - 1 for k in ks]), device)[:, None])
        kth[to_device(torch.tensor([k == vocab for k in ks]), device)] = float("-inf")
        logits.masked_fill_(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if any(p.min_p > 0 for p in params):
        probs.masked_fill_(probs < per_row([p.min_p for p in params]) * probs.amax(-1, keepdim=True), 0.0)
    if any(p.top_p < 1.0 for p in params):
        probs.masked_fill_(probs < _top_p_thresholds(probs, per_row([p.top_p for p in params])), 0.0)
    cdf = probs.cumsum(dim=-1)
    target = (1.0 - uniform)[:, None] * cdf[:, -1:]  # in (0, total]: never a zero-probability token
    return torch.searchsorted(cdf, target).squeeze(1).clamp_(max=vocab - 1)


def _sample_on_cpu(logits: torch.Tensor, settings: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """`_sample` by the Rust kernel (rust/cpu_kernels/sampling.rs): each row once, in cache, on
    torch's threads (`_sample_with_torch` makes ~8 passes over the batch: ~70 ms a step at 256
    rows of a 49k vocabulary on 2 cores). `logits` float32 or bfloat16 (the model's LM-head
    output, read as it is); `settings` as `sampling_settings` makes them."""
    rows = logits.shape[0]
    settings = settings.to(torch.float32).contiguous()
    uniform = uniform.to(torch.float32).contiguous()
    if settings.shape != (rows, 4) or uniform.shape != (rows,):
        raise ValueError(f"settings {tuple(settings.shape)} and uniform {tuple(uniform.shape)} for {rows} rows")
    out = torch.empty(rows, dtype=torch.int64)
    _core.sample_rows_cpu(out.data_ptr(), logits.data_ptr(), (rows, logits.shape[1]), settings.data_ptr(),
                          uniform.data_ptr(), torch.get_num_threads(), _CPU_KERNEL_DTYPES[logits.dtype])
    return out


def _top_p_thresholds(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[M, 1]: the smallest probability in each row's top-p set, the fewest most probable tokens
    whose mass reaches top_p (rows with top_p = 1 get 0: keep all; ties with it are kept too). The set usually lies among
    the few hundred best tokens, found by topk; rows where it does not are sorted whole."""

    def smallest_kept(values: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        # values sorted descending; a token is kept while the mass before it is < top_p.
        num_kept = (values.cumsum(-1) - values < top_p).sum(-1, keepdim=True).clamp_(min=1)
        return values.gather(1, num_kept - 1)

    values = probs.topk(min(_TOP_P_CANDIDATES, probs.shape[-1]), dim=-1).values
    thresholds = smallest_kept(values, top_p)
    whole = (values.sum(-1, keepdim=True) < top_p).squeeze(1).nonzero().squeeze(1)
    if whole.numel():
        values = probs.index_select(0, whole).sort(dim=-1, descending=True).values
        thresholds[whole] = smallest_kept(values, top_p[whole])
    thresholds[top_p >= 1.0] = 0.0
    return thresholds
