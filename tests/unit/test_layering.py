"""The package's layering (docs/architecture.md, "Python: python/pagedkv/, bottom to top"): each
part imports only the parts below it. Imports under `if TYPE_CHECKING:` are annotations only
and do not count."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "python" / "pagedkv"

# The package's folders (and top-level modules) by level, bottom to top: a part imports only parts
# of its own level or below. models/ and parallel/ share a level (the loader shards by
# parallel/sharding.py, which knows the models' layouts); parallel/workers.py, a worker rank's main
# loop, runs a ModelRunner: the one import upward, allowed below.
LEVELS = [("errors",), ("config", "outputs", "params"), ("kernels",), ("attention",), ("layers",),
          ("models", "parallel"), ("runner",), ("engine",), ("entrypoints",)]
DEVICE_SIDE = {"kernels", "attention", "layers", "models", "parallel"}
MAY_NOT_IMPORT = {part: {above for upper in LEVELS[level + 1:] for above in upper}
                  for level, parts in enumerate(LEVELS) for part in parts}
# The engine never touches the model: the runner is its one way down. The entrypoints work through
# the engine alone.
MAY_NOT_IMPORT["engine"] |= DEVICE_SIDE
MAY_NOT_IMPORT["entrypoints"] |= DEVICE_SIDE | {"runner"}
# Within entrypoints/: the CLI sits above the server.
SERVER_MAY_NOT_IMPORT = {"entrypoints.cli"}
ALLOWED = {("parallel/workers.py", "runner")}


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
                if pieces[1] == "entrypoints" and len(pieces) > 2:
                    parts.add(".".join(pieces[1:3]))
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
        relative = path.relative_to(PACKAGE)
        forbidden = set(MAY_NOT_IMPORT[part])
        if relative.parts[:2] == ("entrypoints", "server"):
            forbidden |= SERVER_MAY_NOT_IMPORT
        for imported in sorted(imports_of(path) & forbidden):
            if (relative.as_posix(), imported) not in ALLOWED:
                violations.append(f"{relative} imports pagedkv.{imported}")
    assert not violations, violations


def test_every_folder_is_in_the_table():
    parts = {part_of(path) for path in PACKAGE.rglob("*.py")} - {"__init__"}
    assert parts == set(MAY_NOT_IMPORT), "a new folder or module: give it its row in MAY_NOT_IMPORT"
    assert len(list(PACKAGE.iterdir())) <= 14, sorted(p.name for p in PACKAGE.iterdir())


def test_the_checker_sees_a_violation(tmp_path):
    module = tmp_path / "module.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pagedkv.engine.llm_engine import X\n"
                      "def f():\n    from pagedkv.runner.model_runner import ModelRunner\n")
    assert imports_of(module) == {"runner"}
