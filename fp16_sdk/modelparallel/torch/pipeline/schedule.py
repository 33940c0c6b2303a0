"""Pipeline schedules as data: one list of actions per stage.

An action is `F3` (forward of microbatch 3), `B3` (its backward) or `O3` (receive microbatch
3's model outputs from the last stage). Communication is implied by the action and the stage
(`messages()` spells it out, and both the simulator and the executor, executor.py, use that one
function):

| action on stage s | receives                         | sends                               |
|-------------------|----------------------------------|-------------------------------------|
| F(mb)             | act(mb) from s-1 (s > 0)         | act(mb) to s+1 (s < p-1);           |
|                   |                                  | out(mb) to every other stage (s = p-1) |
| O(mb), s < p-1    | out(mb) from p-1                 | -                                   |
| B(mb)             | grad(mb) from s+1 (s < p-1)      | grad(mb) to s-1 (s > 0)             |

The actions and `messages()` are actions.py's (the simulator reads them too); this module
builds the lists.

Design notes: docs/internals-runtime.md, "Pipeline schedules: message order, builders, forward-only steps".
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import SMPConfigError
from .actions import B, F, O, Action, Kind, Message, messages
from .simulate import simulate

__all__ = [
    "Kind", "Action", "Message", "Schedule", "F", "B", "O",
    "simple_schedule", "interleaved_schedule", "forward_only_schedule", "switch_to_forward_only",
    "build_schedule", "messages", "format_grid", "run_actions",
]


@dataclass(frozen=True)
class Schedule:
    """Per-stage action lists of one pipeline step.

    Attributes:
        name: "simple", "interleaved", "forward", or a switched one's name.
        num_stages, num_microbatches: p and m.
        active_microbatches: the in-flight bound it was built for (None for simple).
        stages: stages[s] is stage s's tuple of actions, in execution order.
        backwards: the microbatches that have a B action on every stage: all of them for a
            training schedule, none when forward-only, (0,) once switched to forward-only.
    """

    name: str
    num_stages: int
    num_microbatches: int
    active_microbatches: int | None
    stages: tuple[tuple[Action, ...], ...]
    backwards: tuple[int, ...] | None = None  # None: every microbatch

    @property
    def backward_microbatches(self) -> tuple[int, ...]:
        if self.backwards is None:
            return tuple(range(self.num_microbatches))
        return self.backwards

    def actions(self, stage: int) -> tuple[Action, ...]:
        return self.stages[stage]

    def __str__(self) -> str:
        return format_grid(self)


def _check_sizes(p: int, m: int) -> None:
    for key, value in (("pipeline_parallel_degree", p), ("microbatches", m)):
        if not isinstance(value, int) or value < 1:
            raise SMPConfigError(f"{key} ({value!r}) must be an integer >= 1", key=key,
                                 value=value)


def _one_f_one_b(p: int, m: int, stage: int, active: int) -> list[Action]:
    warmup = min(p - stage - 1, active - 1, m)
    actions = [F(i) for i in range(warmup)]
    next_f, next_b = warmup, 0
    while next_b < m:
        if next_f < m:
            actions.append(F(next_f))
            next_f += 1
        actions.append(B(next_b))
        next_b += 1
    return actions


def _insert_output_receives(p: int, stages: list[list[Action]]) -> None:
    """Put O(mb) on every non-last stage, in an order consistent with the last stage's sends.

    Stage p-2 receives both outputs and gradients from p-1 on one ordered channel: before each
    of its B(j) it takes every output the last stage sent before grad(j). Other stages only
    get outputs from p-1, so O(mb) goes right before B(mb).
    """
    last = p - 1
    send_pos: dict[tuple[str, int], int] = {}  # position of each send from last to p-2
    for action in stages[last]:
        if action.kind is Kind.FORWARD:
            send_pos[("out", action.mb)] = len(send_pos)
        elif last > 0:
            send_pos[("grad", action.mb)] = len(send_pos)
    for stage in range(last):
        pending = sorted(mb for kind, mb in send_pos if kind == "out")
        result: list[Action] = []
        for action in stages[stage]:
            if action.kind is Kind.BACKWARD:
                if stage == last - 1:
                    limit = send_pos[("grad", action.mb)]
                    ready = [mb for mb in pending if send_pos[("out", mb)] < limit]
                else:
                    ready = [mb for mb in pending if mb <= action.mb]
                result.extend(O(mb) for mb in ready)
                pending = [mb for mb in pending if mb not in ready]
            result.append(action)
        stages[stage] = result


def _finish(name: str, p: int, m: int, active: int | None,
            stages: list[list[Action]]) -> Schedule:
    _insert_output_receives(p, stages)
    return Schedule(name, p, m, active, tuple(tuple(s) for s in stages))


def simple_schedule(p: int, m: int) -> Schedule:
    """GPipe: on every stage F0..F(m-1), then B0..B(m-1).

    Raises:
        SMPConfigError: p or m not a positive integer.
    """
    _check_sizes(p, m)
    stages = [[F(i) for i in range(m)] + [B(i) for i in range(m)] for _ in range(p)]
    return _finish("simple", p, m, None, stages)


def interleaved_schedule(p: int, m: int, active_microbatches: int | None = None) -> Schedule:
    """1F1B: backward as early as possible, at most `active_microbatches` in flight per stage.

    Args:
        p: number of stages; m: number of microbatches.
        active_microbatches: in-flight bound (default p + 2, smp's default).

    Raises:
        SMPConfigError: a size or the bound not a positive integer.
    """
    _check_sizes(p, m)
    active = p + 2 if active_microbatches is None else active_microbatches
    if not isinstance(active, int) or active < 1:
        raise SMPConfigError(f"active_microbatches ({active!r}) must be an integer >= 1",
                             key="active_microbatches", value=active)
    stages = [_one_f_one_b(p, m, s, active) for s in range(p)]
    return _finish("interleaved", p, m, active, stages)


def forward_only_schedule(p: int, m: int) -> Schedule:
    """Evaluation: F0..F(m-1) on every stage, no backward; outputs still reach every stage.

    Stage s < p-1 takes O(k) right after its F(k + p-1-s): with equal forward costs the last
    stage finishes F(k) exactly then, so the receive does not stall the stage's forwards
    (taking O(k) right after F(k) would wait for the whole pipeline on every microbatch).

    Raises:
        SMPConfigError: p or m not a positive integer.
    """
    _check_sizes(p, m)
    stages = []
    for s in range(p):
        lag = p - 1 - s  # forwards stage s runs while its F(k) travels to the last stage
        actions: list[Action] = []
        for i in range(m):
            actions.append(F(i))
            if s < p - 1:
                actions.extend(O(k) for k in range(m) if min(k + lag, m - 1) == i)
        stages.append(actions)
    return Schedule("forward", p, m, None, tuple(tuple(a) for a in stages), backwards=())


def switch_to_forward_only(schedule: Schedule) -> Schedule:
    """`schedule` with every B but B0 dropped: what a training step runs once microbatch 0
    turned out to be forward-only (executor.py decides at B0).

    Raises:
        ValueError: a stage whose first backward is not B0 (the decision point must be the
            first backward everywhere, or a stage would decide after running another one).
    """
    stages = []
    for s, actions in enumerate(schedule.stages):
        first = next((a for a in actions if a.kind is Kind.BACKWARD), None)
        if first is not None and first.mb != 0:
            raise ValueError(f"stage {s} of the {schedule.name} schedule runs {first} before B0")
        stages.append(tuple(a for a in actions if a.kind is not Kind.BACKWARD or a.mb == 0))
    return Schedule(f"{schedule.name}, forward-only after B0", schedule.num_stages,
                    schedule.num_microbatches, schedule.active_microbatches, tuple(stages),
                    backwards=(0,))


def build_schedule(name: str, p: int, m: int, active_microbatches: int | None = None) -> Schedule:
    """The schedule named by the `pipeline` config key.

    Raises:
        SMPConfigError: an unknown name.
    """
    if name == "simple":
        return simple_schedule(p, m)
    if name == "interleaved":
        return interleaved_schedule(p, m, active_microbatches)
    raise SMPConfigError(f"pipeline ({name!r}) must be 'simple' or 'interleaved'",
                         key="pipeline", value=name)


def format_grid(schedule: Schedule, *, t_f: int = 1, t_b: int = 1) -> str:
    """The schedule as a stage x time grid, timed by the simulator with integer costs.

    Each column is one time unit; an action of cost c fills c cells; "." is idle. O actions
    take no time and are listed under the grid.
    """
    result = simulate(schedule, t_f=t_f, t_b=t_b)
    width = max(3, len(str(schedule.num_microbatches - 1)) + 2)
    cells = [["." * 1] * int(round(result.makespan)) for _ in range(schedule.num_stages)]
    for event in result.timeline:
        for t in range(int(round(event.start)), int(round(event.end))):
            cells[event.stage][t] = str(event.action)
    header = "time    " + "".join(f"{t:<{width}}" for t in range(len(cells[0])))
    rows = [header] + [f"stage {s:<2}" + "".join(f"{c:<{width}}" for c in row)
                       for s, row in enumerate(cells)]
    rows.append(f"{schedule.name}: p={schedule.num_stages} m={schedule.num_microbatches} "
                f"makespan={result.makespan:g} idle={result.idle_fraction:.3f}")
    return "\n".join(rows)


def run_actions(actions, handlers) -> None:
    """The executor: call `handlers[action.kind](action.mb)` for each action, in order.

    benchmarks/pipeline_schedule.py executes schedules with it; the pipeline's executor
    (executor.py) is the same loop with the transfers of `messages()` around each handler.
    """
    for action in actions:
        handlers[action.kind](action.mb)
