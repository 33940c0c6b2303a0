"""docs/modules.md's module index names every module and package of fp16_sdk/, and nothing
that is gone: a file added, moved or removed without its row fails here.

The index is the section "## Module index": each `### ... (`<root>`)` heading names the folder
its rows are relative to, and each table row starts with a path in backticks (`name.py`, or
`folder/` for a package). A module belongs to the deepest root that holds it.
"""

from __future__ import annotations

import re

from helpers.paths import REPO

PACKAGE = REPO / "fp16_sdk"
DOC = REPO / "docs" / "modules.md"
ROOT_HEADING = re.compile(r"^### .*\(`(fp16_sdk/[\w/]*)`\)\s*$")
ROW = re.compile(r"^\| `([\w/.]+)` \|")


def _index() -> dict[str, list[str]]:
    """Root folder (repository-relative, ending in /) -> the paths its rows name."""
    text = DOC.read_text()
    assert "\n## Module index\n" in text, "docs/modules.md has no '## Module index' section"
    section = text.split("\n## Module index\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, list[str]] = {}
    root = None
    for line in section.splitlines():
        heading = ROOT_HEADING.match(line)
        if heading:
            root = heading.group(1).rstrip("/") + "/"
            rows.setdefault(root, [])
        elif (row := ROW.match(line)) and root is not None:
            rows[root].append(row.group(1))
    return rows


def _on_disk(roots: list[str]) -> dict[str, set[str]]:
    """What each root must list: its modules (no __init__/__main__) and sub-packages, each in
    the deepest root holding it."""
    def owner(rel: str) -> str:
        return max((r for r in roots if rel.startswith(r)), key=len)

    want: dict[str, set[str]] = {r: set() for r in roots}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(REPO).as_posix()
        if path.name in ("__init__.py", "__main__.py"):
            folder = rel.rsplit("/", 1)[0] + "/"
            if any(r.startswith(folder) for r in roots):
                continue  # a root, or a folder above one: the headings name those
            root = owner(folder)
            want[root].add(folder[len(root):])
        else:
            root = owner(rel)
            want[root].add(rel[len(root):])
    return want


def test_every_module_has_a_row_and_every_row_a_module():
    index = _index()
    assert "fp16_sdk/" in index, "the index needs a heading for fp16_sdk/ itself"
    want = _on_disk(list(index))
    missing = sorted(r + p for r in want for p in want[r] - set(index[r]))
    stale = sorted(r + p for r in index for p in set(index[r]) - want[r])
    twice = sorted(r + p for r in index for p in set(index[r]) if index[r].count(p) > 1)
    assert not missing, f"modules with no row in docs/modules.md's module index: {missing}"
    assert not stale, f"rows in docs/modules.md's module index naming no module: {stale}"
    assert not twice, f"modules with two rows: {twice}"


RUNTIME = PACKAGE / "modelparallel"
DOCSTRING_LINES = 34  # what a module is and how it is used; design reasoning: docs/internals*.md


def test_runtime_module_docstrings_leave_design_notes_to_internals():
    import ast

    long = []
    for path in sorted(RUNTIME.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        if doc and doc.count("\n") + 1 > DOCSTRING_LINES:
            long.append(f"{path.relative_to(REPO)}: {doc.count(chr(10)) + 1} lines")
    assert not long, (f"module docstrings over {DOCSTRING_LINES} lines (move the design notes to "
                      f"docs/internals-runtime.md and point there): {long}")
