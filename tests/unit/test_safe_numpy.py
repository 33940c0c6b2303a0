"""numpy values in checkpoint files are rebuilt as plain data, never by numpy's __setstate__.

The attack (issue 42, T4-1): numpy trusts a pickled dtype's code and flags, so a planted file
made numpy take 8 raw bytes of an "object" array as a PyObject pointer: `smp.load` of it
returned any live object whose address the file named, or crashed the process. The load runs
in a child process, so that the unfixed loader's crash would not take pytest with it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import smdistributed.modelparallel.torch as smp
from fp16_sdk.modelparallel.torch.checkpoint import safe_load
from helpers import forged_numpy
from helpers.paths import REPO, TESTS

_CHILD = textwrap.dedent("""
    import sys
    sys.path[:0] = [{repo!r}, {tests!r}]
    import smdistributed.modelparallel.torch as smp
    from helpers import forged_numpy
    secret = ["a live object the file must not reach"]
    path = sys.argv[1]
    open(path, "wb").write(forged_numpy.object_array_from(id(secret)))
    try:
        got = smp.load(path, partial=False)
    except smp.CheckpointError as exc:
        print("REFUSED", exc)
        raise SystemExit(0)
    print("LOADED", got["user"][0] is secret)
""")


def test_planted_object_array_cannot_point_at_a_live_object(tmp_path):
    code = _CHILD.format(repo=str(REPO), tests=str(TESTS))
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "planted.pt")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"the load crashed ({done.returncode}): {done.stderr[-2000:]}"
    assert done.stdout.startswith("REFUSED"), done.stdout  # before the fix: "LOADED True"
    assert "planted.pt" in done.stdout and "object array" in done.stdout, done.stdout
    assert "weights_only=False" in done.stdout, done.stdout


def test_forged_dtype_flags_are_ignored_and_the_values_load_as_plain_floats(tmp_path):
    values = np.array([1.5, -2.0, 1e-300])
    path = tmp_path / "flagged.pt"
    path.write_bytes(forged_numpy.flagged_float_array(values))
    got = smp.load(str(path), partial=False)["user"]
    assert type(got) is np.ndarray and got.dtype == np.float64 and not got.dtype.hasobject
    np.testing.assert_array_equal(got, values)


@pytest.mark.parametrize("value,why", [
    (np.zeros(2, dtype=[("a", "f4"), ("b", "i2")]), "structured"),
    (np.array(["2020-01-01"], dtype="M8[D]"), "M8"),
    (np.zeros(3, dtype="V4"), "V4"),
])
def test_dtypes_outside_plain_data_are_refused_by_name(tmp_path, value, why):
    path = tmp_path / "v.pt"
    torch.save({"v": value}, path)
    with pytest.raises(smp.CheckpointError, match=f"refusing to load checkpoint file.*{why}"):
        smp.load(str(path), partial=False)


def test_plain_numpy_values_of_every_accepted_kind_round_trip(tmp_path):
    """Each loads as the exact type and value numpy itself would give (the reference)."""
    value = {"i8": np.int64(-3), "u1": np.uint8(200), "f2": np.float16(1.5),
             "c16": np.complex128(1 - 2j), "b": np.bool_(True), "s": np.array([b"ab", b"c"]), "by": np.bytes_(b"ab"),
             "u": np.str_("héllo"), "be": np.arange(4, dtype=">i4"),
             "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
             "empty": np.zeros((0, 3), np.float32), "strs": np.array(["a", "bcd"]),
             "objs": np.array([1, "a", None, np.arange(2)], dtype=object),
             "dtype": np.dtype(">u2"), "dtypes": {np.dtype("f4"), np.dtype("i1")},
             "shared": [np.arange(3)] * 2, "rng": np.random.RandomState(5).get_state()}
    torch.save(value, tmp_path / "v.pt")
    got = safe_load.load(str(tmp_path / "v.pt"), opt_in="test")
    want = torch.load(tmp_path / "v.pt", weights_only=False)  # numpy's own unpickling
    for key in value:
        _same(got[key], want[key], key)
    assert got["shared"][0] is got["shared"][1]  # one array pickled once stays one array
    assert got["fortran"].flags.f_contiguous


def _same(a, b, where):
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, np.ndarray):
        # numpy itself loads a big-endian array as native: compare kind, size and values
        assert (a.dtype.kind, a.dtype.itemsize, a.shape) == \
            (b.dtype.kind, b.dtype.itemsize, b.shape), where
        for x, y in zip(a.ravel(), b.ravel()):
            _same(x, y, where) if a.dtype.hasobject else None
        if not a.dtype.hasobject:
            np.testing.assert_array_equal(a, b)
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), where
        for x, y in zip(a, b):
            _same(x, y, where)
    elif isinstance(a, (set, dict)):
        assert a == b, where
    else:
        assert a == b or (a is None and b is None), where
