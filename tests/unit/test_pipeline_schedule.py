"""Pipeline schedules as data: builders, simulator (deadlock-freedom, bubble), grid."""

from fractions import Fraction

import pytest

from fp16_sdk.errors import ConfigError
from fp16_sdk.modelparallel.torch.pipeline.schedule import (
    B, F, O, Schedule, build_schedule, format_grid, forward_only_schedule, interleaved_schedule,
    messages, simple_schedule, switch_to_forward_only)
from fp16_sdk.modelparallel.torch.pipeline.simulate import (
    ScheduleError, check_schedule, simulate)

SIZES = [(p, m) for p in (2, 4) for m in (1, 2, 4, 8, 16)]


@pytest.mark.parametrize("p,m", SIZES)
@pytest.mark.parametrize("name", ["simple", "interleaved"])
def test_deadlock_free_and_bubble_matches_formula(name, p, m):
    schedule = build_schedule(name, p, m, p + 2)
    result = check_schedule(schedule)  # raises on deadlock / message order / in-flight bound
    # performance.md: idle fraction (p-1)/(m+p-1); exact with unit costs.
    assert Fraction(result.idle_fraction).limit_denominator(1000) == Fraction(p - 1, m + p - 1)
    assert result.makespan == (m + p - 1) * 2


@pytest.mark.parametrize("t_f,t_b", [(1.0, 2.0), (0.25, 1.0), (3.0, 1.0)])
@pytest.mark.parametrize("name", ["simple", "interleaved"])
def test_makespan_in_units_of_tf_plus_tb(name, t_f, t_b):
    for p, m in SIZES:
        result = simulate(build_schedule(name, p, m), t_f=t_f, t_b=t_b)
        assert result.makespan == pytest.approx((m + p - 1) * (t_f + t_b))
        assert result.idle_fraction == pytest.approx((p - 1) / (m + p - 1))


def test_one_f_one_b_lists_by_hand():
    # p=2, m=3: stage 0 warms up with one forward, stage 1 alternates from the start.
    s = interleaved_schedule(2, 3)
    assert s.stages[1] == (F(0), B(0), F(1), B(1), F(2), B(2))
    # stage 0 takes each output just before the gradient that the last stage sent after it.
    assert s.stages[0] == (F(0), F(1), O(0), B(0), F(2), O(1), B(1), O(2), B(2))


def test_simple_lists_by_hand():
    s = simple_schedule(2, 2)
    assert s.stages[1] == (F(0), F(1), B(0), B(1))
    assert s.stages[0] == (F(0), F(1), O(0), O(1), B(0), B(1))


@pytest.mark.parametrize("active", [1, 2, 3])
def test_in_flight_bound_is_respected(active):
    for p, m in SIZES:
        result = check_schedule(interleaved_schedule(p, m, active))
        assert max(result.max_in_flight) <= active


def test_simple_keeps_every_microbatch_in_flight():
    assert check_schedule(simple_schedule(4, 8)).max_in_flight == (8, 8, 8, 8)


def test_one_f_one_b_in_flight_is_stage_depth():
    assert check_schedule(interleaved_schedule(4, 8)).max_in_flight == (4, 3, 2, 1)


def test_deadlock_is_detected_and_explained():
    good = simple_schedule(2, 2)
    # stage 1 does B1 before B0 while stage 0 waits for grad0 first: channel order breaks;
    # and a stage-0 list that wants B0's gradient before anyone has sent it deadlocks.
    bad = Schedule("bad", 2, 2, None, ((F(0), O(0), B(0), F(1), O(1), B(1)),
                                       good.stages[1]))
    with pytest.raises(ScheduleError, match="deadlocks: stage 0 at B0 waits for grad0"):
        simulate(bad)


def test_message_order_mismatch_is_detected():
    good = simple_schedule(2, 2)
    swapped = Schedule("swapped", 2, 2, None, (good.stages[0], (F(0), F(1), B(1), B(0))))
    with pytest.raises(ScheduleError, match="would receive"):
        simulate(swapped)


def test_missing_action_is_detected():
    with pytest.raises(ScheduleError, match="exactly once"):
        simulate(Schedule("short", 2, 1, None, ((F(0), B(0)), (F(0), B(0)))))


def test_messages_table():
    assert messages(4, 0, F(2)) == ([], [_msg(0, 1, "act", 2)])
    assert messages(4, 3, F(2)) == ([_msg(2, 3, "act", 2)],
                                    [_msg(3, d, "out", 2) for d in range(3)])
    assert messages(4, 1, B(5)) == ([_msg(2, 1, "grad", 5)], [_msg(1, 0, "grad", 5)])
    assert messages(4, 0, O(1)) == ([_msg(3, 0, "out", 1)], [])


def _msg(src, dst, what, mb):
    from fp16_sdk.modelparallel.torch.pipeline.schedule import Message
    return Message(src, dst, what, mb)


def test_grid_shows_the_bubble():
    grid = format_grid(interleaved_schedule(2, 2)).splitlines()
    assert grid[1].split()[2:] == ["F0", "F1", ".", "B0", ".", "B1"]
    assert grid[2].split()[2:] == [".", "F0", "B0", "F1", "B1", "."]
    assert "idle=0.333" in grid[-1]


@pytest.mark.parametrize("bad", [
    lambda: build_schedule("zigzag", 2, 4),
    lambda: simple_schedule(0, 4),
    lambda: interleaved_schedule(2, 0),
    lambda: interleaved_schedule(2, 4, 0),
])
def test_bad_sizes_name_the_key(bad):
    with pytest.raises(ConfigError) as info:
        bad()
    assert info.value.key in {"pipeline", "pipeline_parallel_degree", "microbatches",
                              "active_microbatches"}


# ---- forward-only steps (evaluation) ---------------------------------------------------------
@pytest.mark.parametrize("p,m", SIZES)
def test_forward_only_is_deadlock_free_with_the_forward_bubble(p, m):
    schedule = forward_only_schedule(p, m)
    assert all(a.kind.value != "B" for stage in schedule.stages for a in stage)
    result = check_schedule(schedule)  # every F, every O on non-last stages, channel order
    # only forwards: makespan (m+p-1) t_f, idle (p-1)/(m+p-1), nothing held after a forward
    assert result.makespan == m + p - 1 and max(result.max_in_flight) == 1
    assert Fraction(result.idle_fraction).limit_denominator(1000) == Fraction(p - 1, m + p - 1)
    # the O receives never hold a forward back: stage s runs F(k) at time s + k
    for e in result.timeline:
        if e.action.kind.value == "F":
            assert e.start == e.stage + e.action.mb, e


def test_forward_only_lists_by_hand():
    s = forward_only_schedule(2, 3)
    assert s.stages[1] == (F(0), F(1), F(2))
    assert s.stages[0] == (F(0), F(1), O(0), F(2), O(1), O(2))


@pytest.mark.parametrize("p,m", SIZES)
@pytest.mark.parametrize("name", ["simple", "interleaved"])
def test_switch_to_forward_only_at_b0_is_deadlock_free(name, p, m):
    for active in (1, 2, p, p + 2):
        train = build_schedule(name, p, m, active)
        switched = switch_to_forward_only(train)
        for s, (before, after) in enumerate(zip(train.stages, switched.stages)):
            cut = before.index(B(0)) + 1  # the engine switches lists right after B0
            assert after[:cut] == before[:cut]
            assert after[cut:] == tuple(a for a in before[cut:] if a.kind.value != "B")
        check_schedule(switched)  # B0's marker and the outputs keep their channel order
        if active >= p:  # with a free B0 (it only passes the marker) no bubble is added
            assert simulate(switched, t_f=1, t_b=0).makespan == m + p - 1


def test_switch_needs_b0_first():
    odd = Schedule("odd", 2, 2, None, ((F(0), F(1), O(0), O(1), B(1), B(0)),
                                       (F(0), F(1), B(1), B(0))))
    with pytest.raises(ValueError, match="stage 0 of the odd schedule runs B1 before B0"):
        switch_to_forward_only(odd)
