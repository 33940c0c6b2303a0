"""One rank of a two-process Gloo job whose rank 0 exits while a worker thread waits for the GIL.

    python gloo_late_decref.py {plain|smp}    (RANK, WORLD_SIZE=2, MASTER_ADDR/PORT set)

Rank 0 starts an all-reduce on a temporary tensor and drops every Python reference to it, then
holds the GIL (a huge switch interval and a busy loop). Rank 1 joins the all-reduce half a second
after rank 0 said (through the rendezvous store) that it is busy. The work completes, and the Gloo worker thread that drops it must hand the tensor's
Python object back, so it waits for the GIL, which rank 0 keeps until its script ends and the
interpreter shuts down. With `plain` (torch.distributed alone) the worker is ended inside
torch's destructor and rank 0 dies of SIGABRT ("terminate called without an active
exception"). With `smp` (smp.init starts the group) the exit drain hands the GIL over first.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

BUSY_S, LATE_S = 4.0, 0.5


def main(mode: str) -> None:
    torch.set_num_threads(1)
    if mode == "smp":
        import fp16_sdk.modelparallel.torch as smp
        smp.init({})
    else:
        dist.init_process_group("gloo")
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 1:
        store.wait(["rank0_busy"])
        time.sleep(LATE_S)
        dist.all_reduce(torch.ones(1000))
        return
    work = dist.all_reduce(torch.ones(1000), async_op=True)
    del work  # the tensor was a temporary: only the work holds it now
    store.set("rank0_busy", "1")
    sys.setswitchinterval(100.0)  # the waiting worker cannot ask for the GIL in time
    end = time.monotonic() + BUSY_S
    while time.monotonic() < end:
        pass
    # nothing after the loop: a write would release the GIL and let the worker through early


if __name__ == "__main__":
    main(sys.argv[1])
