"""Realistic sizes on a real GPU (skipped under the simulator): output and counters."""

import numpy as np
import pytest
from conftest import SCHEDULES, gpu, random_qkv

import loop_orders as lo
from loop_orders.reference import relative_error, tolerance


@gpu
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_realistic_size(schedule, causal, dtype, rng):
    b, h, n, d = 2, 4, 1024, 64
    q, k, v = random_qkv(rng, b, h, n, d, d, dtype)
    res = lo.attention(q, k, v, schedule=schedule, block_q=64, block_k=64, causal=causal,
                       save_lse=True, count=True)
    ref, ref_lse = lo.attention_reference(q, k, v, causal=causal)
    roundings = lo.get_schedule(schedule).output_roundings(res.problem)
    err = relative_error(res.out, ref)
    print(f"{schedule} causal={causal} {dtype}: relative error {err:.2e}, {res.ms:.2f} ms")
    assert err <= tolerance(dtype, roundings, v, ref)
    np.testing.assert_allclose(res.lse, ref_lse, rtol=1e-5, atol=1e-4)
    assert res.counts == lo.get_schedule(schedule).model(res.problem)


@gpu
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tail_blocks_and_odd_dims_at_scale(schedule, rng):
    q, k, v = random_qkv(rng, 3, 5, 777, 72, 40)
    res = lo.attention(q, k, v, schedule=schedule, block_q=48, block_k=40, causal=True,
                       count=True)
    ref, _ = lo.attention_reference(q, k, v, causal=True)
    assert relative_error(res.out, ref) <= 1e-5
    assert res.counts == lo.get_schedule(schedule).model(res.problem)
