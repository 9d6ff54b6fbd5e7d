"""vLLM's `thinking_token_budget`: a reply's think block (a reasoning parser's `<think>` ...
`</think>`, opened by the reply or by the chat template in the prompt) is closed after at most
that many tokens: once they are spent, the sampler is made to write `</think>`'s tokens next
(a logits processor), and the reply goes on as content."""

from __future__ import annotations

from typing import Callable, Optional

import torch

Processor = Callable[[list[int], list[int], torch.Tensor], torch.Tensor]


def _last(tokens: list[int], marker: list[int], start: int) -> int:
    """Where `marker` last begins in tokens[start:] (an index into `tokens`), or -1."""
    for index in range(len(tokens) - len(marker), start - 1, -1):
        if tokens[index:index + len(marker)] == marker:
            return index
    return -1


def budget_processor(budget: int, start: list[int], end: list[int],
                     prompt_opens: Callable[[list[int]], bool]) -> Processor:
    """A logits processor (prompt ids, output ids, logits) that forces `end`'s tokens once a think
    block has `budget` tokens. Only the output's last budget + markers tokens are looked at: a
    block that ran longer was closed (this forced it), so past them the reply is content.
    `prompt_opens(prompt ids)`: whether the prompt ends inside a think block (read as text: a
    template's `<think>` may merge with the tokens around it)."""
    window = budget + len(start) + len(end)
    opened_by_prompt: dict[tuple, bool] = {}

    def spent(prompt: list[int], output: list[int]) -> Optional[int]:
        """Tokens in the open think block, or None where none is open."""
        first = max(0, len(output) - window)
        opened, closed = _last(output, start, first), _last(output, end, first)
        if closed > opened:
            return None
        if opened >= 0:
            return len(output) - opened - len(start)
        if first > 0:
            return None
        key = (len(prompt), tuple(prompt[-window:]))
        if key not in opened_by_prompt:
            opened_by_prompt[key] = prompt_opens(prompt)
        return len(output) if opened_by_prompt[key] else None

    def force_end(prompt: list[int], output: list[int], logits: torch.Tensor) -> torch.Tensor:
        used = spent(prompt, output)
        if used is None or used < budget:
            return logits
        written = next(k for k in range(len(end) - 1, -1, -1) if k == 0 or output[-k:] == end[:k])
        logits.fill_(float("-inf"))
        logits[end[written]] = 0.0
        return logits

    return force_end
