"""Loading checkpoint files without running code from them.

Every file smp reads (`smp.load`, `smp.resume_from_checkpoint`) goes through `load` here:
torch's own weights-only unpickler (`torch.load(weights_only=True)`), with the types real
checkpoints hold added to its allow-list for the length of the load through torch's
`torch.serialization.safe_globals`. torch's mechanism is used as is (no unpickler of ours):
its opcode checks are the security boundary and stay torch's to maintain.

Allowed without asking, beyond torch's defaults (tensors, containers, numbers, strings,
torch dtypes / sizes / devices):
- numpy scalars, dtypes and plain arrays (`np.prod(...)` in AWS's scripts' user_content,
  numpy's RNG state in Trainer's rng_state.pth) under numpy 1.x's and 2.x's pickle names,
  rebuilt by safe_numpy.py's stand-ins, never by numpy's `__setstate__` (which trusts the
  file's dtype flags: a planted file could make numpy read raw bytes as object pointers).
  Bool, int, float, complex, bytes, str and object dtypes (object arrays element by element).
- transformers configuration objects (`PretrainedConfig` subclasses the job has imported;
  AWS's scripts save `model_config`) and `argparse.Namespace`: attribute bags, rebuilt by
  `object.__new__` plus a `__dict__` update, no code of theirs runs.
Anything else (a planted `__reduce__`, a user's own class) is refused with a CheckpointError
naming the file, the offending global(s) and the two ways to accept it.
"""

from __future__ import annotations

import argparse
import contextlib
import pickle
import re
import sys

import torch

from ..errors import CheckpointError
from . import safe_numpy

__all__ = ["load", "allowed_globals"]

def _config_classes() -> list:
    """transformers' PretrainedConfig and every subclass already imported (never imports it)."""
    transformers = sys.modules.get("transformers")
    base = getattr(transformers, "PretrainedConfig", None) if transformers else None
    if base is None:
        return []
    found, todo = {base}, [base]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    return sorted(found, key=lambda c: f"{c.__module__}.{c.__qualname__}")


def allowed_globals() -> list:
    """What smp adds to torch's weights-only allow-list for a load (see the module docstring)."""
    return [*safe_numpy.globals_for_numpy(), *_config_classes(), argparse.Namespace]


@contextlib.contextmanager
def _allowed():
    """torch's safe_globals for smp's list, minus what the user already allowed (leaving the
    context removes what it added, and must not remove the user's own add_safe_globals)."""
    if not hasattr(torch.serialization, "safe_globals"):  # torch < 2.5: its defaults only
        yield
        return
    mine = set(torch.serialization.get_safe_globals())
    extra = [g for g in allowed_globals() if g not in mine]
    with torch.serialization.safe_globals(extra):
        yield


def _offenders(path: str) -> list[str]:
    """The globals in the file that are still not allowed (inside `_allowed`)."""
    try:
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # noqa: BLE001 - not a zip checkpoint, or unreadable: no list to give
        return []


def load(path: str, *, map_location=None, weights_only: bool = True, opt_in: str, **kwargs):
    """torch.load `path`, weights-only with smp's allow-list unless `weights_only` is False.

    Args:
        path: the file.
        map_location: as torch.load.
        weights_only: False unpickles anything (only for files you trust).
        opt_in: how the caller's user turns weights_only off, quoted in the refusal, e.g.
            "smp.load(f, weights_only=False)".
        kwargs: further torch.load arguments (pickle_module only with weights_only=False).

    Raises:
        CheckpointError: the file holds a global outside the allow-list (names the file, the
            global(s) and the fixes), or it cannot be unpickled at all (names the file).
    """
    if weights_only is False:
        return _torch_load(path, map_location=map_location, weights_only=False, **kwargs)
    with _allowed():
        try:
            before = safe_numpy.made()
            loaded = _torch_load(path, map_location=map_location, weights_only=True, **kwargs)
            return loaded if safe_numpy.made() == before else safe_numpy.plain(loaded)
        except _Refused as exc:
            offenders, detail = _offenders(path), str(exc)
    if detail.startswith(safe_numpy.REFUSED):
        raise CheckpointError(
            f"refusing to load checkpoint file {path!r}: it holds a{detail[len('Unsupported'):]}"
            f"; smp rebuilds numpy values itself, as plain data, and a value like this one "
            f"cannot be rebuilt that way (or the file was forged to make numpy read raw bytes "
            f"as object pointers). If you wrote this file yourself and trust it, unpickle "
            f"everything with {opt_in}") from None
    what = ", ".join(offenders) if offenders else detail
    names = ", ".join(o.rsplit(".", 1)[-1] for o in offenders) or "<the type>"
    raise CheckpointError(
        f"refusing to load checkpoint file {path!r}: it holds {what}, which loading would "
        f"construct or call; smp loads only tensors, containers, numbers, strings, torch "
        f"dtypes/sizes, numpy scalars/arrays and transformers configs without asking, because "
        f"anyone who can write to the checkpoint folder could otherwise run code in this job. "
        f"If you wrote this object yourself (e.g. in user_content) and trust the file: allow "
        f"that type only with torch.serialization.add_safe_globals([{names}]) before loading, "
        f"or unpickle everything with {opt_in}") from None


class _Refused(Exception):
    """torch's weights-only unpickler met a global or a call outside its allow-list."""


# What torch's WeightsUnpickler says when it refuses an object (not when the bytes are bad).
_REFUSALS = (safe_numpy.REFUSED, "Unsupported global", "Trying to call reduce",
             "Can only create new object", "Can only build", "Trying to load unsupported GLOBAL")


def _torch_load(path: str, **kwargs):
    """torch.load; a refusal by the weights-only unpickler raises _Refused, any other failure
    to unpickle a CheckpointError naming the file (garbage and truncated files fail with
    anything from EOFError to KeyError, depending on where the bytes stop making sense)."""
    try:
        return torch.load(path, **kwargs)
    except pickle.UnpicklingError as exc:
        found = re.search(r"WeightsUnpickler error:\s*(.*)", str(exc))
        detail = found.group(1).strip() if found else (str(exc).splitlines() or [""])[0]
        if kwargs.get("weights_only") and detail.startswith(_REFUSALS):
            raise _Refused(detail) from None
        problem, first = exc, detail
    except (OSError, MemoryError):
        raise
    except Exception as exc:  # noqa: BLE001 - see the docstring
        problem, first = exc, (str(exc).splitlines() or [""])[0]
    first = first[:200]
    raise CheckpointError(f"cannot load checkpoint file {path!r}: {type(problem).__name__}: "
                          f"{first or '(no message)'}; a truncated or garbage file fails like "
                          f"this: save it again, or resume an older checkpoint") from problem
