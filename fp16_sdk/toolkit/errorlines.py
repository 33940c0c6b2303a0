"""Recognising a Python error in the training command's stderr (standard library only).

Used while the stderr streams (process.py stamps when the traceback of the command's error
began) and afterwards (report.py names that error in the failure file): both must mean the
same error: the last exception printed of the best `rank` (the script's own error before a
rank's reaction to a lost peer, both before torchrun's own exceptions).
"""

from __future__ import annotations

import re

from fp16_sdk import contract

__all__ = ["TRACEBACK", "exception_line", "launcher_error", "diagnostic", "rank"]

TRACEBACK = "Traceback (most recent call last)"
# "ValueError: ..." as Python prints it last in a traceback.
_EXCEPTION_LINE = re.compile(r"^[\w.]*(?:Error|Exception|Interrupt)(?::|$)")
# torchrun's ChildFailedError only says that a worker failed, and its SignalException that it
# was stopped: the worker's own exception is the one to report.
_LAUNCHER_EXCEPTIONS = ("ChildFailedError", "SignalException")
# torch prefixes a worker's uncaught traceback with "[rankN]: " once its process group exists
# (every smp job), and torchrun's --tee with "[defaultN]:"; the exception line follows it.
_RANK_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:\s?")


# What the runtime itself prints while a process winds down after an error: c10's log lines
# ("[W1206 10:00:00 ProcessGroupNCCL.cpp:...]", also behind a rank prefix), torchrun's own
# ("W1206 10:00:00.123000 140 .../elastic/multiprocessing/api.py:897] Sending process ...")
# and Python warnings.
_DIAGNOSTIC = re.compile(r"^(?:\[(?:rank|default)\d+\]:\s?)?(?:\[?[WIEF]\d{4} \d\d:\d\d|"
                         r"\S*Warning\b|\S+:\d+: \w*Warning: |\s*warnings\.warn)")


def diagnostic(line: str) -> bool:
    """A runtime log or warning line, not output of the script's own (see `_DIAGNOSTIC`)."""
    return _DIAGNOSTIC.match(line.strip()) is not None


def exception_line(line: str) -> str | None:
    """`line` without its rank prefix when it is an exception line, else None."""
    text = _RANK_PREFIX.sub("", line.strip()).strip()
    return text if _EXCEPTION_LINE.match(text) else None


def launcher_error(text: str) -> bool:
    """An exception line of torchrun's own (it reports a worker's failure or a stop)."""
    return any(name in text for name in _LAUNCHER_EXCEPTIONS)


def rank(text: str | None) -> int:
    """How well an exception line names the error where it began on this host, best first:
    0 an error of the script's own, 1 one that only reports a peer's failure (a rank of this
    host reacting to the lost rank, `contract.PEER_FAILURE`), 2 torchrun's own. A traceback cut
    before its exception line (None) counts as the script's own."""
    if text is None:
        return 0
    if launcher_error(text):
        return 2
    return 1 if contract.PEER_FAILURE.search(text) else 0
