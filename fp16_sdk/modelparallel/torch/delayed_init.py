"""Delayed parameter initialization: parameters on the meta device until the rank's share is known.

Size: over the 400-line guideline because creation (meta registration, the RNG snapshots)
and materialisation (per unit, for the four layouts below) are one mechanism whose halves
share private state; splitting them would only move the snapshot format into an interface.

Creation (`smp.delay_param_initialization()`, or `smp.model_creation(...)` with
`delayed_param_initialization=True` or the config's `delayed_parameter_initialization`):
while the context is open, a parameter a module registers stays real only while that
module's own __init__ can still initialise it, and goes to the meta device as soon as
another module registers one; so one module's parameters exist at a time, and the RNG
advances exactly as in eager creation (a transformers `post_init()` runs on meta parameters
with its random fills drawn on scratch tensors, `_RandomOnMeta`). Each module keeps the RNG
state its __init__ started from (`_smp_delayed_rng`, ~5 KB) and, for transformers models,
the RNG state and the `_init_weights` of the post_init that initialised it
(`_smp_hf_init`). Buffers stay real: they are small and often computed in __init__.
An smp.nn distributed layer at tensor_parallel_degree > 1 keeps its parameters: its
__init__ already initialises each weight in full and keeps only this rank's slice.

Materialisation. At DistributedModel wrap (`begin`) every rank takes global rank 0's RNG
snapshots (eager creation broadcasts rank 0's weights; here each rank initialises its own
share from the same snapshots) and every meta parameter becomes a 0-element placeholder of
the same dtype (full shape in `_smp_full_shape`, `_smp_delayed_init = True`; the same
Parameter object wherever it is registered, so tied weights stay tied and an optimizer
built later sees the final objects). `realise(unit)` then allocates the placeholders of one
module subtree and initialises them as eager creation did, each module from its own
snapshots, so units can be realised in any order:

    reset_parameters() / _reset_parameters()   torch modules, registration order
    _init_weights(m) of the post_init that     transformers modules, children first (an
      initialised m                              attention module's init of its c_proj)

A parameter a module shares but did not register first (a tied head's weight) is a scratch
tensor while that module initialises (in eager creation tying replaced the head's own
tensor), and the module that registered it first is replayed for it. A value that eager
creation cast to fp16/bf16 (the FP16 wrapper runs between) is rounded through that dtype.
Who realises what (peak host memory while creating and wrapping, per rank):

    pp = tp = sdp = 1   the whole model at wrap                                 the model
    pp > 1              at wrap the partition is computed from the full shapes (the engine
                        computes the same one at the first step, and refuses a different
                        one), this stage's units and the tree's own parameters are realised;
                        the first step's trace realises each other stage's unit while it
                        runs and frees it after                   ~1/pp + one block
    tp > 1              TP distribution realises each module it distributes (an HF block,
                        a registered module) in full, slices this rank's shard and frees
                        the whole one; the rest (replicated) after  ~1/tp + one block
    sdp > 1             shard_model realises one FSDP unit, fully_shard's it and frees the
                        whole tensors, unit by unit                ~1/sdp + one layer
    tp > 1, sdp > 1     TP as above, then FSDP shards the TP shards unit by unit (the TP
                        shards all exist before FSDP runs)         ~1/tp + one block

A transformers model that recorded no init at creation (its `init_weights` switched off by
the script, as AWS's smp v1 examples do because smp v1 re-initialises the model as its own
distributed transformer, or transformers first imported inside the context) is initialised
by its own `_init_weights` per module, from per-module snapshots seeded by the process' seed,
with a warning: those values are transformers' init, not what eager creation leaves there.

A TP slice of a realised weight is marked `_smp_agreed` (equal on every rank, like a realised
parameter): the wrap-time broadcasts skip both, so no flat copy of the model is made.

Why realise-then-shard and not torch's documented meta route for FSDP2 (fully_shard on meta,
`to_empty`, then init per shard): an init applied per shard cannot reproduce eager values
(kaiming/normal draws are made over the whole tensor in one RNG stream, and fan-in comes from
the whole shape), and reproducing eager creation with the same seed is the contract here.
`to_empty` itself is not used because it re-allocates a whole subtree at once (including
tied parameters owned elsewhere) and the placeholder objects must survive (an optimizer may
hold them); `p.data = torch.empty(...)` per parameter is the allocation.

Limits (refused by name): a module with meta parameters and neither reset_parameters() nor a
transformers post_init (`nn.Parameter(torch.randn(n))` in a plain __init__) cannot be
reproduced; pipeline_parallel_degree > 1 with tensor_parallel_degree > 1 (the partition is
decided on the tensor-parallel model, whose shapes exist only after TP distribution); a
pipeline model whose forward uses another stage's parameter outside that stage's modules
(a tie the partition cannot see before the trace) fails at the first step with an error
naming the key. Random buffers are not agreed between ranks (eager creation broadcasts rank
0's): use the same seed on every rank. The script's RNG state is restored after each
realisation, so wrap-time draws (smp.nn layers built by TP distribution) match eager.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .errors import SMPConfigError
from .state import state

__all__ = ["meta_parameters", "not_delayed", "begin", "after_tensor_parallel",
           "realise_module", "release_module", "has_meta", "is_delayed", "is_agreed",
           "full_numel",
           "plan_of", "trace_units", "check_partition"]

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


def _keeps_shard(module: nn.Module) -> bool:
    """An smp.nn distributed layer at tp > 1: its __init__ keeps this rank's slice only."""
    tp = getattr(module, "tp", None)
    return bool(module.__dict__.get("_smp_distributed_module")) and getattr(tp, "size", 1) > 1


def _meta_register(self, name, param):
    # A module's parameters stay real while its own __init__ may still initialise them, so
    # the RNG advances exactly as in eager creation; they go to meta when another module
    # registers one (one module's parameters exist at a time).
    if param is not None and _keeps_shard(self):
        _flush()
        _original_register(self, name, param)
        return
    _flush(keep=self)
    if "_smp_delayed_rng" not in self.__dict__:
        self.__dict__["_smp_delayed_rng"] = torch.get_rng_state()  # replayed by realise
    if param is not None and "_smp_owner" not in param.__dict__:
        param._smp_owner = id(self)  # a tied parameter keeps its first module's init
    _original_register(self, name, param)
    if param is not None:
        _pending.append((self, name))


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
        with _RandomOnMeta():  # nested models' post_init advance the RNG as in eager creation
            return original(self)
    post_init._smp_delayed = True
    return post_init


def _hf_initialize_wrapper(original):
    def _initialize_weights(self, module):
        if not getattr(module, "_is_hf_initialized", False) and \
                "_smp_hf_init" not in module.__dict__:  # HF's init of `module` starts here
            module.__dict__["_smp_hf_init"] = (torch.get_rng_state(), self._init_weights)
        return original(self, module)
    _initialize_weights._smp_delayed = True
    return _initialize_weights


def _hf_init_weights_wrapper(original):
    """Older transformers (4.23) have no `_initialize_weights`: their `init_weights` runs
    `self.apply(self._init_weights)`. For that call an instance attribute stands in for the
    bound `_init_weights` and records where each module's init starts. Those versions have no
    `_is_hf_initialized` either: a nested model's modules (GPT2LMHeadModel's GPT2Model) are
    initialised again by the outer post_init, and the last init is what eager creation leaves,
    so the last record wins (the newer path keeps the first, as transformers then does)."""
    def init_weights(self):
        inner = self._init_weights

        def recording(module):
            module.__dict__["_smp_hf_init"] = (torch.get_rng_state(), inner)
            return inner(module)
        self.__dict__["_init_weights"] = recording
        try:
            return original(self)
        finally:
            del self.__dict__["_init_weights"]
    init_weights._smp_delayed = True
    return init_weights


def _hf_hooks(hf) -> dict:
    """The PreTrainedModel methods delayed creation wraps, as this transformers has them:
    post_init and the per-module init (`_initialize_weights` where it exists, as in 4.28, else `init_weights`).
    A version without post_init (< 4.16) gets no hooks: its models record no init and are
    initialised at materialisation by their own `_init_weights` (`_unrecorded_hf_inits`)."""
    if hf is None or "post_init" not in hf.__dict__:
        return {}
    per_module = "_initialize_weights" if "_initialize_weights" in hf.__dict__ else "init_weights"
    return {"post_init": hf.__dict__["post_init"], per_module: hf.__dict__[per_module]}


_HOOK_WRAPPERS = {"post_init": _hf_post_init_wrapper,
                  "_initialize_weights": _hf_initialize_wrapper,
                  "init_weights": _hf_init_weights_wrapper}


@contextlib.contextmanager
def meta_parameters(enabled: bool = True):
    """Register parameters on the meta device while open (False inside True turns it off)."""
    previous = nn.Module.register_parameter
    transformers = sys.modules.get("transformers")
    hf = transformers.PreTrainedModel if transformers is not None else None
    saved = _hf_hooks(hf)
    if enabled and saved and not getattr(saved["post_init"], "_smp_delayed", False):
        for name, method in saved.items():
            setattr(hf, name, _HOOK_WRAPPERS[name](method))
    _flush()  # the last module of an enclosing context is done: its parameters go to meta
    nn.Module.register_parameter = _meta_register if enabled else _original_register
    try:
        yield
    finally:
        _flush()
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


def has_meta(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


def is_delayed(t) -> bool:
    """A parameter created by delayed initialization (agreed across ranks: not broadcast)."""
    return bool(getattr(t, "_smp_delayed_init", False))


def is_agreed(t) -> bool:
    """Equal on every rank by construction: delayed, or a TP slice of a delayed weight."""
    return is_delayed(t) or bool(getattr(t, "_smp_agreed", False))


def _pending_placeholder(p) -> bool:
    return p.numel() == 0 and "_smp_full_shape" in p.__dict__ and is_delayed(p) \
        and p._smp_full_shape != (0,)


def full_numel(p) -> int:
    """Elements of `p` as created (a placeholder counts its full shape)."""
    if p.numel() == 0 and "_smp_full_shape" in p.__dict__:
        n = 1
        for d in p._smp_full_shape:
            n *= d
        return n
    return p.numel()


def _init_fn(module: nn.Module):
    for name in ("reset_parameters", "_reset_parameters"):
        fn = getattr(type(module), name, None)
        if callable(fn):
            return getattr(module, name)
    return None


def _post_order(root: nn.Module):
    for child in root.children():
        yield from _post_order(child)
    yield root


class _Plan:
    """What `begin` decided for one wrapped model: realise / release units (module doc)."""

    def __init__(self, root: nn.Module, params: list[nn.Parameter]):
        self.root = root
        self.modules = list(root.modules())
        self.by_id = {id(m): m for m in self.modules}
        self.params = params
        self.partition = None
        self.report = {"model_bytes": sum(full_numel(p) * p.element_size() for p in params),
                       "materialised_bytes": 0, "live_bytes": 0, "peak_bytes": 0,
                       "local_bytes": 0, "layout": "whole model"}

    # ---- allocation ----------------------------------------------------------------------
    def _count(self, n: int) -> None:
        r = self.report
        r["live_bytes"] += n
        r["peak_bytes"] = max(r["peak_bytes"], r["live_bytes"])

    def realise(self, params) -> int:
        """Allocate and initialise the pending placeholders among `params` (module doc)."""
        todo, seen = [], set()
        for p in params:
            if _pending_placeholder(p) and id(p) not in seen:
                seen.add(id(p))
                todo.append(p)
        if not todo:
            return 0
        targets = {}
        for p in todo:  # the dtype the parameter has now; init runs in its creation dtype
            targets[id(p)] = (p.dtype, p.__dict__.get("_smp_via_half"))
            p.data = torch.empty(p._smp_full_shape, dtype=p._smp_creation_dtype)
            if p.is_floating_point():
                p.data.fill_(float("nan"))  # an init that misses it is caught below
        live = {id(p) for p in todo}
        rng = torch.get_rng_state()
        try:
            with torch.no_grad():
                self._replay(live)
        finally:
            torch.set_rng_state(rng)
        for p in todo:
            if p.is_floating_point() and bool(torch.isnan(p).any()):
                name = next((f"{mn}.{pn}" if mn else pn for mn, m in self.root.named_modules()
                             for pn, q in m._parameters.items() if q is p), "?")
                raise SMPConfigError(
                    f"delayed parameter initialization: parameter {name} is not written by "
                    f"its module's reset_parameters() or transformers' _init_weights, so its "
                    f"value from __init__ cannot be recreated; initialise it in "
                    f"reset_parameters()/_init_weights, or create the model outside "
                    f"smp.delay_param_initialization", key="delayed_parameter_initialization",
                    value=name)
        n = 0
        with torch.no_grad():
            for p in todo:
                dtype, via = targets[id(p)]
                if dtype != p.dtype:  # cast by the FP16 wrapper after creation: as eager
                    p.data = p.data.to(via or dtype).to(dtype)
                elif via is not None:  # widened back to fp32 after the half cast (sdp)
                    p.data = p.data.to(via).to(dtype)
                n += p.nbytes
        self.report["materialised_bytes"] += n
        self._count(n)
        return n

    def _replay(self, live: set[int]) -> None:
        owners = set()
        for m in self.modules:
            for p in m._parameters.values():
                if p is not None and id(p) in live:
                    owners.add(id(m))
                    owners.add(p.__dict__.get("_smp_owner", id(m)))
        for m in self.modules:  # reset_parameters, each from its own snapshot
            init = _init_fn(m)
            if id(m) in owners and init is not None and "_smp_delayed_rng" in m.__dict__:
                torch.set_rng_state(m.__dict__["_smp_delayed_rng"])
                with _own_params_only(m, live):
                    init()
        for m in _post_order(self.root):  # transformers' _init_weights, children first
            record = m.__dict__.get("_smp_hf_init")
            if record is None:
                continue
            if id(m) not in owners and not any(id(p) in live for p in m.parameters()):
                continue
            torch.set_rng_state(record[0])
            with _own_params_only(m, live):
                record[1](m)

    def release(self, params) -> None:
        n = 0
        for p in params:
            if is_delayed(p) and p.numel():
                n += p.nbytes
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self._count(-n)

    def finish(self, layout: str) -> dict:
        """Record this rank's figures in state (start-up line, health log)."""
        from .sharded_data_parallel import is_sharded
        local = 0
        for p in self.root.parameters():
            if is_sharded(p):
                t = p.to_local()
                local += t.numel() * t.element_size()
            elif is_delayed(p) or getattr(p, "_smp_distributed", False):
                local += p.numel() * p.element_size()
        self.report["local_bytes"] = local
        self.report["layout"] = layout
        state.delayed_init_report = self.report
        if state.rank == 0:
            import logging
            from .memory_report import wrap_line
            logging.getLogger("smp").info(wrap_line())
        return self.report


@contextlib.contextmanager
def _own_params_only(module: nn.Module, live: set[int]):
    """While `module` initialises, each of its parameters that is not being realised now, or
    that it shares but did not register first (a tied head's weight), is a scratch tensor of
    the full shape: the RNG advances as in eager creation and nothing else is written."""
    borrowed = {}
    for name, p in module._parameters.items():
        if p is None:
            continue
        own = p.__dict__.get("_smp_owner", id(module)) == id(module)
        if id(p) in live and own:
            continue
        if id(p) in live or _pending_placeholder(p) or is_delayed(p):
            borrowed[name] = p
    for name, p in borrowed.items():
        shape = p._smp_full_shape if "_smp_full_shape" in p.__dict__ else p.shape
        dtype = p.__dict__.get("_smp_creation_dtype", p.dtype)
        module._parameters[name] = nn.Parameter(torch.empty(shape, dtype=dtype))
    try:
        yield
    finally:
        module._parameters.update(borrowed)


def plan_of(module: nn.Module) -> _Plan | None:
    return module.__dict__.get("_smp_delayed")


def _unrecorded_hf_inits(root: nn.Module) -> list[str]:
    """Give transformers models whose creation recorded no init one of their own.

    A PreTrainedModel with meta parameters and no recorded `_init_weights` either had its
    init switched off by the script (AWS's smp v1 examples replace
    `PreTrainedModel.init_weights` with an empty function before building the model, because
    smp v1 re-initialises it as its own distributed transformer; this is that case, handled
    here) or was built with transformers first imported inside the
    creation context. Its weights would otherwise stay unwritten, so each of its modules is
    initialised at materialisation by the model's own `_init_weights` (transformers' init:
    what smp v1's distributed transformer also draws, normal(0, initializer_range)), each
    from a snapshot of its own, seeded from the process' seed and the module's index (rank
    0's snapshots are agreed afterwards). Returns the models' class names (for a warning).
    """
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(root, transformers.PreTrainedModel):
        return []
    names = []
    for model in [m for m in root.modules() if isinstance(m, transformers.PreTrainedModel)
                  and "_smp_hf_init" not in m.__dict__ and has_meta(m)]:
        if "_smp_hf_init" in model.__dict__:  # nested in one handled above (GPT2Model)
            continue
        names.append(type(model).__name__)
        for index, m in enumerate(model.modules()):
            if "_smp_hf_init" not in m.__dict__:
                generator = torch.Generator().manual_seed(
                    (torch.initial_seed() + 1_000_003 * (index + 1)) % (2 ** 63))
                m.__dict__["_smp_hf_init"] = (generator.get_state(), model._init_weights)
    return names


def _check_inits(root: nn.Module) -> None:
    transformers = sys.modules.get("transformers")
    hf = transformers is not None and isinstance(root, transformers.PreTrainedModel)
    unrecorded = _unrecorded_hf_inits(root)
    if unrecorded and state.rank == 0:
        import logging
        logging.getLogger("smp").warning(
            "delayed parameter initialization: %s recorded no weight init at creation (its "
            "init_weights was switched off, or transformers was first imported inside the "
            "creation context): its modules are initialised with the model's own "
            "_init_weights when materialised, not with the values eager creation leaves",
            ", ".join(unrecorded))
    for m in root.modules():
        if not any(p is not None and p.is_meta for p in m._parameters.values()):
            continue
        if _init_fn(m) is None and not hf and "_smp_hf_init" not in m.__dict__:
            raise SMPConfigError(
                f"delayed parameter initialization: {type(m).__name__} has parameters but no "
                f"reset_parameters(), so its initial values cannot be recreated; add a "
                f"reset_parameters() that initialises them, or create it outside "
                f"smp.delay_param_initialization", key="delayed_parameter_initialization",
                value=type(m).__name__)


def _agree_rng_snapshots(root: nn.Module) -> None:
    """Every rank replays global rank 0's snapshots (eager creation broadcasts rank 0's
    weights: over DP at wrap, over the pipeline at the first step)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    holders = [(m, k) for m in root.modules() for k in ("_smp_delayed_rng", "_smp_hf_init")
               if k in m.__dict__]
    snapshots = [m.__dict__["_smp_delayed_rng"] if k == "_smp_delayed_rng"
                 else m.__dict__[k][0] for m, k in holders]
    dist.broadcast_object_list(snapshots, src=0)
    for (m, k), snap in zip(holders, snapshots):
        m.__dict__[k] = snap if k == "_smp_delayed_rng" else (snap, m.__dict__[k][1])


def _replace_meta(root: nn.Module) -> list[nn.Parameter]:
    """Swap every meta parameter for a 0-element CPU placeholder (module doc); the same
    object wherever the meta parameter is registered (tied weights stay tied)."""
    real: dict[int, nn.Parameter] = {}
    for m in root.modules():
        for name, p in m._parameters.items():
            if p is None or not p.is_meta:
                continue
            if id(p) not in real:
                new = nn.Parameter(torch.empty(0, dtype=p.dtype), requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)
                new._smp_full_shape = tuple(p.shape)
                new._smp_creation_dtype = p.dtype
                new._smp_delayed_init = True
                real[id(p)] = new
            m._parameters[name] = real[id(p)]
    return list(real.values())


# ---- the four layouts (module doc) ---------------------------------------------------------
_active: _Plan | None = None  # between begin() and after_tensor_parallel(): TP realises


def _partition(root: nn.Module):
    from .pipeline.engine import PipelineSettings
    from .pipeline.partition import auto_partition, manual_partition
    s = PipelineSettings.from_state()
    if s.auto_partition:
        return auto_partition(root, s.num_stages, s.memory_weight)
    return manual_partition(root, s.num_stages, recorded=s.recorded,
                            default=s.default_partition)


def begin(root: nn.Module) -> _Plan | None:
    """At wrap, before TP: agree the snapshots, placeholders for the meta parameters, and
    (pp > 1) the partition from the full shapes. None for a model without meta parameters.

    Raises:
        SMPConfigError: pp > 1 with tp > 1, or a module whose init cannot be replayed.
    """
    global _active
    _active = None
    if not has_meta(root):
        return None
    topo = state.topology
    if topo.pp > 1 and topo.tp > 1:
        raise SMPConfigError(
            f"delayed_parameter_initialization with pipeline_parallel_degree {topo.pp} and "
            f"tensor_parallel_degree {topo.tp} together is not implemented (the partition is "
            f"decided on the tensor-parallel model, whose shard shapes exist only after "
            f"distribution): create the model without smp.delay_param_initialization (or set "
            f"\"delayed_parameter_initialization\": False), or use one of the two",
            key="delayed_parameter_initialization", value=True)
    _check_inits(root)
    part = _partition(root) if topo.pp > 1 else None  # meta tensors know their shapes
    _agree_rng_snapshots(root)
    plan = _Plan(root, _replace_meta(root))
    plan.partition = part
    root.__dict__["_smp_delayed"] = plan
    _active = plan
    return plan


def realise_module(module: nn.Module) -> None:
    """TP distribution: `module` (a block or registered module about to be sliced) in full."""
    if _active is not None:
        _active.realise(list(module.parameters()))


def release_module(module: nn.Module, replacement: nn.Module) -> None:
    """TP distribution: the whole tensors of `module`, now sliced into `replacement`, whose
    parameters are then equal on every rank by construction (`_smp_agreed`: the wrap-time
    broadcast skips them, as it skips realised ones, so no flat copy of them is made)."""
    if _active is None:
        return
    params = list(module.parameters())
    if params and all(is_delayed(p) for p in params):
        for p in replacement.parameters():
            p._smp_agreed = True
    _active.release(params)


def after_tensor_parallel(plan: _Plan | None, module: nn.Module) -> None:
    """At wrap, after TP: realise this rank's share (pp: its stage; sdp: nothing yet, the
    sharding realises unit by unit; else everything left)."""
    global _active
    _active = None
    if plan is None:
        return
    if module is not plan.root:  # TP replaced the root itself
        module.__dict__["_smp_delayed"] = plan
    plan.root, plan.modules = module, list(module.modules())
    plan.params = [p for p in module.parameters() if is_delayed(p)]
    from . import sharded_data_parallel
    if sharded_data_parallel.enabled():
        return  # shard_model realises and shards one unit at a time
    if plan.partition is None:
        plan.realise(plan.params)
        plan.finish("tensor-parallel shard" if state.topology.tp > 1 else "whole model")
        return
    from .pipeline.stage_params import _declared, _kept_ids
    part, stage = plan.partition, state.topology.pp_rank(state.rank)
    kept = _kept_ids(module, part, stage, {})
    named = dict(module.named_parameters())
    kept |= {id(named[n]) for n, stages in _declared(module, part).items()
             if stage in stages and n in named}
    for name, s in part.unit_stages().items():  # one unit at a time
        if s == stage:
            plan.realise(list(module.get_submodule(name).parameters()))
    plan.realise([p for p in plan.params if id(p) in kept])
    plan.finish(f"pipeline stage {stage}")


def check_partition(module: nn.Module, part) -> None:
    """The engine's partition (first step) must be the one realised at wrap.

    Raises:
        SMPConfigError: smp.partition / set_partition after wrapping changed it.
    """
    plan = plan_of(module)
    planned = plan.partition if plan is not None else None
    if planned is None:
        return
    same = (planned.block_names, planned.block_stage, planned.pre, planned.post) == \
        (part.block_names, part.block_stage, part.pre, part.post)
    if not same:
        raise SMPConfigError(
            f"delayed parameter initialization realised the pipeline partition "
            f"{list(planned.block_stage)} at smp.DistributedModel, but at the first step it is "
            f"{list(part.block_stage)} (smp.partition / smp.set_partition called after "
            f"wrapping): make those calls before smp.DistributedModel, or set "
            f"\"delayed_parameter_initialization\": False", key="partition",
            value=list(part.block_stage))


@contextlib.contextmanager
def trace_units(module: nn.Module, tracer):
    """The first step's trace (pp > 1): each unit whose parameters this stage does not hold
    is realised for its call and freed after it (it runs under no_grad)."""
    plan = plan_of(module)
    if plan is None:
        yield
        return
    original = tracer.call

    def call(unit, inner, args, kwargs):
        todo = [p for p in unit.parameters() if _pending_placeholder(p)]
        with torch._C.DisableTorchFunction():  # the init is no use the tracer should see
            plan.realise(todo)
        try:
            return original(unit, inner, args, kwargs)
        finally:
            with torch._C.DisableTorchFunction():
                plan.release(todo)
    tracer.call = call
    try:
        yield
    except (RuntimeError, IndexError) as exc:
        raise SMPConfigError(
            f"the first step's trace failed with delayed parameter initialization at "
            f"pipeline_parallel_degree {state.topology.pp} ({type(exc).__name__}: {exc}); if "
            f"the model's forward uses a parameter of another stage's module outside that "
            f"module (a weight tie the partition cannot see), declare it in the module's "
            f"_smp_pipeline_tied or set \"delayed_parameter_initialization\": False",
            key="delayed_parameter_initialization", value=True) from exc
    finally:
        tracer.call = original
