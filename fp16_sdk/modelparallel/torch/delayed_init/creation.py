"""The creation context's mechanism: parameters registered on the meta device while open.

`smp.delay_param_initialization()`, or `smp.model_creation(...)` with
`delayed_param_initialization=True` or the config's `delayed_parameter_initialization`,
opens `meta_parameters()` (contexts.py): nn.Module.register_parameter becomes meta.py's
`meta_register` and transformers' init methods are wrapped to record each module's init
(hf_init.py). Buffers stay real: they are small and often computed in __init__.
"""

from __future__ import annotations

import contextlib
import sys

from torch import nn

from ..param_record import FunctionMark, function_marked
from .hf_init import HOOK_WRAPPERS, hf_hooks
from .meta import flush, meta_register, original_register

__all__ = ["meta_parameters", "not_delayed"]


@contextlib.contextmanager
def meta_parameters(enabled: bool = True):
    """Register parameters on the meta device while open (False inside True turns it off)."""
    previous = nn.Module.register_parameter
    transformers = sys.modules.get("transformers")
    hf = transformers.PreTrainedModel if transformers is not None else None
    saved = hf_hooks(hf)
    if enabled and saved and not function_marked(saved["post_init"],
                                                  FunctionMark.DELAYED_INIT_HOOK):
        for name, method in saved.items():
            setattr(hf, name, HOOK_WRAPPERS[name](method))
    flush()  # the last module of an enclosing context is done: its parameters go to meta
    nn.Module.register_parameter = meta_register if enabled else original_register
    try:
        yield
    finally:
        flush()
        nn.Module.register_parameter = previous
        for key, value in saved.items():
            setattr(hf, key, value)


def not_delayed(init):
    """Decorator: `init` (DistributedModel.__init__) runs with delayed creation off, so a
    wrap inside an open creation context builds real parameters (TP's distributed layers)."""
    def wrapped(*args, **kwargs):
        with meta_parameters(False):
            return init(*args, **kwargs)
    wrapped.__doc__, wrapped.__name__ = init.__doc__, init.__name__
    wrapped.__wrapped__ = init
    return wrapped
