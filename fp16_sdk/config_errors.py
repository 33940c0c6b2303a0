"""pydantic's validation errors as one ConfigError that names the key, the value and the fix.

The schema (`fp16_sdk.config`) declares the fields; this module words what went wrong in the
user's terms: keys spelled under the dict the user wrote ("distribution.mpi.enabled"), an
unknown key answered with the closest known one. Shared by the SDK and the smp runtime; no
torch import.
"""

from __future__ import annotations

import difflib
from typing import Any, Mapping

from pydantic import BaseModel, ValidationError

from fp16_sdk.errors import ConfigError

__all__ = ["schema_error"]


def _known_keys(model: type[BaseModel]) -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        keys.append(name)
        if field.alias:
            keys.append(field.alias)
    return keys


def _model_at(root: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The pydantic model under `root` that owns the field at `loc` (for close key names)."""
    model: Any = root
    for part in loc[:-1]:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return model if model is not root or len(loc) == 1 else None
        ann = field.annotation
        inner = [a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type)
                 and issubclass(a, BaseModel)]
        if not inner:
            return None
        model = inner[0]
    return model


def schema_error(exc: ValidationError, *, prefix: str, root: type[BaseModel]) -> ConfigError:
    """Turn pydantic's error list into one ConfigError naming key, value and fix.

    Args:
        exc: what `root.model_validate` raised.
        prefix: the name of the validated dict as the user knows it ("distribution",
            "smdistributed.modelparallel.parameters"); keys are named under it.
        root: the model that was validated; an unknown key is matched against the keys of
            the model that owns it (`difflib`'s closest, else the list).

    Returns:
        One ConfigError; its key and value are the first error's.
    """
    lines, first_key, first_value = [], None, None
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        key = ".".join([prefix, *map(str, loc)]) if loc else prefix
        value = err.get("input")
        kind, msg = err["type"], err["msg"].removeprefix("Value error, ")
        if kind == "extra_forbidden":
            owner = _model_at(root, loc)
            known = _known_keys(owner) if owner else []
            close = difflib.get_close_matches(str(loc[-1]), known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
            line = f"{key}: unknown key (value {value!r}); {hint}"
        elif not loc or isinstance(value, Mapping):
            line = f"{key}: {msg}"  # a cross-field rule: the message names the keys
        else:
            line = f"{key}={value!r} is invalid: {msg}; fix the value of {loc[-1]!r}"
        lines.append(line)
        if first_key is None:
            first_key, first_value = key, value
    return ConfigError("; ".join(lines), key=first_key, value=first_value)
