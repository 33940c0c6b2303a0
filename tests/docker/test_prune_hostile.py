"""`prune` takes a job only on evidence every user can read, and never on one label alone.

Issue 42: under a /proc mounted with `hidepid` another user's processes have no entry, and
prune took a live SDK of another user for dead (T4-2); one network labelled with a live job's
name and a dead SDK's label made prune remove the live job's containers (T4-7).

- A real `hidepid=invisible` /proc (a private mount namespace), read by a process of another
  user (uid 65534) as the prune does: a live process it cannot see is not gone, one that ended
  is. Needs root and CAP_SYS_ADMIN (unshare, mount, setpriv): skipped elsewhere.
- The same decision against a /proc copy shaped like a hidepid one (`procfs.PROC`): runs
  everywhere.
- A container of a live job plus a forged network naming that job and a dead SDK: prune on
  the real engine leaves the container (and says why), and still removes a job whose every
  resource names the dead SDK.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from fp16_sdk import procfs
from fp16_sdk.backends.local_docker import job as local_docker_job
from fp16_sdk.backends.local_docker import reaper as local_docker_reaper
from helpers.docker_engine import IMAGE
from helpers.docker_engine import client  # noqa: F401 - the fixture
from helpers.paths import REPO

LABEL_JOB, LABEL_SDK = local_docker_job.LABEL_JOB, local_docker_reaper.LABEL_SDK


def _owner(pid: int) -> str:
    """The LABEL_SDK value naming live process `pid` (read while it is visible)."""
    me = local_docker_reaper.sdk_label()[LABEL_SDK]
    start = procfs.read_stat(f"/proc/{pid}/stat").start_time
    return "/".join(me.split("/")[:2] + [str(pid), str(start)])


def _ended_owner() -> str:
    proc = subprocess.Popen(["sleep", "30"])
    owner = _owner(proc.pid)
    proc.kill()
    proc.wait()
    return owner


def _hidepid_possible() -> str | None:
    if os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("setpriv")):
        return "needs root, unshare and setpriv"
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            "mount -t proc -o hidepid=invisible proc /proc"],
                           capture_output=True, text=True)
    return None if probe.returncode == 0 else f"cannot mount a hidepid /proc: {probe.stderr}"


_AS_OTHER_USER = """
import sys
from fp16_sdk.backends.local_docker import reaper as r
print(" ".join(str(r.sdk_gone(o)) for o in sys.argv[1:]))
"""


@pytest.mark.docker
def test_a_real_hidepid_proc_never_makes_a_live_sdk_of_another_user_look_dead(tmp_path):
    why_not = _hidepid_possible()
    if why_not:
        pytest.skip(why_not)
    python = "/usr/bin/python3"  # readable by uid 65534, unlike a Python under /root
    if not os.access(python, os.X_OK):
        pytest.skip(f"{python} is missing")
    live = subprocess.Popen(["sleep", "60"])  # root's: hidden from uid 65534 under hidepid
    try:
        owners = [_owner(live.pid), _ended_owner()]
        inner = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "env",
                 f"PYTHONPATH={REPO}", python, "-c", _AS_OTHER_USER, *owners]
        done = subprocess.run(
            ["unshare", "-m", "--propagation", "private", "sh", "-c",
             'mount -t proc -o hidepid=invisible proc /proc && exec "$@"', "sh", *inner],
            capture_output=True, text=True, timeout=60, cwd="/")
    finally:
        live.kill()
        live.wait()
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"], done.stdout  # live: kept; ended: gone


def _hidepid_shaped(root: Path, visible: list[int]) -> Path:
    """A /proc copy where only `visible` pids have an entry (what hidepid shows a user)."""
    (root / "sys/kernel/random").mkdir(parents=True)
    shutil.copy("/proc/sys/kernel/random/boot_id", root / "sys/kernel/random/boot_id")
    (root / "self/ns").mkdir(parents=True)
    os.symlink(os.readlink("/proc/self/ns/pid"), root / "self/ns/pid")
    for pid in visible:
        (root / str(pid)).mkdir()
        shutil.copy(f"/proc/{pid}/stat", root / str(pid) / "stat")
    return root


@pytest.mark.docker
def test_a_hidepid_shaped_proc_decides_from_what_every_user_can_read(tmp_path, monkeypatch):
    hidden = subprocess.Popen(["sleep", "60"])
    try:
        owners = {"hidden-live": _owner(hidden.pid), "hidden-ended": _ended_owner(),
                  "visible-live": local_docker_reaper.sdk_label()[LABEL_SDK]}
        me = owners["visible-live"].split("/")
        reused = "/".join(me[:3] + [str(int(me[3]) + 1)])  # this pid, another start time
        monkeypatch.setattr(procfs, "PROC", str(_hidepid_shaped(tmp_path / "proc",
                                                                [os.getpid()])))
        assert not local_docker_reaper.sdk_gone(owners["hidden-live"])
        assert local_docker_reaper.sdk_gone(owners["hidden-ended"])
        assert not local_docker_reaper.sdk_gone(owners["visible-live"])
        assert local_docker_reaper.sdk_gone(reused)
        # A forged pid no kernel has (os.kill raised OverflowError and stopped every prune)
        for pid in ("0", "99999999999999999999"):
            assert not local_docker_reaper.sdk_gone("/".join(me[:2] + [pid, "5"])), pid
    finally:
        hidden.kill()
        hidden.wait()


def _labelled(client, job: str) -> list[str]:
    found = {"label": f"{LABEL_JOB}={job}"}
    return sorted([c.name for c in client.containers.list(all=True, filters=found)]
                  + [n.name for n in client.networks.list(filters=found)])


def _remove(client, job: str) -> None:
    found = {"label": f"{LABEL_JOB}={job}"}
    for c in client.containers.list(all=True, filters=found):
        c.remove(force=True)
    for n in client.networks.list(filters=found):
        n.remove()


@pytest.mark.docker
def test_a_forged_network_does_not_make_prune_remove_a_live_jobs_container(client, caplog):
    live, dead = local_docker_reaper.sdk_label()[LABEL_SDK], _ended_owner()
    victim, orphan = (f"hostile-{uuid.uuid4().hex[:10]}" for _ in range(2))
    try:
        client.containers.create(IMAGE, ["true"], name=f"fp16-sdk-{victim}",
                                 labels={LABEL_JOB: victim, LABEL_SDK: live})
        client.networks.create(f"fp16-sdk-{victim}-forged",
                               labels={LABEL_JOB: victim, LABEL_SDK: dead})
        client.networks.create(f"fp16-sdk-{orphan}", labels={LABEL_JOB: orphan, LABEL_SDK: dead})
        with caplog.at_level("INFO", logger=local_docker_reaper.__name__):
            gone = local_docker_reaper.prune(client, grace=1)
        assert _labelled(client, victim) == [f"fp16-sdk-{victim}", f"fp16-sdk-{victim}-forged"]
        assert f"left job {victim} alone" in caplog.text
        assert gone == [f"fp16-sdk-{orphan}"] and not _labelled(client, orphan)
    finally:
        _remove(client, victim)
        _remove(client, orphan)
