"""The benchmark's interval of a median, against the binomial order-statistic tables and by
its coverage on draws whose median is known."""

import math
import random

import pytest

from zero_lifetime.bench.timing import median_interval


@pytest.mark.parametrize("n, ranks", [(6, (1, 6)), (10, (2, 9)), (20, (6, 15)), (25, (8, 18))])
def test_ranks_are_the_tables(n, ranks):
    """Ranks of the 95% interval for the median as tabulated for the sign test (the largest k
    with P(Binomial(n, 1/2) < k) <= 2.5%): shuffled values 1..n give the ranks back."""
    values = list(range(1, n + 1))
    random.Random(n).shuffle(values)
    assert median_interval(values) == ranks


def test_too_few_values_give_no_interval():
    # With 5 draws all fall on one side of the median with chance 2/32 > 5%.
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None
    assert median_interval([]) is None


def test_the_interval_holds_the_true_median_as_often_as_it_says():
    """Skewed draws (exponential, median ln 2), 20 a run like the step bench's rounds: the
    interval covers the median in 95.9% of runs in theory (x_(6)..x_(15))."""
    rng = random.Random(0)
    runs, covered = 4000, 0
    for _ in range(runs):
        low, high = median_interval([rng.expovariate(1.0) for _ in range(20)])
        covered += low <= math.log(2) <= high
    assert 0.945 <= covered / runs <= 0.972
