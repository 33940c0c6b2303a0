"""An SDK process that starts a job with wait=False, then forks a child that exits normally
(issue 42, T4-3): `run_driver` returns the driver's report ("CHILD <exit code>" or "CHILD
HUNG" after 20 s, then "JOB <final status>")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers.paths import REPO

__all__ = ["run_driver"]

SCRIPT = """
import os, time
time.sleep(float(os.environ["JOB_SECONDS"]))
open(os.path.join(os.environ["SM_MODEL_DIR"], "done"), "w").close()
"""

DRIVER = r"""
import os, sys, time
from fp16_sdk.pytorch import PyTorch
src, out, instance_type, seconds, image = sys.argv[1:6]
est = PyTorch("train.py", framework_version="2.13", py_version="py311", source_dir=src,
              instance_type=instance_type, instance_count=1, output_path=out,
              environment={"JOB_SECONDS": seconds}, image_uri=image or None,
              backend_options={"stop_grace_s": 2} if instance_type == "local_process"
              else {"stop_timeout": 2})
est.fit(wait=False, logs=False, job_name="forked")
pid = os.fork()
if pid == 0:
    sys.exit(0)  # the interpreter's normal exit: atexit hooks run in the child
end = time.monotonic() + 20
while time.monotonic() < end:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        print("CHILD", os.waitstatus_to_exitcode(status), flush=True)
        break
    time.sleep(0.1)
else:
    print("CHILD HUNG", flush=True)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
job = est.latest_training_job
job.wait(logs=False)
print("JOB", job.describe()["TrainingJobStatus"], flush=True)
"""


def run_driver(tmp_path: Path, instance_type: str, seconds: float, image: str = "") -> str:
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text(SCRIPT)
    done = subprocess.run([sys.executable, "-c", DRIVER, str(src), f"file://{tmp_path}/out",
                           instance_type, str(seconds), image], cwd=REPO, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    return done.stdout


