"""Memory study: the buddy allocator and the baselines' slot accounting on hand-made traces with
known answers, the paged replay's accounting against the real scheduler, and a short end-to-end
run of `python benches/memory.py` into a temporary directory."""

import os
from dataclasses import replace

import pytest

from memory_study import main
from memory_study.buddy import BuddyAllocator, next_power_of_two
from memory_study.contiguous import replay_contiguous, reservation
from memory_study.paged import replay_paged
from memory_study.report import BEGIN_MARKER, END_MARKER, write_doc
from memory_study.settings import StudySettings
from memory_study.sharing import replay_sharing
from memory_study.system_prompt import make_system_prompt_trace, replay_system_prompt
from memory_study.timeline import StepSample
from memory_study.traces import ALPACA, Request, make_trace, mean_lengths

TINY = StudySettings(kv_slots=16, block_size=4, max_model_len=8, max_num_seqs=4, max_num_batched_tokens=8,
                     watermark=0.0, num_steps=12, warmup_steps=0, sharing_steps=3)
TINY_SHARING = replace(TINY, kv_slots=32, max_model_len=16, max_num_batched_tokens=16)


def request(name: str, prompt_len: int, output_len: int, arrival_step: int = 0) -> Request:
    return Request(name, arrival_step, tuple(range(1, prompt_len + 1)), output_len)


def as_tuple(sample: StepSample) -> tuple[int, int, int, int, int]:
    return sample.stored, sample.reserved, sample.internal, sample.external, sample.free


# -- buddy allocator --------------------------------------------------------------------------


def test_next_power_of_two():
    assert [next_power_of_two(size) for size in (0, 1, 2, 3, 4, 5, 8, 9, 1000)] == [1, 1, 2, 4, 4, 8, 8, 16, 1024]


def test_buddy_rounds_up_places_low_and_merges_back():
    buddy = BuddyAllocator(16)
    assert buddy.allocate(3) == 0  # a run of 4 at 0; 4..7 and 8..15 stay free
    assert buddy.allocate(5) == 8  # a run of 8: only 8..15 is big enough
    assert buddy.allocate(4) == 4
    assert buddy.num_free_slots == 0
    assert not buddy.can_allocate(1) and buddy.allocate(1) is None
    buddy.free(8)
    assert buddy.can_allocate(8) and not buddy.can_allocate(9)
    buddy.free(0)
    buddy.free(4)
    # 0..3 and 4..7 merged, then with 8..15: one free run again.
    assert buddy.free_offsets[buddy.max_order] == [0] and buddy.num_free_slots == 16


def test_buddy_external_fragmentation_blocks_a_fitting_request():
    buddy = BuddyAllocator(16)
    offsets = [buddy.allocate(4) for _ in range(4)]
    buddy.free(offsets[0])
    buddy.free(offsets[2])
    # 8 slots are free, but in two runs of 4 that are not buddies: no run of 8.
    assert buddy.num_free_slots == 8 and not buddy.can_allocate(8)


def test_buddy_rejects_a_budget_that_is_not_a_power_of_two():
    with pytest.raises(ValueError, match="num_slots=12"):
        BuddyAllocator(12)


# -- contiguous baselines -----------------------------------------------------------------------


def test_reservations_of_the_three_policies():
    prompt3_output5 = request("r", 3, 5)
    assert reservation("max", prompt3_output5, max_model_len=2048) == 2048
    assert reservation("pow2", prompt3_output5, max_model_len=2048) == 3 + 8  # output space rounded up
    assert reservation("oracle", prompt3_output5, max_model_len=2048) == 8


@pytest.mark.parametrize(
    "policy, first_step",
    [
        # A (2+3 tokens) and B (1+2) start at step 0. Slots: stored, reserved, internal, external, free.
        ("max", (3, 5, 8, 0, 0)),     # both reserve 8: A wastes 3, B 5, internally
        ("pow2", (3, 5, 1, 3, 4)),    # A asks 2+4=6, gets 8; B asks 1+2=3, gets 4
        ("oracle", (3, 5, 0, 4, 4)),  # A asks 5, gets 8; B asks 3, gets 4
    ],
)
def test_contiguous_accounting_on_a_hand_made_trace(policy, first_step):
    timeline = replay_contiguous([request("A", 2, 3), request("B", 1, 2)], policy, TINY)
    assert as_tuple(timeline.samples[0]) == first_step
    # Each step stores one more token of each; B ends at step 2 (1+2 tokens), A at step 3.
    assert [s.stored for s in timeline.samples[:4]] == [3, 5, 7, 5]
    assert timeline.finish_steps == [2, 3]
    assert all(s.total() == TINY.kv_slots for s in timeline.samples)
    assert [s.running for s in timeline.samples[:5]] == [2, 2, 2, 1, 0]


def test_free_slots_count_as_external_while_a_request_waits():
    # C needs 9 slots, i.e. a run of 16: it waits until A and B are gone.
    trace = [request("A", 2, 3), request("B", 1, 2), request("C", 4, 5)]
    timeline = replay_contiguous(trace, "oracle", TINY)
    # A's and B's rounding (3 + 1) plus the 4 free slots C cannot use.
    assert as_tuple(timeline.samples[0]) == (3, 5, 0, 8, 0)
    # A frees at the end of step 3; C starts at step 4 with 4 stored, 5 to come, 7 rounded away.
    assert as_tuple(timeline.samples[4]) == (4, 5, 0, 7, 0)
    assert timeline.finish_steps == [2, 3, 9]


def test_every_reservation_adds_up_to_its_run():
    """reserved run = used + reserved for future tokens + internal + external, at every step."""
    settings = StudySettings(kv_slots=1024, max_model_len=256, max_num_batched_tokens=256, num_steps=300, warmup_steps=0)
    trace = make_trace(ALPACA, settings.num_steps, settings.max_model_len, seed=1)
    for policy in ("max", "pow2", "oracle"):
        timeline = replay_contiguous(trace, policy, settings)
        assert all(s.total() == settings.kv_slots for s in timeline.samples)
        assert timeline.finish_steps and timeline.fraction("stored") > 0


# -- paged replay through the real scheduler -----------------------------------------------------


def test_paged_accounting_on_a_hand_made_trace():
    # Block size 4. A: 5 prompt + 3 output tokens; B: 2 + 4.
    timeline = replay_paged([request("A", 5, 3), request("B", 2, 4)], TINY)
    # Step 0: A holds 2 blocks (5 stored, 3 to come), B 1 block (2 stored, 2 to come); 1 block free.
    assert as_tuple(timeline.samples[0]) == (7, 5, 0, 0, 4)
    # Step 3: A stores 8 and finishes; B stores 5 in 2 blocks, 1 slot to come, 2 never used.
    assert as_tuple(timeline.samples[3]) == (13, 1, 2, 0, 0)
    assert timeline.finish_steps == [3, 4]
    assert timeline.samples[3].table_entries == 4


def test_paged_waiting_request_makes_free_blocks_external():
    # C's 7-token prompt needs 2 blocks while A and B hold 3 of 4: its wait makes the free block "others".
    timeline = replay_paged([request("A", 5, 3), request("B", 2, 4), request("C", 7, 1)], TINY)
    assert as_tuple(timeline.samples[0]) == (7, 5, 0, 4, 0)
    assert timeline.samples[0].running == 2


def test_paged_study_settings_replay_adds_up():
    settings = StudySettings(kv_slots=2048, max_model_len=512, max_num_batched_tokens=512, num_steps=300, warmup_steps=50)
    trace = make_trace(ALPACA, settings.num_steps, settings.max_model_len, seed=2)
    timeline = replay_paged(trace, settings)
    assert all(s.total() == settings.kv_slots for s in timeline.samples)
    assert timeline.fraction("stored") > 0.8
    assert timeline.peak_running() > replay_contiguous(trace, "oracle", settings).peak_running()


# -- sharing -----------------------------------------------------------------------------------------


def test_parallel_sampling_shares_the_prompt_blocks():
    # 8 prompt tokens = 2 full blocks of 4, forked once after the prefill; 2 outputs each.
    result = replay_sharing([request("A", 8, 2)], "parallel sampling", 2, TINY_SHARING)
    # Step 0: 2 blocks, one sequence. Steps 1-2: two tables of 3 over 4 distinct blocks.
    assert (result.logical_blocks, result.physical_blocks) == (2 + 6 + 6, 2 + 4 + 4)
    assert result.saving == pytest.approx(4 / 14)
    assert result.num_blocks_copied == 0 and result.completed == 1


def test_parallel_sampling_copies_a_shared_partial_block_on_write():
    result = replay_sharing([request("A", 6, 1)], "parallel sampling", 2, TINY_SHARING)
    # The forked partial block (2 of 4 slots used) is copied when the second sample writes to it.
    assert result.num_blocks_copied == 1 and result.completed == 1
    assert (result.logical_blocks, result.physical_blocks) == (2 + 4, 2 + 3)


def test_beam_search_forks_and_frees_beams_and_saves_blocks():
    settings = StudySettings(kv_slots=2048, max_model_len=512, max_num_batched_tokens=512, sharing_steps=200,
                             warmup_steps=20)
    trace = make_trace(ALPACA, settings.sharing_steps, settings.max_model_len, seed=3)
    result = replay_sharing(trace, "beam search", 4, settings)
    assert result.completed > 0 and result.num_blocks_copied > 0
    parallel = replay_sharing(trace, "parallel sampling", 4, settings)
    assert result.saving > parallel.saving > 0


def test_system_prompt_prefix_caching_saves_blocks_and_prefill():
    settings = StudySettings(kv_slots=2048, max_model_len=512, max_num_batched_tokens=512, system_prompt_len=256,
                             system_prompt_requests=12)
    trace = make_system_prompt_trace(settings)
    assert len({r.prompt_token_ids[:256] for r in trace}) == 1
    off, on = (replay_system_prompt(trace, settings, prefix_caching) for prefix_caching in (False, True))
    assert off.saving == 0 and off.prefix_hit_tokens == 0
    assert on.saving > 0.3 and on.prefix_hit_tokens >= 11 * 256
    assert on.prompt_tokens_computed < off.prompt_tokens_computed and on.steps < off.steps


# -- traces, report, end to end ---------------------------------------------------------------------------


def test_traces_are_seeded_and_have_the_paper_means():
    first = make_trace(ALPACA, 2000, 2048, seed=0)
    assert first == make_trace(ALPACA, 2000, 2048, seed=0) != make_trace(ALPACA, 2000, 2048, seed=1)
    mean_prompt, mean_output = mean_lengths(first)
    assert mean_prompt == pytest.approx(19.31, rel=0.05) and mean_output == pytest.approx(58.45, rel=0.05)


def test_write_doc_keeps_hand_written_text(tmp_path):
    path = str(tmp_path / "memory.md")
    write_doc(path, "first")
    text = open(path).read()
    assert text.startswith("# Memory study") and "first" in text
    with open(path, "w") as doc:
        doc.write(text.replace("# Memory study", "# Memory study\n\nWhy we differ.") + "\nClosing notes.\n")
    write_doc(path, "second")
    text = open(path).read()
    assert "Why we differ." in text and "Closing notes." in text and "second" in text and "first" not in text
    assert text.count(BEGIN_MARKER) == text.count(END_MARKER) == 1


def test_bench_memory_end_to_end(tmp_path, capsys):
    assert main(["--quick", "--num-steps", "350", "--sharing-steps", "260", "--out", str(tmp_path), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "| vLLM (paged) |" in printed and "beam search" in printed
    doc = (tmp_path / "memory.md").read_text()
    for heading in ("Where the KV slots go", "Running sequences", "Sharing", "Shared system prompt", "Block size"):
        assert heading in doc
    plots = sorted(os.listdir(tmp_path / "memory"))
    assert plots == ["block_size.png", "breakdown_alpaca.png", "breakdown_bars.png", "breakdown_sharegpt.png",
                     "concurrency.png", "sharing.png"]
    for name in plots:
        assert (tmp_path / "memory" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
