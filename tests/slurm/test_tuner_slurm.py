"""HyperparameterTuner with instance_type="slurm": each trial an ordinary Slurm job (sbatch
through the backend's public path, `fit(wait=False)`), at most max_parallel_jobs at once, on
the real test cluster in containers (helpers.slurm_cluster).

Reference: the trial script's objective written out by hand from the value each trial got.
"""

from __future__ import annotations

import shutil
import textwrap
import uuid

import pytest

from fp16_sdk.pytorch import PyTorch
from fp16_sdk.tuner import CategoricalParameter, HyperparameterTuner
from helpers.slurm_cluster import slurm_cluster  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.slurm, pytest.mark.docker, pytest.mark.slow]

SCRIPT = textwrap.dedent("""\
    import argparse
    p = argparse.ArgumentParser()
    p.add_argument("--width", type=int)
    a = p.parse_args()
    for k in range(3):
        print(f"epoch {k} score {a.width * 10 + k}", flush=True)
""")


def test_trials_are_slurm_jobs(slurm_cluster, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("FP16_SDK_HOME", str(tmp_path / "home"))
    shared = slurm_cluster.shared / f"tune-{uuid.uuid4().hex[:8]}"
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text(SCRIPT)
    try:
        est = PyTorch("train.py", source_dir=str(tmp_path / "src"), framework_version="2.13",
                      py_version="py311", instance_type="slurm", instance_count=1,
                      output_path=f"file://{shared}",
                      backend_options={"submit_command": slurm_cluster.docker_submit_command,
                                       "cpus_per_task": 1})
        tuner = HyperparameterTuner(est, "score", {"width": CategoricalParameter([1, 2])},
                                    metric_definitions=[{"Name": "score",
                                                         "Regex": r"score (\d+)"}],
                                    strategy="Grid", max_parallel_jobs=2)
        tuner.fit(job_name="slurm-tune-1")
        summaries = tuner.analytics().training_job_summaries()
        assert sorted(int(s["TunedHyperParameters"]["width"]) for s in summaries) == [1, 2]
        for s in summaries:
            width = int(s["TunedHyperParameters"]["width"])
            assert s["TrainingJobStatus"] == "Completed", s
            assert s["FinalHyperParameterTuningJobObjectiveMetric"]["Value"] == width * 10 + 2
            assert (shared / s["TrainingJobName"] / "output" / "model.tar.gz").is_file()
        best = tuner.best_training_job()
        assert next(s for s in summaries if s["TrainingJobName"] == best)[
            "TunedHyperParameters"]["width"] == "2"
    finally:
        shutil.rmtree(shared, ignore_errors=True)
