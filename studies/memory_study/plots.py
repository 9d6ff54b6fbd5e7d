"""The study's PNG plots (matplotlib, Agg backend: no display needed)."""

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from memory_study.report import PAPER_SAVINGS, PAPER_TOKEN_STATES, slug  # noqa: E402
from memory_study.study import StudyResults  # noqa: E402
from memory_study.timeline import CATEGORIES, LABELS  # noqa: E402

COLORS = {"stored": "#4c9a2a", "reserved": "#f2c14e", "internal": "#e07a5f", "external": "#8d6a9f", "free": "#d9d9d9"}


def save(figure, directory: str, name: str) -> str:
    path = os.path.join(directory, name)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return path


def plot_breakdown_over_time(results: StudyResults, directory: str) -> list[str]:
    """Per trace: one stacked-area panel per system, % of the budget in each category per step."""
    paths = []
    for name, timelines in results.breakdown.items():
        figure, axes = plt.subplots(2, 2, figsize=(11, 6.5), sharex=True, sharey=True)
        for axis, timeline in zip(axes.flat, timelines):
            steps = range(len(timeline.samples))
            shares = [[100 * getattr(s, c) / timeline.kv_slots for s in timeline.samples] for c in CATEGORIES]
            axis.stackplot(steps, shares, colors=[COLORS[c] for c in CATEGORIES], labels=[LABELS[c] for c in CATEGORIES],
                           linewidth=0)
            axis.axvline(timeline.warmup_steps, color="black", linewidth=0.8, linestyle=":")
            axis.set_title(f"{timeline.system}: {100 * timeline.fraction('stored'):.1f}% token states")
            axis.set_ylim(0, 100)
            axis.set_xlim(0, len(timeline.samples) - 1)
        for axis in axes[-1]:
            axis.set_xlabel("scheduler step")
        for axis in axes[:, 0]:
            axis.set_ylabel("% of KV slots")
        handles, labels = axes.flat[0].get_legend_handles_labels()
        figure.legend(handles, labels, loc="lower center", ncol=len(CATEGORIES), frameon=False)
        figure.suptitle(f"KV slot breakdown, {name}-like trace (dotted: end of warm-up)")
        figure.tight_layout(rect=(0, 0.05, 1, 1))
        paths.append(save(figure, directory, f"breakdown_{slug(name)}.png"))
    return paths


def plot_breakdown_bars(results: StudyResults, directory: str) -> str:
    """The paper's Figure 2: one stacked bar per system and trace, the paper's token-state share marked."""
    rows = [(f"{t.system}\n{name}", t) for name, timelines in results.breakdown.items() for t in timelines]
    figure, axis = plt.subplots(figsize=(9, 0.55 * len(rows) + 1.2))
    for index, (label, timeline) in enumerate(rows):
        left = 0.0
        for category in CATEGORIES:
            width = 100 * timeline.fraction(category)
            axis.barh(index, width, left=left, color=COLORS[category], label=LABELS[category] if index == 0 else None)
            if category == "stored":
                axis.text(left + 1, index, f"{width:.1f}%", va="center", fontsize=8)
            left += width
        axis.plot(PAPER_TOKEN_STATES[timeline.system], index, marker="|", color="black", markersize=14,
                  label="paper: token states" if index == 0 else None)
    axis.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=8)
    axis.invert_yaxis()
    axis.set_xlim(0, 100)
    axis.set_xlabel("% of KV slots, time-averaged")
    axis.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, frameon=False, fontsize=8)
    return save(figure, directory, "breakdown_bars.png")


def plot_concurrency(results: StudyResults, directory: str) -> str:
    """Running sequences per step, every system, one panel per trace."""
    figure, axes = plt.subplots(1, len(results.breakdown), figsize=(12, 4))
    for axis, (name, timelines) in zip(axes, results.breakdown.items()):
        for timeline in timelines:
            axis.plot([s.running for s in timeline.samples], linewidth=0.8,
                      label=f"{timeline.system} (mean {timeline.mean_running():.0f})")
        axis.set_title(f"{name}-like trace")
        axis.set_xlabel("scheduler step")
        axis.set_ylabel("running sequences")
        axis.legend(fontsize=8)
    figure.tight_layout()
    return save(figure, directory, "concurrency.png")


def plot_sharing(results: StudyResults, directory: str) -> str:
    """% blocks saved per decoding mode and width, with the paper's range shaded."""
    figure, axes = plt.subplots(1, 2, figsize=(9, 3.5), sharey=True)
    for axis, decoding in zip(axes, PAPER_SAVINGS):
        runs = [r for r in results.sharing if r.decoding == decoding]
        axis.axhspan(*PAPER_SAVINGS[decoding], color="#d9d9d9", label="paper range (Alpaca)")
        axis.bar([str(r.width) for r in runs], [100 * r.saving for r in runs], color="#4c9a2a", label="ours")
        axis.set_title(decoding)
        axis.set_xlabel("samples" if decoding == "parallel sampling" else "beam width")
        axis.legend(fontsize=8, loc="upper left")
    axes[0].set_ylabel("% blocks saved")
    figure.tight_layout()
    return save(figure, directory, "sharing.png")


def plot_block_size(results: StudyResults, directory: str) -> str:
    """Per trace: % token states and block-table entries per sequence against block size."""
    figure, axes = plt.subplots(1, len(results.block_sizes), figsize=(11, 3.8))
    for axis, (name, sweep) in zip(axes, results.block_sizes.items()):
        sizes = [block_size for block_size, _ in sweep]
        axis.plot(sizes, [100 * t.fraction("stored") for _, t in sweep], marker="o", color="#4c9a2a")
        axis.set_xscale("log", base=2)
        axis.set_xticks(sizes, [str(size) for size in sizes])
        axis.set_xlabel("block size (tokens)")
        axis.set_ylabel("% token states", color="#4c9a2a")
        twin = axis.twinx()
        twin.plot(sizes, [t.mean_table_entries() for _, t in sweep], marker="s", color="#3d5a80")
        twin.set_ylabel("table entries per sequence", color="#3d5a80")
        axis.set_title(f"{name}-like trace")
    figure.tight_layout()
    return save(figure, directory, "block_size.png")


def plot_all(results: StudyResults, directory: str) -> list[str]:
    """Writes every plot into `directory`; returns their paths."""
    os.makedirs(directory, exist_ok=True)
    return [
        *plot_breakdown_over_time(results, directory),
        plot_breakdown_bars(results, directory),
        plot_concurrency(results, directory),
        plot_sharing(results, directory),
        plot_block_size(results, directory),
    ]
