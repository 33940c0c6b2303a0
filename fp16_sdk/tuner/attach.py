"""From a tuning job's description back to a tuner: `HyperparameterTuner.attach`'s half.

`describe_from_record` turns a local record into DescribeHyperParameterTuningJob's shape
(counters, BestTrainingJob, datetimes); `attached_tuner` rebuilds a tuner's settings from any
such description (SageMaker's or a record's); `RecordedTuning` is a local tuning job run by
another process (describe, wait, stop, training_jobs: the interface `LocalTuning` and
`SageMakerTuning` also offer); `RecordedJob` is the JobHandle of one of its trials.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from typing import Any

from fp16_sdk.backends.base import JobHandle, JobStatus
from fp16_sdk.tuner import records
from fp16_sdk.tuner.ranges import CategoricalParameter, ContinuousParameter, IntegerParameter
from fp16_sdk.tuner.settings import TuningConfig

__all__ = ["describe_from_record", "best_summary", "attached_tuner", "RecordedJob",
           "RecordedTuning"]

_TIMES = ("CreationTime", "HyperParameterTuningEndTime", "LastModifiedTime",
          "TrainingStartTime", "TrainingEndTime")


def _times(d: dict) -> dict:
    out = dict(d)
    for key in _TIMES:
        if isinstance(out.get(key), str):
            out[key] = dt.datetime.fromisoformat(out[key])
    return out


def best_summary(trials: list[dict], *, minimize: bool) -> dict | None:
    """The trial with the best final objective (ties: the earlier), None if none has one."""
    scored = [t for t in trials if t.get("ObjectiveStatus") == "Succeeded"
              and "FinalHyperParameterTuningJobObjectiveMetric" in t]
    if not scored:
        return None
    value = (lambda t: t["FinalHyperParameterTuningJobObjectiveMetric"]["Value"])
    return (min if minimize else max)(scored, key=value)


def describe_from_record(record: dict) -> dict:
    """A local record as DescribeHyperParameterTuningJob's response."""
    trials = record.get("Trials", [])
    desc = {k: v for k, v in record.items() if k not in ("Trials", "Pid")}
    statuses = [t["TrainingJobStatus"] for t in trials]
    desc["TrainingJobStatusCounters"] = {
        "Completed": statuses.count("Completed"), "InProgress": statuses.count("InProgress"),
        "RetryableError": 0, "NonRetryableError": statuses.count("Failed"),
        "Stopped": statuses.count("Stopped")}
    objectives = [t.get("ObjectiveStatus") for t in trials]
    desc["ObjectiveStatusCounters"] = {"Succeeded": objectives.count("Succeeded"),
                                       "Pending": objectives.count("Pending"),
                                       "Failed": objectives.count("Failed")}
    objective = desc.get("HyperParameterTuningJobConfig", {}).get(
        "HyperParameterTuningJobObjective", {})
    best = best_summary(trials, minimize=objective.get("Type") == "Minimize")
    if best is not None:
        desc["BestTrainingJob"] = _times(best)
    return _times(desc)


def summaries_of(record: dict) -> list[dict]:
    """A record's trials as ListTrainingJobsForHyperParameterTuningJob's summaries."""
    return [_times(t) for t in record.get("Trials", [])]


class RecordedTuning:
    """A local tuning job seen through its record (run by this or another process).

    Args:
        name: the tuning job's name.
        poll_interval: seconds between reads while waiting.
    """

    def __init__(self, name: str, *, poll_interval: float = 0.5):
        self.name, self.poll_interval = name, poll_interval

    def describe(self) -> dict:
        return describe_from_record(records.read_record(self.name))

    def training_jobs(self) -> list[dict]:
        return summaries_of(records.read_record(self.name))

    def wait(self) -> None:
        """Poll the record until the tuning job has ended."""
        while self.describe()["HyperParameterTuningJobStatus"] not in records.TERMINAL:
            time.sleep(self.poll_interval)

    def stop(self) -> None:
        """Ask the searching process to stop; return once it has stopped every trial."""
        records.request_stop(self.name)
        self.wait()


def _ranges(parameter_ranges: dict, *, json_values: bool) -> dict:
    ranges: dict[str, Any] = {}
    for r in parameter_ranges.get("ContinuousParameterRanges", []):
        ranges[r["Name"]] = ContinuousParameter(float(r["MinValue"]), float(r["MaxValue"]),
                                                r.get("ScalingType", "Auto"))
    for r in parameter_ranges.get("IntegerParameterRanges", []):
        ranges[r["Name"]] = IntegerParameter(int(r["MinValue"]), int(r["MaxValue"]),
                                             r.get("ScalingType", "Auto"))
    for r in parameter_ranges.get("CategoricalParameterRanges", []):
        values = r["Values"]
        if json_values:
            values = [json.loads(v) if v.startswith('"') else v for v in values]
        ranges[r["Name"]] = CategoricalParameter(values)
    return ranges


def attached_tuner(cls: type, name: str, desc: dict, *, job: Any, on_sagemaker: bool) -> Any:
    """A tuner (no estimator) whose settings are the description's."""
    config = desc.get("HyperParameterTuningJobConfig", {})
    objective = config.get("HyperParameterTuningJobObjective", {})
    limits = config.get("ResourceLimits", {})
    algorithm = desc.get("TrainingJobDefinition", {}).get("AlgorithmSpecification", {})
    band = config.get("StrategyConfig", {}).get("HyperbandStrategyConfig", {})
    tuner = cls.__new__(cls)
    tuner.estimator = None
    tuner._config = TuningConfig(
        objective_metric_name=objective.get("MetricName", ""),
        objective_type=objective.get("Type", "Maximize"),
        ranges=_ranges(config.get("ParameterRanges", {}), json_values=on_sagemaker),
        metric_definitions=tuple(algorithm.get("MetricDefinitions", [])),
        strategy=config.get("Strategy", "Bayesian"),
        max_jobs=limits.get("MaxNumberOfTrainingJobs", 1),
        max_parallel_jobs=limits.get("MaxParallelTrainingJobs", 1),
        early_stopping_type=config.get("TrainingJobEarlyStoppingType", "Off"),
        random_seed=config.get("RandomSeed"),
        max_runtime_in_seconds=limits.get("MaxRuntimeInSeconds"),
        min_resource=band.get("MinResource"), max_resource=band.get("MaxResource"))
    tuner.tags, tuner.base_tuning_job_name = [], None
    tuner.warm_start_config = tuner.completion_criteria_config = None
    tuner._on_sagemaker = on_sagemaker
    tuner._current_job_name = name
    tuner.latest_tuning_job = job
    return tuner


class RecordedJob(JobHandle):
    """A local trial seen from another process: its recorded summary, read-only.

    `wait()` returns (the record is final or the trial belongs to a running search);
    `stop()` is refused: stop the tuning job (`stop_tuning_job()`) instead.
    """

    def __init__(self, summary: dict):
        self.name = summary["TrainingJobName"]
        self._summary = summary

    def wait(self, logs: bool | str = True) -> None:
        return None

    def logs(self) -> None:
        print(f"{self.name}: the logs of a local trial stay with the process that ran it; "
              f"its recorded status is {self._summary['TrainingJobStatus']}")

    def stop(self) -> None:
        from fp16_sdk.errors import ConfigError

        raise ConfigError(f"{self.name} is a trial of a tuning job run by another process: "
                          "stop the tuning job (tuner.stop_tuning_job())", key="stop",
                          value=self.name)

    def describe(self) -> dict:
        s = self._summary
        desc = {"TrainingJobName": self.name, "TrainingJobStatus": s["TrainingJobStatus"],
                "HyperParameters": dict(s.get("TunedHyperParameters", {}))}
        for key in ("TrainingStartTime", "TrainingEndTime", "ModelArtifacts", "FailureReason"):
            if key in s:
                desc[key] = s[key]
        final = s.get("FinalHyperParameterTuningJobObjectiveMetric")
        if final:
            desc["FinalMetricDataList"] = [final]
        return _times(desc)

    @property
    def status(self) -> JobStatus:
        return JobStatus(self._summary["TrainingJobStatus"])

    @property
    def model_data(self) -> str | None:
        return self._summary.get("ModelArtifacts", {}).get("S3ModelArtifacts")
