"""Delayed parameter initialization: parameters on the meta device until the rank's share is known.

Creation (`smp.delay_param_initialization()`, or `smp.model_creation(...)` with
`delayed_param_initialization=True` or the config's `delayed_parameter_initialization`):
while the context is open, a parameter a module registers stays real only while that
module's own __init__ can still initialise it, and goes to the meta device as soon as
another module registers one; so one module's parameters exist at a time, and the RNG
advances exactly as in eager creation (a transformers `post_init()` runs on meta parameters
with its random fills drawn on scratch tensors, `_RandomOnMeta`). Each module keeps the RNG
state it started from (`_smp_delayed_rng`, ~5 KB), each HF post_init its own. Buffers stay
real: they are small and often computed in __init__ (causal masks, position ids).

Materialisation (`materialize(module)`, DistributedModel wrap time): the pipeline partition
is computed from the meta shapes (the engine's function and settings; the engine then uses
this partition), stage 0's RNG snapshots are broadcast over the pipeline group (eager
creation broadcasts stage 0's weights), and every module owning meta parameters, in
registration order, is allocated on the CPU and initialised by its own init from its
snapshot:

    reset_parameters() / _reset_parameters()   torch modules (Linear, Embedding, LayerNorm, ...)
    each post_init() that ran, in order         transformers models: _initialize_weights over
                                                the model's tree, children first, as eager

A block (or the head) of another stage is allocated while its modules initialise and freed
right after, so the host holds this stage's parameters plus one block: ~1/pp of the model.
A tied parameter keeps the init of the module that registered it first. With the same seed
the values equal eager creation's wherever each parameter-owning module initialises its
parameters in reset_parameters (torch's modules) or the model is a transformers
PreTrainedModel; a module with meta parameters and neither (e.g. `nn.Parameter(torch.randn
(n))` in a plain module's __init__) cannot be reproduced and is an error naming it. Random
buffers are not broadcast between stages (eager creation broadcasts stage 0's): use the same
seed on every rank. The script's RNG state at wrap time is restored afterwards.

Not implemented: tensor parallelism (tensor_parallel_degree > 1) with delayed
initialization is refused (its shards are sliced from whole weights at wrap time).
"""

from __future__ import annotations

import contextlib
import itertools
import sys

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .errors import SMPConfigError
from .state import state

__all__ = ["meta_parameters", "materialize", "has_meta"]

_original_register = nn.Module.register_parameter
_pending: list[tuple[nn.Module, str]] = []  # real parameters of the module initialising now


def _to_meta(module: nn.Module, name: str) -> None:
    p = module._parameters.get(name)
    if p is not None and not p.is_meta:
        meta = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
        meta.__dict__.update(p.__dict__)
        module._parameters[name] = meta


def _flush(keep: nn.Module | None = None) -> None:
    """Swap the pending parameters of every module but `keep` to meta (their init ran)."""
    rest = []
    for module, name in _pending:
        if module is keep:
            rest.append((module, name))
        else:
            _to_meta(module, name)
    _pending[:] = rest


def _meta_register(self, name, param):
    # A module's parameters stay real while its own __init__ may still initialise them, so
    # the RNG advances exactly as in eager creation; they go to meta when another module
    # registers one (one module's parameters exist at a time).
    _flush(keep=self)
    if "_smp_delayed_rng" not in self.__dict__:
        self.__dict__["_smp_delayed_rng"] = torch.get_rng_state()  # replayed by materialize
    if param is not None and "_smp_owner" not in param.__dict__:
        param._smp_owner = id(self)  # a tied parameter keeps its first module's init
    _original_register(self, name, param)
    if param is not None:
        _pending.append((self, name))


_post_init_calls = itertools.count()
_RANDOM_INPLACE = {"normal_", "uniform_", "bernoulli_", "random_", "exponential_",
                   "geometric_", "log_normal_", "cauchy_"}


class _RandomOnMeta(TorchDispatchMode):
    """Random in-place fills of meta tensors draw the same numbers on a scratch CPU tensor
    (then dropped), so the RNG advances as it would on real parameters."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else None
        if (func.overloadpacket.__name__ in _RANDOM_INPLACE and isinstance(target, torch.Tensor)
                and target.is_meta):
            func(torch.empty(target.shape, dtype=target.dtype), *args[1:], **kwargs)
            return target
        return func(*args, **kwargs)


def _hf_post_init_wrapper(original):
    def post_init(self):
        _flush()
        self.__dict__["_smp_post_init_rng"] = torch.get_rng_state()  # HF's init starts here
        self.__dict__["_smp_post_init_order"] = next(_post_init_calls)
        with _RandomOnMeta():  # nested models' post_init advance the RNG as in eager creation
            return original(self)
    post_init._smp_delayed = True
    return post_init


@contextlib.contextmanager
def meta_parameters(enabled: bool = True):
    """Register parameters on the meta device while open (False inside True turns it off)."""
    previous = nn.Module.register_parameter
    transformers = sys.modules.get("transformers")
    hf_post_init = transformers.PreTrainedModel.post_init if transformers is not None else None
    if enabled and hf_post_init is not None and not getattr(hf_post_init, "_smp_delayed", False):
        transformers.PreTrainedModel.post_init = _hf_post_init_wrapper(hf_post_init)
    nn.Module.register_parameter = _meta_register if enabled else _original_register
    try:
        yield
    finally:
        _flush()
        nn.Module.register_parameter = previous
        if hf_post_init is not None:
            transformers.PreTrainedModel.post_init = hf_post_init


def has_meta(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


def _init_fn(module: nn.Module):
    for name in ("reset_parameters", "_reset_parameters"):
        fn = getattr(type(module), name, None)
        if callable(fn):
            return getattr(module, name)
    return None


def _hf_root(root: nn.Module):
    transformers = sys.modules.get("transformers")
    if transformers is not None and isinstance(root, transformers.PreTrainedModel):
        return root
    return None


def _plan(root: nn.Module):
    """The pipeline partition (pp > 1) and the ids of the tensors this stage keeps."""
    if state.topology.pp == 1:
        return None, None
    from .pipeline.engine import PipelineSettings
    from .pipeline.partition import auto_partition, manual_partition
    from .pipeline.stage_params import _kept_ids
    s = PipelineSettings.from_state()
    if s.auto_partition:
        part = auto_partition(root, s.num_stages, s.memory_weight)
    else:
        part = manual_partition(root, s.num_stages, recorded=s.recorded,
                                default=s.default_partition)
    return part, _kept_ids(root, part, s.stage)


def _replace_meta(root: nn.Module) -> dict[int, nn.Parameter]:
    """Swap every meta parameter for a 0-element CPU one (full shape in `_smp_full_shape`);
    returns id(meta parameter) -> its replacement,
    the same object wherever it is registered (tied weights stay tied)."""
    real: dict[int, nn.Parameter] = {}
    for m in root.modules():
        for name, p in m._parameters.items():
            if p is None or not p.is_meta:
                continue
            if id(p) not in real:
                new = nn.Parameter(torch.empty(0, dtype=p.dtype), requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)
                new._smp_full_shape = tuple(p.shape)
                real[id(p)] = new
            m._parameters[name] = real[id(p)]
    return real


def _allocate(params) -> int:
    n = 0
    for p in params:
        if p.numel() == 0 and p._smp_full_shape != (0,):
            p.data = torch.empty(p._smp_full_shape, dtype=p.dtype)
            n += p.nbytes
    return n


def _free(params) -> None:
    for p in params:
        p.data = torch.empty(0, dtype=p.dtype)


def materialize(root: nn.Module) -> dict | None:
    """Give the parameters this rank holds real values (module docstring).

    A model built outside `smp.delay_param_initialization` has no meta parameters: nothing to
    materialise, and None is returned.

    Returns:
        {"local_bytes", "model_bytes", "peak_bytes"} of parameter memory, or None.

    Raises:
        SMPConfigError: tensor_parallel_degree > 1, or a module with meta parameters and no
            init this runtime can replay.
    """
    if not has_meta(root):
        return None
    if state.topology.tp > 1 or state.topology.pp > 1:
        key, degree = (("tensor_parallel_degree", state.topology.tp) if state.topology.tp > 1
                       else ("pipeline_parallel_degree", state.topology.pp))
        raise SMPConfigError(
            f"delayed_parameter_initialization with {key} {degree} is not implemented (the "
            f"pipeline partitions at the first step, after tracing the whole model, so every "
            f"stage needs every parameter until then): create the model without "
            f"smp.delay_param_initialization (or set \"delayed_parameter_initialization\": "
            f"False)", key="delayed_parameter_initialization", value=True)
    hf = _hf_root(root)
    owners = [m for m in root.modules() if any(p is not None and p.is_meta
                                               for p in m._parameters.values())]
    for m in owners:
        if _init_fn(m) is None and hf is None:
            raise SMPConfigError(
                f"delayed parameter initialization: {type(m).__name__} has parameters but no "
                f"reset_parameters(), so its initial values cannot be recreated; add a "
                f"reset_parameters() that initialises them, or create it outside "
                f"smp.delay_param_initialization", key="delayed_parameter_initialization",
                value=type(m).__name__)
    part, kept = _plan(root)  # from the meta shapes, before anything is swapped
    if part is not None:
        _agree_rng_snapshots(root)
    swapped = _replace_meta(root)
    params = list(swapped.values())
    if kept is not None:  # translated: the swapped meta parameters' ids are free for reuse
        kept = {id(swapped[i]) if i in swapped else i for i in kept}
    units = _transient_units(root, part, kept)
    in_unit = {id(p) for ps in units.values() for p in ps}
    report = {"model_bytes": sum(_numel(p) * p.element_size() for p in params)}
    report["local_bytes"] = _allocate([p for p in params if id(p) not in in_unit])
    report["peak_bytes"] = report["local_bytes"]
    wrap_rng = torch.get_rng_state()
    try:
        with torch.no_grad():
            walk = _UnitWalk(units, report)
            for m in owners:  # what each module's __init__ did, from its RNG state then
                walk.enter(m)
                init = _init_fn(m)
                if init is not None:
                    torch.set_rng_state(m.__dict__["_smp_delayed_rng"])
                    with _own_params_only(m):
                        init()
            if hf is not None:
                _replay_post_inits(hf, walk)
            walk.enter(None)
    finally:
        torch.set_rng_state(wrap_rng)
    if part is not None:
        root.__dict__["_smp_delayed_partition"] = part  # the engine uses this partition
    state.delayed_init_report = report
    return report


def _agree_rng_snapshots(root: nn.Module) -> None:
    """Every stage replays stage 0's RNG snapshots (eager creation broadcasts stage 0's
    weights over the pipeline group; here each stage initialises its own part from them)."""
    import torch.distributed as dist
    keys = ("_smp_delayed_rng", "_smp_post_init_rng")
    holders = [(m, k) for m in root.modules() for k in keys if k in m.__dict__]
    snapshots = [m.__dict__[k] for m, k in holders]
    dist.broadcast_object_list(snapshots, src=state.topology.group("pp", state.rank)[0],
                               group=state.groups.pp)
    for (m, k), snap in zip(holders, snapshots):
        m.__dict__[k] = snap


def _replay_post_inits(hf: nn.Module, walk: "_UnitWalk") -> None:
    """Every post_init() that ran at creation (a nested PreTrainedModel's first), each from
    its RNG state: HF's init over its tree, children first, skipping modules an earlier
    post_init initialised (`_is_hf_initialized`), as eager creation did."""
    for m in hf.modules():
        m._is_hf_initialized = False
    models = sorted((m for m in hf.modules() if "_smp_post_init_rng" in m.__dict__),
                    key=lambda m: m.__dict__["_smp_post_init_order"])
    for model in models:
        torch.set_rng_state(model.__dict__["_smp_post_init_rng"])
        for m in _post_order(model):
            walk.enter(m)
            with _own_params_only(m):
                model._initialize_weights(m)


@contextlib.contextmanager
def _own_params_only(module: nn.Module):
    """While `module` initialises, a parameter it shares but did not create first (a tied
    head's weight) is a scratch tensor: in eager creation that init went to the module's
    own tensor, which tying then replaced."""
    borrowed = {name: p for name, p in module._parameters.items()
                if p is not None and p.__dict__.get("_smp_owner", id(module)) != id(module)}
    for name, p in borrowed.items():
        module._parameters[name] = nn.Parameter(torch.empty(_shape(p), dtype=p.dtype))
    try:
        yield
    finally:
        module._parameters.update(borrowed)


def _shape(p) -> tuple:
    return p._smp_full_shape if p.numel() == 0 and "_smp_full_shape" in p.__dict__ else p.shape


def _numel(p) -> int:
    n = 1
    for d in p._smp_full_shape:
        n *= d
    return n


def _post_order(root: nn.Module):
    for child in root.children():
        yield from _post_order(child)
    yield root


def _transient_units(root, part, kept) -> dict[int, list]:
    """id(module) -> the parameters of its unit, for modules of placed units (blocks, post)
    this stage does not keep: each unit is allocated while its modules initialise, then freed."""
    if part is None:
        return {}
    from .pipeline.stage_params import _placed_names
    out = {}
    for name in _placed_names(part):
        unit = root.get_submodule(name)
        params = list(unit.parameters())
        if any(id(p) in kept for p in params):
            continue
        for m in unit.modules():
            out[id(m)] = params
    return out


class _UnitWalk:
    """Allocates the transient unit a module belongs to, freeing the previous one."""

    def __init__(self, units, report):
        self.units, self.report, self.current = units, report, None

    def enter(self, module) -> None:
        unit = self.units.get(id(module)) if module is not None else None
        if unit is self.current:
            return
        if self.current is not None:
            _free(self.current)
        if unit is not None:
            n = _allocate(unit)
            self.report["peak_bytes"] = max(self.report["peak_bytes"],
                                            self.report["local_bytes"] + n)
        self.current = unit
