"""Generated documentation stays true to its sources (the benchmark JSON)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_benchmarks_page_matches_the_json_results():
    gen = _tool("gen_benchmarks_doc")
    assert (ROOT / "docs" / "benchmarks.md").read_text() == gen.render(), \
        "docs/benchmarks.md is stale: run python3 tools/gen_benchmarks_doc.py"


def test_runtime_api_page_matches_the_smp_namespace():
    gen = _tool("gen_api_docs")
    assert (ROOT / "docs" / "runtime-api.md").read_text() == gen.render(), \
        "docs/runtime-api.md is stale: run python3 tools/gen_api_docs.py"
