"""`smp.utils`: small helpers scripts import from `smdistributed.modelparallel.torch.utils`."""

from __future__ import annotations

from .state import state

__all__ = ["rmsg"]


def rmsg(msg: str) -> str:
    """`msg` prefixed with this process' ranks, for logs from many processes.

    Returns:
        "[rank R] msg" before smp.init(); afterwards
        "[rank R, pp_rank P, tp_rank T, rdp_rank D] msg".
    """
    if not state.initialized:
        return f"[rank {state.rank}] {msg}"
    topo, r = state.topology, state.rank
    return (f"[rank {r}, pp_rank {topo.pp_rank(r)}, tp_rank {topo.tp_rank(r)}, "
            f"rdp_rank {topo.rdp_rank(r)}] {msg}")
