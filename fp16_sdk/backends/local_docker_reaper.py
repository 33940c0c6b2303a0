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
collect artifacts. A child that this process forks without exec (multiprocessing's "fork")
inherits the write end and keeps the job alive until it exits too. Run as `python -m fp16_sdk.backends.local_docker_reaper --job J --fd N`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["Reaper", "engine_url", "reap", "main"]

LABEL_JOB = "fp16_sdk.job"  # the same label as local_docker_job.LABEL_JOB (a test checks it)


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
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "fp16_sdk.backends.local_docker_reaper", "--job", job,
                 "--fd", str(read_end), "--base-url", base_url, "--grace", str(grace)],
                pass_fds=(read_end,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                env=env, start_new_session=True)
        except BaseException:
            os.close(self._write_end)
            raise
        finally:
            os.close(read_end)
        self._lock = threading.Lock()

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def exit_code(self) -> int | None:
        """The watchdog's exit status (0 after `release`), None while it runs."""
        return self._proc.poll()

    def release(self) -> None:
        """The job is over and cleaned up by the SDK: tell the watchdog to exit (idempotent)."""
        with self._lock:
            if self._write_end is None:
                return
            try:
                os.write(self._write_end, b"x")
            except OSError:
                pass  # it already died: nothing to release
            os.close(self._write_end)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fp16_sdk.backends.local_docker_reaper")
    parser.add_argument("--job", required=True)
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--grace", type=int, required=True)
    args = parser.parse_args(argv)
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
