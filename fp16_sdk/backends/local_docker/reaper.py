"""The watchdog that ends a local Docker job when the process that started it dies.

Containers belong to the Docker engine, not to the SDK process: when that process dies
(SIGKILL included, when it can run no cleanup of its own) they would run on until `max_run`.
So before a job creates anything, the SDK starts this module as a small process in a session of
its own (a Ctrl-C or a signal to the SDK's process group does not reach it), holding the read
end of a pipe whose write end only the SDK holds (close-on-exec: no other child inherits it).

- End of file with nothing read: the SDK is gone. Stop the job's containers (SIGTERM, then
  SIGKILL after `--grace` seconds, so each toolkit can write its failure file), remove them and
  the job's networks, found by the job's label (`fp16_sdk.job=<job>`), then exit.
- A byte read: the SDK finished the job itself (`Reaper.release`); exit without touching
  anything.

The job folder stays as the containers left it (failure files included): nobody is left to
collect artifacts. A child that the SDK forks without exec (multiprocessing's "fork") closes
its copy of the write end right after the fork (`local_lifeline.hold`), so only the SDK's
death counts. Run as `python -m fp16_sdk.backends.local_docker.reaper --job J --fd N`.

When this watchdog dies with the SDK (a whole process group or cgroup killed), each container
sees its own lifeline end and stops (`fp16_sdk.toolkit.lifeline`), but stopped containers and
the network stay. Every resource also carries `fp16_sdk.sdk=<boot id>/<pid namespace>/<pid>/
<start time>` of the SDK process: `prune` (run by each local Docker `fit()`, or by hand as
`python -m fp16_sdk.backends.local_docker.reaper --prune`) removes the jobs whose SDK is known
to be gone: same boot and pid namespace as the caller, and /proc showing that pid with another
start time, or no process with that pid at all (`kill(pid, 0)`, which answers every user). A
pid that exists but that /proc hides (another user's SDK under `hidepid`) is never taken for
dead, nor is a job whose resources disagree about their owner (a mislabelled network), nor a
job started elsewhere (another machine's or container's SDK on a shared engine) or before
these labels existed.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from fp16_sdk import procfs
from fp16_sdk.backends import local_lifeline

__all__ = ["Reaper", "engine_url", "reap", "prune", "prune_quietly", "sdk_label", "sdk_gone",
           "main", "LABEL_SDK"]

log = logging.getLogger(__name__)

LABEL_JOB = "fp16_sdk.job"  # the same label as local_docker_job.LABEL_JOB (a test checks it)
LABEL_SDK = "fp16_sdk.sdk"  # the SDK process that owns the job, see `sdk_label`
_PID_MAX_LIMIT = 4194304  # Linux's largest pid_max (a label beyond it was forged)


def engine_url(client: Any) -> str:
    """The address a new client needs to reach the same engine as `client` (docker-py names a
    Unix socket engine `http+docker://localhost`, which it does not accept back)."""
    socket_path = getattr(getattr(client.api, "_custom_adapter", None), "socket_path", None)
    return f"unix://{socket_path}" if socket_path else client.api.base_url


class Reaper:
    """The SDK's side: starts the watchdog process and releases it when the job ended.

    Args:
        job: the job's name (its label value).
        base_url: the Docker engine's address (`engine_url(client)`).
        grace: seconds between SIGTERM and SIGKILL when the watchdog stops the containers.
    """

    def __init__(self, job: str, *, base_url: str, grace: int):
        # This package's root first: fp16_sdk may be importable here only through sys.path.
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [root, *filter(None, [os.environ.get("PYTHONPATH")])])}
        read_end, self._write_end = os.pipe()  # both close-on-exec
        local_lifeline.hold(self._write_end)  # and closed in children forked without exec
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "fp16_sdk.backends.local_docker.reaper", "--job", job,
                 "--fd", str(read_end), "--base-url", base_url, "--grace", str(grace)],
                pass_fds=(read_end,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                env=env, start_new_session=True)
        except BaseException:
            local_lifeline.let_go(self._write_end)
            raise
        finally:
            os.close(read_end)
        self._lock = threading.Lock()
        self._owner = os.getpid()

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def exit_code(self) -> int | None:
        """The watchdog's exit status (0 after `release`), None while it runs."""
        return self._proc.poll()

    def release(self) -> None:
        """The job is over and cleaned up by the SDK: tell the watchdog to exit (idempotent;
        nothing in a child forked from the SDK, which must not release the SDK's watchdog)."""
        if os.getpid() != self._owner:
            return
        with self._lock:
            if self._write_end is None:
                return
            try:
                os.write(self._write_end, b"x")
            except OSError:
                pass  # it already died: nothing to release
            local_lifeline.let_go(self._write_end)
            self._write_end = None
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def reap(client: Any, job: str, *, grace: int) -> list[str]:
    """Stop and remove every container and network labelled with `job`; return their names."""
    labelled = {"label": f"{LABEL_JOB}={job}"}
    # sparse: no inspect per container, which fails for one removed in the meantime
    containers = client.containers.list(all=True, filters=labelled, sparse=True)
    threads = [threading.Thread(target=_stop_and_remove, args=(c, grace), daemon=True)
               for c in containers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gone = [_name(c) for c in containers]
    for network in client.networks.list(filters=labelled):
        try:
            network.remove()
            gone.append(network.name)
        except Exception as exc:  # noqa: BLE001 - report it and go on with the rest
            print(f"fp16_sdk reaper: could not remove network {network.name}: {exc}",
                  file=sys.stderr)
    return gone


def _start_time(pid: int) -> str | None:
    """The start time of live process `pid` (clock ticks since boot), None when /proc shows
    no live process with that pid (it ended, or /proc hides it: hidepid)."""
    stat = procfs.read_stat(f"{procfs.PROC}/{pid}/stat")
    if stat is None or stat.state in ("Z", "X") or stat.start_time is None:
        return None
    return str(stat.start_time)


def _this_kernel() -> str | None:
    """`<boot id>/<pid namespace>` of this process: where its pids mean something."""
    try:
        with open(f"{procfs.PROC}/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.readlink(f'{procfs.PROC}/self/ns/pid')}"
    except OSError:
        return None


def sdk_label() -> dict[str, str]:
    """`{LABEL_SDK: <boot id>/<pid namespace>/<pid>/<start time>}` naming this process, or {}
    where /proc cannot tell (then `prune` never removes the job)."""
    kernel, start = _this_kernel(), _start_time(os.getpid())
    return {LABEL_SDK: f"{kernel}/{os.getpid()}/{start}"} if kernel and start else {}


def sdk_gone(owner: str) -> bool:
    """Whether the SDK process named by a `LABEL_SDK` value is known to have ended.

    Only evidence that any user can read counts: the label must name this boot and pid
    namespace, and then either /proc shows the pid with another start time (the pid was
    reused) or a zombie, or the kernel has no process with that pid at all (`kill(pid, 0)`:
    ESRCH). A pid that exists but whose /proc entry cannot be read (another user's process
    under hidepid, or /proc unreadable) may be the SDK itself: not gone, the job is left."""
    parts = owner.split("/")  # boot id, pid namespace, pid, start time
    if len(parts) != 4 or "/".join(parts[:2]) != _this_kernel() or not parts[2].isdigit() \
            or not parts[3].isdigit():
        return False
    pid = int(parts[2])
    if not 0 < pid <= _PID_MAX_LIMIT:  # no process of this kernel ever had it: not ours
        return False
    stat = procfs.read_stat(f"{procfs.PROC}/{pid}/stat")
    if stat is not None and stat.start_time is not None:
        return stat.state in ("Z", "X") or str(stat.start_time) != parts[3]
    if procfs.pid_exists(pid):
        log.info("SDK process %d exists but /proc does not show it to this user (hidepid?): "
                 "it may be the job's SDK, its job is left alone", pid)
        return False
    return True


def prune(client: Any, *, grace: int) -> list[str]:
    """Remove the containers and networks of every job whose SDK process is gone (`sdk_gone`),
    running or stopped; return their names.

    A job is taken only when every container and network labelled with its name carries the
    same `LABEL_SDK` owner and that owner is gone: one resource without the label, or with
    another owner (a mislabelled or forged network), leaves the whole job alone. Jobs of live
    or unknown SDKs are left alone, and logged when the SDK's liveness cannot be read."""
    jobs: dict[str, set] = {}
    for labels in [c.get("Labels") or {} for c in
                   client.api.containers(all=True, filters={"label": LABEL_JOB})] \
            + [n.get("Labels") or {} for n in client.api.networks(filters={"label": LABEL_JOB})]:
        if labels.get(LABEL_JOB):
            jobs.setdefault(labels[LABEL_JOB], set()).add(labels.get(LABEL_SDK))
    gone: list[str] = []
    for job, owners in sorted(jobs.items()):
        if len(owners) != 1 or None in owners:
            if len(owners) > 1:
                log.info("left job %s alone: its resources name different SDK processes (%s)",
                         job, ", ".join(sorted(map(str, owners))))
            continue
        if sdk_gone(next(iter(owners))):
            gone += reap(client, job, grace=grace)
    return gone


def prune_quietly(client: Any, *, grace: int) -> None:
    """`prune` for a new job: a failure is logged, never raised (a leftover must not block)."""
    try:
        gone = prune(client, grace=grace)
    except Exception as exc:  # noqa: BLE001
        log.warning("could not remove leftovers of earlier jobs on the Docker engine (%s); "
                    "`python -m fp16_sdk.backends.local_docker.reaper --prune` retries", exc)
        return
    if gone:
        log.info("removed what jobs of dead SDK processes left: %s", ", ".join(gone))


def _name(container: Any) -> str:
    names = container.attrs.get("Names") or [container.id[:12]]
    return names[0].lstrip("/")


def _stop_and_remove(container: Any, grace: int) -> None:
    try:
        container.stop(timeout=grace)
    except Exception:  # noqa: BLE001 - already gone or exited; removal below decides
        pass
    try:
        container.remove(force=True)
    except Exception as exc:  # noqa: BLE001
        if "No such container" not in str(exc) and "already in progress" not in str(exc):
            print(f"fp16_sdk reaper: could not remove container {_name(container)}: {exc}",
                  file=sys.stderr)


def _prune_main(base_url: str | None, grace: int) -> int:
    """`--prune`: remove what jobs of dead SDKs left on the engine (DOCKER_HOST by default)."""
    import docker

    client = docker.DockerClient(base_url=base_url) if base_url else docker.from_env()
    gone = prune(client, grace=grace)
    print(f"removed {', '.join(gone)}" if gone else "nothing to remove: every job labelled "
          f"{LABEL_SDK} belongs to a live SDK process or to another machine")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fp16_sdk.backends.local_docker.reaper")
    parser.add_argument("--prune", action="store_true",
                        help="remove the containers and networks of jobs whose SDK is gone")
    parser.add_argument("--job")
    parser.add_argument("--fd", type=int)
    parser.add_argument("--base-url")
    parser.add_argument("--grace", type=int, default=5)
    args = parser.parse_args(argv)
    if args.prune:
        return _prune_main(args.base_url, args.grace)
    if args.job is None or args.fd is None or args.base_url is None:
        parser.error("--job, --fd and --base-url are required without --prune")
    while True:
        try:
            released = os.read(args.fd, 1) != b""
            break
        except InterruptedError:
            continue
    if released:
        return 0
    import docker

    started = time.monotonic()
    try:
        client = docker.DockerClient(base_url=args.base_url, timeout=60)
        gone = reap(client, args.job, grace=args.grace)
    except Exception as exc:  # noqa: BLE001 - the engine is gone or refuses: say what is left
        print(f"fp16_sdk reaper: the process that started job {args.job} died, and the Docker "
              f"engine at {args.base_url} could not be asked to remove its containers ({exc}): "
              f"remove them with `docker rm -f $(docker ps -aq --filter "
              f"label={LABEL_JOB}={args.job})`", file=sys.stderr)
        return 1
    print(f"fp16_sdk reaper: the process that started job {args.job} died; removed "
          f"{', '.join(gone) or 'nothing'} in {time.monotonic() - started:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
