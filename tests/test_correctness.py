"""Every registered schedule against the float64 reference, with counters == model exactly."""

import numpy as np
import pytest
from conftest import SCHEDULES, random_qkv

import loop_orders as lo
from loop_orders.microkernel import tuning
from loop_orders.reference import relative_error, tolerance

# (batch, heads, n, d, dv, block_q, block_k, causal, dtype): tails of both block sizes, N
# smaller than a block, block size 1, odd d, dv != d, causal, batch and heads > 1, float16.
CASES = [
    (1, 1, 6, 2, 2, 2, 2, False, "float32"),
    (1, 1, 13, 5, 3, 4, 3, False, "float32"),
    (1, 1, 13, 5, 3, 4, 3, True, "float32"),
    (2, 3, 10, 4, 4, 16, 16, False, "float32"),
    (1, 1, 7, 3, 5, 1, 1, True, "float32"),
    (1, 1, 9, 3, 2, 1, 4, False, "float32"),
    (2, 2, 17, 7, 9, 8, 5, True, "float32"),
    (1, 2, 21, 16, 8, 6, 8, True, "float32"),
    (1, 1, 40, 6, 6, 16, 32, True, "float32"),  # diagonal tiles: key by key, a predicate a row
    (1, 1, 13, 128, 9, 8, 4, True, "float32"),  # d = 128: q_outer's first S_ij chunk peeled
    (1, 1, 16, 8, 8, 4, 8, False, "float16"),
    (2, 1, 11, 6, 4, 4, 3, True, "float16"),
]


def case_id(case):
    b, h, n, d, dv, bq, bk, causal, dtype = case
    return f"B{b}H{h}N{n}d{d}dv{dv}-{bq}x{bk}{'-causal' if causal else ''}-{dtype}"


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_output_and_counts(schedule, case, rng):
    b, h, n, d, dv, bq, bk, causal, dtype = case
    q, k, v = random_qkv(rng, b, h, n, d, dv, dtype)
    res = lo.attention(q, k, v, schedule=schedule, block_q=bq, block_k=bk, causal=causal,
                       save_lse=True, count=True)
    ref, ref_lse = lo.attention_reference(q, k, v, causal=causal)

    assert isinstance(res.out, np.ndarray) and res.out.dtype == np.dtype(dtype)
    assert res.out.shape == (b, h, n, dv)
    assert np.isfinite(res.out).all()
    roundings = lo.get_schedule(schedule).output_roundings(res.problem)
    assert relative_error(res.out, ref) <= tolerance(dtype, roundings, v, ref)
    np.testing.assert_allclose(res.lse, ref_lse, rtol=1e-5, atol=1e-5)
    assert res.counts == lo.get_schedule(schedule).model(res.problem)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_two_dimensional_inputs_and_custom_scale(schedule, rng):
    q, k, v = random_qkv(rng, 0, 0, 12, 4, 6)
    res = lo.attention(q, k, v, schedule=schedule, block_q=5, block_k=4, scale=0.3,
                       count=True)
    ref, _ = lo.attention_reference(q, k, v, scale=0.3)
    assert res.out.shape == (12, 6)
    assert relative_error(res.out, ref) <= 1e-5
    assert res.counts == lo.predict_traffic(schedule, n=12, d=4, dv=6, block_q=5, block_k=4)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_more_keys_than_queries(schedule, rng):
    q, _, _ = random_qkv(rng, 1, 1, 5, 3, 3)
    _, k, v = random_qkv(rng, 1, 1, 14, 3, 2)
    res = lo.attention(q, k, v, schedule=schedule, block_q=2, block_k=4, count=True)
    ref, _ = lo.attention_reference(q, k, v)
    assert relative_error(res.out, ref) <= 1e-5
    assert res.counts == lo.predict_traffic(schedule, n=5, n_k=14, d=3, dv=2, block_q=2,
                                            block_k=4)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_device_array_in_device_array_out(schedule, rng):
    from loop_orders.device import runtime

    q, k, v = random_qkv(rng, 1, 2, 9, 4, 4)
    dq, dk, dv = (runtime.to_device(x) for x in (q, k, v))
    res = lo.attention(dq, dk, dv, schedule=schedule, block_q=4, block_k=4)
    assert not isinstance(res.out, np.ndarray) and hasattr(res.out, "copy_to_host")
    ref, _ = lo.attention_reference(q, k, v)
    assert relative_error(res.out.copy_to_host(), ref) <= 1e-5


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_counting_off_gives_the_same_output_and_no_ledger(schedule, rng):
    q, k, v = random_qkv(rng, 1, 1, 10, 4, 4)
    counted = lo.attention(q, k, v, schedule=schedule, block_q=4, block_k=3, count=True)
    plain = lo.attention(q, k, v, schedule=schedule, block_q=4, block_k=3)
    assert plain.counts is None
    np.testing.assert_array_equal(plain.out, counted.out)


# (batch, heads, n, d, dv, block_q, block_k, causal): d, dv not multiples of 4 (plain tile
# loads), tails of both block sizes, more keys than a tile
TF32_CASES = [(1, 2, 13, 5, 3, 16, 8, True), (1, 1, 24, 12, 20, 16, 16, False)]


@pytest.mark.parametrize("schedule", [s for s in SCHEDULES if lo.get_schedule(s).TENSOR_CORES])
@pytest.mark.parametrize("case", TF32_CASES, ids=lambda c: "B{}H{}N{}d{}dv{}-{}x{}-{}".format(*c))
@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
def test_tf32_precisions_on_float32_inputs(schedule, case, precision, rng):
    """precision="tf32" or "tf32x3": float32 in and out, the products on TF32 tensor cores,
    within the bound each one's rounding gives (`tf32_tolerance`): TF32's error (above
    float32's 1e-6), or with each operand split into TF32 head and tail (3xTF32) float32's;
    lse moves by at most the scores' shift; counters == model (precision moves no element)."""
    from loop_orders.reference import FLOAT32_TOLERANCE, tf32_score_shift, tf32_tolerance

    b, h, n, d, dv, bq, bk, causal = case
    q, k, v = random_qkv(rng, b, h, n, d, dv)
    res = lo.attention(q, k, v, schedule=schedule, block_q=bq, block_k=bk, causal=causal,
                       save_lse=True, count=True, precision=precision)
    ref, ref_lse = lo.attention_reference(q, k, v, causal=causal)
    sched = lo.get_schedule(schedule)
    assert res.out.dtype == np.float32 and res.problem.precision == precision
    assert str(sched.layout(res.problem)).startswith(f"mma.{precision}")
    err = relative_error(res.out, ref)
    assert err <= tf32_tolerance(q, k, v, ref, causal=causal, precision=precision)
    if precision == "tf32":
        assert err > 1e-6  # TF32's own rounding shows: the tensor cores took the products
    else:
        assert err <= FLOAT32_TOLERANCE
    shift = tf32_score_shift(q, k, precision=precision)  # over all pairs, masked or not
    assert np.abs(res.lse - ref_lse).max() <= shift + 1e-5
    assert res.counts == sched.model(res.problem)


@pytest.mark.parametrize("case", TF32_CASES, ids=lambda c: "B{}H{}N{}d{}dv{}-{}x{}-{}".format(*c))
def test_q_outer_tf32x3_on_one_kv_buffer(case, monkeypatch, rng):
    """q_outer's tensor-core loop nest on one K/V buffer (what TC_KV_STAGES takes for 3xTF32
    on 64 x 64 tiles at d = 128; LOOP_ORDERS_KV_STAGES=1 forces it here, at small tiles):
    K_j, V_j copied after the barrier that ends the previous tile, float32's accuracy,
    counters == model."""
    from loop_orders.microkernel.tensor_cores import TensorCores
    from loop_orders.reference import FLOAT32_TOLERANCE

    monkeypatch.setattr(tuning, "CURRENT", tuning.Tuning(kv_stages=int("1")))
    b, h, n, d, dv, bq, bk, causal = case
    q, k, v = random_qkv(rng, b, h, n, d, dv)
    res = lo.attention(q, k, v, schedule="q_outer", block_q=bq, block_k=bk, causal=causal,
                       count=True, precision="tf32x3")
    sched = lo.get_schedule("q_outer")
    assert sched.layout(res.problem) == TensorCores("tf32x3", 1)
    ref, _ = lo.attention_reference(q, k, v, causal=causal)
    assert relative_error(res.out, ref) <= FLOAT32_TOLERANCE
    assert res.counts == sched.model(res.problem)


# (batch, heads, n_q, n_k, d, dv, block_q, block_k, causal): the smallest tiles the
# warp-specialised kernel takes (one warp of S threads, one of P V threads), with tails of both
# blocks, dv != d, and the causal diagonal (two K/V tiles a query block); then whole tiles,
# which build the kernel without the tails' code (`Specialised.even`)
WS_CASES = [(1, 2, 70, 45, 20, 64, 64, 32, False), (1, 1, 70, 70, 12, 64, 64, 32, True),
            (1, 1, 64, 96, 8, 64, 64, 32, False), (1, 1, 64, 64, 8, 64, 64, 32, True)]


@pytest.mark.parametrize("case", WS_CASES, ids=lambda c: "B{}H{}N{}x{}d{}dv{}-{}x{}-{}".format(
    *c[:-1], "causal" if c[-1] else "full"))
def test_q_outer_warp_specialised(case, monkeypatch, rng):
    """q_outer's warp-specialised kernel (`warp_specialised`: what SPECIALISED takes at d = 128
    on 128 x 64 tiles; LOOP_ORDERS_LAYOUT=ws forces it here, at small tiles, unrolled as
    there for the mask): S warps and P V warps under named barriers, float32's accuracy, lse,
    counters == model."""
    from loop_orders.reference import FLOAT32_TOLERANCE
    from loop_orders.schedules.q_outer.warp_specialised import Specialised

    sched = lo.get_schedule("q_outer")
    b, h, n_q, n_k, d, dv, bq, bk, causal = case
    chunks, keys = sched.SPECIALISED[(128, 64, 128, 128, causal)]  # the GPU's for the mask
    monkeypatch.setattr(tuning, "CURRENT", tuning.Tuning(layout=f"ws,{chunks},{keys},1"))
    monkeypatch.setenv("LOOP_ORDERS_SIMULATOR_BUDGET_S", "600")  # 256 threads' worth of work
    q, k, v = random_qkv(rng, b, h, n_q, d, dv, n_k=n_k)
    res = lo.attention(q, k, v, schedule="q_outer", block_q=bq, block_k=bk, causal=causal,
                       save_lse=True, count=True)
    even = n_q % bq == 0 and n_k % bk == 0
    assert sched.layout(res.problem) == Specialised(dv, chunks, keys, even=even)
    ref, ref_lse = lo.attention_reference(q, k, v, causal=causal)
    assert relative_error(res.out, ref) <= FLOAT32_TOLERANCE
    np.testing.assert_allclose(res.lse, ref_lse, rtol=1e-5, atol=1e-5)
    assert res.counts == sched.model(res.problem)


# (batch, heads, n_q, n_k, d, dv, block_q, block_k, causal): more work items (query blocks x
# heads) than the simulator's persistent CTAs (`persistent.SIMULATED_CTAS`, 2), so that a
# CTA folds block after block, the first its own and the next ones drawn; tails of both blocks
# and dv != d, the causal diagonal, and whole tiles (`Specialised.even`)
PERSISTENT_CASES = [(1, 2, 70, 45, 20, 64, 64, 32, False), (1, 2, 70, 70, 12, 64, 64, 32, True),
                    (1, 3, 64, 64, 8, 64, 64, 32, True)]


@pytest.mark.parametrize("case", PERSISTENT_CASES,
                         ids=lambda c: "B{}H{}N{}x{}d{}dv{}-{}x{}-{}".format(
                             *c[:-1], "causal" if c[-1] else "full"))
def test_q_outer_warp_specialised_on_persistent_ctas(case, monkeypatch, rng):
    """The warp-specialised kernel on persistent CTAs (what PERSISTENT takes causal at d = 128
    and short N; forced here, unrolled as there): each CTA draws its next block from the
    stream's counter while it folds one in, the S warps start the next block's Q_i and S_i0
    under the P V warps' last tile; float32's accuracy, lse, counters == model, and the
    counter back at zero for the next launch (twice in a row: a second launch that found it
    raised would skip blocks and leave their rows of O unwritten)."""
    from loop_orders.microkernel.persistent import persistent_grid, tickets
    from loop_orders.reference import FLOAT32_TOLERANCE
    from loop_orders.schedules.q_outer.warp_specialised import Specialised

    sched = lo.get_schedule("q_outer")
    b, h, n_q, n_k, d, dv, bq, bk, causal = case
    _, (chunks, keys, peel) = sched.PERSISTENT[(128, 64, 128, 128, True)]
    forced = f"ws,{chunks},{keys},{int(peel)},1"
    monkeypatch.setattr(tuning, "CURRENT", tuning.Tuning(layout=forced))
    monkeypatch.setenv("LOOP_ORDERS_SIMULATOR_BUDGET_S", "600")
    q, k, v = random_qkv(rng, b, h, n_q, d, dv, n_k=n_k)
    ref, ref_lse = lo.attention_reference(q, k, v, causal=causal)
    for _ in range(2):
        res = lo.attention(q, k, v, schedule="q_outer", block_q=bq, block_k=bk, causal=causal,
                           save_lse=True, count=True)
        even = n_q % bq == 0 and n_k % bk == 0
        assert sched.layout(res.problem) == Specialised(dv, chunks, keys, peel, True, even)
        assert relative_error(res.out, ref) <= FLOAT32_TOLERANCE
        np.testing.assert_allclose(res.lse, ref_lse, rtol=1e-5, atol=1e-5)
        assert res.counts == sched.model(res.problem)
        assert tickets().copy_to_host()[0] == 0
    assert persistent_grid((res.problem.tr, res.problem.bh))[0] < res.problem.tr * b * h


@pytest.mark.parametrize("where", ["k", "v"])
def test_q_outer_warp_specialised_never_multiplies_a_masked_key(where, monkeypatch, rng):
    """A NaN in key 40's row of K or V reaches only the rows that see key 40 (causal): the
    S warps give its score -inf where masked, and the P V warps skip it on the diagonal."""
    monkeypatch.setattr(tuning, "CURRENT", tuning.Tuning(layout="ws"))
    monkeypatch.setenv("LOOP_ORDERS_SIMULATOR_BUDGET_S", "600")
    q, k, v = random_qkv(rng, 1, 1, 70, 12, 64)
    clean = (q.copy(), k.copy(), v.copy())
    {"k": k, "v": v}[where][0, 0, 40, 1] = np.nan
    res = lo.attention(q, k, v, schedule="q_outer", block_q=64, block_k=32, causal=True)
    ref, _ = lo.attention_reference(*clean, causal=True)
    assert not np.isnan(res.out[0, 0, :40]).any()
    assert relative_error(res.out[0, 0, :40], ref[0, 0, :40]) <= 1e-5
    assert np.isnan(res.out[0, 0, 40:]).any(axis=-1).all()


# Hopper's build (wgmma; the simulator stands in for an H100): whole warpgroups of query rows,
# tails of both blocks, n_q != n_k, dv != d, swizzled rows of 32, 64 and 16 elements.
HOPPER_CASES = [  # (schedule, n_q, n_k, d, dv, block_q, block_k, causal, dtype, products)
    # two warpgroups taking turns, K/V through the ring of buffers and mbarriers
    ("q_outer", 130, 100, 32, 48, 128, 16, True, "float16", None),
    ("kv_outer", 70, 45, 64, 32, 64, 16, True, "bfloat16", None),
    ("split_kv", 70, 90, 80, 48, 64, 32, False, "float16", None),
    ("dense", 70, 45, 32, 48, 64, 32, True, "float16", None),  # its two matmul kernels
    # the ring filled by a producer warpgroup's TMA copies; the first query block sees no key
    ("q_outer", 200, 40, 64, 32, 128, 32, True, "bfloat16", "wgmma-tma"),
    # ... on persistent CTAs: 6 query blocks on the simulator's 2 CTAs, the ring's positions
    # and phases running on from block to block
    ("q_outer", 300, 240, 32, 48, 128, 32, True, "float16", "wgmma-persistent"),
]


def test_a_causal_grid_by_groups_of_heads_is_each_blocks_once_heaviest_first(rng):
    """`tiles.grouped_block` (the causal grid by groups of heads, `tuning` causal_heads) visits
    every (query block, head) once, the heaviest blocks first within each group; q_outer's
    Hopper build on that grid (3 heads by 2: a group of one last) is right, counted == model."""
    from loop_orders.microkernel.tiles import grouped_block

    n_blocks, n_bh, group = 5, 7, 3
    order = [grouped_block(c, n_blocks, n_bh, group) for c in range(n_blocks * n_bh)]
    assert sorted(order) == [(i, h) for i in range(n_blocks) for h in range(n_bh)]
    for g in range(0, n_bh, group):
        blocks = [i for i, h in order if g <= h < g + group]
        assert blocks == sorted(blocks, reverse=True)  # heaviest first
        assert {h for _, h in order[g * n_blocks:(g + group) * n_blocks]} == set(
            range(g, min(g + group, n_bh)))  # a group's CTAs run together
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(rng.standard_normal((1, 3, 200, 32)).astype(np.float32)).half()
               for _ in range(3))
    sched = lo.get_schedule("q_outer")
    with tuning.tuned(causal_heads=2):
        res = lo.attention(q, k, v, block_q=64, block_k=32, causal=True, count=True)
        assert str(sched.layout(res.problem)).endswith(".heads2")
    ref, _ = lo.attention_reference(*(x.float().numpy() for x in (q, k, v)), causal=True)
    assert relative_error(res.out.float().numpy(), ref) <= tolerance(
        "float16", sched.output_roundings(res.problem), v.float().numpy(), ref)
    assert res.counts == sched.model(res.problem)


@pytest.mark.parametrize("heads, kv_heads, causal_heads", [(3, 3, 2), (4, 2, None)])
def test_hopper_persistent_ctas_fold_empty_blocks_head_groups_and_shared_kv(
        heads, kv_heads, causal_heads, rng):
    """The TMA build on persistent CTAs (the simulator's 2 CTAs) over 3 query blocks a head,
    the first seeing no key (N_q = 300, N_k = 100, causal): 3 heads taken 2 at a time (a group
    of one last), and 4 query heads on 2 K/V heads; right, counted == model."""
    torch = pytest.importorskip("torch")
    q = torch.from_numpy(rng.standard_normal((1, heads, 300, 32)).astype(np.float32)).half()
    k, v = (torch.from_numpy(rng.standard_normal((1, kv_heads, 100, 32)).astype(np.float32))
            .half() for _ in range(2))
    sched = lo.get_schedule("q_outer")
    with tuning.tuned(products="wgmma-persistent", causal_heads=causal_heads):
        res = lo.attention(q, k, v, block_q=128, block_k=32, causal=True, count=True)
        assert ".persistent" in str(sched.layout(res.problem))
    group = heads // kv_heads
    ref, _ = lo.attention_reference(q.float().numpy(),
                                    *(x.float().numpy().repeat(group, axis=1) for x in (k, v)),
                                    causal=True)
    assert relative_error(res.out.float().numpy(), ref) <= tolerance(
        "float16", sched.output_roundings(res.problem), v.float().numpy(), ref)
    assert res.counts == sched.model(res.problem)


@pytest.mark.parametrize("case", HOPPER_CASES, ids=lambda c: "-".join(map(str, c)))
def test_hopper_build(case, rng):
    name, n_q, n_k, d, dv, bq, bk, causal, dtype, products = case
    torch = pytest.importorskip("torch")
    tdt = getattr(torch, dtype)
    q, k, v = (torch.from_numpy(rng.standard_normal((1, 2, n, w)).astype(np.float32)).to(tdt)
               for n, w in ((n_q, d), (n_k, d), (n_k, dv)))
    sched = lo.get_schedule(name)
    with tuning.tuned(products=products):
        res = lo.attention(q, k, v, schedule=name, block_q=bq, block_k=bk, causal=causal,
                           count=True)
        build = str(sched.layout(res.problem))
    assert build.startswith("wgmma.") and (".tma" in build) == (
        products in ("wgmma-tma", "wgmma-persistent"))
    assert (".persistent" in build) == (products == "wgmma-persistent")
    q, k, v = (x.float().numpy() for x in (q, k, v))
    ref, _ = lo.attention_reference(q, k, v, causal=causal)
    roundings = sched.output_roundings(res.problem)
    assert relative_error(res.out.float().numpy(), ref) <= tolerance(dtype, roundings, v, ref)
    assert res.counts == sched.model(res.problem)
