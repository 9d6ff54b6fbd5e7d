"""From a step's final hidden states and logits to its results: sampled tokens, verified drafts,
prompt logprobs and pooled vectors. Each result that can fail for one sequence (a logits
processor that raises, ...) fails alone: the error is kept for that sequence and the rest of
the step goes on."""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from pagedkv.params.pooling import PoolingParams
from pagedkv.runner.sampler import SampledTokens, Sampler, SamplingRow, argmax_rows
from pagedkv.runner.step_messages import PromptLogprobsRequest
from pagedkv.kernels.transfer import to_device

logger = logging.getLogger("pagedkv.runner")

# Prompt logprobs are computed this many rows at a time: a chunk's whole logits would be [tokens, vocab].
_PROMPT_LOGPROB_ROWS = 256


def sample(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow], row_seq_ids: list[int],
           errors: dict[int, BaseException],
           recompute_logits: Optional[Callable[[], torch.Tensor]] = None) -> SampledTokens:
    """Every row at once; if that raises, row by row, so a bad row fails alone (its token None).
    With `recompute_logits` the batch may change `logits` in place (the caller needs them no
    more), and the rows one by one start from logits computed again."""
    try:
        return sampler.sample(logits, rows, in_place=recompute_logits is not None)
    except Exception:
        logger.warning("sampling the batch failed; sampling its rows one by one")
    if recompute_logits is not None:  # (the failed batch may have changed some rows already)
        logits = recompute_logits()
    sampled = SampledTokens([])
    for index, (row, seq_id) in enumerate(zip(rows, row_seq_ids)):
        token_id = None
        if seq_id not in errors:
            try:
                alone = sampler.sample(logits, [row])
                token_id = alone.token_ids[0]
                if alone.logprobs:
                    sampled.logprobs[index] = alone.logprobs[0]
            except Exception as error:
                errors[seq_id] = error  # (the engine logs it, aborting that request)
        sampled.token_ids.append(token_id)
    return sampled


def verify_drafts(compute_logits: Callable, hidden: torch.Tensor, drafts: list[int]) -> list[int]:
    """`hidden`: final hidden states of [the last token, *drafts]. The drafts the model agrees
    with (greedy), then the model's own next token after them."""
    targets = argmax_rows(compute_logits(hidden[-(len(drafts) + 1):])).tolist()
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return drafts[:accepted] + [targets[accepted]]


def prompt_logprobs(compute_logits: Callable, hidden: torch.Tensor, request: PromptLogprobsRequest) -> list[dict]:
    """`hidden` [tokens, hidden size]: final hidden states of a prefill chunk from position
    `request.start`; row r predicts prompt token start + r + 1. One {token: logprob} entry per
    prompt position from `request.first` that the chunk predicts (the prompt token's and the
    top ones)."""
    prompt, first, start, top = request.prompt_token_ids, request.first, request.start, request.top
    low, high = first - 1 - start, min(len(prompt) - 1 - start, hidden.shape[0])
    entries: list[dict] = []
    if low < 0 or high <= low:  # nothing new here (a gap cannot happen: such prompts skip the prefix cache)
        return entries
    for slice_low in range(low, high, _PROMPT_LOGPROB_ROWS):
        slice_high = min(high, slice_low + _PROMPT_LOGPROB_ROWS)
        target_ids = prompt[first + slice_low - low : first + slice_high - low]
        logprobs = torch.log_softmax(compute_logits(hidden[slice_low:slice_high]).float(), dim=-1)
        targets = to_device(torch.tensor(target_ids), logprobs.device)
        chosen = logprobs.gather(1, targets[:, None]).squeeze(1).tolist()
        if top:
            top_values, top_ids = logprobs.topk(top, dim=-1)
            top_values, top_ids = top_values.tolist(), top_ids.tolist()
        for row, (target, value) in enumerate(zip(target_ids, chosen)):
            entry = dict(zip(top_ids[row], top_values[row])) if top else {}
            entry[target] = value
            entries.append(entry)
    return entries


def pool(classifier, last_hidden: torch.Tensor, params: PoolingParams) -> list[float]:
    """The prompt's embedding (its last token's final hidden state, normalized if asked) or the
    classifier's scores of it."""
    if params.task == "classify":
        vector = classifier(last_hidden, params.use_activation)
    else:
        vector = last_hidden.float()
        if params.normalize:
            vector = torch.nn.functional.normalize(vector, dim=-1)
    return vector.tolist()
