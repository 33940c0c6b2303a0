"""Discrete-event simulation of a schedule: deadlock-freedom, message order, bubble.

Model: each stage runs its actions in list order; F costs t_f, B costs t_b, O costs 0 (and
communication is free). An action starts when its stage is free and every message it
receives has been sent; sends never block. Messages from one rank to another are matched in
posting order (one FIFO channel per ordered pair, as NCCL and our Gloo use work), so the
simulator also checks that the k-th receive on a channel is the k-th send on it.

With costs in units of (t_f + t_b) the ideal pipeline time is m (each stage does m forward and
m backward passes); the simulated makespan of GPipe and 1F1B is (m + p - 1)(t_f + t_b), so the
idle fraction of the p x makespan area is (p - 1)/(m + p - 1) (performance.md). A forward-only
schedule has makespan (m + p - 1) t_f and the same idle fraction. In-flight counts microbatches
forwarded and not yet backpropagated; one without a B action counts only during its forward.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Protocol

from ..errors import SMPError
from .actions import Action, Kind, messages

__all__ = ["ScheduleError", "Event", "SimulationResult", "ActionLists", "simulate",
           "check_schedule"]


class ActionLists(Protocol):
    """What the simulator reads of a schedule (`schedule.Schedule` is one; schedule.py renders
    its grids with this simulator, so this module does not import it)."""

    @property
    def name(self) -> str: ...

    @property
    def num_stages(self) -> int: ...

    @property
    def num_microbatches(self) -> int: ...

    @property
    def active_microbatches(self) -> int | None: ...

    @property
    def stages(self) -> tuple[tuple[Action, ...], ...]: ...

    @property
    def backward_microbatches(self) -> tuple[int, ...]: ...


class ScheduleError(SMPError, RuntimeError):
    """A schedule that would deadlock, mismatch messages, or exceed its in-flight bound."""


@dataclass(frozen=True)
class Event:
    stage: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimulationResult:
    """What one simulated step did.

    Attributes:
        makespan: time from the first start to the last end.
        busy: per-stage compute time; idle: per-stage makespan - busy.
        idle_fraction: sum(idle) / (p * makespan).
        max_in_flight: per stage, the most microbatches forwarded but not yet backpropagated.
        timeline: every action with its start and end, in start order.
    """

    makespan: float
    busy: tuple[float, ...]
    idle: tuple[float, ...]
    idle_fraction: float
    max_in_flight: tuple[int, ...]
    timeline: tuple[Event, ...]


def _cost(action: Action, t_f: float, t_b: float) -> float:
    return {Kind.FORWARD: t_f, Kind.BACKWARD: t_b, Kind.RECV_OUTPUT: 0.0}[action.kind]


def _check_coverage(schedule: ActionLists) -> None:
    p, m = schedule.num_stages, schedule.num_microbatches
    backwards = schedule.backward_microbatches
    for s, actions in enumerate(schedule.stages):
        want = {(Kind.FORWARD, i) for i in range(m)} | {(Kind.BACKWARD, i) for i in backwards}
        if s < p - 1:
            want |= {(Kind.RECV_OUTPUT, i) for i in range(m)}
        got = [(a.kind, a.mb) for a in actions]
        if len(got) != len(set(got)) or set(got) != want:
            raise ScheduleError(f"stage {s} must run every F (and O on non-last stages) for "
                                f"microbatches 0..{m - 1} and B for {list(backwards)}, each "
                                f"exactly once; it has {list(actions)}")
        done_f = set()
        for a in actions:
            if a.kind is Kind.FORWARD:
                done_f.add(a.mb)
            elif a.mb not in done_f:
                raise ScheduleError(f"stage {s}: {a} comes before F{a.mb}")


def _blocked_report(schedule: ActionLists, pos: list[int], channel, taken) -> str:
    lines = []
    for s, actions in enumerate(schedule.stages):
        if pos[s] < len(actions):
            recvs, _ = messages(schedule.num_stages, s, actions[pos[s]])
            waits = [f"{r.what}{r.mb} from stage {r.src}" for r in recvs
                     if len(channel[(r.src, r.dst)]) <= taken[(r.src, r.dst)]]
            lines.append(f"stage {s} at {actions[pos[s]]} waits for {', '.join(waits)}")
    return "; ".join(lines)


def simulate(schedule: ActionLists, *, t_f: float = 1.0, t_b: float = 1.0) -> SimulationResult:
    """Run the schedule on the event model above.

    Raises:
        ScheduleError: a stage's list misses or repeats an action, a deadlock (which stage waits
            for what), or a receive that would take another message off its channel.
    """
    _check_coverage(schedule)
    p = schedule.num_stages
    backwards = set(schedule.backward_microbatches)
    pos = [0] * p
    clock = [0.0] * p
    channel: dict[tuple[int, int], list[tuple[str, int, float]]] = defaultdict(list)  # sends
    taken: dict[tuple[int, int], int] = defaultdict(int)  # receives done per channel
    in_flight, max_in_flight = [0] * p, [0] * p
    timeline: list[Event] = []
    total = sum(len(a) for a in schedule.stages)
    while len(timeline) < total:
        progressed = False
        for s in range(p):
            if pos[s] == len(schedule.stages[s]):
                continue
            action = schedule.stages[s][pos[s]]
            recvs, sends = messages(p, s, action)
            if any(len(channel[(r.src, r.dst)]) <= taken[(r.src, r.dst)] for r in recvs):
                continue
            ready = clock[s]
            for r in recvs:
                what, mb, at = channel[(r.src, r.dst)][taken[(r.src, r.dst)]]
                if (what, mb) != (r.what, r.mb):
                    raise ScheduleError(
                        f"stage {s} at {action} would receive {r.what}{r.mb} from stage {r.src}"
                        f" but the next message on that channel is {what}{mb}")
                taken[(r.src, r.dst)] += 1
                ready = max(ready, at)
            end = ready + _cost(action, t_f, t_b)
            for snd in sends:
                channel[(snd.src, snd.dst)].append((snd.what, snd.mb, end))
            if action.kind is Kind.FORWARD:
                in_flight[s] += 1
                max_in_flight[s] = max(max_in_flight[s], in_flight[s])
                if action.mb not in backwards:  # no backward follows: nothing is kept
                    in_flight[s] -= 1
            elif action.kind is Kind.BACKWARD:
                in_flight[s] -= 1
            timeline.append(Event(s, action, ready, end))
            clock[s] = end
            pos[s] += 1
            progressed = True
        if not progressed:
            raise ScheduleError(f"{schedule.name} schedule (p={p}, m={schedule.num_microbatches})"
                                f" deadlocks: {_blocked_report(schedule, pos, channel, taken)}")
    for key, sends_on in channel.items():
        if taken[key] != len(sends_on):
            raise ScheduleError(f"{len(sends_on) - taken[key]} message(s) from stage {key[0]} "
                                f"to stage {key[1]} are never received")
    makespan = max(e.end for e in timeline)
    busy = tuple(sum(e.end - e.start for e in timeline if e.stage == s) for s in range(p))
    idle = tuple(makespan - b for b in busy)
    timeline.sort(key=lambda e: (e.start, e.stage))
    return SimulationResult(makespan, busy, idle, sum(idle) / (p * makespan) if makespan else 0.0,
                            tuple(max_in_flight), tuple(timeline))


def check_schedule(schedule: ActionLists) -> SimulationResult:
    """Simulate with unit costs and enforce the in-flight bound the schedule was built for.

    Raises:
        ScheduleError: as `simulate`, or more than active_microbatches in flight on a stage.
    """
    result = simulate(schedule)
    bound = schedule.active_microbatches
    if bound is not None and max(result.max_in_flight) > bound:
        raise ScheduleError(f"{schedule.name} schedule keeps {max(result.max_in_flight)} "
                            f"microbatches in flight; active_microbatches is {bound}")
    return result
