"""Materialisation: placeholders allocated and initialised as eager creation did.

`DelayedPlan.realise(params)` allocates the placeholders among `params` and initialises them,
each module from its own snapshots, so units can be realised in any order:

    reset_parameters() / _reset_parameters()   torch modules, registration order
    _init_weights(m) of the post_init that     transformers modules, children first (an
      initialised m                              attention module's init of its c_proj)

A parameter a module shares but did not register first (a tied head's weight) is a scratch
tensor while that module initialises (in eager creation tying replaced the head's own
tensor), and the module that registered it first is replayed for it. A value that eager
creation cast to fp16/bf16 (the FP16 wrapper runs between) is rounded through that dtype.
The script's RNG state is restored after each realisation, so wrap-time draws (smp.nn layers
built by TP distribution) match eager. `release(params)` frees what a caller realised only
for a while (a TP block once sliced, an FSDP unit once sharded, another stage's unit once
traced). Tensor-parallel distribution is handed the plan (parallelize.py) and calls
`realise_module` / `release_module` around each module it slices.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..errors import SMPConfigError
from ..param_record import full_numel_of, module_record, param_record, update_param_record
from ..state import state
from .placeholders import is_delayed, pending_placeholder

__all__ = ["DelayedPlan", "plan_of", "init_fn"]


def init_fn(module: nn.Module):
    for name in ("reset_parameters", "_reset_parameters"):
        fn = getattr(type(module), name, None)
        if callable(fn):
            return getattr(module, name)
    return None


def _post_order(root: nn.Module):
    for child in root.children():
        yield from _post_order(child)
    yield root


class DelayedPlan:
    """What `begin` decided for one wrapped model (wrap.py): its placeholders, the pipeline
    partition realised at wrap (pp > 1), and the figures of what was materialised."""

    def __init__(self, root: nn.Module, params: list[nn.Parameter]):
        self.root = root
        self.modules = list(root.modules())
        self.by_id = {id(m): m for m in self.modules}
        self.params = params
        self.partition = None
        self.report = {"model_bytes": sum(full_numel_of(p) * p.element_size() for p in params),
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
            if pending_placeholder(p) and id(p) not in seen:
                seen.add(id(p))
                todo.append(p)
        if not todo:
            return 0
        targets = {}
        for p in todo:  # the dtype the parameter has now; init runs in its creation dtype
            record = param_record(p)
            targets[id(p)] = (p.dtype, record.via_half)
            p.data = torch.empty(record.full_shape, dtype=record.creation_dtype)
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
                    owner = param_record(p).owner
                    owners.add(owner if owner is not None else id(m))
        for m in self.modules:  # reset_parameters, each from its own snapshot
            init = init_fn(m)
            rng = module_record(m).delayed_rng
            if id(m) in owners and init is not None and rng is not None:
                torch.set_rng_state(rng)
                with _own_params_only(m, live):
                    init()
        for m in _post_order(self.root):  # transformers' _init_weights, children first
            record = module_record(m).hf_init
            if record is None:
                continue
            if id(m) not in owners and not any(id(p) in live for p in m.parameters()):
                continue
            torch.set_rng_state(record[0])
            with _own_params_only(m, live):
                record[1](m)

    def release(self, params) -> None:
        """Free the realised delayed parameters among `params` (back to 0-element)."""
        n = 0
        for p in params:
            if is_delayed(p) and p.numel():
                n += p.nbytes
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self._count(-n)

    # ---- tensor-parallel distribution (nn/auto.py, nn/huggingface/_shard.py) ------------
    def realise_module(self, module: nn.Module) -> None:
        """`module` (a block or registered module about to be sliced) in full."""
        self.realise(list(module.parameters()))

    def release_module(self, module: nn.Module, replacement: nn.Module) -> None:
        """The whole tensors of `module`, now sliced into `replacement`, whose parameters are
        then equal on every rank by construction (recorded `agreed`: the wrap-time broadcast
        skips them, as it skips realised ones, so no flat copy of them is made)."""
        params = list(module.parameters())
        if params and all(is_delayed(p) for p in params):
            for p in replacement.parameters():
                update_param_record(p, agreed=True)
        self.release(params)

    def finish(self, layout: str) -> dict:
        """Record this rank's figures in state (the start-up line and the health log read
        them; the wrap's plan logs them, parallelize.py)."""
        # Here, not at the top: the sharded_data_parallel package imports delayed_init.
        from ..sharded_data_parallel.settings import is_sharded

        local = 0
        for p in self.root.parameters():
            if is_sharded(p):  # by sharded data parallelism
                t = p.to_local()
                local += t.numel() * t.element_size()
            elif is_delayed(p) or param_record(p).distributed:
                local += p.numel() * p.element_size()
        self.report["local_bytes"] = local
        self.report["layout"] = layout
        state.delayed_init_report = self.report
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
        owner = param_record(p).owner
        own = owner is None or owner == id(module)
        if id(p) in live and own:
            continue
        if id(p) in live or pending_placeholder(p) or is_delayed(p):
            borrowed[name] = p
    for name, p in borrowed.items():
        record = param_record(p)
        shape = record.full_shape if record.full_shape is not None else p.shape
        dtype = record.creation_dtype if record.creation_dtype is not None else p.dtype
        module._parameters[name] = nn.Parameter(torch.empty(shape, dtype=dtype))
    try:
        yield
    finally:
        module._parameters.update(borrowed)


def plan_of(module: nn.Module) -> DelayedPlan | None:
    """The DelayedPlan of a wrapped model (or of the model TP replaced it with), else None."""
    return module_record(module).delayed_plan
