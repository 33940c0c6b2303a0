"""HyperparameterTuner searching here (local_process trials: real toolkit processes).

References, independent of the tuner's code: Optuna's own sampler run alone with the same seed
(the values each trial must receive), the trial script's objective written out by hand
(`objective`), the median-stopping rule applied by hand to the trials in the order they ran,
and the operating system's process table (nothing of a stopped tuning job may remain).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import optuna
import pytest

from fp16_sdk.pytorch import PyTorch
from fp16_sdk.tuner import CategoricalParameter, ContinuousParameter, HyperparameterTuner
from fp16_sdk.tuner import records
from helpers.paths import REPO
from helpers.procs import scan

SCRIPT = textwrap.dedent("""\
    import argparse, time
    p = argparse.ArgumentParser()
    p.add_argument("--lr", type=float)
    p.add_argument("--opt", default="adam")
    p.add_argument("--reports", type=int, default=3)
    p.add_argument("--pause", type=float, default=0.0)
    a = p.parse_args()
    value = (a.lr - 0.03) ** 2 * 100 + (0.5 if a.opt == "sgd" else 0.0)
    for k in range(a.reports):
        print(f"epoch {k} valid loss {value:.6f}", flush=True)
        time.sleep(a.pause)
""")
DEFS = [{"Name": "valid:loss", "Regex": r"valid loss ([0-9.]+)"}]


def objective(lr: float, opt: str) -> float:
    return round((lr - 0.03) ** 2 * 100 + (0.5 if opt == "sgd" else 0.0), 6)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("FP16_SDK_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _estimator(tmp_path: Path, **hps) -> PyTorch:
    (tmp_path / "src").mkdir(exist_ok=True)
    (tmp_path / "src" / "train.py").write_text(SCRIPT)
    return PyTorch(entry_point="train.py", source_dir=str(tmp_path / "src"),
                   framework_version="2.1.0", py_version="py311", instance_type="local_process",
                   instance_count=1, output_path=f"file://{tmp_path}/jobs", hyperparameters=hps,
                   base_job_name="tune")


def _index(name: str) -> int:
    return int(name.split("-")[-2])


def _max_overlap(summaries: list[dict]) -> int:
    events = sorted([(s["TrainingStartTime"], 1) for s in summaries]
                    + [(s["TrainingEndTime"], -1) for s in summaries])
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def test_random_search_runs_optunas_trials_and_attach_reads_them(tmp_path, home):
    ranges = {"lr": ContinuousParameter(0.001, 0.1, "Logarithmic"),
              "opt": CategoricalParameter(["adam", "sgd"])}
    tuner = HyperparameterTuner(_estimator(tmp_path, reports=3, pause=0.3), "valid:loss", ranges,
                                metric_definitions=DEFS, strategy="Random",
                                objective_type="Minimize", max_jobs=4, max_parallel_jobs=2,
                                random_seed=3)
    tuner.fit(job_name="rs-1")

    # The values Optuna's RandomSampler gives with this seed, drawn without the tuner.
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    dists = {n: r.distribution() for n, r in ranges.items()}
    drawn = [study.ask(dists).params for _ in range(4)]

    summaries = sorted(tuner.analytics().training_job_summaries(),
                       key=lambda s: _index(s["TrainingJobName"]))
    assert [_index(s["TrainingJobName"]) for s in summaries] == [1, 2, 3, 4]
    for s, params in zip(summaries, drawn):
        tuned = s["TunedHyperParameters"]
        assert float(tuned["lr"]) == pytest.approx(params["lr"], rel=1e-12)
        assert tuned["opt"] == params["opt"]
        assert s["TrainingJobStatus"] == "Completed"
        value = s["FinalHyperParameterTuningJobObjectiveMetric"]["Value"]
        assert value == pytest.approx(objective(params["lr"], params["opt"]), abs=1e-6)
        # each trial is an ordinary job of the backend, with its own folder and model
        assert (tmp_path / "jobs" / s["TrainingJobName"] / "output" / "model.tar.gz").is_file()
    best = min(summaries, key=lambda s: objective(float(s["TunedHyperParameters"]["lr"]),
                                                  s["TunedHyperParameters"]["opt"]))
    assert tuner.best_training_job() == best["TrainingJobName"]
    assert tuner.best_estimator().latest_training_job.name == best["TrainingJobName"]
    assert _max_overlap(summaries) == 2  # parallel, and never more than max_parallel_jobs

    desc = tuner.describe()
    assert desc["HyperParameterTuningJobStatus"] == "Completed"
    assert desc["TrainingJobStatusCounters"]["Completed"] == 4
    table = tuner.analytics().table()
    assert table.columns == ["lr", "opt", "TrainingJobName", "TrainingJobStatus",
                             "FinalObjectiveValue", "TrainingStartTime", "TrainingEndTime",
                             "TrainingElapsedTimeSeconds"]
    assert all(t > 0 for t in table["TrainingElapsedTimeSeconds"])

    # Another process attaches by name and sees the same job.
    probe = ("from fp16_sdk.tuner import HyperparameterTuner\n"
             "import json\n"
             "t = HyperparameterTuner.attach('rs-1')\n"
             "d = t.describe()\n"
             "print(json.dumps([d['HyperParameterTuningJobStatus'], t.best_training_job(),"
             " len(t.analytics().table()), t.objective_type, t.max_parallel_jobs,"
             " t.best_estimator().model_data]))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120, check=True)
    model = f"file://{tmp_path}/jobs/{best['TrainingJobName']}/output/model.tar.gz"
    assert json.loads(out.stdout.splitlines()[-1]) == [
        "Completed", best["TrainingJobName"], 4, "Minimize", 2, model]


def test_auto_early_stopping_stops_trials_worse_than_the_median(tmp_path, home):
    values = ["0.01", "0.025", "0.06", "0.1"]
    tuner = HyperparameterTuner(_estimator(tmp_path, reports=8, pause=0.25), "valid:loss",
                                {"lr": CategoricalParameter(values)}, metric_definitions=DEFS,
                                strategy="Grid", objective_type="Minimize", max_parallel_jobs=1,
                                early_stopping_type="Auto", random_seed=4)
    tuner.fit(job_name="es-1")
    summaries = sorted(tuner.analytics().training_job_summaries(),
                       key=lambda s: _index(s["TrainingJobName"]))
    order = [s["TunedHyperParameters"]["lr"] for s in summaries]
    assert sorted(order) == sorted(values)  # the grid, each combination once
    # The median rule by hand: after 2 completed trials, a trial whose (constant) objective is
    # above the median of the completed ones' is stopped; the others complete.
    completed, expected = [], []
    for lr in order:
        value = objective(float(lr), "adam")
        stop = len(completed) >= 2 and value > statistics.median(completed)
        expected.append("Stopped" if stop else "Completed")
        if not stop:
            completed.append(value)
    assert [s["TrainingJobStatus"] for s in summaries] == expected
    assert "Stopped" in expected, "this seed's order stops nothing: the test would prove nothing"
    for s in summaries:
        handle = tuner.latest_tuning_job.estimators[s["TrainingJobName"]].latest_training_job
        assert handle.describe()["TrainingJobStatus"] == s["TrainingJobStatus"]
        if s["TrainingJobStatus"] == "Stopped":
            assert s["FailureReason"].startswith("early stopping")
            reports = [ln for ln in handle.log_lines() if "valid loss" in ln]
            assert len(reports) < 8  # stopped before it ended on its own


def _leftovers(name: str) -> list:
    return [p for p in scan() if name in p.cmdline or name in p.cwd]


def _start_search(tmp_path: Path, name: str) -> subprocess.Popen:
    est = _estimator(tmp_path, reports=400, pause=0.1)  # ~40 s a trial unless stopped
    code = textwrap.dedent(f"""\
        from fp16_sdk.pytorch import PyTorch
        from fp16_sdk.tuner import HyperparameterTuner, ContinuousParameter
        est = PyTorch(entry_point="train.py", source_dir={str(tmp_path / 'src')!r},
                      framework_version="2.1.0", py_version="py311",
                      instance_type="local_process", instance_count=1,
                      output_path={est.output_path!r}, hyperparameters={{"reports": 400,
                      "pause": 0.1}})
        t = HyperparameterTuner(est, "valid:loss", {{"lr": ContinuousParameter(0.01, 0.1)}},
                                metric_definitions={DEFS!r}, max_jobs=4, max_parallel_jobs=2)
        t.fit(job_name={name!r})
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ,
                            "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        trials = records.read_record(name).get("Trials", []) if records.has_record(name) else []
        if len([t for t in trials if t["TrainingJobStatus"] == "InProgress"]) == 2 and \
                len(_leftovers(name)) >= 2:
            return proc
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"two trials never ran: {proc.communicate()[0]}")


@pytest.mark.parametrize("how", ["stop_tuning_job from another process", "Ctrl-C in wait()"])
def test_stopping_a_tuning_job_leaves_nothing_running(tmp_path, home, how):
    name = "stop-1"
    proc = _start_search(tmp_path, name)
    if how.startswith("stop"):
        HyperparameterTuner.attach(name).stop_tuning_job()  # returns once it has stopped
    else:
        proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    desc = HyperparameterTuner.attach(name).describe()
    assert desc["HyperParameterTuningJobStatus"] == "Stopped", out
    assert desc["TrainingJobStatusCounters"]["Stopped"] == 2
    assert desc["TrainingJobStatusCounters"]["InProgress"] == 0
    assert len(records.read_record(name)["Trials"]) == 2  # nothing started after the stop
    assert _leftovers(name) == []
    if how.startswith("Ctrl"):
        assert proc.returncode != 0 and "KeyboardInterrupt" in out
    else:
        assert proc.returncode == 0, out
