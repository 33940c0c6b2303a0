"""Generated documentation stays true to its sources (the benchmark JSON)."""

from pathlib import Path

from helpers.files import load_module

ROOT = Path(__file__).resolve().parent.parent


def _tool(name):
    return load_module(ROOT / "tools" / f"{name}.py")


def test_benchmarks_page_matches_the_json_results():
    gen = _tool("gen_benchmarks_doc")
    assert (ROOT / "docs" / "benchmarks.md").read_text() == gen.render(), \
        "docs/benchmarks.md is stale: run python3 tools/gen_benchmarks_doc.py"


def test_runtime_api_page_matches_the_smp_namespace():
    gen = _tool("gen_api_docs")
    assert (ROOT / "docs" / "runtime-api.md").read_text() == gen.render(), \
        "docs/runtime-api.md is stale: run python3 tools/gen_api_docs.py"
