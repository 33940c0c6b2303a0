"""The dynamic loss scaler against hand-computed tables and a reference written from §5.1's text."""

from __future__ import annotations

import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fp16_sdk.modelparallel.torch.errors import SMPConfigError
from fp16_sdk.modelparallel.torch.fp16.loss_scaler import DynamicLossScaler, StaticLossScaler

T, F = True, False


def run(flags, **kw):
    """(scale, hysteresis) after each update."""
    s = DynamicLossScaler(**kw)
    out = []
    for flag in flags:
        s.update_scale(flag)
        out.append((s.loss_scale, s.cur_hysteresis))
    return out


# Each table: arguments, overflow flags, expected (scale, hysteresis) after each update.
# Worked by hand from the rule: a doubling happens on a good step at iteration i when
# (i - last_overflow_iter) % scale_window == 0, with last_overflow_iter starting at -1.
TABLES = [
    pytest.param(dict(init_scale=16, scale_window=3, delayed_shift=1), [F, F, F, F, F, F],
                 [(16, 1), (16, 1), (32, 1), (32, 1), (32, 1), (64, 1)], id="no-overflow"),
    pytest.param(dict(init_scale=16, scale_window=3, delayed_shift=1), [F, F, F, T, F, F, F],
                 [(16, 1), (16, 1), (32, 1), (16, 1), (16, 1), (16, 1), (32, 1)],
                 id="shift1-overflow-restarts-window"),
    pytest.param(dict(init_scale=16, scale_window=3, delayed_shift=2), [T, T, T, F, F, F, T],
                 [(16, 1), (8, 1), (4, 1), (4, 1), (4, 1), (8, 2), (8, 1)],
                 id="shift2-refill-only-at-doubling"),
    pytest.param(dict(init_scale=16, scale_window=3, delayed_shift=2), [T, F, T, T],
                 [(16, 1), (16, 1), (8, 1), (4, 1)], id="shift2-no-consecutive"),
    pytest.param(dict(init_scale=16, scale_window=3, delayed_shift=2, consecutive_hysteresis=True),
                 [T, F, T, T], [(16, 1), (16, 2), (16, 1), (8, 1)], id="shift2-consecutive"),
    pytest.param(dict(init_scale=16, scale_window=2, delayed_shift=3, consecutive_hysteresis=True),
                 [T, T, F, T, T, T], [(16, 2), (16, 1), (16, 3), (16, 2), (16, 1), (8, 1)],
                 id="shift3-consecutive"),
    pytest.param(dict(init_scale=4, min_scale=2, delayed_shift=1), [T, T, T],
                 [(2, 1), (2, 1), (2, 1)], id="min-scale-floor"),
    pytest.param(dict(init_scale=8, scale_factor=4, scale_window=1, delayed_shift=1), [F, T, F],
                 [(32, 1), (8, 1), (32, 1)], id="factor4-window1"),
]


@pytest.mark.parametrize("kw,flags,expected", TABLES)
def test_hand_computed_tables(kw, flags, expected):
    assert run(flags, **kw) == expected


def test_first_doubling_at_scale_window_minus_one():
    s = DynamicLossScaler()  # smp defaults: 2**32, x2, window 1000
    for _ in range(999):     # iterations 0..998
        s.update_scale(False)
    assert s.loss_scale == 2.0**32
    s.update_scale(False)    # iteration 999 = scale_window - 1
    assert s.loss_scale == 2.0**33
    for _ in range(999):
        s.update_scale(False)
    assert s.loss_scale == 2.0**33
    s.update_scale(False)
    assert s.loss_scale == 2.0**34  # no upper cap


def test_persistent_overflow_at_floor_warns_once():
    s = DynamicLossScaler(init_scale=2, min_scale=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(10):
            s.update_scale(True)
    floor = [w for w in caught if "min_scale" in str(w.message)]
    assert len(floor) == 1 and issubclass(floor[0].category, RuntimeWarning)
    assert s.loss_scale == 1


def test_state_dict_resumes_exactly():
    flags = [T, F, F, T, T, F, F, F, F, T, F]
    a = DynamicLossScaler(init_scale=64, scale_window=2, delayed_shift=2)
    for f in flags[:5]:
        a.update_scale(f)
    b = DynamicLossScaler()
    b.load_state_dict(a.state_dict())
    for f in flags[5:]:
        a.update_scale(f)
        b.update_scale(f)
        assert (a.loss_scale, a.cur_hysteresis, a.cur_iter) == (b.loss_scale, b.cur_hysteresis, b.cur_iter)


@pytest.mark.parametrize("key,value", [("scale_window", 0), ("delayed_shift", 0),
                                       ("scale_factor", 1.0), ("min_scale", 0), ("init_scale", -1)])
def test_bad_arguments_name_the_key(key, value):
    with pytest.raises(SMPConfigError, match=key):
        DynamicLossScaler(**{key: value})


def test_static_scaler_is_constant():
    s = StaticLossScaler(128.0)
    for f in [T, F, T]:
        s.update_scale(f)
    assert s.loss_scale == 128.0 and not s.dynamic
    with pytest.raises(SMPConfigError, match="static_loss_scale"):
        StaticLossScaler(0)


def reference(flags, init_scale, scale_factor, scale_window, min_scale, delayed_shift, consecutive):
    """§5.1 read literally, as a fold over (iteration, flag)."""
    scale, last_overflow, hyst, trace = init_scale, -1, delayed_shift, []
    for it, overflow in enumerate(flags):
        if overflow:
            if delayed_shift == 1 or hyst == 1:
                scale = max(scale / scale_factor, min_scale)
            else:
                hyst -= 1
            last_overflow = it
        else:
            if consecutive:
                hyst = delayed_shift
            if (it - last_overflow) % scale_window == 0:
                if not consecutive:
                    hyst = delayed_shift
                scale *= scale_factor
        trace.append((scale, hyst))
    return trace


@settings(max_examples=300, deadline=None)
@given(flags=st.lists(st.booleans(), max_size=60),
       init_exp=st.integers(0, 40), factor=st.sampled_from([1.5, 2.0, 4.0]),
       window=st.integers(1, 8), min_scale=st.sampled_from([0.25, 1.0, 4.0]),
       shift=st.integers(1, 4), consecutive=st.booleans())
def test_matches_reference(flags, init_exp, factor, window, min_scale, shift, consecutive):
    kw = dict(init_scale=2.0**init_exp, scale_factor=factor, scale_window=window,
              min_scale=min_scale, delayed_shift=shift, consecutive_hysteresis=consecutive)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = run(flags, **kw)
    assert got == reference(flags, 2.0**init_exp, factor, window, min_scale, shift, consecutive)
