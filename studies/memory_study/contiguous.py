"""Orca-style baselines: each request reserves one contiguous run of KV slots for its whole life.

The three policies differ only in how much they reserve (the paper's §6.1): max_model_len
(Orca max), the prompt plus the output length rounded up to a power of two, i.e. at most 2x
over-reserved output space (Orca pow2; the paper's example reserves 32 for 25 outputs), or
exactly the final length, known in advance (Orca oracle). Runs come from a buddy allocator over the same slot
budget the paged system gets; the step loop is the paged replay's, so timelines line up.
"""

from collections import deque
from dataclasses import dataclass

from memory_study.buddy import BuddyAllocator, next_power_of_two
from memory_study.settings import StudySettings
from memory_study.timeline import StepSample, Timeline
from memory_study.traces import Request, arrivals_by_step

POLICIES = ("max", "pow2", "oracle")


def reservation(policy: str, request: Request, max_model_len: int) -> int:
    """Slots a policy reserves for a request before it starts."""
    if policy == "max":
        return max_model_len
    if policy == "pow2":
        return min(max_model_len, request.prompt_len + next_power_of_two(request.output_len))
    if policy == "oracle":
        return request.final_len
    raise ValueError(f"policy={policy!r} is not one of {POLICIES}")


@dataclass
class Reservation:
    """A running request and the run of slots it holds."""

    request: Request
    offset: int
    run_len: int
    """Slots the buddy allocator handed out (reserved_len rounded up to a power of two)."""
    reserved_len: int
    """Slots the policy asked for."""
    stored: int
    """Tokens whose K/V is in the run so far."""

    def sample(self) -> StepSample:
        """This request's slots by category; they add up to run_len."""
        final_len = self.request.final_len
        return StepSample(
            stored=self.stored,
            reserved=final_len - self.stored,
            internal=self.reserved_len - final_len,
            external=self.run_len - self.reserved_len,
        )


def breakdown(running: list[Reservation], allocator: BuddyAllocator, requests_waiting: bool) -> StepSample:
    """The whole budget at one step. Free slots count as external fragmentation while a
    request waits: it could not be placed in them."""
    total = StepSample(running=len(running))
    for held in running:
        part = held.sample()
        total.stored += part.stored
        total.reserved += part.reserved
        total.internal += part.internal
        total.external += part.external
    if requests_waiting:
        total.external += allocator.num_free_slots
    else:
        total.free = allocator.num_free_slots
    return total


def replay_contiguous(trace: list[Request], policy: str, settings: StudySettings) -> Timeline:
    """Serves the trace FCFS with iteration-level batching: each step every running request
    stores one token, and waiting requests start (whole prompt in one step) while the token
    budget, max_num_seqs and the allocator allow."""
    allocator = BuddyAllocator(settings.kv_slots)
    timeline = Timeline(f"Orca ({policy})", settings.kv_slots, settings.warmup_steps)
    waiting: deque[Request] = deque()
    running: list[Reservation] = []
    for step, arriving in arrivals_by_step(trace, settings.num_steps):
        waiting.extend(arriving)
        for held in running:
            held.stored += 1
        token_budget = settings.max_num_batched_tokens - len(running)
        while waiting and len(running) < settings.max_num_seqs and waiting[0].prompt_len <= token_budget:
            request = waiting[0]
            reserved_len = reservation(policy, request, settings.max_model_len)
            offset = allocator.allocate(reserved_len)
            if offset is None:
                break
            waiting.popleft()
            running.append(Reservation(request, offset, next_power_of_two(reserved_len), reserved_len, request.prompt_len))
            token_budget -= request.prompt_len
        timeline.samples.append(breakdown(running, allocator, bool(waiting)))
        for held in [held for held in running if held.stored == held.request.final_len]:
            allocator.free(held.offset)
            running.remove(held)
            timeline.finish_steps.append(step)
    return timeline
