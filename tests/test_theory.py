"""Theorem 2 block sizes and bounds, the Saha–Ye bound, and the power-law fit."""

import numpy as np
import pytest

import loop_orders as lo
from loop_orders import theory


def test_flash_block_sizes_follow_algorithm_1():
    assert theory.flash_block_sizes(64, 4) == (4, 4)
    assert theory.flash_block_sizes(1024, 16) == (16, 16)
    assert theory.flash_block_sizes(100, 8) == (4, 4)      # ceil(100/32) = 4 <= d
    assert theory.flash_block_sizes(4096, 8) == (8, 128)   # Br capped at d
    assert lo.get_schedule("kv_outer").tiles_for_sram(4096, 8) == theory.flash_block_sizes(4096, 8)
    with pytest.raises(ValueError, match="M >= 1"):
        theory.flash_block_sizes(0, 4)


def test_theorem2_range_and_bounds():
    assert theory.theorem2_range(1024, 64) == (64, 65536)
    assert theory.in_theorem2_range(1024, 64, 64) and not theory.in_theorem2_range(1024, 64, 63)
    assert theory.standard_traffic(10, 3) == 130
    assert theory.flash_traffic(10, 3, 9) == 100
    # Saha–Ye: equals FA's form for M >= d^2, below it for M < d^2
    n, d = 1024, 64
    assert theory.saha_ye_lower_bound(n, d, d**2) == pytest.approx(theory.flash_traffic(n, d, d**2))
    assert theory.saha_ye_lower_bound(n, d, 4 * d**2) == pytest.approx(
        theory.flash_traffic(n, d, 4 * d**2))
    small = d**2 // 4
    assert theory.saha_ye_lower_bound(n, d, small) < theory.flash_traffic(n, d, small)
    assert list(theory.flash_optimal(d, [small, d**2])) == [False, True]


def test_fit_power_law_recovers_exponent_and_error():
    x = np.array([2.0, 4, 8, 16, 32])
    fit = theory.fit_power_law(x, 3 * x**-1)
    assert fit.slope == pytest.approx(-1) and fit.stderr == pytest.approx(0, abs=1e-12)
    assert fit.predict([64])[0] == pytest.approx(3 / 64)
    noisy = 5 * x**2 * np.array([1.1, 0.9, 1.05, 0.95, 1.0])
    fit = theory.fit_power_law(x, noisy)
    assert abs(fit.slope - 2) < 0.1 and 0 < fit.stderr < 0.1 and fit.points == 5
    with pytest.raises(ValueError, match="at least 3"):
        theory.fit_power_law([1, 2], [1, 2])
    with pytest.raises(ValueError, match="positive"):
        theory.fit_power_law([1, 2, 3], [1, 0, 2])


@pytest.mark.parametrize("schedule", [s.name for s in lo.all_schedules()
                                      if s.EXPECTED_SLOPES.get("m") == -1])
def test_flash_schedules_scale_as_theorem2(schedule):
    """Model traffic with each schedule's own tiles ~ N^2 d^2 / M deep inside the range."""
    sched = lo.get_schedule(schedule)
    n, d = 8192, 16
    ms = [256, 512, 1024, 2048]
    traffic = []
    for m in ms:
        bq, bk = sched.tiles_for_sram(m, d)
        p = lo.Problem(n_q=n, n_k=n, d=d, dv=d, block_q=bq, block_k=bk)
        traffic.append(sched.model(p).total)
    assert theory.fit_power_law(ms, traffic).slope == pytest.approx(-1, abs=0.05)
