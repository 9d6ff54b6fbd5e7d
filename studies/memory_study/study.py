"""Runs every experiment of the study with one set of settings and collects the results."""

from dataclasses import dataclass, field

from tqdm import tqdm

from memory_study.contiguous import POLICIES, replay_contiguous
from memory_study.paged import replay_paged
from memory_study.settings import StudySettings
from memory_study.sharing import SharingResult, replay_sharing
from memory_study.system_prompt import SystemPromptResult, make_system_prompt_trace, replay_system_prompt
from memory_study.timeline import Timeline
from memory_study.traces import ALPACA, SHAREGPT, TraceShape, make_trace, mean_lengths

TRACES = (SHAREGPT, ALPACA)
SHARING_WIDTHS = (2, 4, 6)
BLOCK_SIZES = (8, 16, 32, 64, 128)


@dataclass
class TraceSummary:
    """What a generated trace turned out to be (lengths are redrawn to fit max_model_len)."""

    shape: TraceShape
    num_requests: int
    mean_prompt_len: float
    mean_output_len: float


@dataclass
class StudyResults:
    """Everything `report.py` and `plots.py` show."""

    settings: StudySettings
    traces: list[TraceSummary] = field(default_factory=list)
    breakdown: dict[str, list[Timeline]] = field(default_factory=dict)
    """Trace name -> Orca (max), Orca (pow2), Orca (oracle), paged."""
    sharing: list[SharingResult] = field(default_factory=list)
    system_prompt: list[SystemPromptResult] = field(default_factory=list)
    block_sizes: dict[str, list[tuple[int, Timeline]]] = field(default_factory=dict)
    """Trace name -> (block size, paged timeline) for each swept size."""


def run_study(settings: StudySettings, show_progress: bool = True) -> StudyResults:
    """Every experiment, in a fixed order; the same settings and seed give the same numbers."""
    results = StudyResults(settings)
    block_sizes = sorted({*BLOCK_SIZES, settings.block_size})
    num_runs = len(TRACES) * (len(POLICIES) + len(block_sizes)) + 2 * len(SHARING_WIDTHS) + 2
    progress = tqdm(total=num_runs, desc="memory study", disable=not show_progress)

    def advance(label: str) -> None:
        progress.set_postfix_str(label)
        progress.update()

    traces = {}
    for shape in TRACES:
        trace = make_trace(shape, settings.num_steps, settings.max_model_len, settings.seed)
        traces[shape.name] = trace
        results.traces.append(TraceSummary(shape, len(trace), *mean_lengths(trace)))
        timelines = []
        for policy in POLICIES:
            timelines.append(replay_contiguous(trace, policy, settings))
            advance(f"{shape.name} Orca ({policy})")
        results.block_sizes[shape.name] = []
        for block_size in block_sizes:
            timeline = replay_paged(trace, settings.with_block_size(block_size))
            results.block_sizes[shape.name].append((block_size, timeline))
            if block_size == settings.block_size:
                timelines.append(timeline)
            advance(f"{shape.name} paged, block size {block_size}")
        results.breakdown[shape.name] = timelines

    # The paper reports sharing on Alpaca; its short prompts make it the harder case for parallel sampling.
    sharing_trace = make_trace(ALPACA, settings.sharing_steps, settings.max_model_len, settings.seed)
    for decoding in ("parallel sampling", "beam search"):
        for width in SHARING_WIDTHS:
            results.sharing.append(replay_sharing(sharing_trace, decoding, width, settings))
            advance(f"{decoding} {width}")

    system_prompt_trace = make_system_prompt_trace(settings)
    for prefix_caching in (False, True):
        results.system_prompt.append(replay_system_prompt(system_prompt_trace, settings, prefix_caching))
        advance(f"system prompt, prefix caching {'on' if prefix_caching else 'off'}")
    progress.close()
    return results
