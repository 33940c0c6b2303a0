"""`fp16_sdk.huggingface.HuggingFace`: the real class's version rules, a local_process fit(), and
the SageMaker request through moto (botocore validation on).

Expected values are written from the real `sagemaker.huggingface.HuggingFace` (its
`_validate_args`, its `enable_sagemaker_metrics=True` default, versions used only for the
image) and from the contract's hyperparameter encoding.
"""

from __future__ import annotations

import json

import pytest

from helpers.aws import ACCOUNT, REGION, aws, moto_server  # noqa: F401 (fixtures)
from helpers.aws import capture_requests, make_buckets
from helpers.paths import REPO
from fp16_sdk.errors import ConfigError
from fp16_sdk.huggingface import HuggingFace
from fp16_sdk.session import Session

ROLE = f"arn:aws:iam::{ACCOUNT}:role/SageMakerRole"
IMAGE = f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/fp16-sdk-training:latest-gpu"
SMP = {"smdistributed": {"modelparallel": {"enabled": True, "parameters": {
    "partitions": 2, "microbatches": 2, "ddp": True, "fp16": True}}},
    "mpi": {"enabled": True, "processes_per_host": 2}}


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(
        "import os, sys\n"
        "print('argv', sys.argv[1:])\n"
        "print('hps', os.environ['SM_HPS'])\n"
        "open(os.path.join(os.environ['SM_MODEL_DIR'], 'done.txt'), 'w').write('ok')\n")
    return tmp_path


def make(script, **overrides) -> HuggingFace:
    """The arguments of AWS's GPT-J notebook's HuggingFace(...) call, run on this machine."""
    args = dict(entry_point="train.py", source_dir=str(script), role=ROLE,
                instance_type="local_process", volume_size=200, instance_count=1,
                pytorch_version="1.10.2", transformers_version="4.17.0", py_version="py38",
                output_path=str(script / "jobs"), hyperparameters={"epochs": 1, "do_train": ""},
                debugger_hook_config=False, disable_profiler=True, base_job_name="gptj")
    args.update(overrides)
    return HuggingFace(**{k: v for k, v in args.items() if v is not DROP})


DROP = object()


@pytest.mark.parametrize("overrides, key", [
    (dict(tensorflow_version="2.4.1", pytorch_version=None), "tensorflow_version"),
    (dict(tensorflow_version="2.4.1"), "tensorflow_version"),
    (dict(transformers_version=None), "transformers_version"),
    (dict(pytorch_version=None), "pytorch_version"),
    (dict(py_version=None), "py_version"),
    (dict(pytorch_version="1.10"), "pytorch_version"),  # full and shortened mixed
    (dict(transformers_version="latest"), "transformers_version"),
    (dict(py_version="3.8"), "py_version"),
    (dict(compiler_config={"enabled": True}), "compiler_config"),
    (dict(distribution={"pytorchxla": {"enabled": True}}), "pytorchxla"),
    (dict(distribution={"smdistributed": {"modelparallel": {
        "enabled": True, "parameters": {"tensor_parallel_degree": 2}}}}), "ddp"),
    (dict(instance_typ="local_process"), "instance_typ"),
])
def test_version_and_argument_errors_name_the_key(script, overrides, key):
    with pytest.raises(ConfigError) as err:
        make(script, **overrides)
    assert key in str(err.value)
    assert not (script / "jobs").exists()


def test_image_uri_makes_the_versions_optional(script):
    est = make(script, instance_type="local", image_uri="fp16-sdk-training:latest-cpu",
               pytorch_version=None, transformers_version=None, py_version=None)
    assert est.training_image_uri() == "fp16-sdk-training:latest-cpu"


def test_versions_are_recorded_as_the_real_class_does(script):
    est = make(script, transformers_version="4.17", pytorch_version="1.10")
    assert (est.framework_version, est.transformers_version, est.pytorch_version,
            est.tensorflow_version, est.py_version) == ("4.17", "4.17", "1.10", None, "py38")
    assert (est.base_framework_name, est.base_framework_version) == ("pytorch", "1.10")
    # Versions choose the image in SageMaker; they are not hyperparameters.
    assert est.hyperparameters() == {"epochs": "1", "do_train": '""'}


def test_local_process_fit_runs_the_script(script):
    est = make(script, distribution={"torch_distributed": {"enabled": True}})
    est.fit(job_name="hf-1")
    log = "\n".join(est.latest_training_job.log_lines())
    assert "argv ['--do_train', '--epochs', '1']" in log  # sorted, bare flag for ''
    hps = json.loads(log.split("hps ", 1)[1].splitlines()[0])
    assert hps == {"epochs": 1, "do_train": ""}
    assert est.model_data.endswith("hf-1/output/model.tar.gz")


def test_sagemaker_request_through_moto(aws, script):
    session = Session()
    make_buckets(session, "out-bucket")
    sent = capture_requests(session, "CreateTrainingJob")
    est = make(script, instance_type="ml.p4d.24xlarge", image_uri=IMAGE, distribution=SMP,
               sagemaker_session=session, output_path="s3://out-bucket/models",
               base_job_name=DROP)
    est.fit({"train": "s3://data-bucket/train"}, wait=False)
    [request] = sent
    assert request["TrainingJobName"].startswith("fp16-sdk-training-")  # from the image
    assert request["AlgorithmSpecification"] == {
        "TrainingImage": IMAGE, "TrainingInputMode": "File",
        "EnableSageMakerMetricsTimeSeries": True}  # HuggingFace's default
    hps = {k: json.loads(v) for k, v in request["HyperParameters"].items()}
    assert hps["mp_parameters"] == SMP["smdistributed"]["modelparallel"]["parameters"]
    assert hps["sagemaker_mpi_enabled"] is True
    assert hps["sagemaker_mpi_num_of_processes_per_host"] == 2
    assert hps["epochs"] == 1 and hps["do_train"] == ""
    assert not any("version" in k for k in hps)
    assert "DebugHookConfig" not in request
    assert request["ProfilerConfig"] == {"DisableProfiler": True}
    described = est.latest_training_job.describe()
    assert described["ResourceConfig"]["VolumeSizeInGB"] == 200


def test_default_base_job_name_without_image(script):
    est = make(script, base_job_name=DROP)
    est.fit(wait=False)
    assert est.latest_training_job.name.startswith("huggingface-pytorch-training-")
    est.latest_training_job.wait(logs=False)


def test_import_does_not_import_torch_or_transformers():
    import subprocess
    import sys

    code = ("import sys, fp16_sdk.huggingface; "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, check=True)
    assert out.stdout.strip() == "False False"
