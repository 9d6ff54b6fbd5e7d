"""Block sharing: parallel sampling and beam search replayed through the real scheduler.

Parallel sampling forks the n-1 other samples off the prompt right after its prefill, as the
engine does; every sample then runs to the request's output length (EOS ignored, as is usual
in serving benchmarks). Beam search is the engine's own `BeamSearch` fed random logits: each
step it keeps the best `width` of all beams' candidates, forking a beam chosen more than once
and freeing a beam chosen by none, so beams share the blocks of their common ancestors.

Saving = 1 - physical / logical blocks over the measured steps, where logical counts each
sequence's block table in full (what the sequences would hold without sharing) and physical
counts distinct device blocks.
"""

from dataclasses import dataclass

import torch

from pagedkv import Scheduler
from pagedkv.engine.beam_search import BeamSearch
from memory_study.paged import measure, next_token, scheduler_config
from memory_study.settings import StudySettings
from memory_study.traces import Request, arrivals_by_step

BEAM_VOCAB_SIZE = 1000


@dataclass
class SharingResult:
    """One decoding mode at one width, over the measured steps."""

    decoding: str
    """'parallel sampling' or 'beam search'."""
    width: int
    """n samples or beams per request."""
    logical_blocks: int = 0
    """Block-table entries of the running sequences, summed over steps."""
    physical_blocks: int = 0
    """Distinct device blocks they use, summed over steps."""
    running_seq_steps: int = 0
    num_blocks_copied: int = 0
    """Copy-on-write block copies over the whole run."""
    completed: int = 0
    """Requests finished after the warm-up."""
    measured_steps: int = 0

    @property
    def saving(self) -> float:
        """Share of blocks saved by sharing (0..1)."""
        return 1 - self.physical_blocks / max(1, self.logical_blocks)

    @property
    def mean_running_seqs(self) -> float:
        return self.running_seq_steps / max(1, self.measured_steps)

    @property
    def requests_per_kilostep(self) -> float:
        return 1000 * self.completed / max(1, self.measured_steps)


def replay_sharing(trace: list[Request], decoding: str, width: int, settings: StudySettings) -> SharingResult:
    """Serves the trace with `width` samples or beams per request for settings.sharing_steps
    steps. Preempted groups are swapped out (recomputing would re-prefill each beam apart and
    lose its sharing), so the CPU pool is sized to never refuse a swap."""
    if decoding not in ("parallel sampling", "beam search"):
        raise ValueError(f"decoding={decoding!r} is not 'parallel sampling' or 'beam search'")
    # Beam search runs torch on tensors of a few thousand floats: extra threads only add
    # synchronisation (100x slower on a busy 2-core machine).
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_sharing(trace, decoding, width, settings)
    finally:
        torch.set_num_threads(num_threads)


def run_sharing(trace: list[Request], decoding: str, width: int, settings: StudySettings) -> SharingResult:
    num_device_blocks = settings.kv_slots // settings.block_size
    scheduler = Scheduler(scheduler_config(settings, preemption_mode="swap", num_cpu_blocks=8 * num_device_blocks))
    result = SharingResult(decoding, width)
    generator = torch.Generator().manual_seed(settings.seed)
    final_len: dict[int, int] = {}
    request_of: dict[int, Request] = {}
    searches: dict[str, BeamSearch] = {}
    live: dict[str, int] = {}
    for step, arriving in arrivals_by_step(trace, settings.sharing_steps):
        for request in arriving:
            seq_id = scheduler.add_request(request.request_id, list(request.prompt_token_ids))
            final_len[seq_id], request_of[seq_id] = request.final_len, request
            if decoding == "beam search":
                # max_tokens counts the sampled token that never gets KV: +1 so beams store final_len.
                searches[request.request_id] = BeamSearch(
                    beam_width=width, num_outputs=width, max_tokens=request.output_len + 1, length_penalty=1.0,
                    eos_token_ids=frozenset(), ignore_eos=True, running={seq_id: ([], 0.0)},
                )
        out = scheduler.schedule()
        sample, physical = measure(out, final_len, settings.block_size)
        if step >= settings.warmup_steps:
            result.measured_steps += 1
            result.logical_blocks += sample.table_entries
            result.physical_blocks += len(physical)
            result.running_seq_steps += sample.running
        sampled = [seq for seq in out.scheduled if seq.sample]
        if decoding == "parallel sampling":
            finished = step_parallel(scheduler, sampled, width, final_len, request_of, live)
        else:
            finished = step_beams(scheduler, sampled, searches, final_len, request_of, generator)
        if step >= settings.warmup_steps:
            result.completed += finished
    result.num_blocks_copied = int(scheduler.stats()["num_blocks_copied"])
    return result


def step_parallel(scheduler: Scheduler, sampled, n: int, final_len: dict[int, int], request_of: dict, live: dict[str, int]) -> int:
    """Appends a token to every sampled sequence, forking the other n-1 samples right after the
    prefill (`live` counts each request's unfinished samples). Returns requests finished."""
    finished = 0
    for seq in sampled:
        request = request_of[seq.seq_id]
        targets = [seq.seq_id]
        if request.request_id not in live:
            live[request.request_id] = n
            for _ in range(n - 1):
                child = scheduler.fork(seq.seq_id)
                final_len[child], request_of[child] = final_len[seq.seq_id], request
                targets.append(child)
        for seq_id in targets:
            if seq.end < final_len[seq_id]:
                scheduler.append_token(seq_id, next_token(seq_id, seq.end))
                continue
            scheduler.finish_sequence(seq_id)
            del final_len[seq_id], request_of[seq_id]
            live[request.request_id] -= 1
            finished += live[request.request_id] == 0
    return finished


def step_beams(scheduler: Scheduler, sampled, searches: dict[str, BeamSearch], final_len: dict[int, int], request_of: dict, generator) -> int:
    """One beam-search step for every request whose beams were sampled, on random logits.
    Returns the number of requests that finished."""
    beams_of: dict[str, list[int]] = {}
    for seq in sampled:
        beams_of.setdefault(request_of[seq.seq_id].request_id, []).append(seq.seq_id)
    finished = 0
    for request_id, seq_ids in beams_of.items():
        search = searches[request_id]
        request = request_of[seq_ids[0]]
        logits = random_logits(len(seq_ids), generator)
        before = set(search.running)
        moves = search.step(seq_ids, logits)
        children = scheduler.update([seq_id for seq_id, _ in moves.appends], [token for _, token in moves.appends],
                                    finished=moves.finished, forks=[(parent, token, False) for parent, token in moves.forks])
        search.settle(moves, children)
        for seq_id in set(search.running) - before:
            final_len[seq_id], request_of[seq_id] = final_len[seq_ids[0]], request
        for seq_id in before - set(search.running):
            del final_len[seq_id], request_of[seq_id]
        if search.done:
            del searches[request_id]
            finished += 1
    return finished


def random_logits(num_beams: int, generator: torch.Generator) -> torch.Tensor:
    """Next-token logits of a stand-in model: normal over a small vocabulary, scaled so that the
    most likely token gets about half of the probability mass on average. (The savings barely
    move with the scale: top-1 mass from 5% to 54% changes them by under 4 points.)"""
    return 5.0 * torch.randn(num_beams, BEAM_VOCAB_SIZE, generator=generator)
