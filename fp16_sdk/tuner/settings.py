"""The tuner's arguments checked once, before anything starts, into one frozen `TuningConfig`.

SageMaker's `HyperparameterTuner` checks some arguments in the SDK and leaves the rest to the
CreateHyperParameterTuningJob call; here every rule is checked at construction (and the
estimator's own checks again at `fit()`), each error naming the key, the value and the fix:
- strategy "Bayesian" | "Random" | "Grid" | "Hyperband"; objective_type "Maximize" |
  "Minimize"; early_stopping_type "Off" | "Auto" (Hyperband stops trials itself: "Auto" with
  it is refused, as SageMaker does);
- the objective needs a metric definition of that Name (the tuner's metric_definitions, else
  the estimator's), each Regex valid;
- max_jobs >= 1 (default 1, as SageMaker's; Grid: at most the number of combinations,
  which is its default), 1 <= max_parallel_jobs; Grid takes CategoricalParameter ranges only;
- a tuned name cannot be a sagemaker_* key or a distribution key the framework sets;
- autotune / hyperparameters_to_keep_static: SageMaker's Autotune picks the ranges on AWS's
  side; it is sent on SageMaker and refused elsewhere.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from fp16_sdk.errors import ConfigError
from fp16_sdk.metrics import parse_metrics
from fp16_sdk.tuner.ranges import CategoricalParameter, ParameterRange, check_ranges

__all__ = ["TuningConfig", "STRATEGIES", "OBJECTIVE_TYPES", "EARLY_STOPPING_TYPES",
           "TUNING_JOB_NAME_MAX_LENGTH", "check_config"]

STRATEGIES = ("Bayesian", "Random", "Grid", "Hyperband")
OBJECTIVE_TYPES = ("Maximize", "Minimize")
EARLY_STOPPING_TYPES = ("Off", "Auto")
TUNING_JOB_NAME_MAX_LENGTH = 32  # SageMaker's limit on HyperParameterTuningJobName


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """Everything the search needs, checked.

    Attributes:
        objective_metric_name, objective_type: what to optimise and which way.
        ranges: {name: range}.
        metric_definitions: the definitions the objective is read with.
        strategy, max_jobs, max_parallel_jobs, early_stopping_type, random_seed: SageMaker's.
        max_runtime_in_seconds: the whole tuning job's limit (None: none).
        min_resource, max_resource: Hyperband's (HyperbandStrategyConfig MinResource /
            MaxResource: metric reports, e.g. epochs); None: Optuna's defaults.
        autotune, hyperparameters_to_keep_static: SageMaker's Autotune (SageMaker only).
        completion_criteria: TuningJobCompletionCriteria (SageMaker only).
    """

    objective_metric_name: str
    objective_type: str
    ranges: Mapping[str, ParameterRange]
    metric_definitions: tuple[Mapping[str, str], ...]
    strategy: str
    max_jobs: int
    max_parallel_jobs: int
    early_stopping_type: str
    random_seed: int | None = None
    max_runtime_in_seconds: int | None = None
    min_resource: int | None = None
    max_resource: int | None = None
    autotune: bool = False
    hyperparameters_to_keep_static: tuple[str, ...] | None = None
    completion_criteria: Mapping[str, Any] | None = None

    @property
    def minimize(self) -> bool:
        return self.objective_type == "Minimize"

    def tuning_config_request(self, *, json_categoricals: bool) -> dict:
        """HyperParameterTuningJobConfig as SageMaker's SDK sends it."""
        ranges: dict[str, list] = {"ContinuousParameterRanges": [],
                                   "IntegerParameterRanges": [],
                                   "CategoricalParameterRanges": []}
        for name, rng in self.ranges.items():
            key = f"{rng.__name__}ParameterRanges"
            if isinstance(rng, CategoricalParameter) and json_categoricals:
                ranges[key].append(rng.as_json_range(name))
            else:
                ranges[key].append(rng.as_tuning_range(name))
        config: dict[str, Any] = {
            "Strategy": self.strategy,
            "ResourceLimits": {"MaxNumberOfTrainingJobs": self.max_jobs,
                               "MaxParallelTrainingJobs": self.max_parallel_jobs},
            "TrainingJobEarlyStoppingType": self.early_stopping_type,
            "HyperParameterTuningJobObjective": {"Type": self.objective_type,
                                                 "MetricName": self.objective_metric_name},
            "ParameterRanges": ranges,
        }
        if self.max_runtime_in_seconds is not None:
            config["ResourceLimits"]["MaxRuntimeInSeconds"] = self.max_runtime_in_seconds
        if self.random_seed is not None:
            config["RandomSeed"] = self.random_seed
        if self.min_resource is not None or self.max_resource is not None:
            hyperband = {k: v for k, v in (("MinResource", self.min_resource),
                                           ("MaxResource", self.max_resource)) if v is not None}
            config["StrategyConfig"] = {"HyperbandStrategyConfig": hyperband}
        if self.completion_criteria is not None:
            config["TuningJobCompletionCriteria"] = dict(self.completion_criteria)
        return config


def _choice(key: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} must be one of {', '.join(map(repr, allowed))}",
                          key=key, value=value)
    return value


def _positive_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key}={value!r} must be an integer >= 1", key=key, value=value)
    return value


def _hyperband_resources(strategy: str, strategy_config: Any) -> tuple[int | None, int | None]:
    if strategy_config is None:
        return None, None
    if hasattr(strategy_config, "to_input_req"):  # sagemaker.tuner.StrategyConfig
        strategy_config = strategy_config.to_input_req()
    band = strategy_config.get("HyperbandStrategyConfig") if isinstance(strategy_config,
                                                                        Mapping) else None
    if strategy != "Hyperband" or band is None or set(band) - {"MinResource", "MaxResource"}:
        raise ConfigError(f"strategy_config={strategy_config!r}: the one strategy config is "
                          "{'HyperbandStrategyConfig': {'MinResource': int, 'MaxResource': "
                          "int}} with strategy='Hyperband'", key="strategy_config",
                          value=strategy_config)
    low = band.get("MinResource")
    high = band.get("MaxResource")
    for key, value in (("MinResource", low), ("MaxResource", high)):
        if value is not None:
            _positive_int(f"strategy_config.HyperbandStrategyConfig.{key}", value)
    if low is not None and high is not None and low > high:
        raise ConfigError(f"HyperbandStrategyConfig MinResource ({low}) is greater than "
                          f"MaxResource ({high})", key="strategy_config", value=band)
    return low, high


def _definitions(objective: str, metric_definitions: Any) -> tuple[Mapping[str, str], ...]:
    if metric_definitions is None or not isinstance(metric_definitions, (list, tuple)):
        raise ConfigError(f"metric_definitions={metric_definitions!r}: the objective "
                          f"{objective!r} needs a metric definition; pass metric_definitions="
                          f"[{{'Name': {objective!r}, 'Regex': '...'}}] (to the tuner or the "
                          "estimator)", key="metric_definitions", value=metric_definitions)
    parse_metrics([], metric_definitions)  # each entry a {'Name', 'Regex'} with a valid regex
    names = [md["Name"] for md in metric_definitions]
    if objective not in names:
        raise ConfigError(f"objective_metric_name={objective!r} has no metric definition; the "
                          f"defined metrics are {names}: add {{'Name': {objective!r}, 'Regex': "
                          "'...'}} to metric_definitions", key="objective_metric_name",
                          value=objective)
    return tuple(dict(md) for md in metric_definitions)


def _max_jobs(strategy: str, max_jobs: Any, ranges: Mapping[str, ParameterRange]) -> int:
    """max_jobs checked; its default: the grid's size for Grid, else 1 (SageMaker's)."""
    if strategy != "Grid":
        return _positive_int("max_jobs", 1 if max_jobs is None else max_jobs)
    wrong = [n for n, r in ranges.items() if not isinstance(r, CategoricalParameter)]
    if wrong:
        raise ConfigError(f"strategy='Grid' searches CategoricalParameter ranges only; "
                          f"{wrong[0]!r} is a {type(ranges[wrong[0]]).__name__}: make it a "
                          "CategoricalParameter or pick another strategy",
                          key=f"hyperparameter_ranges.{wrong[0]}", value=ranges[wrong[0]])
    combinations = math.prod(len(r.values) for r in ranges.values())
    if max_jobs is None:
        return combinations
    if _positive_int("max_jobs", max_jobs) > combinations:
        raise ConfigError(f"max_jobs ({max_jobs}) is more than the grid's {combinations} "
                          "combinations; lower max_jobs or leave it unset",
                          key="max_jobs", value=max_jobs)
    return max_jobs


def _check_static(names: Any, autotune: Any) -> None:
    if names is None:
        return
    if not autotune:
        raise ConfigError("hyperparameters_to_keep_static is set but autotune is False; "
                          "set autotune=True or drop it", key="hyperparameters_to_keep_static",
                          value=names)
    if len(set(names)) != len(names):
        raise ConfigError(f"hyperparameters_to_keep_static {names!r} repeats a name; list "
                          "each once", key="hyperparameters_to_keep_static", value=names)


def check_config(*, objective_metric_name: Any, hyperparameter_ranges: Any,
                 metric_definitions: Any, strategy: Any, objective_type: Any, max_jobs: Any,
                 max_parallel_jobs: Any, max_runtime_in_seconds: Any, early_stopping_type: Any,
                 random_seed: Any, strategy_config: Any, autotune: Any,
                 hyperparameters_to_keep_static: Any,
                 reserved: Mapping[str, str]) -> TuningConfig:
    """The tuner's arguments checked (see the module docstring).

    Raises:
        ConfigError: the first invalid argument, naming key, value and fix.
    """
    if not isinstance(objective_metric_name, str) or not objective_metric_name:
        raise ConfigError(f"objective_metric_name={objective_metric_name!r} must be the Name of "
                          "a metric definition", key="objective_metric_name",
                          value=objective_metric_name)
    ranges = check_ranges(hyperparameter_ranges, reserved=reserved)
    strategy = _choice("strategy", strategy, STRATEGIES)
    objective_type = _choice("objective_type", objective_type, OBJECTIVE_TYPES)
    early = _choice("early_stopping_type", early_stopping_type, EARLY_STOPPING_TYPES)
    if strategy == "Hyperband" and early != "Off":
        raise ConfigError("early_stopping_type='Auto' with strategy='Hyperband': Hyperband stops "
                          "trials itself; set early_stopping_type='Off'",
                          key="early_stopping_type", value=early)
    definitions = _definitions(objective_metric_name, metric_definitions)
    max_parallel = _positive_int("max_parallel_jobs", max_parallel_jobs)
    max_jobs = _max_jobs(strategy, max_jobs, ranges)
    if random_seed is not None and (isinstance(random_seed, bool)
                                    or not isinstance(random_seed, int)):
        raise ConfigError(f"random_seed={random_seed!r} must be an integer", key="random_seed",
                          value=random_seed)
    if max_runtime_in_seconds is not None:
        _positive_int("max_runtime_in_seconds", max_runtime_in_seconds)
    low, high = _hyperband_resources(strategy, strategy_config)
    _check_static(hyperparameters_to_keep_static, autotune)
    return TuningConfig(
        objective_metric_name=objective_metric_name, objective_type=objective_type,
        ranges=ranges, metric_definitions=definitions, strategy=strategy, max_jobs=max_jobs,
        max_parallel_jobs=max_parallel, early_stopping_type=early, random_seed=random_seed,
        max_runtime_in_seconds=max_runtime_in_seconds, min_resource=low, max_resource=high,
        autotune=bool(autotune),
        hyperparameters_to_keep_static=(None if hyperparameters_to_keep_static is None
                                        else tuple(hyperparameters_to_keep_static)))
