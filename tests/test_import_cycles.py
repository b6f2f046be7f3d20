"""No module of the project imports, directly or through others, a module that imports it back.

`lint-imports` checks the layers between packages; a cycle inside one package (two modules that need each
other) slips through it, and is where a newcomer cannot tell which of the two to read first."""
import sys

import grimp

PACKAGES = ("billing_pipeline", "formats", "gpu_consumers", "http_api", "infra", "ingress", "lora", "schedulers",
            "schemas", "streams", "structured_outputs", "tokenmill")


def import_cycles(graph) -> list[list[str]]:
    """The strongly connected groups of two or more modules (Tarjan's algorithm) over direct imports, lazy
    imports inside functions included."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return groups


def test_no_import_cycles():
    assert import_cycles(grimp.build_graph(*PACKAGES, cache_dir=None)) == []


def test_the_cycle_finder_sees_a_cycle_through_three_modules():
    graph = grimp.ImportGraph()
    for a, b in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d")):
        graph.add_import(importer=a, imported=b)  # adds both modules
    assert import_cycles(graph) == [["p.a", "p.b", "p.c"]]
