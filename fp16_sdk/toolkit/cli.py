"""`train`: the container's entry point (`docker run <image> train`).

Order of work, as in SageMaker's toolkit: read input/config, create the output folders, put
the code into /opt/ml/code and install its requirements, build the SM_* environment, launch
the script (directly, or through torchrun when a distribution is enabled), then write
`output/success` or `output/failure`.

Exit status: 0 on success. On failure the toolkit exits 1, as SageMaker's does; the real exit
code of the script is the first line of `output/failure` (`ExitCode N`). When the toolkit is
stopped by SIGTERM/SIGINT it exits 128 + the signal number after the tree is gone. A script
that exited 0 is a success even when a stop signal arrived afterwards: never a failure file,
and the toolkit writes `success` before it exits (a stop after the command ended is only
remembered, see `stops`). A stop that finds torchrun alone, its workers all exited, gives it
up to SETTLE_S to finish by itself: its own exit status decides (compose stops the other
containers as soon as one exits, often while torchrun is still shutting down).

Local backends pass two more variables (see `process` for why):
`FP16_SDK_LIFELINE_FD`, a pipe that reaches end of file when the SDK process dies (the
toolkit then stops its tree as on SIGTERM), and `FP16_SDK_STOP_GRACE_S`, the seconds between
SIGTERM and SIGKILL for the tree (default 30). Local Docker adds two (see `lifeline`).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
import traceback
from typing import Mapping, Sequence

from fp16_sdk import __version__, contract
from fp16_sdk.errors import ConfigError, SDKError
from fp16_sdk.toolkit import lifeline
from fp16_sdk.toolkit.code import install_commands, prepare_code
from fp16_sdk.toolkit.env import (JobConfig, Paths, build_env, count_cpus, count_gpus,
                                  seconds_setting)
from fp16_sdk.toolkit.launcher import build_plan, distribution_enabled, wait_for_hosts
from fp16_sdk.toolkit.passable import shown, unpassable
from fp16_sdk.toolkit.process import (DEFAULT_GRACE_S, become_subreaper, run_process,
                                      watch_lifeline)
from fp16_sdk.toolkit.stops import StopSignals, Stopped
from fp16_sdk.toolkit.report import display, failure_text, result_failure, setup_failure

__all__ = ["main", "run_training", "failure_text", "SETTLE_S"]

SETTLE_S = 5.0  # at most this (and a third of the grace) for torchrun to finish after its workers

def _say(message: str) -> None:
    print(f"[toolkit] {message}", flush=True)


def _fail(paths: Paths, text: str) -> int:
    paths.output.mkdir(parents=True, exist_ok=True)
    failure = paths.output / "failure"
    if not failure.exists():  # a failure file the script wrote itself explains more: keep it
        failure.write_text(text)
    sys.stderr.write(text)
    sys.stderr.flush()
    return 1


def _install(paths: Paths, env: Mapping[str, str], stops: StopSignals) -> str | None:
    """Run the requirements.txt / setup.py installs; the failure text, or None when all pass."""
    for step in install_commands(paths.code):
        _say(f"installing {step.what}: {display(step.argv)}")
        try:
            result = run_process(step.argv, env=env, cwd=paths.code, stops=stops)
        except (OSError, ValueError) as exc:
            return _launch_failure(exc, step.argv)
        if result.exit_code != 0:
            return result_failure(result, step.argv, grace_s=DEFAULT_GRACE_S)
    return None


def run_training(environ: Mapping[str, str], *, stops: StopSignals | None = None) -> int:
    """Run one training job on this host.

    Args:
        environ: the toolkit's environment (os.environ in the container).
        stops: the toolkit's stop signals, installed by `main` for the toolkit's whole life
            (None: a fresh, uninstalled one; the caller handles signals).

    Returns:
        The toolkit's exit status: 0 success, 1 failure, 128+N when stopped by signal N.
    """
    stops = stops if stops is not None else StopSignals()
    paths = Paths.from_environ(environ)
    start = time.monotonic()
    _say(f"fp16_sdk {__version__} training toolkit, base dir {paths.base}")
    stops.raise_when_idle = True  # a stop while setting up ends the setup at once
    try:
        if stops.received is not None:
            raise Stopped(stops.received)
        setup = _set_up(paths, environ)
    except Stopped as exc:
        stops.raise_when_idle = False
        return _stopped_before_start(paths, exc.signum, stops.at)
    except Exception as exc:  # noqa: BLE001 - any setup error must end in a failure file
        stops.raise_when_idle = False
        expected = isinstance(exc, (SDKError, OSError))
        detail = "" if expected else "\n" + traceback.format_exc()
        return _fail(paths, setup_failure(f"{type(exc).__name__}: {exc}", detail))
    stops.raise_when_idle = False  # from here on a stop is forwarded, or only remembered
    config, plan, child_env, grace_s = setup

    # exec would fail (ValueError, E2BIG) with nothing to say which hyperparameter is the cause
    problem = unpassable(plan.argv, child_env, hyperparameters=config.user_hyperparameters)
    if problem is not None:
        return _fail(paths, setup_failure(f"ConfigError: {problem}"))
    failed = _install(paths, child_env, stops)
    if failed is not None:
        code = _fail(paths, failed)
        return code if stops.received is None else 128 + stops.received
    for note in plan.notes:
        _say(note)
    _say(f"host {config.current_host} ({config.hosts.index(config.current_host) + 1}/"
         f"{len(config.hosts)}), {plan.nproc_per_node} process(es), "
         f"{'torchrun' if plan.distributed else 'direct'}: {display(plan.argv)}")
    if stops.received is not None:
        return _stopped_before_start(paths, stops.received, stops.at)
    try:
        result = run_process(plan.argv, env=child_env, cwd=paths.code, grace_s=grace_s,
                             stops=stops, settle_s=min(SETTLE_S, grace_s / 3)
                             if plan.distributed else 0.0)
    except (OSError, ValueError) as exc:  # exec refused it: no process ran
        return _fail(paths, _launch_failure(exc, plan.argv))
    return _settle(paths, result, plan.argv, grace_s=grace_s, elapsed=time.monotonic() - start)


def _settle(paths: Paths, result, argv: Sequence[str], *, grace_s: float,
            elapsed: float) -> int:
    """Write exactly one of output/success and output/failure for the training command's
    result; the toolkit's exit status."""
    if result.stopped_by is not None and result.exit_code != 0:
        _fail(paths, result_failure(result, argv, grace_s=grace_s))
        _say(f"stopped by signal {result.stopped_by} after {elapsed:.1f}s")
        return 128 + result.stopped_by
    if result.exit_code != 0:
        _say(f"training failed with exit code {result.exit_code} after {elapsed:.1f}s")
        return _fail(paths, result_failure(result, argv, grace_s=grace_s))
    _succeed(paths)
    _say(f"training succeeded in {elapsed:.1f}s")
    return 0


def _set_up(paths: Paths, environ: Mapping[str, str]):
    """Folders, config, code, the rendezvous host, the plan and the child's environment.

    Returns:
        (config, plan, child_env, grace_s).
    """
    paths.make_output_dirs()
    for stale in ("success", "failure"):  # left by an earlier run in the same tree
        (paths.output / stale).unlink(missing_ok=True)
    config = JobConfig.read(paths)
    _say(prepare_code(config.hyperparameters.get("sagemaker_submit_directory"),
                      paths.code, environ=environ))
    if len(config.hosts) > 1 and distribution_enabled(config.hyperparameters):
        # torchrun's rendezvous needs only the master's address; waiting for every host
        # would hang on a host whose container already finished and left the network DNS.
        wait_for_hosts(config.hosts[:1], environ)
    grace_s = _grace_s(environ)
    num_gpus = count_gpus(environ)
    plan = build_plan(config, code_dir=paths.code, num_gpus=num_gpus, environ=environ)
    sm_env = build_env(config, paths=paths, num_cpus=count_cpus(), num_gpus=num_gpus,
                       environ=environ, master_addr=plan.env_updates["MASTER_ADDR"],
                       master_port=int(plan.env_updates["MASTER_PORT"]))
    child_env = dict(environ)
    # The user's own environment= wins for NCCL knobs (SageMaker overwrites them; we don't).
    for name in ("NCCL_DEBUG", "NCCL_SOCKET_IFNAME"):
        if name in environ:
            sm_env.pop(name)
    child_env.update(sm_env)
    child_env.update(plan.env_updates)
    child_env["PYTHONUNBUFFERED"] = "1"
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(paths.code), environ.get("PYTHONPATH", "")) if p)
    return config, plan, child_env, grace_s


_E2BIG_FIX = ("; an argument or environment value is too long for Linux: pass large "
              "hyperparameter values through a file (in source_dir or an input channel)")


def _launch_failure(exc: BaseException, argv: Sequence[str]) -> str:
    """The failure file of a command that could not be started at all."""
    too_big = isinstance(exc, OSError) and exc.errno == errno.E2BIG
    lines = contract.failure_header(exit_code=1, failed_at=time.time())
    return "\n".join([*lines, f"Command: {display(argv)[:400]}",
                      f"ErrorMessage: the command could not be started: "
                      f"{type(exc).__name__}: {exc}{_E2BIG_FIX if too_big else ''}"]) + "\n"


def _succeed(paths: Paths) -> None:
    """Write output/success (the training command exited 0)."""
    (paths.output / "success").write_text("")


def _stopped_before_start(paths: Paths, signum: int, at: float | None) -> int:
    name = signal.Signals(signum).name
    lines = contract.failure_header(exit_code=128 + signum, failed_at=at or time.time(),
                                    signal=signum)
    _fail(paths, "\n".join([*lines, "Command: train", f"ErrorMessage: the toolkit received "
                                                      f"{name} before the training command "
                                                      "started (the job was stopped)"]) + "\n")
    _say(f"stopped by {name} before the training started")
    return 128 + signum


def _grace_s(environ: Mapping[str, str]) -> float:
    """FP16_SDK_STOP_GRACE_S (a number >= 0), else DEFAULT_GRACE_S."""
    grace = seconds_setting(environ, contract.STOP_GRACE_VAR, zero_allowed=True)
    return DEFAULT_GRACE_S if grace is None else grace


def _lifeline_fd(environ: Mapping[str, str]) -> int | None:
    """FP16_SDK_LIFELINE_FD as an open descriptor number, or None when unset.

    Raises:
        ConfigError: not an open file descriptor.
    """
    text = environ.get(contract.LIFELINE_FD_VAR)
    if text is None:
        return None
    if not text.isdigit():
        raise ConfigError(f"FP16_SDK_LIFELINE_FD must be a file descriptor number, got "
                          f"{shown(text)}", key="FP16_SDK_LIFELINE_FD")
    try:
        os.fstat(int(text))
    except OSError as exc:
        raise ConfigError(f"FP16_SDK_LIFELINE_FD={text} is not an open descriptor ({exc}); the "
                          "local backend passes it, unset it to run the toolkit by hand",
                          key="FP16_SDK_LIFELINE_FD", value=text) from exc
    return int(text)


def main(argv: Sequence[str] | None = None) -> None:
    """Console script `train` (the argument SageMaker passes to the image is ignored)."""
    del argv
    stops = StopSignals()
    stops.install()  # for the toolkit's whole life: no stop signal is ever lost (see stops)
    try:
        fd = _lifeline_fd(os.environ)
        lifeline.start(os.environ)  # local Docker: the SDK's FIFO and max_run
    except ConfigError as exc:
        sys.exit(_fail(Paths.from_environ(os.environ), setup_failure(f"ConfigError: {exc}")))
    become_subreaper()  # orphaned workers stay in our tree (a no-op outside Linux)
    if fd is not None:
        watch_lifeline(fd)
    sys.exit(run_training(os.environ, stops=stops))
