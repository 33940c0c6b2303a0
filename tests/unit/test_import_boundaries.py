"""Imports go one way: the SDK never imports torch, the runtime never imports boto3 or docker,
a local_process job never imports docker, and the contract module and the /proc reader are
standard library only.

Each case runs in a fresh interpreter (this test process has imported everything already) and
reads `sys.modules` after the imports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.import_graph import cycles, import_graph
from helpers.paths import REPO, TESTS

SDK_MODULES = ["fp16_sdk.pytorch", "fp16_sdk.huggingface", "fp16_sdk.estimator.core",
               "fp16_sdk.estimator.validation", "fp16_sdk.backends.base",
               "fp16_sdk.backends.local_process.backend", "fp16_sdk.backends.local_docker.backend",
               "fp16_sdk.backends.sagemaker.backend", "fp16_sdk.backends.ec2.backend", "fp16_sdk.session",
               "fp16_sdk.image", "fp16_sdk.packaging", "fp16_sdk.metrics", "fp16_sdk.config",
               "fp16_sdk.contract", "fp16_sdk.tuner", "fp16_sdk.tuner.local",
               "fp16_sdk.tuner.aws", "optuna"]
TOOLKIT_MODULES = ["fp16_sdk.toolkit", "fp16_sdk.toolkit.cli", "fp16_sdk.toolkit.launcher"]
RUNTIME_MODULES = ["fp16_sdk.modelparallel.torch", "smdistributed.modelparallel.torch",
                   "smdistributed.dataparallel.torch.torch_smddp",
                   "smdistributed.dataparallel.torch.distributed",
                   "smdistributed.dataparallel.torch.parallel.distributed"]


def _loaded_after(code: str) -> list[str]:
    """Top-level package names in sys.modules after running `code` in a fresh interpreter."""
    probe = code + ("\nimport sys, json\n"
                    "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env=env, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _imports(modules: list[str]) -> str:
    return "\n".join(f"import {m}" for m in modules)


def test_sdk_never_imports_torch():
    # Also build an estimator and pick its backend: the choice loads the backend's class.
    code = _imports(SDK_MODULES) + """
import pathlib, tempfile
from fp16_sdk.pytorch import PyTorch
from fp16_sdk.backends.base import backend_for
d = pathlib.Path(tempfile.mkdtemp())
(d / "train.py").write_text("print(1)")
for t in ("local_process", "local"):
    PyTorch(entry_point=str(d / "train.py"), framework_version="2.1.0", py_version="py310",
            instance_type=t, instance_count=1, output_path=str(d / "jobs"),
            distribution={"torch_distributed": {"enabled": True}})
    backend_for(t)
"""
    loaded = _loaded_after(code)
    assert "torch" not in loaded and "transformers" not in loaded, loaded


def test_toolkit_imports_neither_heavy_side():
    loaded = _loaded_after(_imports(TOOLKIT_MODULES))
    assert not {"torch", "boto3", "botocore", "docker"} & set(loaded), loaded


def test_local_process_never_imports_docker():
    code = """
from fp16_sdk.backends.base import backend_for
backend_for("local_process")
import fp16_sdk.backends.local_process.backend
"""
    loaded = _loaded_after(code)
    assert "docker" not in loaded and "torch" not in loaded, loaded


@pytest.mark.parametrize("module", RUNTIME_MODULES)
def test_runtime_never_imports_boto3_or_docker(module):
    loaded = _loaded_after(f"import {module}")
    assert "torch" in loaded  # the probe works: the runtime does import torch
    assert not {"boto3", "botocore", "docker", "moto"} & set(loaded), loaded


@pytest.mark.parametrize("module", ["fp16_sdk.contract", "fp16_sdk.procfs"])
def test_shared_modules_are_standard_library_only(module):
    """The contract and the /proc reader are imported by both the toolkit and the runtime."""
    before = set(_loaded_after("import fp16_sdk"))
    after = set(_loaded_after(f"import {module}"))
    extra = sorted(after - before - set(sys.stdlib_module_names))
    assert extra == [], extra


def _test_module_imports(path: Path) -> set[str]:
    """Names of test modules (`test_*`) that the file at `path` imports, at any depth."""
    import ast
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                 else [])
        for name in names:
            last = name.split(".")[-1] if name.startswith("tests.") else name.split(".")[0]
            if last.startswith("test_"):
                found.add(last)
    return found


def test_no_test_module_imports_another():
    # What tests share lives in tests/helpers/ (one module per concern), never in a test
    # module: importing one runs its module body and couples two files' private names.
    pairs = {(f.stem, imported) for f in sorted(TESTS.rglob("*.py"))
             for imported in _test_module_imports(f)}
    assert pairs == set(), sorted(pairs)


_WRAP_PLAIN_MODEL = """
import os, sys
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
import torch
{before}
import smdistributed.modelparallel.torch as smp
smp.init({{"microbatches": 1, "ddp": True, "fp16": True}})
model = smp.DistributedModel(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
import json
print(json.dumps(sorted(m for m in sys.modules if m.startswith("transformers"))))
"""


@pytest.mark.parametrize("transformers_first", [False, True])
def test_wrapping_a_plain_model_imports_no_hugging_face_model_code(transformers_first):
    """A non-HF model never loads transformers, nor any architecture's modeling code when the
    script had imported transformers (that import stopped every wrap on transformers < 4.37)."""
    pytest.importorskip("transformers")
    from helpers.ports import free_port
    before = "import transformers" if transformers_first else ""
    out = subprocess.run(
        [sys.executable, "-c", _WRAP_PLAIN_MODEL.format(before=before), str(free_port())],
        capture_output=True, text=True, cwd=REPO, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    if not transformers_first:
        assert loaded == [], loaded
    else:
        assert "transformers" in loaded  # the probe works
        modeling = [m for m in loaded if m.startswith("transformers.models.") and
                    m.rsplit(".", 1)[-1].startswith("modeling_")]
        assert modeling == [], modeling


# ---- no import circles inside fp16_sdk ---------------------------------------------------------
_PROBE = {  # a package whose every import form the graph must see
    "__init__.py": "",
    "a.py": "from . import b\n",
    "b.py": "def f():\n    from .sub import c\n",
    "sub/__init__.py": "",
    "sub/c.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                 "    from ..a import x\nelse:\n    import pkg.sub.d\n"),
    "sub/d.py": "import pkg.sub\n",
}


def test_import_graph_sees_imports_in_functions_and_type_only_ones(tmp_path):
    for rel, text in _PROBE.items():
        (tmp_path / "pkg" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / rel).write_text(text)
    graph = import_graph(tmp_path / "pkg")
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.sub.c"}
    assert graph["pkg.sub.c"] == {"pkg.a", "pkg.sub.d"}
    assert graph["pkg.sub.d"] == {"pkg.sub"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]
    assert import_graph(tmp_path / "pkg", type_only=False)["pkg.sub.c"] == {"pkg.sub.d"}
    assert cycles(import_graph(tmp_path / "pkg", type_only=False)) == []


def test_fp16_sdk_has_no_import_circles_of_any_kind():
    """No import circle, counting imports inside functions (a circle hidden in a function
    still ties the two modules together; it only moves the failure to the first call) and
    type-only imports under `if TYPE_CHECKING:` (they tie the modules for every reader)."""
    found = cycles(import_graph())
    assert found == [], "\n".join(" -> ".join(c) for c in found)
