"""docs/internals.md's import rules hold: the table under "## Imports go one way" says, for each
part of fp16_sdk, which other parts it may import, and every import in the source keeps to it
(at any depth, type-only imports included). The table is the rule; this test reads it.

A row is `| **part** | modules | may import |`: `modules` lists module prefixes in backticks
(a module belongs to the part with the longest prefix that holds it), `may import` lists other
parts by name, or `-` for none. Every module of fp16_sdk/ must belong to a part, and every
prefix must name something that exists. The package root `fp16_sdk` (its `__init__`: the
version, importing nothing) belongs to no part and any part may import it.
"""

from __future__ import annotations

import re

from helpers.import_graph import import_graph
from helpers.paths import REPO

DOC = REPO / "docs" / "internals.md"
ROOT = "fp16_sdk"
ROW = re.compile(r"^\| \*\*([\w -]+)\*\* \| (.+?) \| (.+?) \|\s*$")


def _rules() -> tuple[dict[str, str], dict[str, set[str]]]:
    """(module prefix -> part, part -> the parts it may import) from the doc's table."""
    section = DOC.read_text().split("\n## Imports go one way\n", 1)[1].split("\n## ", 1)[0]
    prefixes: dict[str, str] = {}
    allowed: dict[str, set[str]] = {}
    for line in section.splitlines():
        row = ROW.match(line)
        if not row:
            continue
        part, modules, may = row.groups()
        for prefix in re.findall(r"`([\w.]+)`", modules):
            assert prefix not in prefixes, f"{prefix} is in two rows"
            prefixes[prefix] = part
        allowed[part] = set() if may.strip() == "-" else {p.strip() for p in may.split(",")}
    assert prefixes, "docs/internals.md has no import-rule rows under '## Imports go one way'"
    return prefixes, allowed


def _part_of(module: str, prefixes: dict[str, str]) -> str | None:
    held = [p for p in prefixes if module == p or module.startswith(p + ".")]
    return prefixes[max(held, key=len)] if held else None


def test_the_table_names_known_parts_and_existing_modules():
    prefixes, allowed = _rules()
    graph = import_graph()
    unknown = {f"{part} -> {other}" for part, others in allowed.items() for other in others
               if other not in allowed}
    assert not unknown, f"rows name parts that have no row: {sorted(unknown)}"
    stale = [p for p in prefixes if not any(m == p or m.startswith(p + ".") for m in graph)]
    assert not stale, f"prefixes in the table that name no module: {stale}"
    assert graph[ROOT] == set(), graph[ROOT]
    homeless = sorted(m for m in graph if m != ROOT and _part_of(m, prefixes) is None)
    assert not homeless, f"modules no row of the table holds: {homeless}"


def test_every_import_keeps_to_the_table():
    prefixes, allowed = _rules()
    broken = []
    for module, targets in sorted(import_graph().items()):
        if module == ROOT:
            continue
        part = _part_of(module, prefixes)
        for target in sorted(targets - {ROOT}):
            other = _part_of(target, prefixes)
            if other != part and other not in allowed[part]:
                broken.append(f"{module} ({part}) imports {target} ({other})")
    assert not broken, "imports docs/internals.md does not allow:\n" + "\n".join(broken)


def test_the_check_finds_a_forbidden_import():
    """The probe works: the runtime importing a backend would be reported."""
    prefixes, allowed = _rules()
    runtime = _part_of("fp16_sdk.modelparallel.torch.state", prefixes)
    backend = _part_of("fp16_sdk.backends.base", prefixes)
    assert runtime and backend and backend not in allowed[runtime]
