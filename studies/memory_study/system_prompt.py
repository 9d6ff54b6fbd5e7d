"""A shared system prompt: the same long prefix on every request, prefix caching on vs off.

All requests arrive at once (an offline batch) and the run lasts until the last one finishes.
With caching on, the prefix's full blocks are computed once and then mapped into every later
request's block table; with it off, each request stores its own copy.
"""

import random
from dataclasses import dataclass

from pagedkv import Scheduler
from memory_study.paged import measure, next_token, scheduler_config
from memory_study.settings import StudySettings
from memory_study.traces import SHAREGPT, VOCAB_SIZE, Request, sample_lengths

MAX_STEPS = 100_000


@dataclass
class SystemPromptResult:
    """One run of the shared-prefix batch."""

    prefix_caching: bool
    num_requests: int
    steps: int = 0
    """Steps until the last request finished."""
    running_request_steps: int = 0
    peak_running: int = 0
    logical_blocks: int = 0
    """Block-table entries of the running requests, summed over steps."""
    physical_blocks: int = 0
    """Distinct device blocks they use, summed over steps."""
    prompt_tokens_computed: int = 0
    """Prefill tokens the model would run: cache hits are not computed, recomputation after
    a preemption is."""
    prefix_hit_tokens: int = 0

    @property
    def mean_running(self) -> float:
        return self.running_request_steps / max(1, self.steps)

    @property
    def blocks_per_request(self) -> float:
        """Distinct device blocks per running request, time-averaged."""
        return self.physical_blocks / max(1, self.running_request_steps)

    @property
    def saving(self) -> float:
        """Share of blocks saved by sharing the prefix (0..1)."""
        return 1 - self.physical_blocks / max(1, self.logical_blocks)

    @property
    def requests_per_kilostep(self) -> float:
        return 1000 * self.num_requests / max(1, self.steps)


def make_system_prompt_trace(settings: StudySettings) -> list[Request]:
    """settings.system_prompt_requests requests, all at step 0: one shared system prompt of
    settings.system_prompt_len tokens, then a ShareGPT-like user turn and answer."""
    if settings.system_prompt_len >= settings.max_model_len:
        raise ValueError(f"system_prompt_len={settings.system_prompt_len} leaves no room under "
                         f"max_model_len={settings.max_model_len}")
    rng = random.Random(f"system-prompt-{settings.seed}")
    system_prompt = tuple(rng.randrange(VOCAB_SIZE) for _ in range(settings.system_prompt_len))
    requests = []
    for index in range(settings.system_prompt_requests):
        user_len, output_len = sample_lengths(rng, SHAREGPT, settings.max_model_len - settings.system_prompt_len)
        user_turn = tuple(rng.randrange(VOCAB_SIZE) for _ in range(user_len))
        requests.append(Request(f"system-prompt-{index}", 0, system_prompt + user_turn, output_len))
    return requests


def replay_system_prompt(trace: list[Request], settings: StudySettings, prefix_caching: bool) -> SystemPromptResult:
    """Serves the batch to the end through the real scheduler (recompute preemption)."""
    scheduler = Scheduler(scheduler_config(settings, enable_prefix_caching=prefix_caching))
    result = SystemPromptResult(prefix_caching, len(trace))
    final_len = {scheduler.add_request(r.request_id, list(r.prompt_token_ids)): r.final_len for r in trace}
    while scheduler.has_unfinished_requests():
        if result.steps == MAX_STEPS:
            raise RuntimeError(f"the system-prompt batch did not finish in {MAX_STEPS} steps")
        out = scheduler.schedule()
        result.steps += 1
        sample, physical = measure(out, final_len, settings.block_size)
        result.running_request_steps += sample.running
        result.peak_running = max(result.peak_running, sample.running)
        result.logical_blocks += sample.table_entries
        result.physical_blocks += len(physical)
        result.prefix_hit_tokens += out.num_prefix_hit_tokens
        for seq in out.scheduled:
            if seq.is_prefill:
                result.prompt_tokens_computed += seq.end - seq.start
            if not seq.sample:
                continue
            if seq.end >= final_len[seq.seq_id]:
                scheduler.finish_sequence(seq.seq_id)
            else:
                scheduler.append_token(seq.seq_id, next_token(seq.seq_id, seq.end))
    return result
