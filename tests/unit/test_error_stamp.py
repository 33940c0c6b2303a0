"""Which traceback in a command's stderr is its error, and whether the command went on after it
(issue 42, T4-5): the pure part of the toolkit's stderr pump (toolkit/process.py) over lines
as real runs print them."""

from __future__ import annotations

from fp16_sdk.toolkit import process, report

FATAL = ["Traceback (most recent call last):", '  File "train.py", line 3, in <module>',
         "[rank0]: ValueError: boom"]
HANDLED = ["Traceback (most recent call last):", '  File "train.py", line 5, in <module>',
           "ConnectionError: a retried download"]
TEARDOWN = ["[rank0]:[W1206 10:00:00.123 ProcessGroupGloo.cpp:1] Warning: destroyed late",
            "W1206 08:21:49.123000 140 torch/distributed/elastic/multiprocessing/api.py:897] "
            "Sending process 141 closing signal SIGTERM",
            "/usr/lib/python3/x.py:3: UserWarning: something", ""]
PEER = ["Traceback (most recent call last):", '  File "train.py", line 4, in <module>',
        "[rank1]: RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer"]
LAUNCHER = ["Traceback (most recent call last):", '  File "run.py", line 9, in <module>',
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: "]


def _stamp(*blocks: list[str], stop_after: int | None = None) -> tuple[int | None, bool]:
    """(index of the traceback taken as the error, went on) for the lines of `blocks`."""
    tracebacks: list[list] = []
    lines = [line for block in blocks for line in block]
    for i, line in enumerate(lines):
        process._note_error(line, tracebacks, stopped=stop_after is not None and i >= stop_after)
    for n, entry in enumerate(tracebacks):
        entry[0] = n  # stand-in times: the traceback's index
    return process._error(tracebacks)


def test_the_last_traceback_not_the_launchers_is_the_error():
    assert _stamp(HANDLED, ["training on"], FATAL) == (1, False)
    assert _stamp(FATAL, LAUNCHER) == (0, False)


def test_a_ranks_reaction_to_its_lost_peer_is_not_the_hosts_error():
    """rank 0 raised; rank 1 of the same host then failed on the lost connection: the host's
    error is rank 0's (the failure file names it), as it was before rank 1's came."""
    assert _stamp(FATAL, PEER, LAUNCHER) == (0, False)
    assert _stamp(PEER, LAUNCHER) == (0, False)  # only a reaction: that is what there is
    assert _stamp(LAUNCHER) == (None, False)


def test_runtime_warnings_after_a_fatal_traceback_are_not_going_on():
    assert _stamp(FATAL, TEARDOWN) == (0, False)


def test_the_scripts_own_output_after_a_traceback_is_going_on_until_the_stop():
    assert _stamp(HANDLED, ["epoch 2, loss 1.5"]) == (0, True)
    stop = len(HANDLED)  # output that comes after the stop does not count
    assert _stamp(HANDLED, ["terminated, saving"], stop_after=stop) == (0, False)


def test_the_failure_file_names_the_same_error_as_the_stamp():
    text = report.failure_text(1, ["torchrun", "train.py"], FATAL + PEER + LAUNCHER)
    assert "ErrorMessage: ValueError: boom" in text, text
    text = report.failure_text(1, ["torchrun", "train.py"], HANDLED + ["training on"] + FATAL)
    assert "ErrorMessage: ValueError: boom" in text, text
