"""Run a function on N real processes joined in a Gloo group (for multi-process tests).

    from helpers.mp import run_ranks
    results = run_ranks(fn, 2, arg1, env={"SM_HP_MP_PARAMETERS": '{"microbatches": 2}'})

`fn(rank, world_size, *args)` runs in every child with RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (a free port), the extra `env` applied, and
CUDA hidden; it may call `smp.init()` or `torch.distributed.init_process_group` itself
(`init_gloo=True`: the Gloo group is initialised before `fn` runs, one thread per rank). The
return values (picklable) come back in rank order. An exception in any child fails the call
with that child's rank and full traceback.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback

import torch.multiprocessing as mp

from helpers.paths import REPO, TESTS
from helpers.ports import free_port

__all__ = ["run_ranks", "free_port", "RankFailed"]



class RankFailed(AssertionError):
    """A child process raised; the message carries its rank and traceback."""


def _child(rank, world_size, port, env, fn, args, outdir, init_gloo):
    import pickle
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "CUDA_VISIBLE_DEVICES": ""})
    os.environ.update(env or {})
    for path in (str(REPO), str(TESTS)):
        if path not in sys.path:
            sys.path.insert(0, path)
    result_path = os.path.join(outdir, f"rank{rank}.pkl")
    try:
        if init_gloo:
            import torch
            import torch.distributed as dist
            torch.set_num_threads(1)
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001  (report everything to the parent)
        result = ("error", traceback.format_exc())
    finally:
        _shutdown()
    with open(result_path, "wb") as f:
        pickle.dump(result, f)
    if result[0] == "error":
        sys.exit(1)


def _shutdown():
    import torch.distributed as dist

    from fp16_sdk.modelparallel.torch.gloo_exit import drain
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    drain()  # no Gloo worker may still want the GIL when this child exits (gloo_exit.py)


def run_ranks(fn, world_size: int, *args, env: dict | None = None, timeout: float = 120,
              init_gloo: bool = False):
    """Run `fn(rank, world_size, *args)` on `world_size` Gloo ranks; return results by rank.

    Raises:
        RankFailed: a child raised (first failing rank's traceback) or died without result.
    """
    import pickle
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(_child, args=(world_size, free_port(), env, fn, args, outdir,
                                               init_gloo),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline, timed_out = time.monotonic() + timeout, False
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    timed_out = True
                    break
        except (mp.ProcessRaisedException, mp.ProcessExitedException):
            pass  # torch stops the other ranks; the result files say who failed and why
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results, errors = [], []
        for rank in range(world_size):
            path = os.path.join(outdir, f"rank{rank}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {rank} exited (code {ctx.processes[rank].exitcode}) "
                              f"without a result")
                results.append(None)
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append(f"rank {rank} raised:\n{value}")
            results.append(value if status == "ok" else None)
        if timed_out:
            errors.insert(0, f"timed out after {timeout} s")
        if errors:
            raise RankFailed("\n".join(errors))
        return results
