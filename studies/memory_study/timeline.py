"""Per-step KV slot breakdown of one replay, and its time averages (the paper's Figure 2)."""

from dataclasses import dataclass, field

# The paper's categories, in the order they are stacked in plots and tables.
CATEGORIES = ("stored", "reserved", "internal", "external", "free")
LABELS = {
    "stored": "token states",
    "reserved": "reserved for future tokens",
    "internal": "internal fragmentation",
    "external": "external fragmentation & others",
    "free": "free (queue empty)",
}


@dataclass
class StepSample:
    """Where every KV slot is at one step (the fields add up to the whole budget).

    stored: slots holding a token's K/V. reserved: slots a request holds for tokens it will
    still generate. internal: slots it holds that it will never use. external: slots no
    request can use, either lost to the allocator's rounding or left free while requests wait.
    free: slots left free while no request waits.
    """

    stored: int = 0
    reserved: int = 0
    internal: int = 0
    external: int = 0
    free: int = 0
    running: int = 0
    """Sequences running after this step's scheduling."""
    table_entries: int = 0
    """Block-table entries of the running sequences (paged system only)."""

    def total(self) -> int:
        """All slots: equals the KV budget."""
        return self.stored + self.reserved + self.internal + self.external + self.free


@dataclass
class Timeline:
    """One system's replay of one trace: a sample per step, the steps requests finished on."""

    system: str
    kv_slots: int
    warmup_steps: int
    samples: list[StepSample] = field(default_factory=list)
    finish_steps: list[int] = field(default_factory=list)
    num_preemptions: int = 0

    def measured(self) -> list[StepSample]:
        """The samples after the warm-up."""
        return self.samples[self.warmup_steps :]

    def fraction(self, category: str) -> float:
        """Time-averaged share of the KV budget in one category (0..1)."""
        samples = self.measured()
        return sum(getattr(s, category) for s in samples) / (self.kv_slots * max(1, len(samples)))

    def mean_running(self) -> float:
        """Time-averaged running sequences after the warm-up."""
        samples = self.measured()
        return sum(s.running for s in samples) / max(1, len(samples))

    def peak_running(self) -> int:
        """Most sequences running at one step after the warm-up."""
        return max((s.running for s in self.measured()), default=0)

    def mean_table_entries(self) -> float:
        """Block-table entries per running sequence, averaged over sequences and steps."""
        samples = self.measured()
        return sum(s.table_entries for s in samples) / max(1, sum(s.running for s in samples))

    def requests_per_kilostep(self) -> float:
        """Requests completed per 1000 scheduler steps after the warm-up."""
        done = sum(1 for step in self.finish_steps if step >= self.warmup_steps)
        return 1000 * done / max(1, len(self.measured()))
