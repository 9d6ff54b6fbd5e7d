"""Memory study: the paper's KV waste and sharing results, reproduced on our allocator.

Request traces are replayed, without a model, through the real Rust scheduler and block pool
(`paged.py`, `sharing.py`, `system_prompt.py`) and through Orca-style contiguous baselines on
a buddy allocator (`contiguous.py`, `buddy.py`), all with the same KV budget. The results go
to a markdown report (`report.py`) and PNG plots (`plots.py`).

    python benches/memory.py            # full study: docs/memory.md and docs/memory/*.png
    python benches/memory.py --quick    # the short CI run
"""

import argparse
import os
from dataclasses import replace
from typing import Optional

from memory_study.settings import FULL, QUICK, StudySettings


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python benches/memory.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a quarter of the budget and short runs (CI)")
    parser.add_argument("--out", default="docs", help="directory of memory.md; plots go to OUT/memory/ (default: docs)")
    parser.add_argument("--num-steps", type=int, help="steps of the breakdown and block-size runs")
    parser.add_argument("--sharing-steps", type=int, help="steps of the parallel-sampling and beam-search runs")
    parser.add_argument("--seed", type=int, help="seed of every trace")
    parser.add_argument("--no-plots", action="store_true", help="tables only")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> StudySettings:
    settings = QUICK if args.quick else FULL
    overrides = {"num_steps": args.num_steps, "sharing_steps": args.sharing_steps, "seed": args.seed}
    return replace(settings, **{name: value for name, value in overrides.items() if value is not None})


def main(argv: Optional[list[str]] = None) -> int:
    """Runs the study, prints the tables, writes OUT/memory.md and OUT/memory/*.png."""
    args = parse_args(argv)
    settings = settings_from_args(args)
    if settings.warmup_steps >= min(settings.num_steps, settings.sharing_steps):
        print(f"error: --num-steps and --sharing-steps must exceed the warm-up ({settings.warmup_steps} steps)")
        return 2
    # Imported here so that `--help` does not pay for torch and matplotlib.
    from memory_study.report import render, write_doc
    from memory_study.study import run_study

    results = run_study(settings, show_progress=not args.no_progress)
    generated = render(results)
    print(generated)
    os.makedirs(args.out, exist_ok=True)
    doc_path = os.path.join(args.out, "memory.md")
    write_doc(doc_path, generated)
    if not args.no_plots:
        from memory_study.plots import plot_all

        plot_all(results, os.path.join(args.out, "memory"))
    print(f"wrote {doc_path}" + ("" if args.no_plots else f" and plots in {os.path.join(args.out, 'memory')}/"))
    return 0
