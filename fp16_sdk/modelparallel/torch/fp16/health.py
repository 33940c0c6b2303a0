"""The FP16 health log: every N steps on rank 0, the loss scale, the skipped-step count and the
memory figures of memory_report.health_figures (optimizer state per rank, offloaded
activations, delayed-initialization parameters). One `HealthLog` per DistributedOptimizer
holds the interval and what it last reported; it reads only the optimizer's public counters."""

from __future__ import annotations

import logging
import os

from ..errors import SMPConfigError
from ..state import state

__all__ = ["LOG_INTERVAL_ENV", "log_interval", "HealthLog"]

LOG_INTERVAL_ENV = "SMP_LOG_INTERVAL"


def log_interval() -> int:
    """Steps between two health lines, from SMP_LOG_INTERVAL (default 50, 0 = off).

    Raises:
        SMPConfigError: the variable is not a whole number >= 0.
    """
    raw = os.environ.get(LOG_INTERVAL_ENV, "50")
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise SMPConfigError(f"{LOG_INTERVAL_ENV} ({raw!r}) must be a whole number of steps >= 0 "
                             "(0 turns the FP16 health log off)", key=LOG_INTERVAL_ENV, value=raw)
    return value


class HealthLog:
    """Logs one line every `interval` steps (SMP_LOG_INTERVAL) on rank 0.

    Raises:
        SMPConfigError: SMP_LOG_INTERVAL is not a whole number >= 0 (at construction).
    """

    def __init__(self):
        self.interval = log_interval()
        self._logged_skips = 0  # skipped_steps at the last line

    def after_step(self, opt) -> None:
        """Called by DistributedOptimizer.step() once `opt.steps` counts the step."""
        if self.interval and opt.steps % self.interval == 0 and state.rank == 0:
            self._log(opt)

    def _log(self, opt) -> None:
        """One line: step, mode, loss scale, skipped steps (in all and since the last line)."""
        logger = logging.getLogger("smp.fp16")
        if not logger.hasHandlers():
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("[smp] %(message)s"))
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
        recent = opt.skipped_steps - self._logged_skips
        self._logged_skips = opt.skipped_steps
        mode = "fp16" if opt.fp16 else "bf16" if opt.bf16 else "fp32"
        from ..memory_report import health_figures
        logger.info("step %d (%s): loss scale %g, skipped steps %d in total, %d in the last %d; "
                    "%s", opt.steps, mode, opt.loss_scale, opt.skipped_steps, recent,
                    self.interval, health_figures(opt))
