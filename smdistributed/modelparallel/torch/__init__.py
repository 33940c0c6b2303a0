"""`import smdistributed.modelparallel.torch as smp` gives `fp16_sdk.modelparallel.torch`.

Not a copy: this name and every submodule name under it (`...torch.nn`, `...torch.model`, ...)
resolve to the very same module objects as under fp16_sdk, so classes, `smp.state` and the
process groups are shared whichever spelling a script or library imports.
"""

import importlib
import importlib.abc
import importlib.util
import sys

_ALIAS = __name__  # "smdistributed.modelparallel.torch"
_REAL = "fp16_sdk.modelparallel.torch"


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, real_name: str):
        self.real_name = real_name

    def create_module(self, spec):
        return importlib.import_module(self.real_name)

    def exec_module(self, module):
        pass  # already executed under its real name


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Maps `smdistributed.modelparallel.torch.X` to `fp16_sdk.modelparallel.torch.X`."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(_ALIAS + "."):
            return None
        real = _REAL + fullname[len(_ALIAS):]
        if importlib.util.find_spec(real) is None:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(real))


if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _AliasFinder())

_real = importlib.import_module(_REAL)
for _name, _module in list(sys.modules.items()):
    if _name.startswith(_REAL + "."):
        sys.modules.setdefault(_ALIAS + _name[len(_REAL):], _module)
sys.modules[_ALIAS] = _real
