"""Extreme values and limits: a correct result or a clear refusal, never a wrong number.

Numerics (README "Limits and numerics"): scores of magnitude 1e4 stay finite and correct in
every schedule (the online softmax subtracts the running max); float16 inputs are widened to
float32 on load, so products beyond float16's range are fine; a NaN in an input reaches exactly
the output rows that depend on it; with causal every row sees key 0, so no row is NaN.
"""

import numpy as np
import pytest
from conftest import SCHEDULES, random_qkv

import loop_orders as lo
from loop_orders.reference import relative_error, tolerance

# The simulator runs the kernels in NumPy scalars, which warn on NaN/inf arithmetic.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

EPS32 = 2.0**-24

# (block_q, block_k): single keys, tails, and diagonal tiles that are partly masked.
BLOCKS = [(4, 4), (3, 5), (1, 1), (8, 3)]


def scaled_qkv(rng, n, d, score_magnitude, dtype="float32", batch=0, heads=0):
    """Random inputs whose largest |q.k| / sqrt(d) is about `score_magnitude`."""
    q, k, v = random_qkv(rng, batch, heads, n, d, d, "float64")
    s = np.abs(np.einsum("...qd,...kd->...qk", q, k)).max() / np.sqrt(d)
    c = np.sqrt(score_magnitude / s)
    return (c * q).astype(dtype), (c * k).astype(dtype), v.astype(dtype)


def score_tolerance(q, k, dtype, roundings, v, ref):
    """The usual tolerance plus the float32 rounding of the scores themselves.

    A score s is formed in float32 (and scaled by log2 e), so it carries an absolute error of a
    few ulps of |s|; a weight exp(s - m) then has that relative error.
    """
    d = q.shape[-1]
    s_max = np.abs(np.einsum("...qd,...kd->...qk", q.astype(np.float64),
                             k.astype(np.float64))).max() / np.sqrt(d)
    return tolerance(dtype, roundings, v, ref) + 16 * EPS32 * s_max


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("magnitude", [1e2, 1e3, 1e4])
def test_huge_scores_are_finite_and_correct(schedule, causal, magnitude, rng):
    q, k, v = scaled_qkv(rng, 13, 4, magnitude, batch=1, heads=2)
    for bq, bk in BLOCKS:
        res = lo.attention(q, k, v, schedule=schedule, block_q=bq, block_k=bk, causal=causal,
                           save_lse=True)
        ref, ref_lse = lo.attention_reference(q, k, v, causal=causal)
        assert np.isfinite(res.out).all() and np.isfinite(res.lse).all()
        roundings = lo.get_schedule(schedule).output_roundings(res.problem)
        assert relative_error(res.out, ref) <= score_tolerance(q, k, "float32", roundings, v,
                                                               ref)
        np.testing.assert_allclose(res.lse, ref_lse, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("causal", [False, True])
def test_all_scores_of_a_row_hugely_negative(schedule, causal, rng):
    """Every score near -1e4: a softmax without the max shift would underflow to 0/0."""
    n, d = 11, 4
    base = rng.standard_normal(d)
    k = (base + 0.01 * rng.standard_normal((n, d))).astype(np.float32)
    q = np.tile(-1e4 * np.sqrt(d) / (base @ base) * base, (n, 1)).astype(np.float32)
    v = rng.standard_normal((n, d)).astype(np.float32)
    res = lo.attention(q, k, v, schedule=schedule, block_q=4, block_k=3, causal=causal)
    ref, _ = lo.attention_reference(q, k, v, causal=causal)
    assert np.isfinite(res.out).all()
    assert relative_error(res.out, ref) <= score_tolerance(q, k, "float32", 4, v, ref)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("causal", [False, True])
def test_float16_products_beyond_float16_range(schedule, causal, rng):
    """|q.k| ~ 1e6 (float16 ends at 65504) with scale 1e-5: inputs are widened to float32 on
    load and the scores are formed in float32, so nothing overflows."""
    q, k, v = random_qkv(rng, 0, 0, 12, 8, 8, "float16", scale=400.0)
    products = np.abs(q.astype(np.float64)[:, None, :] * k.astype(np.float64)[None, :, :])
    assert products.max() > 65504  # the products alone overflow float16
    res = lo.attention(q, k, v, schedule=schedule, block_q=4, block_k=4, causal=causal,
                       scale=1e-5, save_lse=True)
    ref, ref_lse = lo.attention_reference(q, k, v, causal=causal, scale=1e-5)
    assert res.out.dtype == np.float16 and np.isfinite(res.out).all()
    roundings = lo.get_schedule(schedule).output_roundings(res.problem)
    assert relative_error(res.out, ref) <= tolerance("float16", roundings, v, ref)
    np.testing.assert_allclose(res.lse, ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_float16_largest_values(schedule, rng):
    """q = k = 65504 everywhere: every score is 65504^2 * sqrt(d), all equal -> mean of V."""
    n, d = 9, 4
    q = np.full((n, d), 65504, np.float16)
    v = rng.standard_normal((n, d)).astype(np.float16)
    res = lo.attention(q, q.copy(), v, schedule=schedule, block_q=4, block_k=4)
    expected = np.broadcast_to(v.astype(np.float64).mean(axis=0), (n, d))
    assert np.isfinite(res.out).all()
    assert relative_error(res.out, expected) <= 1e-3


def _rows_attending(key, n, causal):
    return np.arange(n) >= key if causal else np.ones(n, dtype=bool)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("row", [0, 5])
def test_nan_reaches_exactly_the_outputs_that_depend_on_it(schedule, causal, where, row,
                                                          rng):
    """NaN in q[r, :] -> output row r; in k[c, :] -> every row that attends key c; in v[c, x]
    -> column x of every row that attends key c (and lse stays finite).

    Every other output element is exactly what it would be without the NaN (compared with the
    reference on inputs where the NaN is replaced by a number). Block sizes include single keys
    (a tile holding only the NaN key) and diagonal tiles where the NaN key is masked for some
    rows.
    """
    n, d = 10, 3
    q, k, v = random_qkv(rng, 0, 0, n, d, d)
    inputs = {"q": q, "k": k, "v": v}
    clean = {name: x.copy() for name, x in inputs.items()}
    inputs[where][row, 1] = np.nan
    rows = np.arange(n) == row if where == "q" else _rows_attending(row, n, causal)
    expect = np.zeros((n, d), dtype=bool)
    if where == "v":
        expect[rows, 1] = True
    else:
        expect[rows, :] = True
    ref, _ = lo.attention_reference(clean["q"], clean["k"], clean["v"], causal=causal)
    for bq, bk in BLOCKS:
        res = lo.attention(inputs["q"], inputs["k"], inputs["v"], schedule=schedule,
                           block_q=bq, block_k=bk, causal=causal, save_lse=True)
        np.testing.assert_array_equal(np.isnan(res.out), expect, err_msg=f"blocks {bq}x{bk}")
        if (~expect).any():
            assert relative_error(res.out[~expect], ref[~expect]) <= 1e-5
        lse_nan = rows if where != "v" else np.zeros(n, dtype=bool)
        np.testing.assert_array_equal(np.isnan(res.lse), lse_nan)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_float32_score_overflow_gives_nan_rows_never_wrong_numbers(schedule, rng):
    """|q.k| beyond float32's range: those rows become NaN (documented), others stay exact."""
    n, d = 8, 4
    q, k, v = random_qkv(rng, 0, 0, n, d, d)
    q[:3] *= np.float32(1e20)
    k[:] *= np.float32(1e20)
    res = lo.attention(q, k, v, schedule=schedule, block_q=4, block_k=4)
    ref, _ = lo.attention_reference(q, k, v)
    for r in range(n):
        row = res.out[r]
        assert np.isnan(row).all() or relative_error(row, ref[r]) <= 1e-4, r
