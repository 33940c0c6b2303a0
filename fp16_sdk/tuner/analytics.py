"""`HyperparameterTuningJobAnalytics`: one row per training job of a tuning job.

The columns are SageMaker's (sagemaker.analytics): each tuned hyperparameter (as a float
where it reads as one, as SageMaker converts them), TrainingJobName, TrainingJobStatus,
FinalObjectiveValue, TrainingStartTime, TrainingEndTime and TrainingElapsedTimeSeconds. The
rows come from ListTrainingJobsForHyperParameterTuningJob's summaries, or the same summaries
in a local tuning job's record. `dataframe()` is a pandas DataFrame when pandas is installed,
else a `TuningTable` with the same columns (`table["FinalObjectiveValue"]`, `to_rows()`).
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Callable, Iterable, Sequence

__all__ = ["HyperparameterTuningJobAnalytics", "TuningTable", "row_of", "FIXED_COLUMNS"]

FIXED_COLUMNS = ("TrainingJobName", "TrainingJobStatus", "FinalObjectiveValue",
                 "TrainingStartTime", "TrainingEndTime", "TrainingElapsedTimeSeconds")


def _time(value: Any) -> dt.datetime | None:
    if value is None or isinstance(value, dt.datetime):
        return value
    return dt.datetime.fromisoformat(str(value))


def row_of(summary: dict) -> dict:
    """One TrainingJobSummary as an analytics row."""
    row: dict[str, Any] = {}
    for name, value in summary.get("TunedHyperParameters", {}).items():
        try:
            row[name] = float(value)
        except (TypeError, ValueError):
            row[name] = value
    start, end = _time(summary.get("TrainingStartTime")), _time(summary.get("TrainingEndTime"))
    row.update({
        "TrainingJobName": summary["TrainingJobName"],
        "TrainingJobStatus": summary["TrainingJobStatus"],
        "FinalObjectiveValue": summary.get("FinalHyperParameterTuningJobObjectiveMetric",
                                           {}).get("Value"),
        "TrainingStartTime": start,
        "TrainingEndTime": end,
        "TrainingElapsedTimeSeconds": (end - start).total_seconds() if start and end else None,
    })
    return row


class TuningTable(Sequence[dict]):
    """The analytics rows without pandas: `table[i]` a row, `table["column"]` a column."""

    def __init__(self, rows: Iterable[dict], columns: Sequence[str]):
        self._rows = [dict(r) for r in rows]
        self.columns = list(columns)

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, key):
        if isinstance(key, str):
            if key not in self.columns:
                raise KeyError(f"{key!r} is not a column; the columns are {self.columns}")
            return [r.get(key) for r in self._rows]
        return self._rows[key]

    def to_rows(self) -> list[dict]:
        return [{c: r.get(c) for c in self.columns} for r in self._rows]

    def __repr__(self) -> str:
        def text(value: Any) -> str:
            if isinstance(value, dt.datetime):
                return value.strftime("%H:%M:%S")
            return f"{value:.6g}" if isinstance(value, float) else str(value)

        cells = [[text(r.get(c)) for c in self.columns] for r in self._rows]
        widths = [max([len(c), *(len(row[i]) for row in cells)])
                  for i, c in enumerate(self.columns)]
        lines = [[c.rjust(w) for c, w in zip(self.columns, widths)],
                 *[[v.rjust(w) for v, w in zip(row, widths)] for row in cells]]
        return "\n".join("  ".join(line) for line in lines)


class HyperparameterTuningJobAnalytics:
    """Analytics of one tuning job (SageMaker's class of the same name).

    Args:
        tuning_job_name: the tuning job.
        summaries: a callable giving the job's TrainingJobSummary list (read at each refresh).
    """

    def __init__(self, tuning_job_name: str, summaries: Callable[[], list[dict]]):
        self.name = tuning_job_name
        self._summaries = summaries
        self._rows: list[dict] | None = None

    def training_job_summaries(self, force_refresh: bool = False) -> list[dict]:
        """The TrainingJobSummary dicts (cached until force_refresh)."""
        if self._rows is None or force_refresh:
            self._rows = list(self._summaries())
        return self._rows

    def table(self, force_refresh: bool = False) -> TuningTable:
        """The rows as a pandas-free TuningTable, in training-job order."""
        rows = [row_of(s) for s in self.training_job_summaries(force_refresh)]
        tuned = list(dict.fromkeys(k for r in rows for k in r if k not in FIXED_COLUMNS))
        return TuningTable(rows, [*tuned, *FIXED_COLUMNS])

    def dataframe(self, force_refresh: bool = False):
        """A pandas DataFrame if pandas is installed, else the `TuningTable`."""
        table = self.table(force_refresh)
        try:
            import pandas as pd
        except ModuleNotFoundError:
            return table
        return pd.DataFrame(table.to_rows(), columns=table.columns)

    def clear_cache(self) -> None:
        """Forget the cached summaries."""
        self._rows = None
