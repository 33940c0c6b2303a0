"""Generated documentation stays true to its sources (the benchmark JSON)."""

from helpers.files import load_module
from helpers.paths import REPO


def _tool(name):
    return load_module(REPO / "tools" / f"{name}.py")


def test_benchmarks_page_matches_the_json_results():
    gen = _tool("gen_benchmarks_doc")
    assert (REPO / "docs" / "benchmarks.md").read_text() == gen.render(), \
        "docs/benchmarks.md is stale: run python3 tools/gen_benchmarks_doc.py"


def test_runtime_api_page_matches_the_smp_namespace():
    gen = _tool("gen_api_docs")
    assert (REPO / "docs" / "runtime-api.md").read_text() == gen.render(), \
        "docs/runtime-api.md is stale: run python3 tools/gen_api_docs.py"
