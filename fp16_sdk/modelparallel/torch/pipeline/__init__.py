"""Pipeline parallelism: schedules as data (actions, schedule), their simulator (simulate),
partitioning (partition), the first step's trace (trace), one stage's forward (stage_forward),
what a stage keeps (stage_params), stage-to-stage transfer (p2p), the step bodies' threads
(bodies), the action loop (executor), failure propagation (failure), what the engine needs from
the model (host: the PipelineHost Protocol) and the engine tying them (engine)."""

from .schedule import (Action, Schedule, build_schedule, format_grid, interleaved_schedule,
                       run_actions, simple_schedule)
from .simulate import ScheduleError, check_schedule, simulate

__all__ = ["Action", "Schedule", "build_schedule", "format_grid", "interleaved_schedule",
           "run_actions", "simple_schedule", "ScheduleError", "check_schedule", "simulate"]
