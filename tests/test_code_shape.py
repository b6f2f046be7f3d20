"""Issue 31's shape targets, read from the sources: no function longer than 60 lines (a benchmark's
`main` excepted: it is its command line), and no module reaching into a private attribute that only
another of the project's modules defines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("billing_pipeline", "formats", "gpu_consumers", "http_api", "infra", "ingress", "lora", "schedulers", "schemas",
            "streams", "structured_outputs", "tokenmill")
MAX_FUNCTION_LINES = 60
# namedtuple's documented methods, underscored so as not to clash with field names
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}


def _modules() -> dict[str, ast.Module]:
    return {str(p.relative_to(ROOT)): ast.parse(p.read_text(), str(p))
            for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


MODULES = _modules()


def long_functions(modules: dict[str, ast.Module]) -> list[str]:
    found = []
    for path, tree in modules.items():
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            lines = node.end_lineno - node.lineno + 1
            is_bench_main = path.startswith("tokenmill/benchmarks/") and node.name == "main"
            if lines > MAX_FUNCTION_LINES and not is_bench_main:
                found.append(f"{path}:{node.lineno} {node.name} ({lines} lines)")
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_names_defined(tree: ast.Module) -> set[str]:
    """Private names a module gives a meaning: its functions, classes and class attributes, the
    attributes it assigns (`self._x = ...`) and the keywords it passes (a dataclass's `_x=`)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return {n for n in names if _private(n)}


def library_names(tree: ast.Module, project: set[str]) -> set[str]:
    """The names a module binds by importing from outside the project (`os`, `KafkaError`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names
                         if a.name.split(".")[0] not in project)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] not in project:
            names.update(a.asname or a.name for a in node.names)
    return names


def _root(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def private_reaches(modules: dict[str, ast.Module]) -> list[str]:
    """`x._name` (x not self or cls) where `_name` means something only in another project module.
    Private names of libraries reached through their import (`os._exit`, confluent_kafka's
    `KafkaError._PARTITION_EOF`) are theirs to keep stable and are not counted."""
    defined = {path: private_names_defined(tree) for path, tree in modules.items()}
    everywhere = set().union(*defined.values()) - NAMEDTUPLE_API
    project = {p.split("/")[0] for p in modules}
    found = []
    for path, tree in modules.items():
        libraries = library_names(tree, project)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            root = _root(node.value)
            if root in ("self", "cls") and isinstance(node.value, ast.Name) or root in libraries:
                continue
            if node.attr in everywhere and node.attr not in defined[path]:
                found.append(f"{path}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_function_is_longer_than_sixty_lines():
    assert long_functions(MODULES) == []


def test_no_module_reaches_into_another_modules_private_attributes():
    assert private_reaches(MODULES) == []


@pytest.mark.parametrize("source, expected", [
    ("def f():\n" + "    x = 1\n" * 60, ["m.py:1 f (61 lines)"]),
    ("def f():\n" + "    x = 1\n" * 59, []),
])
def test_the_length_check_counts_a_function_from_def_to_last_line(source, expected):
    assert long_functions({"m.py": ast.parse(source)}) == expected


def test_the_reach_check_flags_only_another_modules_private_names():
    owner = ast.parse("class Store:\n    def __init__(self):\n        self._entries = {}\n")
    reader = ast.parse("import os\nimport billing_pipeline.owner as owner\n\n"
                       "def count(store):\n    os._exit(0)\n    return len(store._entries) + len(owner._entries)\n")
    assert private_reaches({"billing_pipeline/owner.py": owner, "billing_pipeline/reader.py": reader}) == [
        "billing_pipeline/reader.py:6 store._entries", "billing_pipeline/reader.py:6 owner._entries"]
