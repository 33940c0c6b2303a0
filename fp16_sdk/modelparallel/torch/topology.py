"""Where every global rank sits in the (rdp, pp, tp) grid: pure arithmetic, no processes.

A placement string is a permutation of the letters D (reduced data parallel), P (pipeline) and
T (tensor parallel). Global ranks enumerate the grid in mixed radix with the leftmost letter the
slowest digit and the rightmost the fastest: "cluster" is "DPT" (a model replica's ranks are
consecutive, so pipeline/tensor traffic stays inside a host), "spread" is "TPD" (consecutive
ranks are data-parallel replicas).

Groups (every list sorted by global rank; a rank's index in it is its group rank, which is what
`torch.distributed.new_group` assigns too):
- tp:  same (pp, rdp)  -> tp ranks
- pp:  same (tp, rdp)  -> pp ranks
- rdp: same (pp, tp)   -> rdp ranks
- dp:  same pp         -> tp*rdp ranks (TP runs inside the DP group)
- mp:  same rdp        -> pp*tp ranks (one full model replica)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from functools import cached_property

from .errors import SMPConfigError

__all__ = ["Topology", "PLACEMENTS", "GROUP_KINDS", "resolve_placement"]

PLACEMENTS = {"cluster": "DPT", "spread": "TPD"}
GROUP_KINDS = ("world", "mp", "dp", "tp", "pp", "rdp")

# Which grid axes vary inside each kind of group (the others are held fixed).
_VARYING = {"world": "DPT", "mp": "PT", "dp": "DT", "tp": "T", "pp": "P", "rdp": "D"}


def resolve_placement(placement: str) -> str:
    """Turn "cluster", "spread" or a D/P/T permutation into the permutation string.

    Raises:
        SMPConfigError: for anything else, listing the accepted values.
    """
    order = PLACEMENTS.get(placement, placement.upper() if isinstance(placement, str) else "")
    if sorted(order) != ["D", "P", "T"]:
        perms = ", ".join("".join(p) for p in itertools.permutations("DPT"))
        raise SMPConfigError(
            f"placement_strategy ({placement!r}) must be 'cluster', 'spread' or a permutation "
            f"of D, P, T ({perms})", key="placement_strategy", value=placement)
    return order


@dataclass(frozen=True)
class Topology:
    """The immutable rank grid of one job.

    Args:
        world_size: number of processes.
        pp: pipeline_parallel_degree.
        tp: tensor_parallel_degree.
        placement: "cluster", "spread" or a permutation of "DPT".

    Raises:
        SMPConfigError: degrees < 1, pp*tp not dividing world_size, or a bad placement.
    """

    world_size: int
    pp: int = 1
    tp: int = 1
    placement: str = "cluster"
    order: str = field(init=False)

    def __post_init__(self):
        for key, value in (("world size", self.world_size),
                           ("pipeline_parallel_degree", self.pp),
                           ("tensor_parallel_degree", self.tp)):
            if not isinstance(value, int) or value < 1:
                raise SMPConfigError(f"{key} ({value!r}) must be an integer >= 1",
                                     key=key, value=value)
        if self.world_size % (self.pp * self.tp):
            raise SMPConfigError(
                f"pipeline_parallel_degree * tensor_parallel_degree ({self.pp} * {self.tp} = "
                f"{self.pp * self.tp}) must divide the world size ({self.world_size}); "
                f"choose degrees whose product divides {self.world_size} or change the "
                f"number of processes", key="pipeline_parallel_degree", value=self.pp)
        object.__setattr__(self, "order", resolve_placement(self.placement))

    # ---- sizes -------------------------------------------------------------------------
    @property
    def rdp(self) -> int:
        """Reduced data-parallel degree: world / (pp*tp)."""
        return self.world_size // (self.pp * self.tp)

    @property
    def dp(self) -> int:
        """Data-parallel group size: tp * rdp (TP runs inside the DP group)."""
        return self.tp * self.rdp

    @property
    def mp(self) -> int:
        """Model-parallel group size: pp * tp."""
        return self.pp * self.tp

    def size(self, kind: str) -> int:
        """Size of a group of `kind` (one of GROUP_KINDS)."""
        return len(self.group(kind, 0))

    # ---- coordinates -------------------------------------------------------------------
    @cached_property
    def _degree(self) -> dict[str, int]:
        return {"D": self.rdp, "P": self.pp, "T": self.tp}

    def coords(self, rank: int) -> dict[str, int]:
        """{"D": rdp_rank, "P": pp_rank, "T": tp_rank} of a global rank."""
        self._check_rank(rank)
        coords = {}
        for letter in reversed(self.order):  # rightmost letter is the fastest digit
            rank, coords[letter] = divmod(rank, self._degree[letter])
        return coords

    def rank_of(self, *, pp_rank: int, tp_rank: int, rdp_rank: int) -> int:
        """The global rank at grid position (pp_rank, tp_rank, rdp_rank)."""
        coords = {"D": rdp_rank, "P": pp_rank, "T": tp_rank}
        rank = 0
        for letter in self.order:
            if not 0 <= coords[letter] < self._degree[letter]:
                raise SMPConfigError(f"{letter} coordinate ({coords[letter]}) is outside "
                                     f"0..{self._degree[letter] - 1}")
            rank = rank * self._degree[letter] + coords[letter]
        return rank

    def pp_rank(self, rank: int) -> int:
        return self.coords(rank)["P"]

    def tp_rank(self, rank: int) -> int:
        return self.coords(rank)["T"]

    def rdp_rank(self, rank: int) -> int:
        return self.coords(rank)["D"]

    def dp_rank(self, rank: int) -> int:
        return self.group_rank("dp", rank)

    def mp_rank(self, rank: int) -> int:
        return self.group_rank("mp", rank)

    def group_rank(self, kind: str, rank: int) -> int:
        """Index of `rank` inside its own group of `kind`."""
        return self.group(kind, rank).index(rank)

    # ---- groups ------------------------------------------------------------------------
    def group(self, kind: str, rank: int) -> list[int]:
        """Sorted global ranks of the group of `kind` that contains `rank`."""
        return list(self._groups_by_rank[kind][rank])

    def all_groups(self, kind: str) -> list[list[int]]:
        """Every group of `kind`, in a fixed order (by smallest member) identical on all ranks."""
        return [list(g) for g in self._all_groups[kind]]

    @cached_property
    def _all_groups(self) -> dict[str, list[tuple[int, ...]]]:
        result = {}
        for kind in GROUP_KINDS:
            varying = _VARYING[kind]
            buckets: dict[tuple[int, ...], list[int]] = {}
            for r in range(self.world_size):
                c = self.coords(r)
                key = tuple(c[letter] for letter in "DPT" if letter not in varying)
                buckets.setdefault(key, []).append(r)
            result[kind] = sorted(tuple(sorted(g)) for g in buckets.values())
        return result

    @cached_property
    def _groups_by_rank(self) -> dict[str, dict[int, tuple[int, ...]]]:
        return {kind: {r: g for g in groups for r in g}
                for kind, groups in self._all_groups.items()}

    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise SMPConfigError(f"rank ({rank!r}) must be in 0..{self.world_size - 1} "
                                 f"for a world of {self.world_size}")

    def describe(self) -> str:
        """One line: degrees and placement, e.g. 'world 8 = pp 2 * tp 1 * rdp 4 (DPT)'."""
        return (f"world {self.world_size} = pp {self.pp} * tp {self.tp} * rdp {self.rdp} "
                f"({self.order})")
