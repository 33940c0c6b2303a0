"""The notebooks, executed on a real Jupyter kernel (nbclient, kernel "python3").

- The local notebook runs the FP16 pp=2 x tp=2 job in local_process; its final cell must show
  the loss falling and a PNG plot. The numbers it prints are checked against the job's own
  output.tar.gz, read here independently.
- The tuning notebook tunes the demo's learning rate with HyperparameterTuner (4 local_process
  trials, 2 at a time); each trial's objective is checked against that trial's own
  output.tar.gz history, and the best against the minimum of those.
- The SageMaker notebook runs against moto's server (an AWS API emulator: it stores the job but
  runs no compute), and once with no AWS access at all, where it must skip the submission
  instead of failing.
"""

from __future__ import annotations

import base64
import json
import re
import tarfile
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from helpers.aws import aws, moto_server  # noqa: F401 (fixtures)
from helpers.paths import REPO

NOTEBOOKS = REPO / "notebooks"
LOCAL = NOTEBOOKS / "fp16_model_parallel_local.ipynb"
SAGEMAKER = NOTEBOOKS / "fp16_model_parallel_sagemaker.ipynb"
TUNING = NOTEBOOKS / "tuning_local.ipynb"


def execute(path: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return nb


def text_of(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.output_type == "stream")


@pytest.mark.parametrize("path", [LOCAL, SAGEMAKER, TUNING], ids=lambda p: p.stem)
def test_notebook_is_valid_and_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)


@pytest.mark.slow
def test_local_notebook_shows_loss_falling_and_plots(tmp_path, monkeypatch):
    monkeypatch.setenv("FP16_SDK_DEMO_STEPS", "30")
    monkeypatch.setenv("FP16_SDK_OUTPUT_PATH", f"file://{tmp_path}")
    nb = execute(LOCAL)
    final = [c for c in nb.cells if c.cell_type == "code"][-1]
    images = [o for o in final.outputs if o.output_type == "display_data" and "image/png" in o.data]
    assert len(images) == 1
    assert base64.b64decode(images[0].data["image/png"])[:8] == b"\x89PNG\r\n\x1a\n"
    m = re.search(r"loss fell from ([0-9.]+) to ([0-9.]+)", text_of(final))
    assert m, text_of(final)
    first, last = float(m.group(1)), float(m.group(2))
    assert last < first

    # The job's own record, read without the notebook's code.
    (job,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    with tarfile.open(job / "output" / "output.tar.gz") as tar:
        history = json.load(tar.extractfile("metrics.json"))
    assert history["step"] == list(range(1, 31))
    assert first == pytest.approx(sum(history["loss"][:5]) / 5, abs=1e-4)
    assert last == pytest.approx(sum(history["loss"][-5:]) / 5, abs=1e-4)
    with tarfile.open(job / "output" / "model.tar.gz") as tar:
        assert "model.pt" in tar.getnames()
    # The metrics cell's FinalMetricDataList is the last logged step (30) of the history.
    metrics_cell = next(c for c in nb.cells if "TrainingJobAnalytics" in c.source)
    assert f"'Value': {round(history['loss'][-1], 4)}" in text_of(metrics_cell)


@pytest.mark.slow
def test_tuning_notebook_tunes_and_plots_the_objective_per_trial(tmp_path, monkeypatch):
    monkeypatch.setenv("FP16_SDK_DEMO_STEPS", "6")
    monkeypatch.setenv("FP16_SDK_OUTPUT_PATH", f"file://{tmp_path / 'jobs'}")
    monkeypatch.setenv("FP16_SDK_HOME", str(tmp_path / "home"))
    nb = execute(TUNING)
    final = [c for c in nb.cells if c.cell_type == "code"][-1]
    images = [o for o in final.outputs if o.output_type == "display_data" and "image/png" in o.data]
    assert len(images) == 1
    assert base64.b64decode(images[0].data["image/png"])[:8] == b"\x89PNG\r\n\x1a\n"
    m = re.search(r"best trial (\S+): lr ([0-9.]+), final loss ([0-9.]+)", text_of(final))
    assert m, text_of(final)

    # Each trial's own record: the last logged loss (step 6) in its output.tar.gz history.
    finals = {}
    for job in (tmp_path / "jobs").iterdir():
        with tarfile.open(job / "output" / "output.tar.gz") as tar:
            history = json.load(tar.extractfile("metrics.json"))
        assert history["step"] == list(range(1, 7))
        finals[job.name] = round(history["loss"][-1], 4)
    assert len(finals) == 4
    assert m.group(1) == min(finals, key=finals.get)
    assert float(m.group(3)) == pytest.approx(min(finals.values()), abs=1e-4)
    table_cell = next(c for c in nb.cells if c.cell_type == "code" and "analytics()" in c.source)
    for name, value in finals.items():
        row = next(ln for ln in text_of(table_cell).splitlines() if name in ln)
        assert f" {value:.6g} " in row and " Completed " in row


def test_sagemaker_notebook_submits_the_job_to_the_emulator(aws):  # noqa: F811
    nb = execute(SAGEMAKER)
    (summary,) = aws.client("sagemaker").list_training_jobs()["TrainingJobSummaries"]
    assert summary["TrainingJobName"].startswith("gpt-fp16-")
    described = aws.client("sagemaker").describe_training_job(
        TrainingJobName=summary["TrainingJobName"])
    hps = {k: json.loads(v) for k, v in described["HyperParameters"].items()}
    assert hps["mp_parameters"] == {"microbatches": 4, "pipeline_parallel_degree": 2,
                                    "tensor_parallel_degree": 2, "ddp": True, "fp16": True}
    assert hps["sagemaker_mpi_num_of_processes_per_host"] == 4
    assert hps["sagemaker_program"] == "train_gpt.py"
    assert described["ResourceConfig"]["InstanceType"] == "ml.g5.12xlarge"
    outputs = "".join(text_of(c) for c in nb.cells if c.cell_type == "code")
    assert f"job {summary['TrainingJobName']} status Completed" in outputs
    assert "no output.tar.gz to read" in outputs and "nothing to plot" in outputs


def test_sagemaker_notebook_without_aws_skips_instead_of_failing(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    nb = execute(SAGEMAKER)
    outputs = "".join(text_of(c) for c in nb.cells if c.cell_type == "code")
    assert "No AWS credentials and no AWS_ENDPOINT_URL" in outputs
    assert "validated: distribution" in outputs and "skipped fit(): no AWS access" in outputs
