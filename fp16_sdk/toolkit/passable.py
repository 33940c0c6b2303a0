"""Can the command and its environment reach exec? If not, say which part and the fix.

Some commands cannot be started at all, and `exec` only says so with an errno the user
cannot act on ("Argument list too long"):
- a NUL character anywhere, or '=' in a variable's name;
- one argument or one `NAME=value` string longer than Linux's MAX_ARG_STRLEN (32 pages,
  131072 bytes with its NUL), or all of them together over ARG_MAX (a quarter of the stack
  limit, usually 2 MiB).

Hyperparameters reach the script as `--key value` and as SM_HP_<KEY>, and all together in
SM_HPS, SM_USER_ARGS and SM_TRAINING_ENV (SageMaker's contract). A value up to about 128 KiB
starts (each string holds it once; a test passes 100,000 characters); a single value over
128 KiB can never be passed, nor values that together overflow SM_HPS. SageMaker itself
refuses values over 2500 characters at CreateTrainingJob. The toolkit refuses such a launch
before it starts, naming the hyperparameters and the fix (pass large values through a file),
rather than dropping variables the script may read.

Environment values are never echoed (they may hold secrets): a message names the variable
and its length only.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

__all__ = ["MAX_ARG_STRLEN", "arg_max", "unpassable", "shown"]

MAX_ARG_STRLEN = 32 * 4096  # linux/binfmts.h: bytes of one argv/envp string, its NUL included
_POINTER = 8  # each argv/envp entry also costs one pointer in the new process's stack
_BLAME_MIN = 4096  # hyperparameters shorter than this are never named as the cause


def arg_max() -> int:
    """ARG_MAX of this system (sysconf), 2 MiB where it cannot be asked."""
    try:
        value = os.sysconf("SC_ARG_MAX")
    except (ValueError, OSError, AttributeError):
        value = -1
    return value if value > 0 else 2 * 1024 * 1024


def shown(text: str, limit: int = 40) -> str:
    """A toolkit setting's value for an error: repr when short, else only its length (an
    over-long value is never echoed, not even in part)."""
    return repr(text) if len(text) <= limit else f"a value of {len(text)} characters"


def _size(text: str) -> int:
    return len(os.fsencode(text)) + 1  # + its NUL


def unpassable(argv: Sequence[str], env: Mapping[str, str], *,
               hyperparameters: Mapping[str, Any] | None = None) -> str | None:
    """Why `argv`/`env` cannot reach exec, or None when they can.

    Args:
        argv: the command.
        env: its full environment.
        hyperparameters: the job's user hyperparameters, to name the one that is too long.
    """
    for name, value in env.items():
        if not name or "=" in name or "\x00" in name or "\x00" in value:
            return (f"environment variable {name[:80]!r} ({len(value)} characters) cannot be "
                    "passed to the script: names must be non-empty without '=' or NUL and "
                    "values without NUL; rename the hyperparameter (SM_HP_<KEY>) or variable")
    for i, arg in enumerate(argv):
        if "\x00" in arg:
            return (f"argument {i} of the command ({len(arg)} characters) holds a NUL "
                    "character, which no command line can carry; remove it from the "
                    "hyperparameter")
    strings = [(f"argument {i}", _size(a)) for i, a in enumerate(argv)]
    strings += [(f"variable {name}", _size(f"{name}={value}")) for name, value in env.items()]
    too_long = [(what, size) for what, size in strings if size > MAX_ARG_STRLEN]
    total = sum(size + _POINTER for _, size in strings) + 2 * _POINTER
    limit = arg_max()
    if not too_long and total <= limit:
        return None
    if too_long:
        shown = ", ".join(f"{what} ({size - 1} bytes)" for what, size in too_long[:6])
        problem = (f"{shown} {'is' if len(too_long) == 1 else 'are'} longer than Linux allows "
                   f"for one argument or environment string ({MAX_ARG_STRLEN} bytes, "
                   "MAX_ARG_STRLEN)")
    else:
        problem = (f"the command line and environment together take {total} bytes, more than "
                   f"Linux allows ({limit} bytes, ARG_MAX)")
    return (f"the training command cannot be started: {problem}. {_blame(hyperparameters)}"
            "SageMaker's containers pass every hyperparameter as `--key value` and in SM_HP_<KEY>, "
            "SM_HPS, SM_USER_ARGS and SM_TRAINING_ENV (and SageMaker refuses values over 2500 "
            "characters): pass large values through a file instead, in source_dir or an input "
            "channel, and give the script its path as the hyperparameter")


def _blame(hyperparameters: Mapping[str, Any] | None) -> str:
    """'hyperparameter 'x' is N characters long. ' for the longest ones, or ''."""
    sizes = sorted(((len(v if isinstance(v, str) else repr(v)), k)
                    for k, v in (hyperparameters or {}).items()), reverse=True)
    named = [f"{k!r} ({n} characters)" for n, k in sizes[:3] if n >= _BLAME_MIN]
    if not named:
        return ""
    return f"Too long: hyperparameter {', '.join(named)}. "
