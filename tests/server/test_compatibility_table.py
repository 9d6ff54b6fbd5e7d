"""docs/serving.md's compatibility tables: the flags table names every flag of vLLM 0.33.0's
`vllm serve` (tests/server/vllm_serve_flags.txt, from its --help=all) and the flags its "same"
rows name are `pagedkv serve`'s; the request table names every field of vLLM's request models
(tests/server/vllm_request_fields.txt)."""

import argparse
import re
from pathlib import Path

from pagedkv.entrypoints.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def flags_table(header: str = "| vLLM server flag | here |") -> list[str]:
    """The rows of the table under `header`."""
    lines = (ROOT / "docs" / "serving.md").read_text().splitlines()
    start = lines.index(header)
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def listed(name: str) -> list[str]:
    text = (Path(__file__).parent / name).read_text()
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def vllm_flags() -> list[str]:
    return listed("vllm_serve_flags.txt")


def test_every_vllm_serve_flag_has_a_row():
    table = "\n".join(flags_table())
    named = set(re.findall(r"--[a-z0-9][a-z0-9-]*", table))
    missing = [flag for flag in vllm_flags() if flag not in named]
    assert len(vllm_flags()) > 300 and not missing, f"docs/serving.md's flags table lacks {missing}"


def test_every_vllm_request_field_has_a_row():
    table = "\n".join(flags_table("| request field or route | here |"))
    missing = [field for field in listed("vllm_request_fields.txt") if f"`{field}`" not in table]
    assert len(listed("vllm_request_fields.txt")) > 90 and not missing, f"the request table lacks {missing}"


def test_the_flags_said_to_work_here_are_ours():
    ours = {option for action in _serve_parser()._actions for option in action.option_strings}
    for row in flags_table():
        first, status = row.strip("|").split(" | ", 1)
        if status.startswith("same") and "`" in first:
            for flag in re.findall(r"`(--[a-z0-9-]+)", first):
                assert flag in ours, f"{flag} is said to work as in vLLM, but `pagedkv serve` has no such flag"


def _serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    serve = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    return serve.choices["serve"]
