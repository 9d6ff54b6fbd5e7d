"""The package's layering (docs/architecture.md, "Python engine": the table of parts): each
part imports only the parts below it. Imports under `if TYPE_CHECKING:` are annotations only
and do not count."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "python" / "pagedkv"

ABOVE_THE_RUNNER = {"engine", "request_state", "beam_search", "ngram_proposer", "scoring", "engine_loop",
                    "async_llm", "llm", "server", "cli"}
# part -> the parts it may not import (a part is a top-level module or subpackage of pagedkv)
MAY_NOT_IMPORT = {
    **dict.fromkeys(("errors", "config", "sampling_params", "pooling_params", "outputs", "structured_output",
                     "detokenizer", "host_memory", "transfer", "lora", "kernels", "attention", "kv_cache", "layers",
                     "models", "loader", "quantized_checkpoints"),
                    ABOVE_THE_RUNNER | {"runner"}),
    "parallel": ABOVE_THE_RUNNER,  # (a worker rank's main loop runs a ModelRunner: parallel/workers.py)
    "runner": ABOVE_THE_RUNNER,
    # The engine never touches the model: the runner is its one way down.
    "engine": {"models", "layers", "loader", "attention", "kv_cache", "kernels", "server", "cli", "llm", "async_llm",
               "engine_loop"},
    # The server works through AsyncLLM and the engine's ModelInfo, never the model side.
    "server": {"runner", "models", "layers", "loader", "attention", "kv_cache", "kernels", "parallel", "cli"},
}


def imports_of(path: pathlib.Path) -> set[str]:
    """The pagedkv parts a module imports, outside `if TYPE_CHECKING:` blocks."""
    tree = ast.parse(path.read_text())
    annotation_only = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
                       and ast.unparse(block.test).endswith("TYPE_CHECKING") for node in ast.walk(block)}
    parts = set()
    for node in ast.walk(tree):
        if id(node) in annotation_only:
            continue
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
            [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        for name in names:
            pieces = name.split(".")
            if pieces[0] == "pagedkv" and len(pieces) > 1:
                parts.add(pieces[1])
            elif pieces[0] == "pagedkv" and isinstance(node, ast.ImportFrom):
                parts.update(alias.name for alias in node.names)
    return parts


def part_of(path: pathlib.Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0].removesuffix(".py")


@pytest.mark.parametrize("part", sorted(MAY_NOT_IMPORT))
def test_each_part_imports_only_what_is_below_it(part):
    modules = [path for path in PACKAGE.rglob("*.py") if part_of(path) == part]
    assert modules, f"no module of part {part!r}: update the table"
    violations = []
    for path in modules:
        for imported in imports_of(path) & MAY_NOT_IMPORT[part]:
            if part == "parallel" and path.name == "workers.py" and imported == "runner":
                continue
            violations.append(f"{path.relative_to(PACKAGE)} imports pagedkv.{imported}")
    assert not violations, violations


def test_the_checker_sees_a_violation(tmp_path):
    module = tmp_path / "module.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pagedkv.engine import X\n"
                      "def f():\n    from pagedkv.runner.model_runner import ModelRunner\n")
    assert imports_of(module) == {"runner"}
