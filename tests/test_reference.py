import numpy as np
import pytest
from conftest import SCHEDULES, random_qkv

import loop_orders as lo


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_masked_nonfinite_v_reaches_only_rows_that_see_it(bad, rng):
    q, k, v = random_qkv(rng, 1, 2, 9, 4, 3)
    v[0, 1, 6, 2] = bad
    ref, _ = lo.attention_reference(q, k, v, causal=True)
    assert np.isfinite(ref[0, 1, :6]).all()  # rows 0..5 never see key 6
    assert not np.isfinite(ref[0, 1, 6:, 2]).any()
    assert np.isfinite(ref[0, 0]).all() and np.isfinite(ref[0, 1, :, :2]).all()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_kernels_follow_the_reference_nan_pattern(schedule, rng):
    q, k, v = random_qkv(rng, 1, 1, 10, 4, 4)
    v[0, 0, 7, 1] = np.nan
    k[0, 0, 3, 0] = np.nan
    res = lo.attention(q, k, v, schedule=schedule, block_q=4, block_k=3, causal=True)
    ref, _ = lo.attention_reference(q, k, v, causal=True)
    np.testing.assert_array_equal(np.isnan(res.out), np.isnan(ref))
    finite = np.isfinite(ref)
    np.testing.assert_allclose(res.out[finite], ref[finite], rtol=1e-5, atol=1e-6)
