"""The JSON results the benchmarks wrote (benchmarks/results/*.json) as docs/benchmarks.md reads
them: `load(name)` (one file's content, None when the benchmark has not been run) and
`fmt(value, spec)` (a figure as the page prints it: yes/no, a dash for None).
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["RESULTS", "load", "fmt"]

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def load(name: str):
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def fmt(v, spec=".3f"):
    if isinstance(v, bool):
        return "yes" if v else "no"
    return "–" if v is None else format(v, spec) if isinstance(v, (int, float)) else str(v)
