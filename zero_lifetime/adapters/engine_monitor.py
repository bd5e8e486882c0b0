"""DeepSpeed's monitor (TensorBoard / W&B / CSV / Comet) of an engine (DeepSpeed 0.19.8 and 0.17.6)."""

from .errors import require


class EngineMonitor:

    def __init__(self, engine):
        self._engine = engine
        self._monitor = require(engine, "monitor", "the engine's monitor")
        require(self._monitor, "write_events", "the monitor's event writer")
        require(engine, "global_samples", "the engine's sample counter")

    @property
    def enabled(self) -> bool:
        return bool(getattr(self._monitor, "enabled", False))

    def write(self, values: dict, prefix: str) -> None:
        """One event per value, at the engine's sample count (DeepSpeed's own x axis)."""
        step = self._engine.global_samples
        self._monitor.write_events([(f"{prefix}/{name}", value, step) for name, value in values.items()])
