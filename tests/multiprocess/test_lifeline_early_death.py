"""A local Docker job whose SDK dies before the toolkit reads its lifeline still stops.

Issue 42 (T4-6): the SDK writes one byte into each host's FIFO and holds it; the toolkit in
the container reads that byte, then waits for end of file. A whole-tree SIGKILL within about a
second of the containers starting (the SDK and its watchdog gone before the toolkit opened the
FIFO) took the byte with the last holder, and the toolkit read end of file first: taken for a
FIFO of another kernel (Docker Desktop's VM), the job ran on until max_run (24 h by default).

Here the SDK side (`HostLifelines`) runs in a real process that is SIGKILLed before the
toolkit's watcher (`fp16_sdk.toolkit.lifeline`, in another real process, as in the container:
the FIFO's folder is what the container sees at /run/fp16_sdk) opens the FIFO. The watcher must
stop its toolkit (SIGTERM to itself); with a boot id of another kernel beside the FIFO (the VM
case) it must leave the job to max_run, as before.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from fp16_sdk import contract
from fp16_sdk.backends import local_lifeline
from fp16_sdk.toolkit import lifeline
from helpers.paths import REPO

SDK = """
import sys, time
from pathlib import Path
from fp16_sdk.backends.local_lifeline import HostLifelines
HostLifelines(Path(sys.argv[1]), ["algo-1"])
print("held", flush=True)
time.sleep(3600)
"""

WATCHER = """
import os, signal, sys, time
from fp16_sdk.toolkit import lifeline
signal.signal(signal.SIGTERM, lambda *_: (print("STOPPED", flush=True), os._exit(0)))
lifeline.start({sys.argv[1]: sys.argv[2]})
time.sleep(2)
print("STILL RUNNING", flush=True)
"""


def _dead_sdks_fifo(folder: Path) -> Path:
    sdk = subprocess.Popen([sys.executable, "-c", SDK, str(folder)], cwd=REPO,
                           stdout=subprocess.PIPE, text=True)
    assert sdk.stdout.readline().strip() == "held"
    sdk.send_signal(signal.SIGKILL)  # nothing of it runs: no cleanup, the FIFO stays
    sdk.wait()
    return folder / "algo-1" / "sdk"


def _watch(fifo: Path) -> str:
    done = subprocess.run([sys.executable, "-c", WATCHER, contract.LIFELINE_PATH_VAR, str(fifo)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    return done.stdout


def test_an_sdk_dead_before_the_toolkit_read_its_lifeline_stops_the_job(tmp_path):
    fifo = _dead_sdks_fifo(tmp_path / "lifelines")
    out = _watch(fifo)
    assert "STOPPED" in out and "SDK process that started this job is gone" in out, out


def test_a_lifeline_made_in_another_kernel_is_left_to_max_run(tmp_path):
    fifo = _dead_sdks_fifo(tmp_path / "lifelines")
    (fifo.parent / local_lifeline.KERNEL_NAME).write_text("another-kernels-boot-id\n")
    out = _watch(fifo)
    assert "STILL RUNNING" in out and "another kernel" in out, out


def test_both_sides_name_the_same_file():
    assert lifeline.KERNEL_NAME == local_lifeline.KERNEL_NAME
