"""HyperparameterTuner on the local Docker backend: each trial an ordinary local Docker job in
the real training image, at most max_parallel_jobs at once, the objective read from the
containers' live logs.

Reference: the trial script's objective written out by hand from the values each trial was
given, and the engine itself (no container of the tuning job is left).
"""

from __future__ import annotations

import pytest

from fp16_sdk.tuner import CategoricalParameter, HyperparameterTuner
from helpers.docker_engine import client  # noqa: F401 (the fixture)
from helpers.docker_engine import estimator as _estimator

SCRIPT = """\
    import argparse
    p = argparse.ArgumentParser()
    p.add_argument("--width", type=int)
    a = p.parse_args()
    for k in range(3):
        print(f"epoch {k} score {a.width * 10 + k}", flush=True)
"""


@pytest.mark.docker
def test_trials_are_local_docker_jobs(tmp_path, monkeypatch, client):  # noqa: F811
    monkeypatch.setenv("FP16_SDK_HOME", str(tmp_path / "home"))
    tuner = HyperparameterTuner(
        _estimator(tmp_path, SCRIPT, instance_count=1), "score",
        {"width": CategoricalParameter([1, 2, 3])},
        metric_definitions=[{"Name": "score", "Regex": r"score (\d+)"}], strategy="Grid",
        max_parallel_jobs=2)
    tuner.fit(job_name="dock-1")
    summaries = tuner.analytics().training_job_summaries()
    assert len(summaries) == 3
    for s in summaries:
        width = int(s["TunedHyperParameters"]["width"])
        assert s["TrainingJobStatus"] == "Completed"
        assert s["FinalHyperParameterTuningJobObjectiveMetric"]["Value"] == width * 10 + 2
        assert (tmp_path / "out" / s["TrainingJobName"] / "output" / "model.tar.gz").is_file()
    widths = {s["TrainingJobName"]: int(s["TunedHyperParameters"]["width"]) for s in summaries}
    assert widths[tuner.best_training_job()] == 3  # Maximize, SageMaker's default
    assert sorted(widths.values()) == [1, 2, 3]
    for name in widths:  # each trial's containers and network are gone
        label = {"label": f"fp16_sdk.job={name}"}
        assert not client.containers.list(all=True, filters=label)
        assert not client.networks.list(filters=label)
