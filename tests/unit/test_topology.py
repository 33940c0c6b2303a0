"""Topology: pure arithmetic against the spec's examples and a brute-force enumeration."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fp16_sdk.errors import ConfigError
from fp16_sdk.modelparallel.torch.errors import SMPConfigError
from fp16_sdk.modelparallel.torch.topology import Topology


def reference_coords(world, pp, tp, order):
    """Enumerate the grid with itertools.product (leftmost letter slowest): rank -> coords."""
    degree = {"D": world // (pp * tp), "P": pp, "T": tp}
    ranges = [range(degree[letter]) for letter in order]
    return {rank: dict(zip(order, combo))
            for rank, combo in enumerate(itertools.product(*ranges))}


def test_spec_example_cluster_8_ranks_pp2():
    t = Topology(8, pp=2, placement="cluster")
    assert t.all_groups("mp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert t.all_groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert t.group("mp", 5) == [4, 5] and t.pp_rank(5) == 1 and t.rdp_rank(5) == 2


def test_spec_example_spread_8_ranks_pp2():
    t = Topology(8, pp=2, placement="spread")
    assert t.all_groups("mp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert t.all_groups("dp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert t.pp_rank(4) == 1 and t.rdp_rank(4) == 0


def test_cluster_with_tp_keeps_tp_fastest():
    t = Topology(8, pp=2, tp=2)  # DPT: rank = (d*2 + p)*2 + t
    assert t.all_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert t.all_groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert t.all_groups("rdp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert t.all_groups("dp") == [[0, 1, 4, 5], [2, 3, 6, 7]]  # same pp: tp*rdp ranks
    assert t.all_groups("mp") == [[0, 1, 2, 3], [4, 5, 6, 7]]  # same rdp: pp*tp ranks
    assert (t.dp, t.mp, t.rdp) == (4, 4, 2)
    assert [t.mp_rank(r) for r in range(4)] == [0, 1, 2, 3]
    assert [t.dp_rank(r) for r in (0, 1, 4, 5)] == [0, 1, 2, 3]


@pytest.mark.parametrize("order", ["".join(p) for p in itertools.permutations("DPT")])
@pytest.mark.parametrize("world,pp,tp", [(8, 2, 2), (12, 3, 2), (12, 2, 3), (6, 1, 3), (4, 4, 1)])
def test_every_permutation_matches_enumeration(order, world, pp, tp):
    t = Topology(world, pp=pp, tp=tp, placement=order)
    ref = reference_coords(world, pp, tp, order)
    for rank in range(world):
        assert t.coords(rank) == ref[rank]
        c = ref[rank]
        assert t.rank_of(pp_rank=c["P"], tp_rank=c["T"], rdp_rank=c["D"]) == rank
        same = lambda letters: sorted(r for r, o in ref.items()  # noqa: E731
                                      if all(o[x] == c[x] for x in letters))
        assert t.group("tp", rank) == same("DP")
        assert t.group("pp", rank) == same("DT")
        assert t.group("rdp", rank) == same("PT")
        assert t.group("dp", rank) == same("P")
        assert t.group("mp", rank) == same("D")


@settings(max_examples=60, deadline=None)
@given(pp=st.integers(1, 4), tp=st.integers(1, 4), rdp=st.integers(1, 4),
       order=st.sampled_from(["cluster", "spread", "DTP", "PDT", "PTD", "TDP"]))
def test_identities(pp, tp, rdp, order):
    world = pp * tp * rdp
    t = Topology(world, pp=pp, tp=tp, placement=order)
    assert t.mp == pp * tp and t.dp == tp * rdp and t.rdp == rdp
    assert t.size("world") == world and t.size("mp") == t.mp and t.size("dp") == t.dp
    for kind in ("mp", "dp", "tp", "pp", "rdp"):
        groups = t.all_groups(kind)
        assert sorted(r for g in groups for r in g) == list(range(world))  # a partition
        assert len(groups) * len(groups[0]) == world
    for r in range(world):
        assert t.group_rank("tp", r) == t.tp_rank(r)
        assert t.group_rank("pp", r) == t.pp_rank(r)
        assert t.group_rank("rdp", r) == t.rdp_rank(r)
        # tp group lies inside both the dp and the mp group of the rank
        assert set(t.group("tp", r)) <= set(t.group("dp", r)) & set(t.group("mp", r))


def test_error_shows_the_arithmetic():
    with pytest.raises(SMPConfigError, match=r"\(2 \* 3 = 6\) must divide the world size \(8\)"):
        Topology(8, pp=2, tp=3)


def test_error_is_a_config_error_and_names_bad_placement():
    with pytest.raises(ConfigError, match="placement_strategy \\('DDT'\\)"):
        Topology(4, placement="DDT")
    with pytest.raises(SMPConfigError, match="tensor_parallel_degree \\(0\\)"):
        Topology(4, tp=0)
    with pytest.raises(SMPConfigError, match=r"rank \(9\) must be in 0..3"):
        Topology(4).coords(9)


def test_frozen():
    t = Topology(4, pp=2)
    with pytest.raises(Exception):
        t.pp = 4
