"""Commands that exec cannot start (issue 35 item 5): the toolkit writes a failure file that
names the cause and the fix, never a bare traceback. Real toolkit runs; the limits are the
kernel's own (MAX_ARG_STRLEN, ARG_MAX)."""

from __future__ import annotations


from fp16_sdk.toolkit.passable import MAX_ARG_STRLEN, arg_max, unpassable
from helpers.toolkit_jobs import make_job, run_toolkit


def test_a_200000_character_hyperparameter_ends_in_a_failure_that_names_it(tmp_path):
    base = make_job(tmp_path, {"train.py": "print('never')\n"},
                    {"big": "x" * 200_000, "lr": 0.1})
    proc = run_toolkit(base)
    assert proc.returncode == 1 and "never" not in proc.stdout
    assert "Traceback" not in proc.stderr and "Argument list too long" not in proc.stderr
    text = (base / "output" / "failure").read_text()
    head = text[:1024]  # what SageMaker shows as FailureReason
    assert head.startswith("ExitCode 1\n")
    assert "Too long: hyperparameter 'big' (200000 characters)" in head
    assert f"({MAX_ARG_STRLEN} bytes, MAX_ARG_STRLEN)" in head
    assert "pass large values through a file" in head
    assert len(text) < 4000  # the value itself is not echoed


def test_values_that_only_overflow_together_are_named_too(tmp_path):
    """Two 70,000-character values pass one by one, but SM_HPS, SM_USER_ARGS and
    SM_TRAINING_ENV hold both: the same refusal, before anything starts (a single 100,000-
    character value, by contrast, starts: every string holds it once)."""
    base = make_job(tmp_path, {"train.py": "print('never')\n"},
                    {"notes": "y" * 70_000, "more": "w" * 70_001})
    proc = run_toolkit(base)
    text = (base / "output" / "failure").read_text()
    assert proc.returncode == 1 and "never" not in proc.stdout, proc.stderr[-2000:]
    assert "variable SM_HPS" in text and "variable SM_TRAINING_ENV" in text
    assert "hyperparameter 'more' (70001 characters), 'notes' (70000 characters)" in text


def test_a_100000_character_value_is_passed_to_the_script(tmp_path):
    script = ("import os, sys\nassert sys.argv[1:] == ['--big', 'v' * 100000]\n"
              "assert os.environ['SM_HP_BIG'] == 'v' * 100000\nprint('got it')\n")
    base = make_job(tmp_path, {"train.py": script}, {"big": "v" * 100_000})
    proc = run_toolkit(base)
    assert proc.returncode == 0 and "got it" in proc.stdout, proc.stderr[-2000:]


def test_unpassable_checks_the_total_against_arg_max():
    """Every string under MAX_ARG_STRLEN, together over ARG_MAX (pure: no process)."""
    chunk = "z" * (MAX_ARG_STRLEN // 2)
    env = {f"V{i}": chunk for i in range(arg_max() // len(chunk) + 2)}
    problem = unpassable(["python", "train.py"], env)
    assert problem is not None and "ARG_MAX" in problem and "z" * 20 not in problem
    assert unpassable(["python", "train.py"], {"A": chunk}) is None
    assert unpassable(["python", "x" * MAX_ARG_STRLEN], {}) is not None
    assert unpassable(["python", "x" * (MAX_ARG_STRLEN - 1)], {}) is None  # NUL makes 128 KiB


def test_a_secret_value_with_a_nul_is_named_by_variable_and_length_only(tmp_path):
    base = make_job(tmp_path, {"train.py": "print('never')\n"},
                    {"token": "secret-7c1e" + "\x00" + "q" * 100})
    proc = run_toolkit(base)
    text = (base / "output" / "failure").read_text()
    assert proc.returncode == 1
    assert "environment variable 'SM_HP_TOKEN' (112 characters)" in text
    assert "secret-7c1e" not in text and "secret-7c1e" not in proc.stdout + proc.stderr


def test_an_over_long_toolkit_setting_is_named_by_its_length_only(tmp_path):
    base = make_job(tmp_path, {"train.py": "print('never')\n"}, {})
    proc = run_toolkit(base, FP16_SDK_STOP_GRACE_S="9" * 30 + "secret" + "9" * 300)
    text = (base / "output" / "failure").read_text()
    assert proc.returncode == 1
    assert "FP16_SDK_STOP_GRACE_S must be a number of seconds >= 0, got a value of 336 " \
           "characters" in text
    assert "secret" not in text + proc.stdout + proc.stderr
