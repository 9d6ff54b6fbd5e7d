"""The paged system: a trace replayed through the real Rust scheduler and block manager.

No model runs. Each step the scheduler plans the batch exactly as it would for the engine;
every sequence it asked to sample gets a token appended, or is finished once it reaches its
final length. Slots are counted from the block tables the scheduler hands out, so the
accounting is that of the real allocator, not a model of it.
"""

from pagedkv import Scheduler, SchedulerConfig, SchedulerOutput
from memory_study.settings import StudySettings
from memory_study.timeline import StepSample, Timeline
from memory_study.traces import VOCAB_SIZE, Request, arrivals_by_step

PAGED_SYSTEM = "vLLM (paged)"


def scheduler_config(
    settings: StudySettings,
    *,
    enable_prefix_caching: bool = False,
    preemption_mode: str = "recompute",
    num_cpu_blocks: int = 0,
    max_waiting_requests: int = 1 << 30,
) -> SchedulerConfig:
    """The study's budget as a scheduler config. Chunked prefill is off so that a prompt is
    prefilled in one step, as in the contiguous baselines (and in the paper's vLLM)."""
    return SchedulerConfig(
        block_size=settings.block_size,
        num_device_blocks=settings.kv_slots // settings.block_size,
        num_cpu_blocks=num_cpu_blocks,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_model_len=settings.max_model_len,
        max_waiting_requests=max_waiting_requests,
        enable_prefix_caching=enable_prefix_caching,
        enable_chunked_prefill=False,
        preemption_mode=preemption_mode,
        watermark=settings.watermark,
    )


def next_token(seq_id: int, length: int) -> int:
    """A stand-in for the sampled token: deterministic, and different across sequences."""
    return (seq_id * 7919 + length) % VOCAB_SIZE


def measure(out: SchedulerOutput, final_len: dict[int, int], block_size: int) -> tuple[StepSample, set[int]]:
    """Slots of the sequences scheduled this step, by category, counted per sequence (so
    shared blocks count once per sequence), and the set of distinct device blocks they use.

    A sequence's block-table slots hold its `end` computed tokens; of the rest, those its
    future tokens will fill are reserved, the ones past its final length internal
    fragmentation (the paper's split of the last block's waste).
    """
    sample = StepSample(running=len(out.scheduled))
    physical: set[int] = set()
    for seq in out.scheduled:
        table = seq.block_table
        slots = len(table) * block_size
        reach = min(final_len[seq.seq_id], slots)
        sample.stored += seq.end
        sample.reserved += reach - seq.end
        sample.internal += slots - reach
        sample.table_entries += len(table)
        physical.update(table)
    return sample, physical


def add_free_slots(sample: StepSample, stats: dict, num_used_blocks: int, settings: StudySettings) -> None:
    """Completes a sample to the whole budget. Free slots are 'external & others' while a
    request waits (as for the baselines), free otherwise. Blocks neither free nor used by a
    scheduled sequence (a group swapped in but not run this step) also count as others."""
    free_slots = stats["num_free_device_blocks"] * settings.block_size
    sample.external += settings.kv_slots - num_used_blocks * settings.block_size - free_slots
    if stats["num_waiting"] or stats["num_swapped"]:
        sample.external += free_slots
    else:
        sample.free += free_slots


def replay_paged(trace: list[Request], settings: StudySettings) -> Timeline:
    """Serves the trace through the real scheduler (FCFS, recompute preemption, no prefix
    caching); one sample per step, taken after scheduling and before finished requests free."""
    scheduler = Scheduler(scheduler_config(settings))
    timeline = Timeline(PAGED_SYSTEM, settings.kv_slots, settings.warmup_steps)
    final_len: dict[int, int] = {}
    for step, arriving in arrivals_by_step(trace, settings.num_steps):
        for request in arriving:
            final_len[scheduler.add_request(request.request_id, list(request.prompt_token_ids))] = request.final_len
        out = scheduler.schedule()
        sample, physical = measure(out, final_len, settings.block_size)
        stats = scheduler.stats()
        # Without sharing, swapping or caching, the allocator's used blocks are exactly the
        # scheduled sequences' tables: a check that this accounting matches the Rust pool.
        num_used_blocks = stats["num_device_blocks"] - stats["num_free_device_blocks"]
        assert num_used_blocks == len(physical) == sample.table_entries, f"step {step}: {stats}"
        add_free_slots(sample, stats, num_used_blocks, settings)
        timeline.samples.append(sample)
        for seq in out.scheduled:
            if not seq.sample:
                continue
            if seq.end >= final_len[seq.seq_id]:
                scheduler.finish_sequence(seq.seq_id)
                del final_len[seq.seq_id]
                timeline.finish_steps.append(step)
            else:
                scheduler.append_token(seq.seq_id, next_token(seq.seq_id, seq.end))
    stats = scheduler.stats()
    timeline.num_preemptions = int(stats["num_preemptions_recompute"] + stats["num_preemptions_swap"])
    return timeline
