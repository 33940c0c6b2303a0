"""The tuner's checks, request shapes and Optuna mapping, without running a job.

References: SageMaker's documented rules and request format (hand-written dicts below), and
Optuna itself (the samplers/pruners it gives for each strategy; a reverse-log range's draws).
"""

from __future__ import annotations

import datetime as dt

import optuna
import pytest

from fp16_sdk.errors import ConfigError
from fp16_sdk.pytorch import PyTorch
from fp16_sdk.tuner import (CategoricalParameter, ContinuousParameter, HyperparameterTuner,
                            IntegerParameter)
from fp16_sdk.tuner.analytics import HyperparameterTuningJobAnalytics, row_of
from fp16_sdk.tuner.attach import describe_from_record
from fp16_sdk.tuner.local import pruner_for, sampler_for, trial_name

DEFS = [{"Name": "valid:loss", "Regex": r"valid loss ([0-9.]+)"}]


def _estimator(tmp_path, **kw):
    (tmp_path / "train.py").write_text("print('valid loss 1.0')\n")
    return PyTorch(entry_point=str(tmp_path / "train.py"), framework_version="2.1.0",
                   py_version="py311", instance_type=kw.pop("instance_type", "local_process"),
                   instance_count=1, output_path=f"file://{tmp_path}/jobs", **kw)


def _tuner(tmp_path, ranges=None, **kw):
    kw.setdefault("metric_definitions", DEFS)
    return HyperparameterTuner(kw.pop("estimator", None) or _estimator(tmp_path), "valid:loss",
                               ranges or {"lr": ContinuousParameter(1e-4, 1e-1)}, **kw)


@pytest.mark.parametrize("make, key, words", [
    (lambda: ContinuousParameter(0.5, 0.1), "min_value", "greater than max_value"),
    (lambda: ContinuousParameter(0.0, 1.0, "Logarithmic"), "scaling_type", "min_value > 0"),
    (lambda: IntegerParameter(1, 9, "ReverseLogarithmic"), "scaling_type", "continuous"),
    (lambda: ContinuousParameter(0.5, 1.0, "ReverseLogarithmic"), "scaling_type", "< 1"),
    (lambda: ContinuousParameter(0.1, 0.2, "Exponential"), "scaling_type", "must be one of"),
    (lambda: IntegerParameter(1, 2.5), "max_value", "integer"),
    (lambda: CategoricalParameter([]), "values", "1 to 30"),
    (lambda: CategoricalParameter(["a", "a"]), "values", "repeat"),
])
def test_ranges_refuse_what_sagemaker_refuses(make, key, words):
    with pytest.raises(ConfigError, match=words) as err:
        make()
    assert err.value.key == key


@pytest.mark.parametrize("kw, key, words", [
    ({"metric_definitions": [{"Name": "other", "Regex": "x (\\d)"}]}, "objective_metric_name",
     "no metric definition"),
    ({"metric_definitions": None}, "metric_definitions", "needs a metric definition"),
    ({"strategy": "Annealing"}, "strategy", "must be one of"),
    ({"objective_type": "Max"}, "objective_type", "must be one of"),
    ({"strategy": "Hyperband", "early_stopping_type": "Auto"}, "early_stopping_type",
     "Hyperband stops trials itself"),
    ({"strategy": "Grid"}, "hyperparameter_ranges.lr", "CategoricalParameter ranges only"),
    ({"max_parallel_jobs": 0}, "max_parallel_jobs", ">= 1"),
    ({"warm_start_config": {"WarmStartType": "TransferLearning"}}, "warm_start_config",
     "SageMaker tuning feature"),
    ({"estimator_name": "a"}, "estimator_name", "one estimator per tuner"),
    ({"hyperparameters_to_keep_static": ["lr"]}, "hyperparameters_to_keep_static",
     "autotune is False"),
])
def test_tuner_arguments_checked_before_anything_starts(tmp_path, kw, key, words):
    with pytest.raises(ConfigError, match=words) as err:
        _tuner(tmp_path, **kw)
    assert err.value.key == key
    assert not (tmp_path / "jobs").exists()


def test_reserved_names_and_grid_size(tmp_path):
    smp = _estimator(tmp_path, distribution={"smdistributed": {"modelparallel": {
        "enabled": True, "parameters": {"pipeline_parallel_degree": 1}}}})
    with pytest.raises(ConfigError, match="distribution sets it"):
        _tuner(tmp_path, {"mp_parameters": CategoricalParameter(["a"])}, estimator=smp)
    with pytest.raises(ConfigError, match="platform"):
        _tuner(tmp_path, {"sagemaker_program": CategoricalParameter(["a"])})
    grid = {"a": CategoricalParameter([1, 2, 3]), "b": CategoricalParameter(["x", "y"])}
    assert _tuner(tmp_path, grid, strategy="Grid").max_jobs == 6  # 3 x 2 combinations
    with pytest.raises(ConfigError, match="more than the grid's 6"):
        _tuner(tmp_path, grid, strategy="Grid", max_jobs=7)
    assert _tuner(tmp_path).max_jobs == 1  # SageMaker's default for other strategies


def test_metric_definitions_default_to_the_estimators(tmp_path):
    est = _estimator(tmp_path, metric_definitions=DEFS)
    tuner = HyperparameterTuner(est, "valid:loss", {"lr": ContinuousParameter(0.1, 0.2)})
    assert tuner.metric_definitions == DEFS


def test_parameter_ranges_in_sagemakers_request_format(tmp_path):
    ranges = {"lr": ContinuousParameter(0.001, 0.1, "Logarithmic"),
              "layers": IntegerParameter(2, 8),
              "opt": CategoricalParameter(["adam", "sgd"])}
    tuner = _tuner(tmp_path, ranges, strategy="Random", max_jobs=3)
    # SageMaker's format: bounds as strings; local jobs keep categorical values as they are.
    assert tuner.hyperparameter_ranges() == {
        "ContinuousParameterRanges": [{"Name": "lr", "MinValue": "0.001", "MaxValue": "0.1",
                                       "ScalingType": "Logarithmic"}],
        "IntegerParameterRanges": [{"Name": "layers", "MinValue": "2", "MaxValue": "8",
                                    "ScalingType": "Auto"}],
        "CategoricalParameterRanges": [{"Name": "opt", "Values": ["adam", "sgd"]}]}
    # Framework images receive JSON: the real SDK's as_json_range.
    assert ranges["opt"].as_json_range("opt") == {"Name": "opt", "Values": ['"adam"', '"sgd"']}


@pytest.mark.parametrize("strategy, early, sampler, pruner", [
    ("Bayesian", "Off", optuna.samplers.TPESampler, optuna.pruners.NopPruner),
    ("Random", "Auto", optuna.samplers.RandomSampler, optuna.pruners.MedianPruner),
    ("Grid", "Off", optuna.samplers.GridSampler, optuna.pruners.NopPruner),
    ("Hyperband", "Off", optuna.samplers.RandomSampler, optuna.pruners.HyperbandPruner),
])
def test_each_strategy_is_optunas(tmp_path, strategy, early, sampler, pruner):
    tuner = _tuner(tmp_path, {"opt": CategoricalParameter(["a", "b"])}, strategy=strategy,
                   early_stopping_type=early, max_jobs=2)
    assert type(sampler_for(tuner._config)) is sampler
    assert type(pruner_for(tuner._config)) is pruner


def test_reverse_logarithmic_draws_log_of_one_minus_x():
    rng = ContinuousParameter(0.9, 0.999, "ReverseLogarithmic")
    dist = rng.distribution()
    assert dist.log and dist.low == pytest.approx(0.001) and dist.high == pytest.approx(0.1)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(20):
        value = rng.value_of(study.ask({"m": dist}).params["m"])
        assert 0.9 <= value <= 0.999


def test_trial_names_are_sagemakers_shape():
    name = trial_name("tune-1", 7)
    assert name.startswith("tune-1-007-") and len(name.split("-")[-1]) == 8


def test_describe_counters_best_and_analytics_rows_by_hand():
    t0 = "2026-01-01T00:00:00+00:00"
    trials = [
        {"TrainingJobName": "j-001-a", "TrainingJobStatus": "Completed",
         "ObjectiveStatus": "Succeeded", "TunedHyperParameters": {"lr": "0.5", "opt": "adam"},
         "FinalHyperParameterTuningJobObjectiveMetric": {"MetricName": "m", "Value": 2.0},
         "TrainingStartTime": t0, "TrainingEndTime": "2026-01-01T00:00:30+00:00"},
        {"TrainingJobName": "j-002-b", "TrainingJobStatus": "Stopped",
         "ObjectiveStatus": "Succeeded", "TunedHyperParameters": {"lr": "0.1", "opt": "sgd"},
         "FinalHyperParameterTuningJobObjectiveMetric": {"MetricName": "m", "Value": 1.0}},
        {"TrainingJobName": "j-003-c", "TrainingJobStatus": "Failed",
         "ObjectiveStatus": "Failed", "TunedHyperParameters": {"lr": "0.2", "opt": "sgd"}},
    ]
    record = {"HyperParameterTuningJobName": "j", "HyperParameterTuningJobStatus": "Completed",
              "HyperParameterTuningJobConfig": {"HyperParameterTuningJobObjective": {
                  "Type": "Minimize", "MetricName": "m"}}, "Trials": trials, "Pid": 1,
              "CreationTime": t0}
    desc = describe_from_record(record)
    assert desc["TrainingJobStatusCounters"] == {"Completed": 1, "InProgress": 0,
                                                 "RetryableError": 0, "NonRetryableError": 1,
                                                 "Stopped": 1}
    assert desc["ObjectiveStatusCounters"] == {"Succeeded": 2, "Pending": 0, "Failed": 1}
    assert desc["BestTrainingJob"]["TrainingJobName"] == "j-002-b"  # 1.0 < 2.0, minimised
    assert desc["CreationTime"] == dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    assert "Trials" not in desc and "Pid" not in desc
    table = HyperparameterTuningJobAnalytics("j", lambda: trials).dataframe()
    rows = table.to_rows() if hasattr(table, "to_rows") else table.to_dict("records")
    assert list(rows[0]) == ["lr", "opt", "TrainingJobName", "TrainingJobStatus",
                             "FinalObjectiveValue", "TrainingStartTime", "TrainingEndTime",
                             "TrainingElapsedTimeSeconds"]
    assert rows[0]["lr"] == 0.5 and rows[0]["opt"] == "adam"  # numbers as floats, as SageMaker
    assert rows[0]["TrainingElapsedTimeSeconds"] == 30.0
    assert rows[2]["FinalObjectiveValue"] is None
    assert row_of(trials[1])["TrainingElapsedTimeSeconds"] is None
