"""SageMaker's other EstimatorBase arguments: accepted everywhere, validated, noted once in local
modes, and sent to CreateTrainingJob in the real SDK v2's field names and shapes.

The expected request pieces below are written from the real SDK's request builders
(`sagemaker.job._Job._prepare_*`, `Session._get_train_request`, `DebuggerHookConfig.
_to_request_dict`...) and botocore's CreateTrainingJob model, not from fp16_sdk's code; the
requests go through moto's server with botocore's validation on.
"""

from __future__ import annotations

import json
import logging

import pytest

from helpers.aws import ACCOUNT, REGION, aws, moto_server  # noqa: F401 (fixtures)
from helpers.aws import capture_requests, make_buckets
from helpers.paths import REPO
from fp16_sdk.errors import ConfigError
from fp16_sdk.pytorch import PyTorch
from fp16_sdk.session import Session

ROLE = f"arn:aws:iam::{ACCOUNT}:role/SageMakerRole"
IMAGE = f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/fp16-sdk-training:latest-gpu"
SMP = {"mpi": {"enabled": True, "processes_per_host": 2, "custom_mpi_options": "-verbose"},
       "smdistributed": {"modelparallel": {"enabled": True, "parameters": {
           "ddp": True, "partitions": 2, "microbatches": 2, "fp16": True}}}}


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("import sys\nprint('args', sys.argv[1:])\n")
    return tmp_path


def submit(script, **kwargs) -> dict:
    """PyTorch(...).fit() against the emulator; returns the request as sent on the wire."""
    session = Session()
    make_buckets(session, "out-bucket")
    sent = capture_requests(session, "CreateTrainingJob")
    args = dict(entry_point="train.py", source_dir=str(script), image_uri=IMAGE, role=ROLE,
                instance_type="ml.p4d.24xlarge", instance_count=1, sagemaker_session=session,
                output_path="s3://out-bucket/models", framework_version="1.12", py_version="py38")
    args.update(kwargs)
    est = PyTorch(**args)
    est.fit("s3://data-bucket/train", wait=False, job_name="args-job")
    assert len(sent) == 1
    assert est.latest_training_job.describe()["TrainingJobName"] == "args-job"
    return sent[0]


def test_every_pass_through_argument_reaches_create_training_job(aws, script):
    hook = {"S3OutputPath": "s3://out-bucket/debug", "HookParameters": {"save_interval": "10"},
            "CollectionConfigurations": [{"CollectionName": "losses"}]}
    rule = {"RuleConfigurationName": "LossNotDecreasing",
            "RuleEvaluatorImage": f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/rules:latest",
            "RuleParameters": {"rule_to_invoke": "LossNotDecreasing"}}
    sent = submit(
        script, volume_kms_key="alias/volume", output_kms_key="alias/output",
        encrypt_inter_container_traffic=True, max_retry_attempts=3,
        debugger_hook_config=hook, rules=[rule],
        tensorboard_output_config={"S3OutputPath": "s3://out-bucket/tb",
                                   "LocalPath": "/opt/ml/output/tensorboard"},
        profiler_config={"S3OutputPath": "s3://out-bucket/prof",
                         "ProfilingIntervalInMilliseconds": 500},
        enable_sagemaker_metrics=False, training_repository_access_mode="Vpc",
        training_repository_credentials_provider_arn="arn:aws:lambda:us-west-2:1:function:f",
        enable_infra_check=True, container_entry_point=["python3", "-m", "fp16_sdk.toolkit"],
        container_arguments=["--verbose"], disable_output_compression=True,
        enable_remote_debug=True, enable_session_tag_chaining=False,
        use_spot_instances=True, max_run=3600, max_wait=7200, keep_alive_period_in_seconds=1800,
        subnets=["subnet-1"], security_group_ids=["sg-1"], enable_network_isolation=True,
        tags=[{"Key": "team", "Value": "nlp"}], environment={"NCCL_DEBUG": "INFO"},
        checkpoint_s3_uri="s3://out-bucket/ckpt", checkpoint_local_path="/opt/ml/checkpoints")
    assert sent["AlgorithmSpecification"] == {
        "TrainingImage": IMAGE, "TrainingInputMode": "File",
        "TrainingImageConfig": {"TrainingRepositoryAccessMode": "Vpc",
                                "TrainingRepositoryAuthConfig": {
                                    "TrainingRepositoryCredentialsProviderArn":
                                        "arn:aws:lambda:us-west-2:1:function:f"}},
        "ContainerEntrypoint": ["python3", "-m", "fp16_sdk.toolkit"],
        "ContainerArguments": ["--verbose"], "EnableSageMakerMetricsTimeSeries": False}
    assert sent["ResourceConfig"] == {"InstanceType": "ml.p4d.24xlarge", "InstanceCount": 1,
                                      "VolumeSizeInGB": 30, "VolumeKmsKeyId": "alias/volume",
                                      "KeepAlivePeriodInSeconds": 1800}
    assert sent["OutputDataConfig"] == {"S3OutputPath": "s3://out-bucket/models",
                                        "KmsKeyId": "alias/output", "CompressionType": "NONE"}
    assert sent["StoppingCondition"] == {"MaxRuntimeInSeconds": 3600,
                                         "MaxWaitTimeInSeconds": 7200}
    assert sent["EnableManagedSpotTraining"] is True
    assert sent["EnableNetworkIsolation"] is True
    assert sent["EnableInterContainerTrafficEncryption"] is True
    assert sent["VpcConfig"] == {"Subnets": ["subnet-1"], "SecurityGroupIds": ["sg-1"]}
    assert sent["Tags"] == [{"Key": "team", "Value": "nlp"}]
    assert sent["RetryStrategy"] == {"MaximumRetryAttempts": 3}
    assert sent["InfraCheckConfig"] == {"EnableInfraCheck": True}
    assert sent["RemoteDebugConfig"] == {"EnableRemoteDebug": True}
    assert sent["SessionChainingConfig"] == {"EnableSessionTagChaining": False}
    assert sent["CheckpointConfig"] == {"S3Uri": "s3://out-bucket/ckpt",
                                        "LocalPath": "/opt/ml/checkpoints"}
    # Both checkpoint settings: the real Framework estimators turn the Debugger hook off.
    assert "DebugHookConfig" not in sent
    assert sent["DebugRuleConfigurations"] == [rule]
    assert sent["TensorBoardOutputConfig"] == {"S3OutputPath": "s3://out-bucket/tb",
                                               "LocalPath": "/opt/ml/output/tensorboard"}
    assert sent["ProfilerConfig"] == {"S3OutputPath": "s3://out-bucket/prof",
                                      "ProfilingIntervalInMilliseconds": 500,
                                      "DisableProfiler": False}


def test_debugger_hook_given_without_checkpoints_is_sent(aws, script):
    sent = submit(script, debugger_hook_config={"HookParameters": {"save_interval": "5"}})
    # No S3OutputPath given: the real SDK fills in the estimator's output_path.
    assert sent["DebugHookConfig"] == {"HookParameters": {"save_interval": "5"},
                                       "S3OutputPath": "s3://out-bucket/models"}


def test_defaults_match_the_real_sdk(aws, script):
    sent = submit(script)
    # debugger_hook_config=None and disable_profiler=None: default hook and profiler on the
    # output path; PyTorch >= 1.3 turns SageMaker metrics on.
    assert sent["DebugHookConfig"] == {"S3OutputPath": "s3://out-bucket/models"}
    assert sent["ProfilerConfig"] == {"S3OutputPath": "s3://out-bucket/models",
                                      "DisableProfiler": False}
    assert sent["AlgorithmSpecification"]["EnableSageMakerMetricsTimeSeries"] is True
    for absent in ("RetryStrategy", "EnableInterContainerTrafficEncryption", "InfraCheckConfig",
                   "DebugRuleConfigurations", "ProfilerRuleConfigurations", "VpcConfig"):
        assert absent not in sent


def test_notebook_switches_turn_debugger_and_profiler_off(aws, script):
    sent = submit(script, debugger_hook_config=False, disable_profiler=True)
    assert "DebugHookConfig" not in sent
    assert sent["ProfilerConfig"] == {"DisableProfiler": True}


def test_instance_groups_replace_type_and_count(aws, script):
    groups = [{"InstanceGroupName": "gpu", "InstanceType": "ml.p4d.24xlarge",
               "InstanceCount": 2},
              {"InstanceGroupName": "cpu", "InstanceType": "ml.c5.18xlarge", "InstanceCount": 1}]
    sent = submit(script, instance_type=None, instance_count=None, instance_groups=groups)
    assert sent["ResourceConfig"] == {"VolumeSizeInGB": 30, "InstanceGroups": groups}


class _SDKHook:
    """Stands in for sagemaker.debugger.DebuggerHookConfig (the same `_to_request_dict`)."""

    def _to_request_dict(self):
        return {"S3OutputPath": "s3://out-bucket/hook", "LocalPath": None,
                "CollectionConfigurations": [{"CollectionName": "weights"}]}


def test_sdk_objects_are_used_through_their_request_dicts(aws, script):
    sent = submit(script, debugger_hook_config=_SDKHook())
    assert sent["DebugHookConfig"] == {"S3OutputPath": "s3://out-bucket/hook",
                                       "CollectionConfigurations": [{"CollectionName": "weights"}]}


def test_v1_names_are_accepted_with_a_warning(aws, script, caplog):
    with caplog.at_level(logging.WARNING):
        sent = submit(script, instance_type=None, instance_count=None,
                      train_instance_type="ml.p3.16xlarge", train_instance_count=2,
                      train_volume_size=50)
    assert sent["ResourceConfig"] == {"InstanceType": "ml.p3.16xlarge", "InstanceCount": 2,
                                      "VolumeSizeInGB": 50}
    assert "train_instance_type is the SageMaker SDK v1 name of instance_type" in caplog.text


# ---- local modes ------------------------------------------------------------------------

def notebook_style(script, **overrides):
    """An AWS smp notebook's PyTorch(...) call (its argument names and shapes), run locally."""
    hyperparameters = {"max_steps": 2, "fp16": 1, "pipeline_parallel_degree": 2,
                       "checkpoint-dir": "/opt/ml/checkpoints", "do_train": ""}
    kwargs = {"security_group_ids": ["sg-0fsx"], "subnets": ["subnet-0fsx"]}  # the FSx branch
    args = dict(
        entry_point="train.py", source_dir=str(script), role="arn:aws:iam::1:role/r",
        instance_type="local_process", volume_size=500, instance_count=1,
        sagemaker_session=None, distribution=SMP, framework_version="1.12", py_version="py38",
        output_path=str(script / "jobs"), checkpoint_s3_uri=None,
        # the notebook's FSx branch passes hyperparameters["checkpoint-dir"]; in local modes
        # that folder is on this machine, so the test gives one under its own tmp folder
        checkpoint_local_path=str(script / "checkpoints"),
        metric_definitions=[{"Name": "train:loss", "Regex": "loss=([0-9.]+)"}],
        hyperparameters=hyperparameters, debugger_hook_config=False, disable_profiler=True,
        base_job_name="smp-gpt2", **kwargs)
    args.update(overrides)
    return PyTorch(**args)


def test_notebook_call_runs_locally_and_notes_what_has_no_effect(script, caplog, capsys):
    est = notebook_style(script, distribution=None)
    with caplog.at_level(logging.INFO, logger="fp16_sdk.estimator"):
        est.fit(job_name="nb-1")
        est.fit(job_name="nb-2")
    notes = [r.getMessage() for r in caplog.records if "no effect in local mode" in r.getMessage()]
    assert notes == ["recorded, no effect in local mode: debugger_hook_config=False, "
                     "disable_profiler=True, subnets=['subnet-0fsx'], "
                     "security_group_ids=['sg-0fsx']"]
    out = capsys.readouterr().out
    # Bare flag for the empty value, as SageMaker's toolkit passes it.
    assert "'--do_train'," in out and "'--do_train', ''" not in out


def test_notebook_call_with_smp_distribution_is_accepted(script):
    est = notebook_style(script)
    assert est.debugger_hook_config is False and est.disable_profiler is True
    assert json.loads(est.hyperparameters()["mp_parameters"])["partitions"] == 2


def test_model_uri_is_a_channel_locally(script):
    (script / "model").mkdir()
    (script / "model" / "weights.bin").write_text("w")
    (script / "train.py").write_text(
        "import os\nprint('model files', sorted(os.listdir(os.environ['SM_CHANNEL_MODEL'])))\n")
    est = PyTorch(entry_point="train.py", source_dir=str(script), framework_version="2.1",
                  py_version="py3", instance_type="local_process", instance_count=1,
                  output_path=str(script / "jobs"), model_uri=str(script / "model"))
    est.fit(job_name="model-1")
    log = "\n".join(est.latest_training_job.log_lines())
    assert "model files ['weights.bin']" in log


BAD = [
    ("volume_kms_key", dict(volume_kms_key="key with spaces")),
    ("max_retry_attempts", dict(max_retry_attempts=31)),
    ("max_retry_attempts", dict(max_retry_attempts=True)),
    ("encrypt_inter_container_traffic", dict(encrypt_inter_container_traffic="yes")),
    ("disable_profiler", dict(disable_profiler=1)),
    ("training_repository_access_mode", dict(training_repository_access_mode="ECR")),
    ("training_repository_credentials_provider_arn",
     dict(training_repository_credentials_provider_arn="arn:aws:lambda:x")),
    ("container_entry_point", dict(container_entry_point="python3 train.py")),
    ("training_plan", dict(training_plan="my-plan")),
    ("debugger_hook_config", dict(debugger_hook_config={"S3Output": "s3://b"})),
    ("debugger_hook_config.S3OutputPath", dict(debugger_hook_config={"S3OutputPath": "/tmp"})),
    ("tensorboard_output_config", dict(tensorboard_output_config={"LocalPath": "/tb"})),
    ("profiler_config", dict(profiler_config="on")),
    ("profiler_config", dict(disable_profiler=True,
                             profiler_config={"DisableProfiler": False})),
    ("rules", dict(rules={"RuleConfigurationName": "x"})),
    ("rules", dict(rules=[{"RuleConfigurationName": "x",
                           "RuleEvaluatorImage": "DEFAULT_RULE_EVALUATOR_IMAGE"}])),
    ("instance_groups", dict(instance_groups=[{"InstanceGroupName": "g",
                                               "InstanceType": "ml.p4d.24xlarge",
                                               "InstanceCount": 1}])),  # type/count also set
    ("compiler_config", dict(compiler_config={"enabled": True})),
    ("training_recipe", dict(training_recipe="training/llama/hf_llama3_8b")),
    ("git_config", dict(git_config={"repo": "https://github.com/org/repo.git",
                                    "branch": 3})),
    ("instance_typ", dict(instance_typ="ml.p3.2xlarge")),
]


@pytest.mark.parametrize("key, overrides", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_values_name_the_key(script, key, overrides):
    with pytest.raises(ConfigError) as err:
        notebook_style(script, distribution=None, **overrides)
    assert key in str(err.value)
    assert err.value.key == key.split(".")[0] or err.value.key == key
    assert not (script / "jobs").exists()


def test_disabled_compiler_config_is_accepted(script):
    class Off:  # sagemaker.pytorch.TrainingCompilerConfig(enabled=False) has .enabled
        enabled = False

    est = notebook_style(script, distribution=None, compiler_config=Off())
    assert "sagemaker_training_compiler_enabled" not in est.hyperparameters()


def test_configuration_page_lists_every_constructor_argument():
    """docs/configuration.md's estimator table names each argument of the three constructors."""
    import inspect

    from fp16_sdk.estimator.core import Estimator
    from fp16_sdk.huggingface import HuggingFace

    page = (REPO / "docs" / "configuration.md").read_text()
    table = page.split("## Estimator arguments", 1)[1]
    for cls in (Estimator, PyTorch, HuggingFace):
        for name in inspect.signature(cls.__init__).parameters:
            if name not in ("self", "kwargs", "common"):
                assert f"`{name}`" in table, (cls.__name__, name)
