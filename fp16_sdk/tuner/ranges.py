"""Hyperparameter ranges: sagemaker.parameter's classes, checked when they are made.

`ContinuousParameter`, `IntegerParameter` and `CategoricalParameter` take SageMaker's arguments
and give SageMaker's request pieces (`as_tuning_range`, `as_json_range`). Everything SageMaker
would refuse when the tuning job is created is refused here, at construction, naming the key:
min > max, a scaling type the range cannot take (Logarithmic needs min > 0; ReverseLogarithmic
only on a continuous range inside [0, 1)), an empty or over-long categorical list.

For the local search each range is also an Optuna distribution (`distribution`), and turns
the value Optuna drew back into the value the trial receives (`value_of`):
- Auto and Linear search linearly (SageMaker's "Auto" may choose a log scale; here it never
  does, which this docstring and docs/tuning.md say);
- Logarithmic searches log(x) (Optuna's `log=True`);
- ReverseLogarithmic searches log(1 - x): Optuna draws u = 1 - x on a log scale over
  (1 - max, 1 - min], and the trial receives 1 - u.
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping

from fp16_sdk.errors import ConfigError

__all__ = ["ParameterRange", "ContinuousParameter", "IntegerParameter", "CategoricalParameter",
           "SCALING_TYPES", "check_ranges", "MAX_CATEGORICAL_VALUES"]

SCALING_TYPES = ("Auto", "Linear", "Logarithmic", "ReverseLogarithmic")
MAX_CATEGORICAL_VALUES = 30  # SageMaker's limit on CategoricalParameterRange.Values


def _to_string(value: Any) -> str:
    return str(value)


def _number(value: Any, *, key: str, integer: bool) -> float | int:
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (integer and not float(value).is_integer()) or not math.isfinite(float(value)):
        raise ConfigError(f"{key}={value!r} must be {kind}", key=key, value=value)
    return int(value) if integer else float(value)


class ParameterRange:
    """A numeric range (SageMaker's base class).

    Args:
        min_value, max_value: the bounds, both inclusive.
        scaling_type: "Auto", "Linear", "Logarithmic" or "ReverseLogarithmic".

    Raises:
        ConfigError: min > max, a bound that is not a number, or a scaling type the range
            cannot take.
    """

    __name__ = "Range"
    _integer = False

    def __init__(self, min_value: float | int, max_value: float | int, scaling_type: str = "Auto"):
        self.min_value = _number(min_value, key="min_value", integer=self._integer)
        self.max_value = _number(max_value, key="max_value", integer=self._integer)
        self.scaling_type = scaling_type
        if self.min_value > self.max_value:
            raise ConfigError(f"min_value ({min_value}) is greater than max_value ({max_value}); "
                              "swap them", key="min_value", value=min_value)
        if scaling_type not in SCALING_TYPES:
            raise ConfigError(f"scaling_type={scaling_type!r} must be one of "
                              f"{', '.join(SCALING_TYPES)}", key="scaling_type",
                              value=scaling_type)
        if scaling_type == "Logarithmic" and self.min_value <= 0:
            raise ConfigError(f"scaling_type='Logarithmic' needs min_value > 0 (got "
                              f"{min_value}); raise min_value or use 'Linear'",
                              key="scaling_type", value=scaling_type)
        if scaling_type == "ReverseLogarithmic":
            if self._integer:
                raise ConfigError("scaling_type='ReverseLogarithmic' is for continuous ranges "
                                  "only (SageMaker's rule); use 'Linear' or 'Logarithmic' for "
                                  "an IntegerParameter", key="scaling_type", value=scaling_type)
            if not 0 <= self.min_value <= self.max_value < 1:
                raise ConfigError(f"scaling_type='ReverseLogarithmic' needs 0 <= min_value <= "
                                  f"max_value < 1 (got {min_value}..{max_value}); use "
                                  "'Linear' or 'Logarithmic'", key="scaling_type",
                                  value=scaling_type)

    def is_valid(self, value: Any) -> bool:
        """Whether `value` lies in the range."""
        return self.min_value <= value <= self.max_value

    @classmethod
    def cast_to_type(cls, value: Any) -> Any:
        """A tuned value as the range's type (text from a tuning job's summary)."""
        return float(value)

    def as_tuning_range(self, name: str) -> dict:
        """The ContinuousParameterRanges / IntegerParameterRanges entry for `name`."""
        return {"Name": name, "MinValue": _to_string(self.min_value),
                "MaxValue": _to_string(self.max_value), "ScalingType": self.scaling_type}

    # ---- the local search (Optuna) ------------------------------------------------------

    def distribution(self):
        """The Optuna distribution Optuna draws this range's values from."""
        from optuna.distributions import FloatDistribution, IntDistribution

        log = self.scaling_type == "Logarithmic"
        if self._integer:
            return IntDistribution(int(self.min_value), int(self.max_value), log=log)
        if self.scaling_type == "ReverseLogarithmic":  # u = 1 - x on a log scale
            return FloatDistribution(1.0 - self.max_value, 1.0 - self.min_value, log=True)
        return FloatDistribution(self.min_value, self.max_value, log=log)

    def value_of(self, drawn: Any) -> Any:
        """The trial's value for what Optuna drew."""
        if self.scaling_type == "ReverseLogarithmic":
            return 1.0 - drawn
        return int(drawn) if self._integer else float(drawn)


class ContinuousParameter(ParameterRange):
    """A continuous range of floats (SageMaker's ContinuousParameter)."""

    __name__ = "Continuous"


class IntegerParameter(ParameterRange):
    """An integer range (SageMaker's IntegerParameter); ReverseLogarithmic is refused."""

    __name__ = "Integer"
    _integer = True

    @classmethod
    def cast_to_type(cls, value: Any) -> int:
        return int(value)


class CategoricalParameter(ParameterRange):
    """A list of values (SageMaker's CategoricalParameter); values are kept as strings.

    Args:
        values: the values (a single value is a list of one); each becomes `str(value)`.

    Raises:
        ConfigError: no values, more than 30, or a value repeated.
    """

    __name__ = "Categorical"

    def __init__(self, values: Any):  # noqa: super-init-not-called (no bounds)
        values = values if isinstance(values, list) else [values]
        self.values = [_to_string(v) for v in values]
        if not self.values or len(self.values) > MAX_CATEGORICAL_VALUES:
            raise ConfigError(f"CategoricalParameter values {values!r} must hold 1 to "
                              f"{MAX_CATEGORICAL_VALUES} values (SageMaker's limit)",
                              key="values", value=values)
        if len(set(self.values)) != len(self.values):
            raise ConfigError(f"CategoricalParameter values {self.values!r} repeat a value; "
                              "list each once", key="values", value=values)

    def is_valid(self, value: Any) -> bool:
        return value in self.values

    @classmethod
    def cast_to_type(cls, value: Any) -> str:
        return str(value)

    def as_tuning_range(self, name: str) -> dict:
        return {"Name": name, "Values": self.values}

    def as_json_range(self, name: str) -> dict:
        """The entry as SageMaker's framework estimators send it (values JSON-encoded)."""
        return {"Name": name, "Values": [json.dumps(v) for v in self.values]}

    def distribution(self):
        from optuna.distributions import CategoricalDistribution

        return CategoricalDistribution(self.values)

    def value_of(self, drawn: Any) -> str:
        return str(drawn)


def check_ranges(ranges: Any, *, reserved: Mapping[str, str]) -> dict[str, ParameterRange]:
    """`hyperparameter_ranges` checked: a non-empty {name: range} dict.

    Args:
        ranges: what the user passed.
        reserved: names a range may not take -> why.

    Raises:
        ConfigError: not a dict, empty, a value that is not a range, or a reserved name.
    """
    if not isinstance(ranges, Mapping) or not ranges:
        raise ConfigError(f"hyperparameter_ranges={ranges!r} must be a non-empty dict "
                          "{name: ContinuousParameter | IntegerParameter | CategoricalParameter}",
                          key="hyperparameter_ranges", value=ranges)
    for name, rng in ranges.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"hyperparameter_ranges key {name!r} must be a non-empty string",
                              key="hyperparameter_ranges", value=name)
        if not isinstance(rng, ParameterRange):
            raise ConfigError(f"hyperparameter_ranges[{name!r}]={rng!r} must be a "
                              "ContinuousParameter, IntegerParameter or CategoricalParameter",
                              key=f"hyperparameter_ranges.{name}", value=rng)
        if name in reserved or name.startswith("sagemaker_"):
            why = reserved.get(name, "sagemaker_* names are the platform's")
            raise ConfigError(f"hyperparameter_ranges key {name!r} cannot be tuned: {why}",
                              key=f"hyperparameter_ranges.{name}", value=name)
    return dict(ranges)
