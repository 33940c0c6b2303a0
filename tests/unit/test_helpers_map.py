"""tests/helpers/__init__.py's docstring is the map of the shared test machinery: it names
every module of the package (as a "- `module`:" entry), and no module that is not there."""

import ast

from helpers.paths import TESTS

HELPERS = TESTS / "helpers"


def _mapped() -> list[str]:
    doc = ast.get_docstring(ast.parse((HELPERS / "__init__.py").read_text()))
    return [line[3:].split("`", 1)[0] for line in doc.splitlines() if line.startswith("- `")]


def test_every_helper_module_is_on_the_map():
    modules = {p.stem for p in HELPERS.glob("*.py") if p.stem != "__init__"}
    missing = sorted(modules - set(_mapped()))
    assert not missing, f"tests/helpers/__init__.py's docstring does not name {missing}: " \
                        "add a '- `module`: what it holds' line for each"


def test_the_map_names_only_modules_that_exist():
    mapped = _mapped()
    gone = sorted(name for name in mapped if not (HELPERS / f"{name}.py").exists())
    assert not gone, f"tests/helpers/__init__.py's docstring names {gone}, which no longer " \
                     "exist: remove those lines"
    assert len(mapped) == len(set(mapped)), f"named twice: {sorted(mapped)}"
