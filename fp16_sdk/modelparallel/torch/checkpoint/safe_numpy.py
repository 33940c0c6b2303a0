"""numpy values in checkpoints, rebuilt as plain data by smp's own code, never by numpy's.

numpy pickles a dtype as `numpy.dtype(code, align, copy)` followed by a BUILD whose state
holds the dtype's flags, element size and alignment, and an array as `_reconstruct(ndarray,
(0,), b'b')` followed by a BUILD with (version, shape, dtype, fortran, raw bytes). numpy's
`__setstate__` trusts those flags: a file that marks a float dtype "holds objects" makes numpy
read 8 raw bytes of the array as an object pointer (a segfault, or any live object when the
address is known). That is why torch's weights-only unpickler leaves numpy out.

Here the same pickle names map to stand-ins that numpy never sees:
- `SafeDtype` takes the type code from the call and only the byte order from the BUILD state;
  flags, element size and alignment in the file are ignored, the dtype is `np.dtype(code)`.
  Bool, integer, float, complex, bytes (`S<n>`), str (`U<n>`) and object dtypes; structured,
  void and datetime dtypes are refused (smp and Trainer write none of them).
- `ArrayStub` checks that the raw bytes are exactly shape x itemsize and copies them into a
  new array (`np.frombuffer`); `scalar` does the same for one value. An object array is
  filled element by element from the pickled list (elements that this same unpickler
  allowed), never from raw bytes: raw bytes with an object dtype are refused.
- `plain(obj)` swaps every stand-in in the loaded object for its numpy value (`np.ndarray`,
  `np.dtype`), walking containers, `argparse.Namespace` and config objects; `load` calls it
  only when the load made stand-ins.
"""

from __future__ import annotations

import math
import pickle
import threading
from typing import Any

__all__ = ["globals_for_numpy", "made", "plain", "SafeDtype", "ArrayStub", "REFUSED"]

_MODULES = ("numpy.core.multiarray", "numpy._core.multiarray")  # numpy 1.x, 2.x pickle names
_KINDS = {"b": (1,), "i": (1, 2, 4, 8), "u": (1, 2, 4, 8), "f": (2, 4, 8), "c": (8, 16),
          "O": (4, 8)}
_ORDERS = ("<", ">", "|", "=")
# The message start `_torch_load` in safe_load.py recognises as a refusal (not a broken file).
REFUSED = "Unsupported numpy value"

_count = threading.local()


def made() -> int:
    """How many stand-ins this thread has made so far (a load compares before and after)."""
    return getattr(_count, "n", 0)


def _made_one() -> None:
    _count.n = made() + 1


def _refuse(what: str) -> pickle.UnpicklingError:
    return pickle.UnpicklingError(f"{REFUSED}: {what}")


def _code(code: Any) -> tuple[str, int]:
    """(kind, size) of a numpy type code smp accepts, e.g. "f4" -> ("f", 4), "U3" -> ("U", 3)."""
    if not isinstance(code, str) or len(code) < 2 or len(code) > 12:
        raise _refuse(f"numpy dtype code {code!r}")
    kind, size = code[0], code[1:]
    if not size.isdigit() or not size.isascii():
        raise _refuse(f"numpy dtype {code!r} (only bool, int, float, complex, S, U and O)")
    n = int(size)
    if kind in _KINDS and n in _KINDS[kind] or kind in "SU" and 0 < n <= 1 << 20:
        return kind, n
    raise _refuse(f"numpy dtype {code!r}: smp loads bool, int, float, complex, bytes (S), "
                  f"str (U) and object (O) dtypes only, no structured, void or datetime ones")


class SafeDtype:
    """Stands for `numpy.dtype(code, align, copy)` in a pickle; `dtype()` gives the real one."""

    def __init__(self, code: Any, align: Any = False, copy: Any = True):
        self.kind, self.size = _code(code)
        self.order = "="
        _made_one()

    def __setstate__(self, state: Any) -> None:
        # (version, byte order, subarray, names, fields, elsize, alignment, flags[, metadata])
        if not isinstance(state, tuple) or len(state) < 5 or state[1] not in _ORDERS \
                or state[2:5] != (None, None, None):
            raise _refuse(f"numpy dtype state {str(state)[:120]}")
        self.order = state[1]  # everything after the byte order is numpy's to derive

    def dtype(self):
        import numpy as np
        code = f"{self.kind}{self.size}"
        return np.dtype(code if self.order in "|=" else self.order + code)


class _NdarrayName:
    """Stands for the `numpy.ndarray` global, the only subtype `_reconstruct` accepts."""


def _reconstruct(subtype: Any, shape: Any, code: Any) -> "ArrayStub":
    if subtype is not _NdarrayName:
        raise _refuse(f"numpy array subtype {subtype!r}")
    return ArrayStub()


class ArrayStub:
    """Stands for a numpy array until its BUILD state arrives; `value` is the real array."""

    def __init__(self):
        self.value = None
        _made_one()

    def __setstate__(self, state: Any) -> None:
        import numpy as np
        if not isinstance(state, tuple) or len(state) != 5:
            raise _refuse(f"numpy array state of {type(state).__name__}")
        _, shape, dtype, fortran, raw = state
        if not isinstance(shape, tuple) or not all(type(d) is int and d >= 0 for d in shape):
            raise _refuse(f"numpy array shape {str(shape)[:80]}")
        if not isinstance(dtype, SafeDtype):
            raise _refuse(f"numpy array of dtype {type(dtype).__name__}")
        order = "F" if fortran is True else "C"
        if dtype.kind == "O":  # elements come pickled one by one, never as raw pointers
            if type(raw) is not list or len(raw) != math.prod(shape):
                raise _refuse(f"numpy object array of shape {shape} from {type(raw).__name__}")
            flat = np.empty(len(raw), dtype=object)
            for i, item in enumerate(raw):
                flat[i] = plain(item)
            self.value = flat.reshape(shape, order=order)
            return
        dt = dtype.dtype()
        if not isinstance(raw, (bytes, bytearray)) or len(raw) != math.prod(shape) * dt.itemsize:
            raise _refuse(f"numpy array of shape {shape} and dtype {dt} from "
                          f"{len(raw) if isinstance(raw, (bytes, bytearray)) else type(raw)} "
                          f"bytes")
        flat = np.frombuffer(bytes(raw), dtype=dt).copy()
        self.value = flat.reshape(shape, order=order)


def scalar(dtype: Any, data: Any):
    """Stands for numpy's scalar rebuild: one value of `dtype` from exactly its bytes."""
    import numpy as np
    if not isinstance(dtype, SafeDtype) or not isinstance(data, (bytes, bytearray)):
        raise _refuse(f"numpy scalar of {type(dtype).__name__} from {type(data).__name__}")
    dt = dtype.dtype()
    if dtype.kind == "O" or len(data) != dt.itemsize:
        raise _refuse(f"numpy {dt} scalar from {len(data)} bytes")
    return np.frombuffer(bytes(data), dtype=dt, count=1)[0]


def _empty_bytes(*args: Any) -> bytes:
    """`bytes()`: how pickle writes an empty bytes object (an empty array's raw data); any
    argument is refused (`bytes(10**12)` would allocate a terabyte)."""
    if args:
        raise _refuse(f"bytes{str(args)[:40]}")
    return b""


def globals_for_numpy() -> list:
    """(stand-in, pickle name) pairs for torch's safe_globals: numpy's names, smp's code."""
    out: list = [(SafeDtype, "numpy.dtype"), (_NdarrayName, "numpy.ndarray"), ArrayStub,
                 (_empty_bytes, "builtins.bytes")]
    for module in _MODULES:
        out += [(scalar, f"{module}.scalar"), (_reconstruct, f"{module}._reconstruct")]
    return out


def plain(obj: Any, memo: dict | None = None) -> Any:
    """`obj` with every stand-in replaced by its numpy value (in place where mutable)."""
    memo = {} if memo is None else memo
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, ArrayStub):
        memo[id(obj)] = obj.value
        return obj.value
    if isinstance(obj, SafeDtype):
        memo[id(obj)] = obj.dtype()
        return memo[id(obj)]
    memo[id(obj)] = obj  # cycles end here
    if isinstance(obj, dict):
        for key, value in list(obj.items()):
            obj[key] = plain(value, memo)
    elif isinstance(obj, list):
        obj[:] = [plain(v, memo) for v in obj]
    elif isinstance(obj, (tuple, set, frozenset)):
        items = [plain(v, memo) for v in obj]
        if any(a is not b for a, b in zip(items, obj)):
            new = type(obj)(items) if not hasattr(obj, "_fields") else type(obj)(*items)
            memo[id(obj)] = new
            return new
    elif type(obj).__module__ != "builtins" and isinstance(getattr(obj, "__dict__", None), dict) \
            and not _is_tensor(obj):
        for key, value in list(vars(obj).items()):
            vars(obj)[key] = plain(value, memo)
    return obj


def _is_tensor(obj: Any) -> bool:
    import torch
    return isinstance(obj, torch.Tensor)
