"""Pipeline parallelism: schedules as data (schedule), their simulator (simulate), partitioning
(partition), stage-to-stage transfer (p2p) and the per-stage executor (engine)."""

from .schedule import (Action, Schedule, build_schedule, format_grid, interleaved_schedule,
                       run_actions, simple_schedule)
from .simulate import ScheduleError, check_schedule, simulate

__all__ = ["Action", "Schedule", "build_schedule", "format_grid", "interleaved_schedule",
           "run_actions", "simple_schedule", "ScheduleError", "check_schedule", "simulate"]
