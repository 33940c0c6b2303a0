"""Shared test hygiene.

- Every test module starts without a leftover smp runtime or process group.
- The session leaves no process, container or Docker network behind. At the start it records
  what already exists and puts a session marker in the environment that every child inherits;
  at the end, whatever it started that still runs ten seconds later is killed, listed, and the
  run fails (exit status 1) even when every test passed.

"What the session started": new processes (pid and start time not in the first snapshot) that
descend from this pytest process, carry the marker, run a file of this checkout's tests/ or
fp16_sdk/, or run in or from the session's temporary folder (a test that builds its environment
from scratch loses the marker). A process that merely has the checkout as its working directory
(a developer's shell) is not counted. Not counted: multiprocessing's resource tracker and forkserver, which
exit when this process does (they watch a pipe from it). Containers and networks: the ones
labelled `fp16_sdk.job`, and those of the test Slurm cluster this session addresses (labelled
`fp16_sdk.slurm=<FP16_SDK_SLURM_NAME>`, see .ci/slurm-cluster.sh), that were not there at the
start and that this session made (`_made_here`: a job of this process, one whose containers
mount the session's temporary folder, the Slurm cluster if this session's fixture started it).
Other sessions on the same engine (parallel developers) start jobs and clusters all the time:
removing theirs would SIGKILL another session's running job (exit 137, "killed with SIGKILL").
Without a reachable engine that part is skipped, the Docker tests say why. The slurm_cluster
fixture removes a cluster it started before this check runs, so one found here means that
teardown did not happen.
"""

from __future__ import annotations

import os
import signal
import sys
import uuid
from pathlib import Path

import pytest

from helpers.paths import REPO, TESTS
from helpers.procs import Proc, descendants_of, kill_all, scan, wait_gone

SESSION_VAR = "FP16_SDK_TEST_SESSION"
LEAK_WAIT_S = 10.0  # the promptness bound: a job's processes are gone within 10 s
_BOUND_TO_US = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
_LABEL = "fp16_sdk.job"
# The test Slurm cluster's label and default name, as in .ci/slurm-cluster.sh: only the cluster
# this session can start counts (another name on the same engine is someone else's).
_SLURM_LABEL = f"fp16_sdk.slurm={os.environ.get('FP16_SDK_SLURM_NAME') or 'fp16-slurm'}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tier folders and the markers agree (CI's Docker rule and `make test-fast` select by
    marker, the folders show the tiers): a test is marked `slurm` exactly when it is in
    tests/slurm, and every file in tests/docker has a test marked `docker` (a file there may
    also test the backend's logic without an engine)."""
    wrong, docker_files = [], {}
    for item in items:
        if not item.path.is_relative_to(TESTS):
            continue
        tier = item.path.relative_to(TESTS).parts[0]
        marks = {m.name for m in item.iter_markers()}
        if tier == "slurm" and "slurm" not in marks:
            wrong.append(f"{item.nodeid}: in tests/slurm but not marked slurm")
        elif tier != "slurm" and "slurm" in marks:
            wrong.append(f"{item.nodeid}: marked slurm outside tests/slurm")
        if tier == "docker":
            docker_files[item.path] = docker_files.get(item.path, False) or "docker" in marks
    wrong += [f"{path.relative_to(TESTS.parent)}: in tests/docker but no test of it is marked "
              "docker" for path, marked in docker_files.items() if not marked]
    if wrong:
        raise pytest.UsageError("test tiers and markers disagree (move the file or fix its "
                                "marks):\n" + "\n".join(wrong))


@pytest.fixture(autouse=True, scope="module")
def _fresh_runtime():
    yield
    # Only when a test touched torch.distributed: the SDK tests must not import torch.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    smp_state = sys.modules.get("fp16_sdk.modelparallel.torch.state")
    if smp_state is not None:
        smp_state.state.reset()


# ---- the leak check -------------------------------------------------------------------------

def _under(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r + "/") for r in roots)


def _mentions(proc: Proc, roots: tuple[str, ...]) -> bool:
    """Runs in the session's temporary folder, or runs a file of it or of this checkout's tests /
    package (a process merely sitting in the checkout, a developer's shell, is not counted)."""
    tmp = roots[-1:]
    return _under(proc.cwd, tmp) or any(_under(word, roots) for word in proc.cmdline.split())


def _session_processes(session: pytest.Session) -> list[Proc]:
    baseline, marker, roots = session.stash[_BASELINE], session.stash[_MARKER], session.stash[_ROOTS]
    procs = [p for p in scan() if p.key not in baseline]
    below = {p.key for p in descendants_of(os.getpid(), procs)}
    return [p for p in procs
            if (p.key in below or marker in p.environ or _mentions(p, roots))
            and not any(name in p.cmdline for name in _BOUND_TO_US)]


def _docker_client():
    try:
        import docker
        client = docker.from_env(timeout=10)
        client.ping()
        return client
    except Exception:  # noqa: BLE001 - no SDK, no engine: nothing of ours can exist there
        return None


def _docker_resources(client) -> dict[str, tuple[str, object]]:
    """id -> (kind, resource) for every container and network carrying a job's label or this
    session's Slurm cluster label."""
    found = {}
    for label in (_LABEL, _SLURM_LABEL):
        found.update({c.id: ("container", c)
                      for c in client.containers.list(all=True, filters={"label": label})})
        found.update({n.id: ("network", n)
                      for n in client.networks.list(filters={"label": label})})
    return found


def _made_here(resources: list[tuple[str, object]], tmp: Path) -> list[tuple[str, object]]:
    """The resources this session made: the Slurm cluster's if its fixture started it
    (`helpers.slurm_cluster.started_here`); a job's whose SDK process
    (label `fp16_sdk.sdk`) is this one; a container mounting a folder under the session's
    temporary folder `tmp` (a fit() in a child process, a test's own container); a job's network
    whose job has such a container or a folder under `tmp` (output_path/<job>)."""
    from fp16_sdk.backends.local_docker.reaper import LABEL_SDK, sdk_label

    me, root = sdk_label().get(LABEL_SDK), str(tmp)
    slurm = getattr(sys.modules.get("helpers.slurm_cluster"), "started_here", False)

    def labels(res) -> dict:
        return res.attrs.get("Labels") or res.attrs.get("Config", {}).get("Labels") or {}

    def mine(kind: str, res) -> bool:
        found = labels(res)
        key, name = _SLURM_LABEL.split("=", 1)
        if (found.get(key) == name and slurm) or (me and found.get(LABEL_SDK) == me):
            return True
        return kind == "container" and any(
            _under(m.get("Source") or "", (root,)) for m in res.attrs.get("Mounts") or [])

    ours = [(kind, res) for kind, res in resources if mine(kind, res)]
    jobs = {labels(res).get(_LABEL) for kind, res in ours}
    ours += [(kind, res) for kind, res in resources
             if kind == "network" and (kind, res) not in ours and labels(res).get(_LABEL)
             and (labels(res)[_LABEL] in jobs or next(tmp.glob(f"**/{labels(res)[_LABEL]}"),
                                                      None) is not None)]
    return ours


_BASELINE = pytest.StashKey[set]()
_MARKER = pytest.StashKey[bytes]()
_ROOTS = pytest.StashKey[tuple]()
_DOCKER = pytest.StashKey[tuple]()


def pytest_sessionstart(session: pytest.Session) -> None:
    # A suite started as a background job of a non-interactive shell inherits SIGINT ignored
    # (POSIX), and so would every fit() it starts: the Ctrl-C tests would then test nothing.
    # Ctrl-C is what they simulate, so the session restores Python's own handler.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    token = uuid.uuid4().hex
    os.environ[SESSION_VAR] = token
    # A worker that dies of a signal (SIGABRT, SIGSEGV) prints every Python thread's stack, so a
    # crash inside torch shows where the script was (workers inherit the environment).
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")
    session.stash[_MARKER] = f"{SESSION_VAR}={token}".encode()
    session.stash[_BASELINE] = {p.key for p in scan()}
    basetemp = session.config._tmp_path_factory.getbasetemp()  # pytest's tmp_path root
    session.stash[_ROOTS] = (str(REPO / "tests"), str(REPO / "fp16_sdk"),
                             str(basetemp.resolve()))
    client = _docker_client()
    session.stash[_DOCKER] = (client, set(_docker_resources(client)) if client else set())


def _leaked_docker(session: pytest.Session) -> list[str]:
    """Remove the labelled containers and networks the session created; describe each."""
    client, before = session.stash[_DOCKER]
    if client is None:
        return []
    leaked = []
    new = [(kind, res) for rid, (kind, res) in _docker_resources(client).items()
           if rid not in before]
    new = _made_here(new, Path(session.stash[_ROOTS][2]))
    for kind, res in sorted(new, key=lambda kr: kr[0]):  # containers before their networks
        leaked.append(f"{kind} {res.name} ({res.id[:12]})")
        try:
            if kind == "container":
                res.remove(force=True)
            else:
                res.remove()
        except Exception as exc:  # noqa: BLE001 - report it, the run fails anyway
            leaked[-1] += f"; removing it failed: {exc}"
    return leaked


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    left = wait_gone(_session_processes(session), LEAK_WAIT_S)
    kill_all(left)
    lines = [f"process {p.pid} (parent {p.ppid}, cwd {p.cwd}): {p.cmdline[:300]}" for p in left]
    lines += _leaked_docker(session)
    if not lines:
        return
    lines.insert(0, f"LEAK: the test session left {len(lines)} thing(s) behind; killed or "
                    "removed now, and the run fails:")
    report = session.config.pluginmanager.get_plugin("terminalreporter")
    for line in lines:
        if report is not None:
            report.write_line(line, red=True)
        else:
            print(line, file=sys.stderr)
    if exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
