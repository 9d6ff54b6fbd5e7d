"""The examples of driving the scheduler, in the README's quick start and in docs/scheduler.md, run as written."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("page", ["README.md", "docs/scheduler.md"])
def test_scheduler_example_runs(page, capsys):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), re.S)
    example = next(block for block in blocks if "Scheduler(" in block)
    namespace: dict = {}
    exec(compile(example, page, "exec"), namespace)
    stats = namespace["scheduler"].stats()
    assert not namespace["scheduler"].has_unfinished_requests()
    assert stats["num_free_device_blocks"] == stats["num_device_blocks"]
    assert len(namespace["generated"]) == 2  # both requests sampled
    assert all(len(tokens) == 8 for tokens in namespace["generated"].values())
