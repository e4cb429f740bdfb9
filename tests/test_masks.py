"""The mask as an interval of keys per row (`core.mask`): bottom-right causal with n_q != n_k
and sliding windows, in every schedule's kernels (forward and backward, CUDA and tensor
cores), their block ranges and their models."""

import numpy as np
import pytest
from conftest import SCHEDULES, random_qkv

import loop_orders as lo
from loop_orders.cli import main
from loop_orders.core.mask import Mask, key_span, kv_block_range, mask_of, q_block_range
from loop_orders.core.schedule import backward_of, grad_variants
from loop_orders.reference import attention_grad_reference, grad_tolerance, relative_error

# (n_q, n_k, d, dv, block_q, block_k, causal, window): n_q < n_k and n_q > n_k with tails,
# rows that see no key (causal, n_q > n_k; a window past the keys), odd head dims, dv != d
CASES = [
    (13, 21, 5, 3, 8, 4, True, (-1, -1)),
    (21, 13, 3, 6, 8, 5, True, (-1, -1)),
    (19, 19, 6, 5, 7, 4, False, (3, 2)),
    (17, 23, 5, 7, 8, 4, True, (4, -1)),
    (22, 9, 4, 3, 5, 4, False, (2, -1)),
]


def _brute(row, n_q, n_k, left, right):
    """The keys row sees, from the definition: diag - left <= j <= diag + right."""
    diag = row + n_k - n_q
    return {j for j in range(n_k) if (left < 0 or j >= diag - left)
            and (right < 0 or j <= diag + right)}


def test_rule_and_block_ranges_match_the_definition(rng):
    for _ in range(300):
        n_q, n_k = (int(x) for x in rng.integers(1, 40, 2))
        left, right = (int(x) for x in rng.integers(-1, 12, 2))
        bq, bk = (int(x) for x in rng.integers(1, 9, 2))
        seen = [_brute(r, n_q, n_k, left, right) for r in range(n_q)]
        for r in range(n_q):
            lo_, hi = Mask(left, right).row_keys(r, n_q, n_k)
            assert set(range(lo_, hi)) == seen[r]
            key0 = int(rng.integers(0, n_k))
            first, end = key_span(r + n_k - n_q, key0, n_k - key0, left, right)
            assert {key0 + c for c in range(first, end)} == {j for j in seen[r] if j >= key0}
        for i0 in range(0, n_q, bq):
            blocks = {j // bk for r in range(i0, min(i0 + bq, n_q)) for j in seen[r]}
            first, end = kv_block_range(i0, min(bq, n_q - i0), n_q, n_k, bk, left, right)
            assert set(range(first, end)) == blocks
        for j0 in range(0, n_k, bk):
            keys = set(range(j0, min(j0 + bk, n_k)))
            blocks = {r // bq for r in range(n_q) if seen[r] & keys}
            first, end = q_block_range(j0, min(bk, n_k - j0), n_q, n_k, bq, left, right)
            assert set(range(first, end)) == blocks


def test_causal_is_right_zero_and_square_causal_is_the_lower_triangle():
    assert mask_of(True) == Mask(-1, 0) and mask_of(True, (3, 5)) == Mask(3, 0)
    assert not mask_of(False).bounded
    assert (mask_of(True).visible(5, 5) == np.tril(np.ones((5, 5), bool))).all()
    # bottom-right: the last query sees every key, the first n_q - n_k none
    vis = mask_of(True).visible(7, 4)
    assert vis[-1].all() and not vis[:3].any()


def _check_forward(schedule, case, rng, dtype="float32"):
    n_q, n_k, d, dv, bq, bk, causal, window = case
    q, _, _ = random_qkv(rng, 1, 2, n_q, d, dv, dtype)
    _, k, v = random_qkv(rng, 1, 2, n_k, d, dv, dtype)
    res = lo.attention(q, k, v, schedule=schedule, block_q=bq, block_k=bk, causal=causal,
                       window=window, save_lse=True, count=True)
    ref, ref_lse = lo.attention_reference(q, k, v, mask=res.problem.mask)
    tol = 1e-5 if dtype == "float32" else 4e-3
    assert relative_error(res.out, ref) <= tol
    np.testing.assert_allclose(res.lse, ref_lse, rtol=1e-5, atol=1e-4)  # -inf where unseen
    assert res.counts == lo.predict_traffic(schedule, n=n_q, n_k=n_k, d=d, dv=dv, heads=2,
                                            block_q=bq, block_k=bk, causal=causal,
                                            save_lse=True, window=window)
    return res


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward_matches_reference_and_model(schedule, case, rng):
    _check_forward(schedule, case, rng)


@pytest.mark.parametrize("schedule", [s.name for s in lo.all_schedules() if s.TENSOR_CORES])
def test_tensor_cores_take_the_mask(schedule, rng):
    _check_forward(schedule, (20, 27, 8, 8, 16, 16, True, (5, -1)), rng, "float16")


# 16-bit inputs: the tensor-core backward under bottom-right causal with rows that see no key
# (n_q > n_k; query block 0 sees no key at n_q = 30, n_k = 9), a window on both sides with
# n_q < n_k, and one that no query of K/V block 0 sees (n_q = 13, n_k = 40); tails of both tiles
TC_CASES = [(21, 13, 8, 16, 16, 16, True, (-1, -1)), (19, 23, 8, 8, 16, 16, False, (3, 2)),
            (30, 9, 8, 8, 16, 16, True, (-1, -1)), (13, 40, 8, 8, 16, 16, False, (2, 0))]


@pytest.mark.parametrize("variant", grad_variants(), ids=lambda v: v.label)
@pytest.mark.parametrize("case", TC_CASES, ids=str)
def test_tensor_core_backward_takes_the_mask(variant, case, rng):
    n_q, n_k, d, dv, bq, bk, causal, window = case
    q, _, _ = random_qkv(rng, 1, 1, n_q, d, dv, "float16")
    _, k, v = random_qkv(rng, 1, 1, n_k, d, dv, "float16")
    do = rng.standard_normal((1, 1, n_q, dv)).astype(np.float16)
    g = lo.attention_grad(q, k, v, do, schedule=variant.schedule, block_q=bq, block_k=bk,
                          causal=causal, window=window, options=variant.options, count=True)
    bwd = backward_of(lo.get_schedule(variant.schedule))
    pb = g.problem.for_backward()
    assert bwd.tensor_cores(pb) is not None  # the mask keeps the tensor cores
    tol = grad_tolerance("float16", bwd.output_roundings(pb))
    refs = attention_grad_reference(q, k, v, do, mask=g.problem.mask)
    for got, ref in zip((g.dq, g.dk, g.dv), refs, strict=True):
        assert relative_error(got, ref) <= tol
    assert g.counts_backward == lo.predict_traffic(
        variant.schedule, n=n_q, n_k=n_k, d=d, dv=dv, block_q=bq, block_k=bk, causal=causal,
        window=window, options=variant.options, backward=True, dtype="float16")


@pytest.mark.parametrize("variant", grad_variants(), ids=lambda v: v.label)
@pytest.mark.parametrize("case", CASES[:2] + CASES[3:4], ids=str)
def test_backward_matches_reference_and_model(variant, case, rng):
    n_q, n_k, d, dv, bq, bk, causal, window = case
    q, _, _ = random_qkv(rng, 1, 1, n_q, d, dv)
    _, k, v = random_qkv(rng, 1, 1, n_k, d, dv)
    do = rng.standard_normal((1, 1, n_q, dv)).astype(np.float32)
    g = lo.attention_grad(q, k, v, do, schedule=variant.schedule, block_q=bq, block_k=bk,
                          causal=causal, window=window, options=variant.options, count=True)
    refs = attention_grad_reference(q, k, v, do, mask=g.problem.mask)
    for got, ref in zip((g.dq, g.dk, g.dv), refs, strict=True):
        assert relative_error(got, ref) <= 1e-5
    assert g.counts_backward == lo.predict_traffic(
        variant.schedule, n=n_q, n_k=n_k, d=d, dv=dv, block_q=bq, block_k=bk, causal=causal,
        window=window, options=variant.options, backward=True)


def test_rows_that_see_no_key_give_zero_and_minus_inf(rng):
    q, _, _ = random_qkv(rng, 1, 1, 12, 4, 4)
    _, k, v = random_qkv(rng, 1, 1, 5, 4, 4)
    do = rng.standard_normal((1, 1, 12, 4)).astype(np.float32)
    g = lo.attention_grad(q, k, v, do, block_q=4, block_k=4, causal=True)
    assert (g.out[..., :7, :] == 0).all() and np.isneginf(g.lse[..., :7]).all()
    assert (g.dq[..., :7, :] == 0).all() and np.isfinite(g.lse[..., 7:]).all()


def test_windowed_traffic_grows_as_n_times_w():
    """K/V blocks outside the window are skipped: at a fixed window w each further query
    block of q_outer reads the same keys (traffic linear in N), at most w + Br + Bc of them,
    where the unmasked order reads all N."""
    def k_reads(n, w):
        return lo.predict_traffic("q_outer", n=n, d=16, block_q=64, block_k=64,
                                  window=(w, 0)).read("k")

    for w in (128, 500):
        steps = [k_reads(n + 4096, w) - k_reads(n, w) for n in (4096, 8192)]
        assert steps[0] == steps[1] <= 4096 // 64 * (w + 128) * 16
    full = lo.predict_traffic("q_outer", n=8192, d=16, block_q=64, block_k=64).read("k")
    assert k_reads(8192, 500) < full / 10


def test_cli_run_and_traffic_take_the_window(capsys):
    assert main(["run", "--schedule", "kv_outer", "--n", "12", "--n-k", "20", "--d",
                        "4", "--block-q", "4", "--block-k", "4", "--causal", "--window", "3",
                        "-1", "--save-lse", "--repeat", "1"]) == 0
    assert "ok" in capsys.readouterr().out
    assert main(["traffic", "--schedule", "split_kv", "--n", "12", "--n-k", "20",
                        "--d", "4", "--block-q", "4", "--block-k", "4", "--window", "2", "2",
                        "--measure"]) == 0
