"""The serving setup every system in the study shares: KV budget, limits, run length."""

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class StudySettings:
    """One KV budget and one set of limits, given to the paged system and every baseline.

    The full run's budget models OPT-13B on a 40 GB A100 as in the paper: about 12 GB is left
    for the KV cache after the weights, at 800 KB per token some 15,000 slots, rounded to the
    power of two 16,384 that the buddy allocator needs.
    """

    kv_slots: int = 16384
    """KV budget in token slots (a power of two, so the buddy allocator covers it exactly)."""
    block_size: int = 16
    """Tokens per block of the paged system."""
    max_model_len: int = 2048
    """Longest sequence; Orca (max) reserves this many slots per request."""
    max_num_seqs: int = 1024
    """Most running sequences; high, so that KV memory and not this limit bounds the batch."""
    max_num_batched_tokens: int = 2048
    """Tokens computed per step (prompt tokens plus one per decoding sequence)."""
    watermark: float = 0.01
    """Share of device blocks the paged scheduler's admissions leave free (vLLM's default)."""
    num_steps: int = 6000
    """Scheduler steps simulated per run."""
    warmup_steps: int = 1000
    """Steps left out of the time averages while the batch fills up."""
    sharing_steps: int = 2500
    """Steps of the parallel-sampling and beam-search runs."""
    system_prompt_len: int = 1000
    """Tokens of the system prompt shared by every request of the prefix-caching run."""
    system_prompt_requests: int = 100
    seed: int = 0

    def __post_init__(self):
        if self.kv_slots <= 0 or self.kv_slots & (self.kv_slots - 1):
            raise ValueError(f"kv_slots={self.kv_slots} must be a power of two (the buddy allocator covers it whole)")
        if self.kv_slots % self.block_size:
            raise ValueError(f"kv_slots={self.kv_slots} must be a multiple of block_size={self.block_size}")
        if not self.max_model_len <= min(self.kv_slots, self.max_num_batched_tokens):
            # Every request must fit the budget alone, and its prompt one step (no chunked prefill).
            raise ValueError(f"max_model_len={self.max_model_len} must be <= kv_slots={self.kv_slots} and "
                             f"<= max_num_batched_tokens={self.max_num_batched_tokens}")

    def with_block_size(self, block_size: int) -> "StudySettings":
        """The same budget in slots, cut into blocks of another size."""
        return replace(self, block_size=block_size)


FULL = StudySettings()
# A quarter of the budget and short runs: the CI study, under 20 s on two cores.
QUICK = StudySettings(kv_slots=4096, max_model_len=1024, max_num_batched_tokens=1024, num_steps=900,
                      warmup_steps=200, sharing_steps=500, system_prompt_len=400,
                      system_prompt_requests=30)
