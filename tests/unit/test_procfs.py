"""fp16_sdk.procfs.read_stat against the kernel's own line and hand-written odd ones."""

import os

from fp16_sdk.procfs import read_stat


def test_this_process_stat_matches_os():
    stat = read_stat(f"/proc/{os.getpid()}/stat")
    assert stat is not None
    assert stat.ppid == os.getppid()
    assert stat.state == "R"  # it is running: it is reading its own line
    with open(f"/proc/{os.getpid()}/comm") as f:
        assert stat.comm == f.read().rstrip("\n")


def test_a_name_with_spaces_and_parentheses(tmp_path):
    path = tmp_path / "stat"
    path.write_text("4242 (a ) b) (c) S 17 4242 4242 0 -1\n")
    assert tuple(read_stat(str(path))) == ("a ) b) (c", "S", 17, None)  # no start time
    fields = " ".join(str(n) for n in range(5, 23))  # fields 5..22 hold their number
    path.write_text(f"4242 (a ) b) (c) S 17 {fields}\n")
    assert read_stat(str(path)).start_time == 22


def test_missing_or_truncated_lines_read_as_none(tmp_path):
    assert read_stat(str(tmp_path / "gone")) is None
    (tmp_path / "short").write_text("1 (x)")
    assert read_stat(str(tmp_path / "short")) is None
