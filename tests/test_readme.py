"""The README's example of driving the scheduler runs as written."""

import pathlib
import re


def test_readme_scheduler_example_runs(capsys):
    readme = pathlib.Path(__file__).resolve().parents[1] / "README.md"
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), re.S)
    example = next(block for block in blocks if "Scheduler(" in block)
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    stats = namespace["scheduler"].stats()
    assert not namespace["scheduler"].has_unfinished_requests()
    assert stats["num_free_device_blocks"] == stats["num_device_blocks"]
    assert all(len(tokens) == 8 for tokens in namespace["generated"].values())
