"""Running the user's command: own session, signals forwarded to the whole tree, stderr tail.

The child starts in a new session so a SIGTERM from the platform (StopTrainingJob, docker
stop, Ctrl-C on a local job) reaches the toolkit first; the toolkit then signals every
process below it. torchrun starts each worker in a session of its own, so killing the child's
process group is not enough: we also walk /proc for descendants and signal each of them and
their process groups, then SIGKILL whatever is left after a grace period.

Two guards keep that tree complete and bound to whoever started the toolkit (`train` calls
both at start):
- `become_subreaper()`: the toolkit is the child subreaper of its tree, so a worker whose
  torchrun died is reparented to the toolkit instead of init and is still a descendant.
- `watch_lifeline(fd)`: local backends hand the toolkit the read end of a pipe whose write end
  only the SDK process holds. End of file means that process is gone, however it died (SIGKILL
  included); the toolkit then stops as if it had received SIGTERM. A pipe rather than
  PR_SET_PDEATHSIG: the death signal fires when the *thread* that started the child ends, and
  the SDK may call `fit()` from a short-lived thread; a pipe closes only with the process.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from fp16_sdk.procfs import read_stat
from fp16_sdk.toolkit.errorlines import TRACEBACK, diagnostic, exception_line, rank
from fp16_sdk.toolkit.stops import StopSignals

__all__ = ["ProcessResult", "run_process", "descendants", "become_subreaper", "watch_lifeline",
           "StopSignals",
           "DEFAULT_GRACE_S", "TAIL_LINES"]

DEFAULT_GRACE_S = 30.0  # SIGTERM -> SIGKILL; SageMaker allows 120 s for the whole container
TAIL_LINES = 100


@dataclass
class ProcessResult:
    """How the child ended.

    Attributes:
        exit_code: shell convention: the exit status, or 128 + N when killed by signal N.
        stderr_tail: the last `TAIL_LINES` lines the tree wrote to stderr.
        stopped_by: the signal the toolkit received and forwarded, if any.
        sent_signal: the last signal the toolkit sent to the command while it was still
            running (SIGTERM on a stop, SIGKILL after the grace), None if it sent none.
        ended_at: when the command ended (seconds since the epoch).
        error_at: when the traceback of the command's error reached our stderr: the last
            one of the best `errorlines.rank` (the script's own error before a rank's
            reaction to a lost peer, torchrun's own never), the one the failure file's
            ErrorMessage names. A traceback the script printed and went on from (a handled
            error) is not it once a later one came.
        went_on_after_error: the command wrote more to stderr after that traceback's
            exception line and before the stop (runtime warnings aside): it was not failing
            when it was stopped, the traceback was a handled error.
        stopped_at: when the stop signal arrived.
    """

    exit_code: int
    stderr_tail: list[str] = field(default_factory=list)
    stopped_by: int | None = None
    sent_signal: int | None = None
    ended_at: float = 0.0
    error_at: float | None = None
    went_on_after_error: bool = False
    stopped_at: float | None = None


def descendants(pid: int) -> list[int]:
    """All live descendants of `pid` (Linux /proc; [] elsewhere)."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        stat = read_stat(f"/proc/{entry}/stat")
        if stat is not None:
            children[stat.ppid].append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


_PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
_SUBREAPER = threading.Event()  # set once this process is a subreaper: orphans are ours to reap


def become_subreaper() -> bool:
    """Make orphaned descendants reparent to this process (Linux); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        return False
    _SUBREAPER.set()
    return True


def watch_lifeline(fd: int, *, sig: int = signal.SIGTERM) -> threading.Thread:
    """Send `sig` to this process when `fd` (a pipe's read end) reaches end of file.

    Nothing is ever written to the pipe: end of file comes when the last holder of the write
    end, the SDK process, is gone. Our stdout/stderr went to that process, so they are pointed
    at /dev/null first: the shutdown must not die of a broken pipe halfway.
    """
    def watch() -> None:
        while True:
            try:
                if not os.read(fd, 4096):
                    break
            except InterruptedError:
                continue
            except OSError:
                break  # a closed or bad descriptor: treat as the SDK gone
        devnull = os.open(os.devnull, os.O_WRONLY)
        for std in (1, 2):
            os.dup2(devnull, std)
        os.kill(os.getpid(), sig)

    thread = threading.Thread(target=watch, name="sdk-lifeline", daemon=True)
    thread.start()
    return thread


def _reap_orphans(keep: int) -> None:
    """Reap exited orphans that were reparented to us (subreaper), never `keep` (Popen's).

    Only in a subreaper: elsewhere (run_process called inside a test) the other children
    belong to other Popen objects, whose exit status must not be stolen.
    """
    while _SUBREAPER.is_set():
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None or info.si_pid == keep:
            return
        try:
            os.waitpid(info.si_pid, 0)
        except ChildProcessError:
            return


class _Tree:
    """The child and everything it started, remembered so orphans can still be killed."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.known: set[int] = set()
        self.sent_to_command: int | None = None  # the last signal sent while proc ran

    def refresh(self) -> None:
        self.known.update(descendants(self.proc.pid))
        if _SUBREAPER.is_set():  # orphans of the tree were reparented to us: still ours
            self.known.update(descendants(os.getpid()))

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:  # still running: the signal may be what ends it
            self.sent_to_command = sig
        self.refresh()
        groups = {self.proc.pid}  # the child leads its own session/group
        for pid in self.known:
            try:
                groups.add(os.getpgid(pid))
            except OSError:
                pass
        for target in groups:
            try:
                os.killpg(target, sig)
            except OSError:
                pass
        for pid in self.known | {self.proc.pid}:
            try:
                os.kill(pid, sig)
            except OSError:
                pass

    def workers_done(self) -> bool:
        """No process below the command is alive now: the command (a launcher) is alone.

        Decided from the tree as it is now, never from workers seen earlier: torchrun reaps a
        worker within 0.1 s of its exit, so a worker that lived a few milliseconds is never
        seen by a look every 0.5 s (issue 42, T4-14). A launcher that has not started its
        workers yet is alone too; the settle that follows ends as soon as one starts."""
        below = set(descendants(self.proc.pid))
        if _SUBREAPER.is_set():  # orphans of the tree were reparented to us
            below.update(descendants(os.getpid()))
        self.known.update(below)
        below.discard(self.proc.pid)
        return not any(_pid_alive(pid) for pid in below)

    def alive(self) -> bool:
        if self.proc.poll() is None:
            return True
        self.refresh()  # orphans the subreaper adopted since the last look
        return any(_pid_alive(pid) for pid in self.known)


def _pid_alive(pid: int) -> bool:
    stat = read_stat(f"/proc/{pid}/stat")
    if stat is not None:
        return stat.state not in ("Z", "X")
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def _pump_stderr(pipe, tail: collections.deque, marks: dict) -> None:
    """Copy the child's stderr to ours as it comes, keeping the last lines; marks["tracebacks"]
    is [start time, exception line or None, went on] for each traceback, in order (`_error`)."""
    out = sys.stderr.buffer if hasattr(sys.stderr, "buffer") else None
    tracebacks: list[list] = marks.setdefault("tracebacks", [])
    partial = b""
    while True:
        chunk = os.read(pipe.fileno(), 65536)
        if not chunk:
            break
        if out is not None:
            out.write(chunk)
            out.flush()
        else:
            sys.stderr.write(chunk.decode("utf-8", "replace"))
        lines = (partial + chunk).split(b"\n")
        partial = lines.pop()
        for raw in lines:
            line = raw.decode("utf-8", "replace")
            tail.append(line)
            _note_error(line, tracebacks, stopped="stopped" in marks)
    if partial:
        tail.append(partial.decode("utf-8", "replace"))
        _note_error(tail[-1], tracebacks, stopped="stopped" in marks)
    pipe.close()


def _note_error(line: str, tracebacks: list[list], *, stopped: bool) -> None:
    if TRACEBACK in line:
        tracebacks.append([time.time(), None, False])
    elif tracebacks and tracebacks[-1][1] is None:
        tracebacks[-1][1] = exception_line(line)  # None until the traceback's last line
    elif tracebacks and line.strip() and not stopped and not diagnostic(line):
        tracebacks[-1][2] = True  # the script wrote on after it: a handled error


def _error(tracebacks: list[list]) -> tuple[float | None, bool]:
    """(when the traceback of the command's error began, whether the command went on after
    it): the last traceback of the best `errorlines.rank`, the error the failure file names
    (torchrun's own only when there is nothing else)."""
    best = min((rank(error) for _, error, _ in tracebacks), default=2)
    ours = [(at, went_on) for at, error, went_on in tracebacks
            if rank(error) == best and best < 2]
    return ours[-1] if ours else (None, False)


def run_process(argv: Sequence[str], *, env: Mapping[str, str], cwd: Path,
                grace_s: float = DEFAULT_GRACE_S, tail_lines: int = TAIL_LINES,
                forward: Sequence[int] = (signal.SIGTERM, signal.SIGINT),
                stops: StopSignals | None = None, settle_s: float = 0.0) -> ProcessResult:
    """Run `argv` to completion, streaming its output through.

    stdout is inherited (zero copies); stderr goes through a pipe that is copied to our stderr
    and remembered. On a stop signal the whole tree gets SIGTERM, then SIGKILL after
    `grace_s`; so do processes still running after the child itself exited.

    A launcher (torchrun) outlives its workers for a moment: it waits for the other hosts'
    launchers (its exit barrier) and shuts its rendezvous down. With `settle_s` > 0, a stop
    that finds no process alive below the command gives the command up to `settle_s` to exit
    by itself before it gets SIGTERM: its own exit status then says whether its workers
    succeeded (a job whose training finished is a success, even when the platform stopped the
    container a moment later, as compose does once another host exited). A stop that comes
    while the launcher is still starting its workers is forwarded as soon as one starts, or
    after `settle_s`.

    Args:
        argv: the command (never a shell string).
        env: its full environment.
        cwd: its working directory.
        grace_s: seconds between SIGTERM and SIGKILL.
        tail_lines: how many stderr lines to keep.
        forward: signals to forward when `stops` is not given.
        stops: the caller's StopSignals (the toolkit's, installed for its whole life); None:
            handlers for `forward` are installed for this call only (main thread only).
        settle_s: see above; 0 forwards a stop at once.

    Returns:
        The ProcessResult; a stop that came before the command could start gives exit code
        128 + N without running it.
    """
    own = stops is None
    stops = stops if stops is not None else StopSignals(forward)
    previous = stops.install() if own else {}
    try:
        if stops.received is not None:  # stopped before the command started: do not start it
            now = time.time()
            return ProcessResult(exit_code=128 + stops.received, stopped_by=stops.received,
                                 ended_at=now, stopped_at=stops.at or now)
        return _run(argv, env=env, cwd=cwd, grace_s=grace_s, tail_lines=tail_lines,
                    stops=stops, settle_s=settle_s)
    finally:
        stops.target = None
        StopSignals.restore(previous)


def _run(argv: Sequence[str], *, env: Mapping[str, str], cwd: Path, grace_s: float,
         tail_lines: int, stops: StopSignals, settle_s: float) -> ProcessResult:
    tail: collections.deque = collections.deque(maxlen=tail_lines)
    proc = subprocess.Popen(list(argv), env=dict(env), cwd=str(cwd), stdin=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    tree = _Tree(proc)
    marks: dict[str, float] = {}
    pump = threading.Thread(target=_pump_stderr, args=(proc.stderr, tail, marks), daemon=True)
    pump.start()
    settle_until: list[float] = []  # set while a stop waits for the launcher to finish

    def on_signal(_signum: int) -> None:
        if "stopped" in marks:
            return
        marks["stopped"] = stops.at or time.time()
        if settle_s > 0 and tree.workers_done():
            settle_until.append(time.monotonic() + settle_s)
            _note(f"stop signal {_signal_name(_signum)}: every worker has exited; the launcher "
                  f"gets up to {settle_s:g} s to finish by itself")
        else:
            tree.signal(signal.SIGTERM)

    stops.target = on_signal
    if stops.received is not None:  # arrived between the caller's check and now
        on_signal(stops.received)
    while proc.poll() is None and ("stopped" not in marks or settle_until):
        if settle_until and (time.monotonic() > settle_until[0] or not tree.workers_done()):
            settle_until.clear()  # the launcher did not finish (or started workers again)
            _note("the launcher is still running: stopping it")
            tree.signal(signal.SIGTERM)
            break
        tree.refresh()  # remember workers while they live, to reach them if orphaned
        _reap_orphans(proc.pid)
        try:
            proc.wait(timeout=0.1 if settle_until else 0.5)
        except subprocess.TimeoutExpired:
            pass
    if proc.returncode is not None:
        marks["ended"] = time.time()
    # The child ended by itself but left processes (workers of a torchrun that was killed,
    # a daemon): a tree never outlives its root, they get the same SIGTERM/SIGKILL.
    stray = "stopped" not in marks and tree.alive()
    if stray:
        tree.signal(signal.SIGTERM)
    if "stopped" in marks or stray:
        _end_tree(tree, grace_s)
        marks.setdefault("ended", time.time())
    pump.join(timeout=5.0)
    code = proc.returncode
    return ProcessResult(exit_code=128 - code if code < 0 else code, stderr_tail=list(tail),
                         stopped_by=stops.received if "stopped" in marks else None,
                         sent_signal=tree.sent_to_command, ended_at=marks["ended"],
                         error_at=_error(marks.get("tracebacks", []))[0],
                         went_on_after_error=_error(marks.get("tracebacks", []))[1],
                         stopped_at=marks.get("stopped"))


def _note(message: str) -> None:
    print(f"[toolkit] {message}", flush=True)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def _end_tree(tree: _Tree, grace_s: float) -> None:
    """Wait up to `grace_s` for the tree (already sent SIGTERM) to exit, SIGKILL the rest."""
    deadline = time.monotonic() + grace_s
    while tree.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    if tree.alive():
        tree.signal(signal.SIGKILL)
        deadline = time.monotonic() + 5.0  # SIGKILL is not instant either
        while tree.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
    tree.proc.wait()
    _reap_orphans(tree.proc.pid)
