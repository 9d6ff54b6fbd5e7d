"""`_core.pyi` against the built module: every class, method, property and function of one is in
the other, with the same parameter names, so a stale stub fails CI."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pagedkv_core
from pagedkv_core import _core

STUB = Path(pagedkv_core.__file__).with_name("_core.pyi")


def stub_members() -> tuple[dict[str, dict[str, list[str] | None]], dict[str, list[str]]]:
    """({class: {member: parameter names, or None for an attribute}}, {function: parameter names})."""
    classes, functions = {}, {}
    for node in ast.parse(STUB.read_text()).body:
        if isinstance(node, ast.ClassDef):
            members = {}
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    is_property = any(isinstance(d, ast.Name) and d.id == "property" for d in item.decorator_list)
                    members[item.name] = None if is_property else parameter_names(item)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members[item.target.id] = None
            classes[node.name] = members
        elif isinstance(node, ast.FunctionDef):
            functions[node.name] = parameter_names(node)
    return classes, functions


def parameter_names(function: ast.FunctionDef) -> list[str]:
    args = function.args
    names = [arg.arg for arg in args.posonlyargs + args.args + args.kwonlyargs]
    return [name for name in names if name != "self"]


def runtime_parameters(obj) -> list[str] | None:
    try:
        parameters = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return None  # no text signature to compare
    if [p.kind for p in parameters.values()] == [inspect.Parameter.VAR_KEYWORD]:
        return None  # **options: see test_scheduler_config_stub_is_the_rust_definition
    return [name for name in parameters if name != "self"]


def test_the_stub_lists_every_class_member_and_function_of_the_module_with_its_parameters():
    classes, functions = stub_members()
    module_classes = {name for name, value in vars(_core).items() if isinstance(value, type) and not name.startswith("_")}
    module_functions = {name for name, value in vars(_core).items() if callable(value) and not isinstance(value, type)
                        and not name.startswith("_")}
    assert module_classes == set(classes), "classes differ between _core and _core.pyi"
    assert module_functions == set(functions), "functions differ between _core and _core.pyi"
    for class_name, members in classes.items():
        cls = getattr(_core, class_name)
        public = {name for name in dir(cls) if not name.startswith("_")}
        assert public == set(members) - {"__init__"}, f"{class_name}: members differ"
        for name, stub_parameters in members.items():
            attribute = cls.__init__ if name == "__init__" else getattr(cls, name)
            if name == "__init__":
                attribute = cls  # (PyO3 puts the constructor's signature on the class)
            if stub_parameters is not None and callable(attribute):
                actual = runtime_parameters(attribute)
                assert actual is None or actual == stub_parameters, f"{class_name}.{name}: {actual} != {stub_parameters}"
    for name, stub_parameters in functions.items():
        actual = runtime_parameters(getattr(_core, name))
        assert actual is None or actual == stub_parameters, f"{name}: {actual} != {stub_parameters}"


def test_scheduler_config_stub_is_the_rust_definition():
    """SchedulerConfig(**options) takes its fields by keyword: the stub's keywords are the
    fields of rust/sched/config.rs, in its order, with its defaults."""
    [stub] = [node for node in ast.parse(STUB.read_text()).body
              if isinstance(node, ast.ClassDef) and node.name == "SchedulerConfig"]
    [init] = [item for item in stub.body if isinstance(item, ast.FunctionDef) and item.name == "__init__"]
    stub_defaults = {arg.arg: ast.literal_eval(default) for arg, default in zip(init.args.kwonlyargs, init.args.kw_defaults)}
    default = _core.SchedulerConfig()
    fields = [name for name in dir(_core.SchedulerConfig) if not name.startswith("_")]
    assert sorted(stub_defaults) == fields
    assert stub_defaults == {name: getattr(default, name) for name in fields}
    assert inspect.signature(_core.SchedulerConfig).parameters.keys() == {"options"}
