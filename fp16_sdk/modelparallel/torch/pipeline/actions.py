"""The vocabulary of pipeline schedules: actions (`F3`, `B3`, `O3`) and the messages each
implies (`messages()`, the table in schedule.py's module doc). Both the simulator
(simulate.py) and the executor (executor.py) read communication from `messages()`; the
schedules themselves, built from these actions, are schedule.py's. A leaf of the pipeline's
schedule modules: it needs only the number of stages, never a schedule."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Kind", "Action", "Message", "F", "B", "O", "messages"]


class Kind(str, enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    RECV_OUTPUT = "O"


@dataclass(frozen=True)
class Action:
    """One step of one stage: `kind` applied to microbatch `mb`."""

    kind: Kind
    mb: int

    def __str__(self) -> str:
        return f"{self.kind.value}{self.mb}"

    __repr__ = __str__


def F(mb: int) -> Action:
    return Action(Kind.FORWARD, mb)


def B(mb: int) -> Action:
    return Action(Kind.BACKWARD, mb)


def O(mb: int) -> Action:  # noqa: E743 (the letter is the action's name in the grid)
    return Action(Kind.RECV_OUTPUT, mb)


@dataclass(frozen=True)
class Message:
    """A point-to-point transfer implied by an action: `what` is "act", "grad" or "out"."""

    src: int
    dst: int
    what: str
    mb: int


def messages(p: int, stage: int, action: Action) -> tuple[list[Message], list[Message]]:
    """The (receives, sends) that `action` performs on `stage` of a `p`-stage pipeline (the
    table in schedule.py's module doc)."""
    last, mb = p - 1, action.mb
    recvs: list[Message] = []
    sends: list[Message] = []
    if action.kind is Kind.FORWARD:
        if stage > 0:
            recvs.append(Message(stage - 1, stage, "act", mb))
        if stage < last:
            sends.append(Message(stage, stage + 1, "act", mb))
        else:
            sends.extend(Message(last, dst, "out", mb) for dst in range(last))
    elif action.kind is Kind.RECV_OUTPUT:
        if stage == last:
            raise ValueError("the last stage computes its outputs; it has no O action")
        recvs.append(Message(last, stage, "out", mb))
    else:
        if stage < last:
            recvs.append(Message(stage + 1, stage, "grad", mb))
        if stage > 0:
            sends.append(Message(stage, stage - 1, "grad", mb))
    return recvs, sends
