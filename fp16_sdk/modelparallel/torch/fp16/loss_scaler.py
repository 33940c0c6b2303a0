"""Loss scalers: the dynamic rule of smp v1 (legacy Megatron / DeepSpeed) and a static one.

The dynamic rule of smp v1, reproduced exactly:

    state: cur_scale = init_scale, cur_iter = 0, last_overflow_iter = -1,
           cur_hysteresis = delayed_shift
    update_scale(overflow):
      overflow:    shrink (max(cur_scale / scale_factor, min_scale)) if delayed_shift == 1
                   or cur_hysteresis == 1, else spend one unit of hysteresis;
                   last_overflow_iter = cur_iter
      no overflow: consecutive_hysteresis refills the hysteresis on every good step;
                   every scale_window-th good step since the last overflow doubles the
                   scale (and refills the hysteresis when consecutive_hysteresis is off)
      always:      cur_iter += 1

So the first doubling happens at iteration scale_window - 1 (because last_overflow_iter
starts at -1), there is no upper cap and the floor is min_scale.
"""

from __future__ import annotations

import warnings

from ..errors import SMPConfigError

__all__ = ["DynamicLossScaler", "StaticLossScaler", "DYNAMIC_LOSS_ARGS", "make_scaler"]

# Keys DistributedOptimizer accepts in dynamic_loss_args (or flattened), with smp's defaults.
DYNAMIC_LOSS_ARGS = {
    "init_scale": 2.0**32,
    "scale_factor": 2.0,
    "scale_window": 1000,
    "min_scale": 1.0,
    "delayed_shift": 1,
    "consecutive_hysteresis": False,
}

# Consecutive overflows at the floor after which the scaler warns (once): the scale cannot
# shrink any more, so every further step is skipped and training makes no progress.
_FLOOR_OVERFLOWS_BEFORE_WARNING = 3


class DynamicLossScaler:
    """The smp v1 dynamic loss scaler.

    Args:
        init_scale: starting scale.
        scale_factor: factor of each increase and decrease (> 1).
        scale_window: good steps since the last overflow between two increases (>= 1).
        min_scale: the floor the scale never goes below (> 0).
        delayed_shift: overflows tolerated before the scale shrinks (hysteresis, >= 1).
        consecutive_hysteresis: refill the hysteresis on every good step instead of only
            when the scale grows.

    Raises:
        SMPConfigError: an argument is out of range (the message names it and the fix).
    """

    def __init__(
        self,
        init_scale: float = 2.0**32,
        scale_factor: float = 2.0,
        scale_window: int = 1000,
        min_scale: float = 1.0,
        delayed_shift: int = 1,
        consecutive_hysteresis: bool = False,
    ):
        _check(init_scale > 0, "init_scale", init_scale, "a positive number such as 2**16")
        _check(scale_factor > 1, "scale_factor", scale_factor, "a number above 1 such as 2.0")
        _check(_is_int(scale_window) and scale_window >= 1, "scale_window", scale_window,
               "an integer >= 1 such as 1000")
        _check(min_scale > 0, "min_scale", min_scale, "a positive number such as 1")
        _check(_is_int(delayed_shift) and delayed_shift >= 1, "delayed_shift", delayed_shift,
               "an integer >= 1 (1 disables hysteresis)")
        self.scale_factor = float(scale_factor)
        self.scale_window = int(scale_window)
        self.min_scale = float(min_scale)
        self.delayed_shift = int(delayed_shift)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.cur_scale = float(init_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = self.delayed_shift
        self._floor_overflows = 0
        self._warned_floor = False

    @property
    def loss_scale(self) -> float:
        """The scale the next backward multiplies the loss by."""
        return self.cur_scale

    @property
    def dynamic(self) -> bool:
        return True

    def update_scale(self, overflow: bool) -> None:
        """Advance one iteration: apply the dynamic rule above for a step that did (not) overflow."""
        if overflow:
            at_floor = self.cur_scale <= self.min_scale
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
            self._note_floor_overflow(at_floor)
        else:
            self._floor_overflows = 0
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def _note_floor_overflow(self, at_floor: bool) -> None:
        self._floor_overflows = self._floor_overflows + 1 if at_floor else 0
        if self._floor_overflows >= _FLOOR_OVERFLOWS_BEFORE_WARNING and not self._warned_floor:
            self._warned_floor = True
            warnings.warn(
                f"FP16 gradients overflowed {self._floor_overflows} steps in a row with the loss "
                f"scale already at min_scale ({self.min_scale:g}); every such step is skipped, so "
                "training is not progressing. The model itself produces inf/NaN: lower the "
                "learning rate, check the inputs, or lower min_scale in dynamic_loss_args.",
                RuntimeWarning,
                stacklevel=3,
            )

    def state_dict(self) -> dict:
        """Everything needed to resume the rule exactly."""
        return {
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
            "scale_factor": self.scale_factor,
            "scale_window": self.scale_window,
            "min_scale": self.min_scale,
            "delayed_shift": self.delayed_shift,
            "consecutive_hysteresis": self.consecutive_hysteresis,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore from state_dict(); raises KeyError naming a missing key."""
        for key in ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis"):
            if key not in state:
                raise KeyError(f"loss scaler state has no {key!r}; give the dict state_dict() made")
        self.cur_scale = float(state["cur_scale"])
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
        self.cur_hysteresis = int(state["cur_hysteresis"])
        for key in ("scale_factor", "min_scale"):
            if key in state:
                setattr(self, key, float(state[key]))
        for key in ("scale_window", "delayed_shift"):
            if key in state:
                setattr(self, key, int(state[key]))
        if "consecutive_hysteresis" in state:
            self.consecutive_hysteresis = bool(state["consecutive_hysteresis"])

    def __repr__(self) -> str:
        return (f"DynamicLossScaler(scale={self.cur_scale:g}, iter={self.cur_iter}, "
                f"hysteresis={self.cur_hysteresis}/{self.delayed_shift})")


class StaticLossScaler:
    """A constant loss scale; overflowing steps are still skipped by the optimizer.

    Args:
        scale: the loss scale (> 0).
    """

    def __init__(self, scale: float = 1.0):
        _check(scale > 0, "static_loss_scale", scale, "a positive number such as 128.0")
        self.cur_scale = float(scale)
        self.cur_iter = 0

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    @property
    def dynamic(self) -> bool:
        return False

    def update_scale(self, overflow: bool) -> None:
        self.cur_iter += 1

    def state_dict(self) -> dict:
        return {"cur_scale": self.cur_scale, "cur_iter": self.cur_iter}

    def load_state_dict(self, state: dict) -> None:
        self.cur_scale = float(state["cur_scale"])
        self.cur_iter = int(state.get("cur_iter", 0))

    def __repr__(self) -> str:
        return f"StaticLossScaler(scale={self.cur_scale:g})"


def make_scaler(*, fp16: bool, static_loss_scale, dynamic_loss_scale: bool, args: dict):
    """The scaler DistributedOptimizer's arguments ask for.

    Args:
        fp16: fp16 training; otherwise the scale is 1.0 whatever the arguments (as in smp).
        static_loss_scale: the constant scale (None means 1.0).
        dynamic_loss_scale: use DynamicLossScaler.
        args: dynamic_loss_args merged with the flattened keywords (keys of DYNAMIC_LOSS_ARGS).

    Raises:
        SMPConfigError: an unknown key in `args`, or a value out of range.
    """
    unknown = sorted(set(args) - set(DYNAMIC_LOSS_ARGS))
    if unknown:
        raise SMPConfigError(
            f"DistributedOptimizer got unknown loss-scale argument(s) {unknown}; valid keys are "
            f"{sorted(DYNAMIC_LOSS_ARGS)} (in dynamic_loss_args={{...}} or as keywords)",
            key=unknown[0], value=args[unknown[0]])
    if not fp16:
        return StaticLossScaler(1.0)  # loss-scale arguments act only with fp16, as in smp
    if dynamic_loss_scale:
        return DynamicLossScaler(**{**DYNAMIC_LOSS_ARGS, **args})
    return StaticLossScaler(1.0 if static_loss_scale is None else static_loss_scale)


def _is_int(value) -> bool:
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


def _check(ok: bool, key: str, value, fix: str) -> None:
    if not ok:
        raise SMPConfigError(f"loss scaler argument {key} ({value!r}) is invalid; use {fix}",
                             key=key, value=value)
