"""`load_module(path)`: a Python file that is not on sys.path (a benchmark, a tool, an example
or a job script) loaded as a module, without running its `__main__` block."""

import importlib.util
from pathlib import Path


def load_module(path: Path, name: str | None = None):
    spec = importlib.util.spec_from_file_location(name or Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
