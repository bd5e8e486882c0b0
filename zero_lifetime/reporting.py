"""Logging and metrics through DeepSpeed's own channels.

Log records go to a child of DeepSpeed's logger ("DeepSpeed.zero_lifetime"), so they
share its handler, format and level, and only rank 0 logs unless
ZERO_LIFETIME_LOG_ALL_RANKS=1. stats() go to DeepSpeed's monitor (TensorBoard, W&B, CSV,
Comet: whatever the config enables) after each optimizer step.
"""

import logging
import os

LOGGER_NAME = "DeepSpeed.zero_lifetime"
ALL_RANKS_ENV = "ZERO_LIFETIME_LOG_ALL_RANKS"


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class RankZeroFilter(logging.Filter):

    def filter(self, record: logging.LogRecord) -> bool:
        if os.environ.get(ALL_RANKS_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
            return True
        return _rank() == 0


def get_logger() -> logging.Logger:
    logger = logging.getLogger(LOGGER_NAME)
    if not any(isinstance(f, RankZeroFilter) for f in logger.filters):
        logger.addFilter(RankZeroFilter())
    return logger


class StatsReporter:
    """Writes the numeric stats() to DeepSpeed's monitor after each applied optimizer step."""

    PREFIX = "zero_lifetime"
    NOT_METRICS = ("stage", )

    def __init__(self, engine, stats):
        from .adapters.engine_monitor import EngineMonitor
        self._monitor = EngineMonitor(engine)
        self._stats = stats

    def after_step(self) -> None:
        if not self._monitor.enabled:
            return
        values = {k: v for k, v in self._stats().items()
                  if k not in self.NOT_METRICS and isinstance(v, (int, float)) and not isinstance(v, bool)}
        self._monitor.write(values, self.PREFIX)
