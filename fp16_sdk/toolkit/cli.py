"""`train`: the container's entry point (`docker run <image> train`).

Order of work, as in SageMaker's toolkit: read input/config, create the output folders, put
the code into /opt/ml/code and install its requirements, build the SM_* environment, launch
the script (directly, or through torchrun when a distribution is enabled), then write
`output/success` or `output/failure`.

Exit status: 0 on success. On failure the toolkit exits 1, as SageMaker's does; the real exit
code of the script is the first line of `output/failure` (`ExitCode N`). When the toolkit is
stopped by SIGTERM/SIGINT it exits 128 + the signal number after the tree is gone. A script
that exited 0 is a success even when a stop signal arrived afterwards: never a failure file.

Local backends pass two more variables (see `process` for why):
`FP16_SDK_LIFELINE_FD`, a pipe that reaches end of file when the SDK process dies (the
toolkit then stops its tree as on SIGTERM), and `FP16_SDK_STOP_GRACE_S`, the seconds between
SIGTERM and SIGKILL for the tree (default 30). Local Docker adds two (see `lifeline`).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
import time
import traceback
from typing import Mapping, Sequence

from fp16_sdk import __version__, contract
from fp16_sdk.errors import ConfigError, SDKError
from fp16_sdk.toolkit import lifeline
from fp16_sdk.toolkit.code import install_commands, prepare_code
from fp16_sdk.toolkit.env import JobConfig, Paths, build_env, count_cpus, count_gpus
from fp16_sdk.toolkit.launcher import build_plan, distribution_enabled, wait_for_hosts
from fp16_sdk.toolkit.process import (DEFAULT_GRACE_S, become_subreaper, run_process,
                                      watch_lifeline)

__all__ = ["main", "run_training", "failure_text"]

_OOM_HINT = ("The process was killed with SIGKILL (exit 137), most often by the kernel's "
             "out-of-memory killer: use a larger instance, a smaller batch, or more pipeline/"
             "tensor parallelism; in Docker also check the container memory and --shm-size.")
# torchrun's error summary for a worker killed by SIGKILL.
_WORKER_SIGKILL = re.compile(r"exitcode\s*:\s*-9\b|Signal 9 \(SIGKILL\)")
# "ValueError: ..." as Python prints it last in a traceback; torchrun's own ChildFailedError
# only says that a worker failed, so the worker's exception is preferred.
_EXCEPTION_LINE = re.compile(r"^[\w.]*(?:Error|Exception|Interrupt)(?::|$)")
# torch prefixes a worker's uncaught traceback with "[rankN]: " once its process group exists
# (every smp job), and torchrun's --tee with "[defaultN]:"; the exception line follows it.
_RANK_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:\s?")


def _say(message: str) -> None:
    print(f"[toolkit] {message}", flush=True)


def _display(argv: Sequence[str]) -> str:
    """The command as one line, for humans only (never executed)."""
    return shlex.join(argv)


def failure_text(exit_code: int, argv: Sequence[str], stderr_tail: Sequence[str]) -> str:
    """The failure file: `ExitCode N`, `Command: ...`, an `ErrorMessage:` line when the tail
    shows an exception (SageMaker shows only the first 1024 characters as FailureReason), an
    out-of-memory hint for SIGKILL, then the stderr tail."""
    lines = [f"ExitCode {exit_code}", f"Command: {_display(argv)}"]
    unprefixed = (_RANK_PREFIX.sub("", ln.strip()).strip() for ln in reversed(stderr_tail))
    error = next((ln for ln in unprefixed
                  if _EXCEPTION_LINE.match(ln) and "ChildFailedError" not in ln), None)
    if error:
        lines.append(f"ErrorMessage: {error}")
    if exit_code == 137 or any(_WORKER_SIGKILL.search(ln) for ln in stderr_tail):
        lines.append(_OOM_HINT)
    lines.append("")
    lines.extend(stderr_tail)
    return "\n".join(lines).rstrip("\n") + "\n"


def _fail(paths: Paths, text: str) -> int:
    paths.output.mkdir(parents=True, exist_ok=True)
    failure = paths.output / "failure"
    if not failure.exists():  # a failure file the script wrote itself explains more: keep it
        failure.write_text(text)
    sys.stderr.write(text)
    sys.stderr.flush()
    return 1


def _install(paths: Paths, env: Mapping[str, str]) -> str | None:
    """Run the requirements.txt / setup.py installs; the failure text, or None when all pass."""
    for step in install_commands(paths.code):
        _say(f"installing {step.what}: {_display(step.argv)}")
        result = run_process(step.argv, env=env, cwd=paths.code)
        if result.exit_code != 0:
            return failure_text(result.exit_code, step.argv, result.stderr_tail)
    return None


def run_training(environ: Mapping[str, str]) -> int:
    """Run one training job on this host.

    Args:
        environ: the toolkit's environment (os.environ in the container).

    Returns:
        The toolkit's exit status: 0 success, 1 failure, 128+N when stopped by signal N.
    """
    paths = Paths.from_environ(environ)
    start = time.monotonic()
    _say(f"fp16_sdk {__version__} training toolkit, base dir {paths.base}")
    try:
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
    except Exception as exc:  # noqa: BLE001 - any setup error must end in a failure file
        expected = isinstance(exc, (SDKError, OSError))
        detail = "" if expected else "\n" + traceback.format_exc()
        return _fail(paths, f"ExitCode 1\nCommand: train\nErrorMessage: "
                            f"{type(exc).__name__}: {exc}\n{detail}")

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

    problem = _unpassable(plan.argv, child_env)
    if problem is not None:  # exec would raise ValueError after we can no longer report it
        return _fail(paths, f"ExitCode 1\nCommand: train\nErrorMessage: ConfigError: {problem}\n")
    failed = _install(paths, child_env)
    if failed is not None:
        return _fail(paths, failed)
    for note in plan.notes:
        _say(note)
    _say(f"host {config.current_host} ({config.hosts.index(config.current_host) + 1}/"
         f"{len(config.hosts)}), {plan.nproc_per_node} process(es), "
         f"{'torchrun' if plan.distributed else 'direct'}: {_display(plan.argv)}")
    result = run_process(plan.argv, env=child_env, cwd=paths.code,
                         grace_s=grace_s)
    elapsed = time.monotonic() - start
    if result.stopped_by is not None and result.exit_code != 0:
        _fail(paths, failure_text(result.exit_code, plan.argv, result.stderr_tail))
        _say(f"stopped by signal {result.stopped_by} after {elapsed:.1f}s")
        return 128 + result.stopped_by
    if result.exit_code != 0:
        _say(f"training failed with exit code {result.exit_code} after {elapsed:.1f}s")
        return _fail(paths, failure_text(result.exit_code, plan.argv, result.stderr_tail))
    (paths.output / "success").write_text("")
    _say(f"training succeeded in {elapsed:.1f}s")
    return 0


def _unpassable(argv: Sequence[str], env: Mapping[str, str]) -> str | None:
    """Why `argv`/`env` cannot reach exec (a NUL anywhere, '=' in a name), or None."""
    for name, value in env.items():
        if not name or "=" in name or "\x00" in name or "\x00" in value:
            return (f"environment variable {name[:80]!r} (value {value[:40]!r}) cannot be "
                    "passed to the script: names must be non-empty without '=' or NUL and "
                    "values without NUL; rename the hyperparameter (SM_HP_<KEY>) or variable")
    for arg in argv:
        if "\x00" in arg:
            return (f"argument {arg[:80]!r} holds a NUL character, which no command line can "
                    "carry; remove it from the hyperparameter")
    return None


def _grace_s(environ: Mapping[str, str]) -> float:
    """FP16_SDK_STOP_GRACE_S, else DEFAULT_GRACE_S.

    Raises:
        ConfigError: not a number >= 0.
    """
    text = environ.get(contract.STOP_GRACE_VAR)
    if text is None:
        return DEFAULT_GRACE_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also refuses nan
        raise ConfigError(f"FP16_SDK_STOP_GRACE_S must be a number of seconds >= 0, got "
                          f"{text!r}", key="FP16_SDK_STOP_GRACE_S", value=text)
    return value


def _lifeline_fd(environ: Mapping[str, str]) -> int | None:
    """FP16_SDK_LIFELINE_FD as an open descriptor number, or None when unset.

    Raises:
        ConfigError: not an open file descriptor.
    """
    text = environ.get(contract.LIFELINE_FD_VAR)
    if text is None:
        return None
    if not text.isdigit():
        raise ConfigError(f"FP16_SDK_LIFELINE_FD must be a file descriptor number, got {text!r}",
                          key="FP16_SDK_LIFELINE_FD", value=text)
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
    try:
        fd = _lifeline_fd(os.environ)
        lifeline.start(os.environ)  # local Docker: the SDK's FIFO and max_run
    except ConfigError as exc:
        sys.exit(_fail(Paths.from_environ(os.environ),
                       f"ExitCode 1\nCommand: train\nErrorMessage: ConfigError: {exc}\n"))
    become_subreaper()  # orphaned workers stay in our tree (a no-op outside Linux)
    if fd is not None:
        watch_lifeline(fd)
    sys.exit(run_training(os.environ))
