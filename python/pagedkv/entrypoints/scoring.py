"""Scoring text pairs (vLLM's `LLM.score`, `/score` and `/rerank`): with a cross-encoder, a
sequence classifier of one label, each pair is encoded together (the tokenizer's text-pair
encoding) and its score is the classifier's sigmoid; with any other model, each text is embedded
(the last token's final hidden state) and a pair's score is the cosine similarity of its two
embeddings. These helpers build the requests and combine their outputs; `LLM.score` and the
server run them."""

from __future__ import annotations

from typing import Sequence, Union

import torch

from pagedkv.outputs import PoolingRequestOutput
from pagedkv.params.pooling import PoolingParams


def score_pairs(text_1: Union[str, Sequence[str]], text_2: Union[str, Sequence[str]]) -> list[tuple[str, str]]:
    """vLLM's pairing: one text against each of a list (1 to N), or two lists of one length
    element by element (N to N)."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    if not firsts or not seconds or not all(isinstance(text, str) for text in firsts + seconds):
        raise ValueError("text_1 and text_2 must be non-empty strings or lists of strings")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise ValueError(f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, or as many "
                         "as text_2")
    return list(zip(firsts, seconds))


def scoring_requests(pairs: list[tuple[str, str]], tokenizer, num_labels: int) -> tuple[list, PoolingParams]:
    """(prompts, their pooling parameters): one prompt per pair with a cross-encoder (a classifier
    of one label; `num_labels`: the model's, 0 for a model that is no classifier), else one per
    distinct text, to embed."""
    if num_labels:
        if num_labels != 1:
            raise ValueError(f"scoring needs a cross-encoder (a classifier of one label) or an embedding model; "
                             f"this classifier has {num_labels} labels")
        prompts = [tokenizer(first, second)["input_ids"] for first, second in pairs]
        return prompts, PoolingParams(task="classify")
    return list(dict.fromkeys(text for pair in pairs for text in pair)), PoolingParams(task="embed")


def scores_of(pairs: list[tuple[str, str]], prompts: list, outputs: list[PoolingRequestOutput],
              params: PoolingParams) -> list[tuple[float, list[int]]]:
    """(score, prompt token ids) per pair, from the outputs of `scoring_requests`' prompts, in order."""
    if params.task == "classify":
        return [(output.outputs.probs[0], output.prompt_token_ids) for output in outputs]
    by_text = dict(zip(prompts, outputs))
    results = []
    for first, second in pairs:
        left, right = by_text[first], by_text[second]
        similarity = torch.tensor(left.outputs.embedding) @ torch.tensor(right.outputs.embedding)  # (unit vectors)
        results.append((similarity.item(), left.prompt_token_ids + right.prompt_token_ids))
    return results
