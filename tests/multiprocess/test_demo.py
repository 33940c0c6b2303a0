"""`make demo` (examples/run_demo.py) in a subprocess: the FP16 pp=2 x tp=2 job end to end.

The printed artifact paths must exist; what they hold is checked here independently of the
demo's own code (tarfile, PNG signature, the loss history in output.tar.gz).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from helpers.files import load_module
from helpers.paths import REPO


@pytest.mark.slow
def test_demo_prints_existing_artifacts_and_loss_falls(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "run_demo.py"), "--steps", "20", "--quiet",
         "--output-path", f"file://{tmp_path}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = dict(re.findall(r"^(plot|model|artifacts):\s+(\S+)$", proc.stdout, re.M))
    model, plot = Path(found["model"]), Path(found["plot"])
    assert model.is_file() and model.parent == Path(found["artifacts"])
    assert model.is_relative_to(tmp_path)
    with tarfile.open(model) as tar:
        assert "model.pt" in tar.getnames()
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    with tarfile.open(model.with_name("output.tar.gz")) as tar:
        history = json.load(tar.extractfile("metrics.json"))
    assert history["step"] == list(range(1, 21))
    assert sum(history["loss"][-5:]) < sum(history["loss"][:5])
    m = re.search(r"loss ([0-9.]+) -> ([0-9.]+) over 20 steps", proc.stdout)
    assert m and float(m.group(1)) == pytest.approx(sum(history["loss"][:5]) / 5, abs=1e-3)
    assert float(m.group(2)) == pytest.approx(sum(history["loss"][-5:]) / 5, abs=1e-3)
    # metric_definitions picked the last logged values out of the job's log.
    assert f"train:loss={round(history['loss'][-1], 4):g}," in proc.stdout


def test_progress_line_while_a_step_runs_long(capsys):
    train_gpt = load_module(REPO / "examples" / "gpt_fp16" / "train_gpt.py")
    import time

    progress = train_gpt.StepProgress(0.3)
    progress.begin(7)
    time.sleep(1.6)  # ~5 periods: a line at 0.3 s, 0.6 s, ... (one per period, not per poll)
    progress.end()
    time.sleep(0.6)  # no line once the step is over
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln]
    assert lines and all(ln.startswith("step 7 still running after ") for ln in lines)
    assert 2 <= len(lines) <= 6  # at most one line per elapsed period
