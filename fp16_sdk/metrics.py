"""Training metrics from job logs: `metric_definitions` applied in every mode.

SageMaker scans each log line of a training job with the estimator's `metric_definitions`
regexes and records every match as a CloudWatch metric; `estimator.training_job_analytics
.dataframe()` then gives a table with the columns `timestamp` (seconds since the job started),
`metric_name` and `value`. This module does the same from the log lines any `JobHandle` keeps
(`log_lines()`), so local_process and local Docker jobs get the same table without AWS.

Rules (SageMaker's, where it has one):
- Each regex is applied to the message of each line, with the `algo-N | ` host prefix the
  backends add removed first, so `^`-anchored regexes work as on SageMaker.
- Every match is one record; its value is capture group 1 (the whole match if the regex has no
  group). A capture that is not a finite number is skipped (CloudWatch stores neither NaN nor
  infinity).
- `timestamp` is seconds since the job started (describe()'s TrainingStartTime; else since the
  first log line) when the handle can tell when each line arrived (`log_records()`: (epoch
  seconds, line) pairs); otherwise None.

The table is pandas-free (`MetricsTable`); `TrainingJobAnalytics.dataframe()` returns a pandas
DataFrame when pandas is installed, else the `MetricsTable`, which offers the same columns
through `table["value"]`, `len(table)` and `to_rows()`.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import re
from typing import Any, Iterable, Iterator, Mapping, Sequence

from fp16_sdk.errors import ConfigError

__all__ = ["MetricRecord", "MetricsTable", "parse_metrics", "job_metrics",
           "TrainingJobAnalytics", "COLUMNS"]

COLUMNS = ("timestamp", "metric_name", "value")
_HOST_PREFIX = re.compile(r"^algo-\d+ \| ")


@dataclasses.dataclass(frozen=True)
class MetricRecord:
    """One metric value found in the logs.

    Attributes:
        timestamp: seconds since the job started (None when arrival times are unknown).
        metric_name: the metric definition's Name.
        value: the captured number.
        host: the host whose log line held it ("algo-1"), None if the line had no prefix.
    """

    timestamp: float | None
    metric_name: str
    value: float
    host: str | None = None


class MetricsTable(Sequence[MetricRecord]):
    """Metric records in log order, with the columns of SageMaker's analytics dataframe."""

    columns = COLUMNS

    def __init__(self, records: Iterable[MetricRecord] = ()):
        self._records = tuple(records)

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[MetricRecord]:
        return iter(self._records)

    def __getitem__(self, key):
        """`table[i]` a record, `table[i:j]` a table, `table["value"]` a column as a list."""
        if isinstance(key, str):
            if key not in (*COLUMNS, "host"):
                raise KeyError(f"{key!r} is not a column; the columns are {', '.join(COLUMNS)}")
            return [getattr(r, key) for r in self._records]
        if isinstance(key, slice):
            return MetricsTable(self._records[key])
        return self._records[key]

    def __repr__(self) -> str:
        rows = [f"{'' if r.timestamp is None else f'{r.timestamp:.1f}':>9}  {r.metric_name:<24} "
                f"{r.value:g}" for r in self._records[:10]]
        more = f"\n... {len(self) - 10} more" if len(self) > 10 else ""
        return f"{'timestamp':>9}  {'metric_name':<24} value\n" + "\n".join(rows) + more

    def to_rows(self) -> list[dict]:
        """The table as a list of {"timestamp", "metric_name", "value"} dicts."""
        return [{c: getattr(r, c) for c in COLUMNS} for r in self._records]

    def metric_names(self) -> list[str]:
        """The names that occur, in order of first appearance."""
        return list(dict.fromkeys(r.metric_name for r in self._records))

    def series(self, metric_name: str) -> list[float]:
        """Every value of one metric, in log order."""
        return [r.value for r in self._records if r.metric_name == metric_name]

    def where(self, metric_name: str) -> "MetricsTable":
        """The records of one metric."""
        return MetricsTable(r for r in self._records if r.metric_name == metric_name)

    def final(self) -> list[dict]:
        """FinalMetricDataList: the last value of each metric, [{"MetricName", "Value"}]."""
        last = {r.metric_name: r.value for r in self._records}
        return [{"MetricName": k, "Value": v} for k, v in last.items()]

    def to_dataframe(self):
        """A pandas DataFrame with the columns timestamp, metric_name, value.

        Raises:
            ModuleNotFoundError: pandas is not installed (`pip install pandas`).
        """
        import pandas as pd

        return pd.DataFrame(self.to_rows(), columns=list(COLUMNS))

    def to_csv(self, filename: str) -> None:
        """Write the table as CSV with a header row (SageMaker's export_csv layout)."""
        with open(filename, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(COLUMNS))
            writer.writeheader()
            writer.writerows(self.to_rows())


def _compiled(metric_definitions: Iterable[Mapping[str, str]]) -> list[tuple[str, re.Pattern]]:
    out = []
    for md in metric_definitions:
        if not isinstance(md, Mapping) or not isinstance(md.get("Name"), str) \
                or not isinstance(md.get("Regex"), str):
            raise ConfigError(f"metric_definitions entry {md!r} must be "
                              "{'Name': str, 'Regex': str}", key="metric_definitions", value=md)
        try:
            out.append((md["Name"], re.compile(md["Regex"])))
        except re.error as exc:
            raise ConfigError(f"metric_definitions[{md['Name']!r}] Regex {md['Regex']!r} is not a "
                              f"valid regex ({exc}); fix the pattern", key="metric_definitions",
                              value=md["Regex"]) from None
    return out


def _number(match: re.Match) -> float | None:
    text = match.group(1) if match.re.groups else match.group(0)
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def parse_metrics(lines: Iterable[str | tuple[float | None, str]],
                  metric_definitions: Iterable[Mapping[str, str]], *,
                  start_time: float | None = None) -> MetricsTable:
    """Apply `metric_definitions` to log lines.

    Args:
        lines: log lines ("algo-N | message" or bare messages), or (epoch seconds, line)
            pairs when arrival times are known.
        metric_definitions: [{"Name": ..., "Regex": ...}], as given to the estimator.
        start_time: epoch seconds timestamps count from (default: the first timed line).

    Returns:
        The records in log order (within a line, in definition order, then match order).

    Raises:
        ConfigError: an entry that is not {"Name": str, "Regex": str} or a bad regex.
    """
    patterns = _compiled(metric_definitions)
    records, start = [], start_time
    for item in lines:
        when, line = item if isinstance(item, tuple) else (None, item)
        if when is not None and start is None:
            start = when
        prefix = _HOST_PREFIX.match(line)
        host = prefix.group(0)[:-3] if prefix else None
        message = line[prefix.end():] if prefix else line
        stamp = None if when is None else when - start
        for name, pattern in patterns:
            for match in pattern.finditer(message):
                value = _number(match)
                if value is not None and math.isfinite(value):
                    records.append(MetricRecord(stamp, name, value, host))
    return MetricsTable(records)


def _definitions_of(job: Any) -> list[Mapping[str, str]]:
    spec = getattr(job, "spec", None)
    if spec is not None and getattr(spec, "metric_definitions", None) is not None:
        return list(spec.metric_definitions)
    algorithm = job.describe().get("AlgorithmSpecification", {})
    return list(algorithm.get("MetricDefinitions", []))


def job_metrics(job: Any, metric_definitions: Iterable[Mapping[str, str]] | None = None
                ) -> MetricsTable:
    """The metrics table of a job handle (what `latest_training_job.metrics()` returns).

    Args:
        job: a JobHandle (anything with `log_lines()`; `log_records()` adds timestamps).
        metric_definitions: default: the job's own (its spec, else describe()'s
            AlgorithmSpecification.MetricDefinitions).

    Returns:
        The records found so far (the job may still be running).
    """
    definitions = _definitions_of(job) if metric_definitions is None else list(metric_definitions)
    records = getattr(job, "log_records", None)
    if not callable(records):
        return parse_metrics(job.log_lines(), definitions)
    started = job.describe().get("TrainingStartTime")
    start = started.timestamp() if hasattr(started, "timestamp") else None
    return parse_metrics(records(), definitions, start_time=start)


class TrainingJobAnalytics:
    """SageMaker's `TrainingJobAnalytics`, computed from the job's logs.

    Args:
        job: the job handle (`estimator.latest_training_job`).
        metric_names: keep only these metrics (default: every defined metric).
        metric_definitions: default: the job's own.

    Raises:
        ConfigError: a metric name that no definition has.
    """

    def __init__(self, job: Any, *, metric_names: Sequence[str] | None = None,
                 metric_definitions: Iterable[Mapping[str, str]] | None = None):
        self._job = job
        self._definitions = (_definitions_of(job) if metric_definitions is None
                             else list(metric_definitions))
        known = [md["Name"] for md in self._definitions]
        for name in metric_names or ():
            if name not in known:
                raise ConfigError(f"metric_names entry {name!r} has no metric definition; the "
                                  f"defined metrics are {known}", key="metric_names", value=name)
        self._metric_names = list(metric_names) if metric_names else known
        self._table: MetricsTable | None = None

    @property
    def name(self) -> str:
        """The training job's name."""
        return self._job.name

    def table(self, force_refresh: bool = False) -> MetricsTable:
        """The metrics as a pandas-free `MetricsTable` (cached; refresh while the job runs)."""
        if self._table is None or force_refresh:
            wanted = [md for md in self._definitions if md["Name"] in self._metric_names]
            self._table = job_metrics(self._job, wanted)
        return self._table

    def dataframe(self, force_refresh: bool = False):
        """A pandas DataFrame (timestamp, metric_name, value) if pandas is installed, else the
        `MetricsTable` (same columns: `table["value"]`, `to_rows()`)."""
        table = self.table(force_refresh)
        try:
            return table.to_dataframe()
        except ModuleNotFoundError:
            return table

    def export_csv(self, filename: str) -> None:
        """Write the metrics to `filename` as CSV (timestamp, metric_name, value)."""
        self.table().to_csv(filename)

    def clear_cache(self) -> None:
        """Forget the cached table; the next call reads the logs again."""
        self._table = None
