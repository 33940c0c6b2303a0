"""The static import graph of fp16_sdk/, read from the source (ast), for the import tests:
`import_graph()` (module -> the fp16_sdk modules it imports, at any depth, type-only imports
included unless asked not to) and `cycles(graph)` (one path through each circle).
Standard library only: no fp16_sdk module is imported to read it."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers.paths import REPO

__all__ = ["import_graph", "cycles", "module_name"]


def module_name(path: Path, base: Path = REPO) -> str:
    """Dotted name of the module file at `path`, relative to the folder `base` holds it in."""
    parts = list(path.relative_to(base).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree, *, type_only: bool):
    """Every import statement at any depth (inside functions and classes too); the body of an
    `if TYPE_CHECKING:` block (imports that never execute) only when `type_only`."""
    todo = list(ast.iter_child_nodes(tree))
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test) and not type_only:
            todo.extend(node.orelse)  # the `else:` branch runs
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        todo.extend(ast.iter_child_nodes(node))


def import_graph(package: Path = REPO / "fp16_sdk", *,
                 type_only: bool = True) -> dict[str, set[str]]:
    """Module of `package` -> the modules of `package` it imports.

    Imports under `if TYPE_CHECKING:` count unless `type_only` is False: an annotation's
    import still ties two modules (a reader follows it, and it becomes a real import the day
    code needs the name). Relative imports are resolved, and `from pkg import name` points at
    the submodule `pkg.name` when there is one, else at `pkg`. A package's parent packages,
    which Python also runs, are not counted: every submodule would otherwise form a circle
    with the package `__init__` that imports it.
    """
    files = {module_name(p, package.parent): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets: set[str] = set()
        for node in _import_nodes(ast.parse(path.read_text(), str(path)),
                                  type_only=type_only):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = alias.name
                    while target and target not in files:
                        target = target.rpartition(".")[0]
                    targets.add(target)
                continue
            if node.level:
                base = package[:len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                targets.add(sub if sub in files else module)
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a -> ... -> a) through each strongly connected component of more than one
    module (Tarjan), so a failure names a path to follow rather than a set."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for component in components:  # the shortest way back to its first module, breadth first
        start = min(component)
        parent: dict[str, str | None] = {start: None}
        queue = [start]
        for v in queue:
            if start in graph[v]:
                break
            for w in sorted(graph[v] & component):
                if w not in parent:
                    parent[w] = v
                    queue.append(w)
        path: list[str] = []
        while v is not None:
            path.insert(0, v)
            v = parent[v]
        cycles.append(path + [start])
    return cycles


