"""The simulator's time estimate (api.simulated_seconds) against the simulator itself, and
the refusal of a call over budget before anything runs."""

import time

import numpy as np
import pytest
from conftest import random_qkv

import loop_orders as lo
from loop_orders.api import simulated_seconds
from loop_orders.device import runtime

pytestmark = pytest.mark.skipif(not runtime.SIMULATOR, reason="the simulator's budget")


def fastest_call(q, k, v, **kw):
    """(seconds, result) of the fastest of three calls after a warm one: the least disturbed
    by other work on the machine (CI's test workers share its two cores)."""
    lo.attention(q, k, v, **kw)  # warm
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        res = lo.attention(q, k, v, **kw)
        runs.append(time.perf_counter() - t0)
    return min(runs), res


@pytest.mark.parametrize("schedule, n, d, block", [("q_outer", 32, 8, 16),
                                                    ("kv_outer", 32, 8, 8),
                                                    ("split_kv", 24, 4, 8)])
def test_estimate_is_within_a_few_times_of_the_simulator(schedule, n, d, block, rng):
    """The estimate is rough: on a two-core machine like CI's, the fused orders at these
    tiny sizes take 3-6 times it (kv_outer 1.05 s alone, 1.23 s beside other work, against
    0.21 s), dense about it; a band of 8 either way keeps the test to what it checks (an
    estimate of the right size) rather than to the machine's speed."""
    q, k, v = random_qkv(rng, 1, 1, n, d, d)
    took, res = fastest_call(q, k, v, schedule=schedule, block_q=block, block_k=block)
    estimate = simulated_seconds(lo.get_schedule(schedule), res.problem)
    assert estimate / 8 <= took <= estimate * 8, (took, estimate)


def test_over_budget_is_refused_before_launch_with_the_estimate(rng, monkeypatch,
                                                               fresh_calls):
    monkeypatch.setenv("LOOP_ORDERS_SIMULATOR_BUDGET_S", "0.001")
    monkeypatch.setattr(runtime, "device_empty", lambda *a: pytest.fail("launched"))
    q, k, v = random_qkv(rng, 1, 1, 16, 4, 4)
    with pytest.raises(ValueError, match=r"^n: the Numba CUDA simulator would take about .* s "
                                         r"for q_outer .*its budget is 0.001 s, "
                                         r"LOOP_ORDERS_SIMULATOR_BUDGET_S.*run on a GPU"):
        lo.attention(q, k, v, block_q=8, block_k=8)
    monkeypatch.setenv("LOOP_ORDERS_ALLOW_SLOW", "1")
    monkeypatch.undo()
    with pytest.warns(UserWarning, match="would take about"):
        monkeypatch.setenv("LOOP_ORDERS_SIMULATOR_BUDGET_S", "0.001")
        monkeypatch.setenv("LOOP_ORDERS_ALLOW_SLOW", "1")
        out = lo.attention(q, k, v, block_q=8, block_k=8).out
    assert np.isfinite(out).all()


def test_estimate_covers_the_tensor_core_emulation(rng):
    """float16 runs the tensor-core micro-kernel, whose warp-collective calls the simulator
    emulates (intrinsics._warp_gather): the estimate counts them."""
    q, k, v = random_qkv(rng, 1, 2, 40, 16, 16, "float16")
    took, res = fastest_call(q, k, v, schedule="q_outer", block_q=32, block_k=16)
    sched = lo.get_schedule("q_outer")
    assert sched.warp_exchanges(res.problem) > 0
    estimate = simulated_seconds(sched, res.problem)
    assert estimate / 5 <= took <= estimate * 5, (took, estimate)
