"""The search on every backend but SageMaker: Optuna chooses, the SDK runs the trials.

Each trial is an ordinary training job of the estimator's backend (local_process, local,
local_gpu, slurm, EC2), started by a copy of the estimator with the trial's values over its
hyperparameters, named `<tuning job>-<NNN>-<8 hex>` as SageMaker names them, at most
`max_parallel_jobs` at once. One thread (`LocalTuning._run`) asks Optuna for a trial, starts
it, polls the running trials' live logs, and tells Optuna how each ended:
- strategy -> sampler: Bayesian: `TPESampler`; Random and Hyperband: `RandomSampler`; Grid:
  `GridSampler` (every combination once); all seeded by random_seed.
- pruning: Hyperband: `HyperbandPruner` (resource = the objective's reports, e.g. epochs;
  min/max from HyperbandStrategyConfig); early_stopping_type "Auto": `MedianPruner` (a trial
  whose objective at report k is worse than the median of the completed trials' at report k is
  stopped; pruning starts once 2 trials have completed); otherwise none.
- the objective: every match of the objective's metric definition in a trial's log lines is
  reported to Optuna as it appears (step = its index); a trial that completes has the last
  one as FinalObjectiveValue; one that completes with none has ObjectiveStatus Failed; a
  pruned trial is stopped and ends "Stopped", as SageMaker's early-stopped jobs do.
- the tuning job: Completed when max_jobs trials have ended and at least one has an objective;
  Failed when none has; Stopped after `stop()` (or a stop request from another process, or
  Ctrl-C in `wait()`), which stops every running trial first.
The record (`records`) is rewritten after every change.
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import logging
import secrets
import sys
import threading
import time
from typing import Any, TextIO

from fp16_sdk.backends.base import JobHandle, JobStatus
from fp16_sdk.metrics import parse_metrics
from fp16_sdk.tuner import records
from fp16_sdk.tuner.settings import TuningConfig

__all__ = ["LocalTuning", "sampler_for", "pruner_for", "trial_name"]

logger = logging.getLogger(__name__)
_LIVE: set["LocalTuning"] = set()
MEDIAN_STARTUP_TRIALS = 2  # completed trials before MedianPruner may stop one


def sampler_for(cfg: TuningConfig):
    """The Optuna sampler for the strategy (see the module docstring)."""
    import optuna

    if cfg.strategy == "Bayesian":
        return optuna.samplers.TPESampler(seed=cfg.random_seed)
    if cfg.strategy == "Grid":
        space = {name: list(rng.values) for name, rng in cfg.ranges.items()}
        return optuna.samplers.GridSampler(space, seed=cfg.random_seed)
    return optuna.samplers.RandomSampler(seed=cfg.random_seed)


def pruner_for(cfg: TuningConfig):
    """The Optuna pruner for the strategy and early_stopping_type."""
    import optuna

    if cfg.strategy == "Hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=cfg.min_resource or 1,
                                              max_resource=cfg.max_resource or "auto")
    if cfg.early_stopping_type == "Auto":
        return optuna.pruners.MedianPruner(n_startup_trials=MEDIAN_STARTUP_TRIALS,
                                           n_warmup_steps=0)
    return optuna.pruners.NopPruner()


def trial_name(tuning_job: str, index: int) -> str:
    """SageMaker's training-job name under a tuning job: `<name>-<NNN>-<8 hex>`."""
    return f"{tuning_job}-{index:03d}-{secrets.token_hex(4)}"


@dataclasses.dataclass
class _Running:
    trial: Any  # optuna.trial.Trial
    summary: dict
    handle: JobHandle | None = None
    estimator: Any = None
    reports: int = 0  # objective values told to Optuna
    lines: int = 0  # log lines already read
    series: list = dataclasses.field(default_factory=list)  # the objective's values so far


class LocalTuning:
    """One tuning job searched here (see the module docstring).

    Args:
        name: the tuning job's name.
        estimator: the estimator each trial copies.
        config: the checked tuning settings.
        inputs: fit()'s inputs, given to every trial.
        poll_interval: seconds between looks at the running trials.
        out: where progress lines go (default: stdout).
    """

    def __init__(self, name: str, estimator: Any, config: TuningConfig, *, inputs: Any = None,
                 poll_interval: float = 0.25, out: TextIO | None = None):
        import optuna

        self.name, self.estimator, self.config, self.inputs = name, estimator, config, inputs
        self.poll_interval, self.out = poll_interval, out
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.study = optuna.create_study(
            direction="minimize" if config.minimize else "maximize",
            sampler=sampler_for(config), pruner=pruner_for(config), study_name=name)
        self.distributions = {n: r.distribution() for n, r in config.ranges.items()}
        self.trials: list[dict] = []  # summaries in start order
        self.estimators: dict[str, Any] = {}  # trial name -> the estimator that ran it
        self._stop = threading.Event()
        self._finished = threading.Event()  # set by the search thread as its last act
        self._thread: threading.Thread | None = None
        self._started = time.monotonic()
        self.record: dict = {}

    # ---- the record -------------------------------------------------------------------

    def start(self, describe_base: dict) -> None:
        """Claim the record, write its first state and start the search thread.

        Args:
            describe_base: the Describe fields that never change (config, definition).
        """
        records.claim_record(self.name)
        self.record = {**describe_base, "HyperParameterTuningJobName": self.name,
                       "HyperParameterTuningJobStatus": "InProgress",
                       "CreationTime": records.now(), "Pid": _pid(), "Trials": self.trials}
        self._save()
        self._thread = threading.Thread(target=self._run, name=f"tuning-{self.name}",
                                        daemon=True)
        _LIVE.add(self)
        self._thread.start()

    def _save(self, **changes: Any) -> None:
        self.record.update(changes)
        self.record["LastModifiedTime"] = records.now()
        records.write_record(self.record)

    def _say(self, line: str) -> None:
        print(f"{self.name}: {line}", file=self.out or sys.stdout, flush=True)

    # ---- the loop ----------------------------------------------------------------------

    def _run(self) -> None:
        running: list[_Running] = []
        try:
            status, reason = self._search(running)
        except BaseException as exc:  # the search itself broke: stop what it started
            status, reason = "Failed", f"the search failed: {type(exc).__name__}: {exc}"
            logger.exception("tuning job %s", self.name)
        for item in running:
            self._stop_trial(item, why="the tuning job stopped")
        if status == "Completed" and not any(t.get("ObjectiveStatus") == "Succeeded"
                                             for t in self.trials):
            status = "Failed"
            first = next((t.get("FailureReason") for t in self.trials
                          if t.get("FailureReason")), "no trial reported the objective")
            reason = f"no training job reported {self.config.objective_metric_name!r}: {first}"
        changes = {"HyperParameterTuningJobStatus": status,
                   "HyperParameterTuningEndTime": records.now()}
        if reason:
            changes["FailureReason"] = reason
        self._save(**changes)
        self._say(f"tuning job {status}" + (f": {reason}" if reason else ""))
        _LIVE.discard(self)
        self._finished.set()

    def _search(self, running: list[_Running]) -> tuple[str, str | None]:
        cfg = self.config
        while True:
            if self._stop.is_set() or records.stop_requested(self.name):
                return "Stopped", None
            if cfg.max_runtime_in_seconds is not None and \
                    time.monotonic() - self._started > cfg.max_runtime_in_seconds:
                return "Stopped", f"MaxRuntimeInSeconds ({cfg.max_runtime_in_seconds}) reached"
            while len(running) < cfg.max_parallel_jobs and len(self.trials) < cfg.max_jobs:
                running.append(self._start_trial())
            for item in list(running):
                if self._poll(item):
                    running.remove(item)
            self._save()
            if not running and len(self.trials) >= cfg.max_jobs:
                return "Completed", None
            self._stop.wait(self.poll_interval)

    def _start_trial(self) -> _Running:
        trial = self.study.ask(self.distributions)
        values = {n: self.config.ranges[n].value_of(v) for n, v in trial.params.items()}
        name = trial_name(self.name, len(self.trials) + 1)
        summary = {"TrainingJobName": name, "TuningJobName": self.name,
                   "TrainingJobStatus": "InProgress", "ObjectiveStatus": "Pending",
                   "TunedHyperParameters": {n: str(v) for n, v in values.items()},
                   "CreationTime": records.now()}
        self.trials.append(summary)
        item = _Running(trial, summary)
        est = copy.copy(self.estimator)  # the trial's own estimator: its own job and values
        est._hyperparameters = {**self.estimator._hyperparameters, **values}
        est.latest_training_job, est._reserved = None, {}
        try:
            est.fit(self.inputs, wait=False, logs=False, job_name=name)
        except Exception as exc:  # noqa: BLE001 (the trial fails; the search goes on)
            self._end(item, "Failed", reason=f"fit() failed: {type(exc).__name__}: {exc}")
            return item
        item.handle, item.estimator = est.latest_training_job, est
        self.estimators[name] = est
        self._say(f"{name} started: " + ", ".join(f"{k}={v}" for k, v in values.items()))
        return item

    def _poll(self, item: _Running) -> bool:
        """Report new objective values, prune, notice the end. True once the trial is over."""
        if item.handle is None:
            return True  # failed at submission
        job_status = item.handle.status  # read before the logs: no line is missed at the end
        lines = item.handle.log_lines()
        item.series += parse_metrics(lines[item.lines:], self.config.metric_definitions).series(
            self.config.objective_metric_name)
        item.lines = len(lines)
        series = item.series
        for step in range(item.reports, len(series)):
            item.trial.report(series[step], step)
        item.reports = len(series)
        if series:
            item.summary["FinalHyperParameterTuningJobObjectiveMetric"] = {
                "MetricName": self.config.objective_metric_name, "Value": series[-1]}
        if job_status is JobStatus.IN_PROGRESS:
            if series and item.trial.should_prune():
                self._stop_trial(item, why=f"early stopping: {self.config.objective_metric_name}"
                                           f" {series[-1]:g} at report {len(series) - 1}")
                return True
            return False
        if job_status is JobStatus.COMPLETED and series:
            self._end(item, "Completed", value=series[-1])
        elif job_status is JobStatus.COMPLETED:
            self._end(item, "Completed", reason=f"the job completed without a line matching "
                                                f"{self.config.objective_metric_name!r}")
        else:
            reason = item.handle.describe().get("FailureReason") or job_status.value
            self._end(item, job_status.value, reason=reason)
        return True

    def _stop_trial(self, item: _Running, *, why: str) -> None:
        if item.summary["TrainingJobStatus"] != "InProgress":
            return
        if item.handle is not None:
            item.handle.stop()
        self._end(item, "Stopped", reason=why, pruned=why.startswith("early stopping"))

    def _end(self, item: _Running, status: str, *, value: float | None = None,
             reason: str | None = None, pruned: bool = False) -> None:
        import optuna

        s = item.summary
        s["TrainingJobStatus"] = status
        if item.handle is not None:
            desc = item.handle.describe()
            for key in ("TrainingStartTime", "TrainingEndTime"):
                if desc.get(key) is not None:
                    s[key] = desc[key].isoformat() if hasattr(desc[key], "isoformat") \
                        else str(desc[key])
            if item.handle.model_data:
                s["ModelArtifacts"] = {"S3ModelArtifacts": item.handle.model_data}
        s.setdefault("TrainingEndTime", records.now())
        if reason:
            s["FailureReason"] = reason
        if value is not None:
            s["ObjectiveStatus"] = "Succeeded"
            self._tell(item.trial, value)
        elif pruned:  # SageMaker keeps an early-stopped job's last objective value
            s["ObjectiveStatus"] = "Succeeded" if item.reports else "Failed"
            self._tell(item.trial, state=optuna.trial.TrialState.PRUNED)
        else:
            s["ObjectiveStatus"] = "Failed"
            self._tell(item.trial, state=optuna.trial.TrialState.FAIL)
        final = s.get("FinalHyperParameterTuningJobObjectiveMetric", {}).get("Value")
        self._say(f"{s['TrainingJobName']} {status}" + (f" ({reason})" if reason else "")
                  + (f", objective {final:g}" if final is not None else ""))

    def _tell(self, trial: Any, value: float | None = None, **state: Any) -> None:
        try:
            self.study.tell(trial, value, **state)
        except RuntimeError as exc:
            # GridSampler calls study.stop() once every grid point has been tried, which
            # Optuna allows only inside optimize(); tell() has stored the trial's state
            # before (its `finally`), and max_jobs already ends the search at the grid's size.
            if self.config.strategy != "Grid" or "Study.stop" not in str(exc):
                raise

    def describe(self) -> dict:
        """DescribeHyperParameterTuningJob's shape, from the record."""
        from fp16_sdk.tuner.attach import describe_from_record
        return describe_from_record(records.read_record(self.name))

    def training_jobs(self) -> list[dict]:
        """The trials as ListTrainingJobsForHyperParameterTuningJob's summaries."""
        from fp16_sdk.tuner.attach import summaries_of
        return summaries_of(records.read_record(self.name))

    # ---- control -------------------------------------------------------------------------

    def running(self) -> bool:
        return self._thread is not None and not self._finished.is_set()

    # An Event, not Thread.join: a join that Ctrl-C interrupts can mark the thread finished
    # while it still runs (CPython), and the stop would then return with trials running.
    def wait(self) -> None:
        """Block until the tuning job ends; Ctrl-C stops it (every trial) and re-raises."""
        try:
            while self.running():
                self._finished.wait(0.2)
        except KeyboardInterrupt:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop the search and every running trial; returns once nothing runs."""
        self._stop.set()
        if self._thread is not None:
            self._finished.wait()


def _pid() -> int:
    import os

    return os.getpid()


@atexit.register
def _stop_live_searches() -> None:
    """A process that ends with a search running stops it (and its trials) first."""
    for tuning in list(_LIVE):
        tuning.stop()
