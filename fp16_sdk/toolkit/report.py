"""The text of `output/failure`: what ended the job on this host, and why.

Layout (SageMaker shows the first 1024 characters as FailureReason, so the useful lines come
first): the contract's header (`ExitCode N`, `FailedAt`, `Signal N NAME toolkit|outside`),
`Command: ...` (cut when very long), `ErrorMessage: ...` (the last exception line of the
stderr tail of the best `errorlines.rank`: the script's own error before a rank's reaction to
a lost peer, torchrun's own never), one explanatory line when a signal ended the command, a blank line, the tail.

Who sent the SIGKILL matters: one the toolkit sent itself (after a stop, when the process
outlived the grace) is said as such; only a SIGKILL from outside gets the out-of-memory hint.
"""

from __future__ import annotations

import re
import shlex
import signal
import time
from typing import Sequence

from fp16_sdk import contract
from fp16_sdk.toolkit.errorlines import exception_line, rank
from fp16_sdk.toolkit.process import ProcessResult

__all__ = ["failure_text", "result_failure", "setup_failure", "display", "OOM_HINT"]

OOM_HINT = ("The process was killed with SIGKILL (exit 137), most often by the kernel's "
            "out-of-memory killer: use a larger instance, a smaller batch, or more pipeline/"
            "tensor parallelism; in Docker also check the container memory and --shm-size.")
_COMMAND_SHOWN = 400  # characters of a command line kept in the header
# torchrun's error summary for a worker killed by SIGKILL.
_WORKER_SIGKILL = re.compile(r"exitcode\s*:\s*-9\b|Signal 9 \(SIGKILL\)")
def display(argv: Sequence[str]) -> str:
    """The command as one line, for humans only (never executed)."""
    return shlex.join(argv)


def _shown_command(argv: Sequence[str]) -> str:
    text = display(argv)
    if len(text) <= _COMMAND_SHOWN:
        return text
    return f"{text[:_COMMAND_SHOWN]}... [{len(text)} characters]"


def failure_text(exit_code: int, argv: Sequence[str], stderr_tail: Sequence[str], *,
                 failed_at: float | None = None, signal: int | None = None,
                 signal_from_toolkit: bool = False, signal_after_error: bool = False,
                 note: str | None = None) -> str:
    """The failure file (see the module docstring).

    Args:
        exit_code: the command's exit status (128 + N when killed by signal N).
        argv: the command.
        stderr_tail: its last stderr lines.
        failed_at: when the error began on this host (seconds since the epoch).
        signal: the signal that ended the command, if one did.
        signal_from_toolkit: the toolkit sent `signal` itself.
        signal_after_error: the command had printed a traceback before the stop came.
        note: what the toolkit did (its stop); replaces the out-of-memory hint.
    """
    lines = contract.failure_header(exit_code=exit_code, failed_at=failed_at, signal=signal,
                                    signal_from_toolkit=signal_from_toolkit,
                                    signal_after_error=signal_after_error)
    lines.append(f"Command: {_shown_command(argv)}")
    found = [e for e in map(exception_line, stderr_tail) if e is not None]
    best = min(map(rank, found), default=2)
    error = next((e for e in reversed(found) if rank(e) == best and best < 2), None)
    if error:
        lines.append(f"ErrorMessage: {error}")
    if note:
        lines.append(note)
    elif not signal_from_toolkit and (
            exit_code == 137 or any(_WORKER_SIGKILL.search(ln) for ln in stderr_tail)):
        lines.append(OOM_HINT)
    lines.append("")
    lines.extend(stderr_tail)
    return "\n".join(lines).rstrip("\n") + "\n"


def setup_failure(message: str, detail: str = "") -> str:
    """The failure file of an error before the user's command ran (exit code 1)."""
    lines = contract.failure_header(exit_code=1, failed_at=time.time())
    return "\n".join([*lines, "Command: train", f"ErrorMessage: {message}"]) + "\n" + detail


def _ending_signal(result: ProcessResult) -> tuple[int | None, bool]:
    """(the signal that ended the command, whether the toolkit sent it); (None, False) when
    the command exited by itself."""
    if result.exit_code == 0:
        return None, False
    if result.sent_signal is not None:  # our SIGTERM (a stop), or our SIGKILL after the grace
        killed = result.sent_signal == signal.SIGKILL and result.exit_code == 128 + signal.SIGKILL
        return (signal.SIGKILL if killed else signal.SIGTERM), True
    if 128 < result.exit_code < 128 + signal.NSIG:  # shell convention: killed by signal N
        return result.exit_code - 128, False
    return None, False


def _stop_note(result: ProcessResult, ending: int | None, grace_s: float) -> str:
    """What the toolkit did when it was stopped, in place of a guess about the cause."""
    got = signal.Signals(result.stopped_by).name if result.stopped_by else "a stop signal"
    text = (f"The toolkit received {got} (the job was stopped, its time ran out, or its "
            "backend ended this host after another host failed: look for the host where the "
            "error began) and sent SIGTERM to the training process")
    if ending == signal.SIGKILL:
        return (text + f"; it was still running {grace_s:g} s later, so the toolkit sent "
                "SIGKILL (exit 137). This was not the out-of-memory killer.")
    return text + "."


def result_failure(result: ProcessResult, argv: Sequence[str], *, grace_s: float) -> str:
    """The failure file of a command that ended with a non-zero status."""
    sig, ours = _ending_signal(result)
    error_at = None if result.went_on_after_error else result.error_at  # handled: no error
    began = [t for t in (error_at, result.stopped_at) if t is not None]
    note = _stop_note(result, sig, grace_s) if ours else None
    after_error = (ours and result.error_at is not None and result.stopped_at is not None
                   and result.error_at < result.stopped_at and not result.went_on_after_error)
    return failure_text(result.exit_code, argv, result.stderr_tail,
                        failed_at=min(began) if began else result.ended_at, signal=sig,
                        signal_from_toolkit=ours, signal_after_error=after_error, note=note)
