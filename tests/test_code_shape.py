"""Issue 31's shape targets, read from the sources: no function longer than 60 lines (a benchmark's
`main` excepted: it is its command line), and no module reaching into a private name that only another
of the project's modules defines: not as `x._name`, not as `from m import _name`, and not as `self._name`
in a subclass whose base class in another module defines `_name` (issue 58)."""

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


SOURCES = {str(p.relative_to(ROOT)): p.read_text() for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}
MODULES = {path: ast.parse(text, path) for path, text in SOURCES.items()}


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


def private_imports(modules: dict[str, ast.Module]) -> list[str]:
    """`from m import _name` with m one of the project's modules: another module's private name taken."""
    project = {p.split("/")[0] for p in modules}
    found = []
    for path, tree in modules.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or node.module.split(".")[0] in project):
                found += [f"{path}:{node.lineno} from {'.' * node.level}{node.module or ''} import {a.name}"
                          for a in node.names if _private(a.name)]
    return found


def _module_name(path: str) -> str:
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def _bindings(tree: ast.Module) -> dict[str, str]:
    """What each name a module imports stands for, dotted: `from a.b import C as D` binds D to a.b.C,
    `import a.b as m` binds m to a.b, `import a.b` binds a to a."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            bound.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
        elif isinstance(node, ast.Import):
            bound.update({a.asname: a.name for a in node.names if a.asname})
            bound.update({a.name.split(".")[0]: a.name.split(".")[0] for a in node.names if not a.asname})
    return bound


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return head and f"{head}.{node.attr}"
    return None


class ClassIndex:
    """Every class of the project's modules by its dotted name, its bases resolved through the imports
    (and re-exports: `gpu_consumers.engine.Engine` is the class engine/core/engine.py defines)."""

    def __init__(self, modules: dict[str, ast.Module]):
        self.path_of = {_module_name(path): path for path in modules}
        self.bindings = {_module_name(path): _bindings(tree) for path, tree in modules.items()}
        self.classes = {f"{_module_name(path)}.{node.name}": node for path, tree in modules.items()
                        for node in tree.body if isinstance(node, ast.ClassDef)}

    def resolve(self, module: str, expr: ast.expr, depth: int = 0) -> str | None:
        """The dotted name of the project class `expr` means in `module`, or None (a library's, or unknown)."""
        dotted = _dotted(expr)
        if dotted is None or depth > 8:
            return None
        head, _, rest = dotted.partition(".")
        target = self.bindings[module].get(head, f"{module}.{head}") + (f".{rest}" if rest else "")
        return self._follow(target, depth)

    def _follow(self, target: str, depth: int) -> str | None:
        if target in self.classes:
            return target
        owner, _, name = target.rpartition(".")
        if owner in self.bindings and name in self.bindings[owner] and depth <= 8:  # a re-export
            return self._follow(self.bindings[owner][name], depth + 1)
        return None

    def module_of(self, cls: str) -> str:
        return cls.rpartition(".")[0]


def _own_private_attributes(cls: ast.ClassDef) -> set[str]:
    """The private names a class gives a meaning itself: its methods, class attributes, `self._x = ...`."""
    names = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    names.update(t.id for n in cls.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name))
    names.update(n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name))
    names.update(n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store))
    return {n for n in names if _private(n)}


def _inherited(index: ClassIndex, cls: str, home: str, seen: set[str]) -> tuple[set[str], set[str]]:
    """The private attributes `cls`'s bases give it: (those classes of other modules than `home` define,
    those classes of `home` define)."""
    foreign: set[str] = set()
    local: set[str] = set()
    module = index.module_of(cls)
    for base in index.classes[cls].bases:
        resolved = index.resolve(module, base)
        if resolved is None or resolved in seen:
            continue
        seen.add(resolved)
        own = _own_private_attributes(index.classes[resolved])
        (local if index.module_of(resolved) == home else foreign).update(own)
        deeper_foreign, deeper_local = _inherited(index, resolved, home, seen)
        foreign |= deeper_foreign
        local |= deeper_local
    return foreign, local


def inherited_private_reads(modules: dict[str, ast.Module]) -> list[str]:
    """`self._name` read in a class whose base class in another module defines `_name` (and the class, or
    a base of its own module, does not): a subclass reaching into its base's private state."""
    index = ClassIndex(modules)
    found = []
    for name, cls in index.classes.items():
        home = index.module_of(name)
        foreign, local = _inherited(index, name, home, set())
        reachable = foreign - local - _own_private_attributes(cls) - NAMEDTUPLE_API
        for node in ast.walk(cls):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and node.attr in reachable
                    and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append((node.lineno, f"{index.path_of[home]}:{node.lineno} {ast.unparse(node)}"))
    return [finding for _, finding in sorted(found)]


def test_no_function_is_longer_than_sixty_lines():
    assert long_functions(MODULES) == []


def test_no_module_reaches_into_another_modules_private_attributes():
    assert private_reaches(MODULES) == []


MAX_FILE_LINES = 400


def test_no_file_is_longer_than_four_hundred_lines():
    """A newcomer reads a module whole; past this it is more than one concept (the benchmarks, each a command
    with its tables, excepted)."""
    long = sorted(f"{path} ({text.count(chr(10))} lines)" for path, text in SOURCES.items()
                  if text.count("\n") > MAX_FILE_LINES and not path.startswith("tokenmill/benchmarks/"))
    assert long == []


def test_partition_ends_are_asked_in_one_module():
    """Watermarks (where a partition ends) are asked through infra/kafka/topic_reader.py only: how to ask
    (which client, cached or not, the compaction and transaction-marker cases) is decided there once."""
    readers = sorted({path for path, tree in MODULES.items() for node in ast.walk(tree)
                      if isinstance(node, ast.Attribute) and node.attr == "get_watermark_offsets"
                      and not path.startswith("tokenmill/benchmarks/")})
    assert readers == ["infra/kafka/topic_reader.py"]


def test_no_module_imports_another_modules_private_names():
    assert private_imports(MODULES) == []


def test_no_class_reads_private_state_its_base_class_in_another_module_defines():
    assert inherited_private_reads(MODULES) == []


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


def test_the_import_check_flags_a_project_modules_private_name_and_nothing_else():
    owner = ast.parse("def _helper():\n    return 1\n\ndef helper():\n    return _helper()\n")
    taker = ast.parse("from os import _exit\nfrom billing_pipeline.owner import _helper, helper\n")
    public = ast.parse("from billing_pipeline.owner import helper\n")
    assert private_imports({"billing_pipeline/owner.py": owner, "billing_pipeline/taker.py": taker,
                            "billing_pipeline/public.py": public}) == [
        "billing_pipeline/taker.py:2 from billing_pipeline.owner import _helper"]


BASE = "class Store:\n    def __init__(self):\n        self._rows = []\n"


def test_the_inheritance_check_flags_a_read_of_a_base_classes_private_state_from_another_module():
    modules = {"billing_pipeline/base.py": ast.parse(BASE),
               # a package re-exporting the base: the subclass below takes it from there
               "billing_pipeline/__init__.py": ast.parse("from billing_pipeline.base import Store\n"),
               "billing_pipeline/sub.py": ast.parse(
                   "from billing_pipeline import Store\n\nclass Counted(Store):\n"
                   "    def count(self):\n        return len(self._rows)\n")}
    assert inherited_private_reads(modules) == ["billing_pipeline/sub.py:5 self._rows"]


def test_the_inheritance_check_leaves_a_same_module_base_its_own_state_and_a_librarys_base_alone():
    same_module = ast.parse(BASE + "\nclass Counted(Store):\n    def count(self):\n        return len(self._rows)\n")
    own_state = ast.parse("from billing_pipeline.base import Store\n\nclass Mine(Store):\n"
                          "    def __init__(self):\n        self._rows = ()\n\n"
                          "    def count(self):\n        return len(self._rows)\n")
    library_base = ast.parse("import threading\n\nclass Worker(threading.Thread):\n"
                             "    def go(self):\n        return self._target\n")
    assert inherited_private_reads({"billing_pipeline/base.py": ast.parse(BASE), "billing_pipeline/same.py": same_module,
                                    "billing_pipeline/own.py": own_state,
                                    "billing_pipeline/library.py": library_base}) == []
