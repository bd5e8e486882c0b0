"""Side-by-side timing: every method once per round, rounds interleaved, so drift hits all alike."""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple


def synchronizer(device: str) -> Callable[[], None]:
    if device == "cuda":
        import torch
        return torch.cuda.synchronize
    return lambda: None


def interleave(methods: Dict[str, Callable[[], object]], device: str, repeats: int, warmup: int = 2,
               setup: Optional[Dict[str, Callable[[], object]]] = None,
               calls_per_round: int = 1) -> Dict[str, List[float]]:
    """Seconds per call of each method; ``setup[name]`` runs untimed before each of its calls.

    With ``calls_per_round`` > 1 a method runs that many times in a row per round and the
    round's sample is their median (calls too short to time one by one)."""
    sync = synchronizer(device)
    setup = setup or {}
    samples: Dict[str, List[float]] = {name: [] for name in methods}
    for round_index in range(warmup + repeats):
        for name, fn in methods.items():
            calls = []
            for _ in range(calls_per_round):
                if name in setup:
                    setup[name]()
                sync()
                start = time.perf_counter()
                fn()
                sync()
                calls.append(time.perf_counter() - start)
            if round_index >= warmup:
                samples[name].append(statistics.median(calls))
    return samples


def paired_ratios(samples: Dict[str, Sequence[float]], method: str, reference: str) -> List[float]:
    """``method`` time / ``reference`` time of each round: a round runs its methods back to
    back, so drift from one round to the next (other jobs on shared cores) cancels."""
    return [a / b for a, b in zip(samples[method], samples[reference])]


def median_interval(values: Sequence[float], confidence: float = 0.95) -> Optional[Tuple[float, float]]:
    """A distribution-free confidence interval of the median of ``values``: the order
    statistics x_(k) and x_(n+1-k), with k the largest rank for which the chance that fewer
    than k of n draws fall below the true median, P(Binomial(n, 1/2) < k), is at most
    (1 - confidence) / 2. Assumes nothing of the distribution (rounds of a loaded machine are
    skewed). None when there are too few values for any such interval (n < 6 at 95%)."""
    ordered = sorted(values)
    n = len(ordered)
    tail = (1 - confidence) / 2
    below, k = 0.0, 0
    while k < n:
        chance = math.comb(n, k) / 2 ** n  # P(Binomial(n, 1/2) = k)
        if below + chance > tail:
            break
        below += chance
        k += 1
    if k == 0:
        return None
    return ordered[k - 1], ordered[n - k]
