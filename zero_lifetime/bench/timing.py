"""Side-by-side timing: every method once per round, rounds interleaved, so drift hits all alike."""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional


def synchronizer(device: str) -> Callable[[], None]:
    if device == "cuda":
        import torch
        return torch.cuda.synchronize
    return lambda: None


def interleave(methods: Dict[str, Callable[[], object]], device: str, repeats: int, warmup: int = 2,
               setup: Optional[Dict[str, Callable[[], object]]] = None) -> Dict[str, List[float]]:
    """Seconds per call of each method; ``setup[name]`` runs untimed before each of its calls."""
    sync = synchronizer(device)
    setup = setup or {}
    samples: Dict[str, List[float]] = {name: [] for name in methods}
    for round_index in range(warmup + repeats):
        for name, fn in methods.items():
            if name in setup:
                setup[name]()
            sync()
            start = time.perf_counter()
            fn()
            sync()
            elapsed = time.perf_counter() - start
            if round_index >= warmup:
                samples[name].append(elapsed)
    return samples
