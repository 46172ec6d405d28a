"""compare.stats.ratio_interval against a hand computation of the t interval."""

import math
import statistics

import pytest

from leantrain.compare.stats import ratio_interval


def test_geometric_mean_with_a_student_t_interval():
    ratios = [0.97, 1.05, 1.01, 1.10]
    mean, low, high = ratio_interval(ratios)
    logs = [math.log(r) for r in ratios]
    assert mean == pytest.approx(math.exp(statistics.fmean(logs)))
    half = 3.18 * statistics.stdev(logs) / 2  # t(0.975, 3 dof), sqrt(4)
    assert (low, high) == pytest.approx((mean * math.exp(-half), mean * math.exp(half)))


def test_two_seeds_give_the_wide_one_degree_of_freedom_interval():
    mean, low, high = ratio_interval([1.039, 1.062])
    logs = [math.log(1.039), math.log(1.062)]
    half = 12.71 * statistics.stdev(logs) / math.sqrt(2)
    assert low == pytest.approx(mean * math.exp(-half)) and low < 1 < high


def test_one_ratio_has_no_interval_and_a_diverged_run_has_nothing():
    one = ratio_interval([1.3])
    assert one[0] == pytest.approx(1.3) and math.isnan(one[1]) and math.isnan(one[2])
    for bad in (math.nan, math.inf, 0.0, -1.0):
        assert all(math.isnan(x) for x in ratio_interval([1.0, bad]))
