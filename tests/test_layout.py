"""The micro-kernel's thread-layout policy (microkernel.thread_layout) and shared-memory plan."""

import numpy as np
import pytest

from loop_orders.core.mask import NO_MASK
from loop_orders.device.runtime import cuda
from loop_orders.microkernel import tuning
from loop_orders.microkernel.cuda_cores import (
    DATA_REGISTERS,
    Layout,
    Unroll,
    make_micro_kernel,
    shared_layout,
    thread_layout,
)
from loop_orders.microkernel.tiles import block_grid, make_block_of, make_clear, unrolled


@pytest.fixture(autouse=True)
def no_forced_layout(monkeypatch):
    monkeypatch.setattr(tuning, "CURRENT", tuning.Tuning())


def test_tuned_tiles_take_the_measured_layouts():
    """q_outer's TUNED_LAYOUTS at the benchmark's tiles; kv_outer and split_kv keep the rule
    (kv_outer measured slower at 8 x 8)."""
    import loop_orders as lo

    tuned = lo.get_schedule("q_outer").TUNED_LAYOUTS
    assert thread_layout(128, 64, 64, tuned) == Layout(8, 8)  # 64 scores + 64 accumulators
    assert thread_layout(128, 64, 128, tuned) == Layout(8, 4)  # d = 128: 32 + 64
    assert thread_layout(64, 64, 128, tuned) == Layout(8, 4, 1, True)  # P_ij^T in K_j's place
    for (block_q, block_k, dv), tile in tuned.items():
        lay = Layout(*tile)  # on 255 registers, 4 warps or more
        assert lay.registers(block_k, dv) == 255 and lay.threads(block_q, block_k) >= 128
    assert thread_layout(128, 64, 64) == Layout(8, 4)  # the rule
    for name in ("kv_outer", "split_kv"):
        assert lo.get_schedule(name).TUNED_LAYOUTS == {}


def test_short_causal_sequences_take_the_short_tiles_measured_for_their_path():
    """q_outer's SHORT_TILES: 64 x 64 for causal d = 64 at N = 512 on CUDA cores (d = 128
    keeps 128 x 64, on persistent CTAs);
    TC_SHORT_TILES: 64 x 64 for causal 3xTF32 at d = 128 up to N = 2048, where (TF32 too)
    they take one K/V buffer (TC_KV_STAGES: two CTAs an SM). The benchmark's sweep takes
    them there and BLOCKS everywhere else (and for SDPA's rows)."""
    import loop_orders as lo
    from experiments import bench_runtime as bench
    from loop_orders.microkernel.tensor_cores import TensorCores

    q_outer = lo.get_schedule("q_outer")

    def tiles(n, d=64, causal=True, dtype="float32", name="q_outer"):
        p = bench.sweep_problem(name, lo.get_schedule(name), dtype, n, d, causal)
        return p.block_q, p.block_k, lo.get_schedule(name).short_tiles(p)

    assert tiles(256) == (64, 64, (64, 64))
    assert tiles(512) == (64, 64, (64, 64))
    assert tiles(1024) == (*bench.BLOCKS[64], None)
    assert tiles(512, causal=False) == (*bench.BLOCKS[64], None)
    assert tiles(512, d=128) == (*bench.BLOCKS[128], None)
    assert q_outer.layout(bench.sweep_problem("q_outer", q_outer, "float32", 512, 128,
                                              True)).persistent
    assert tiles(1024, d=128) == (*bench.BLOCKS[128], None)
    assert tiles(512, dtype="float16") == (*bench.BLOCKS[64], None)  # tensor cores
    assert tiles(512, dtype="tf32x3") == (*bench.BLOCKS[64], None)
    assert tiles(2048, d=128, dtype="tf32x3") == (64, 64, (64, 64))
    assert tiles(4096, d=128, dtype="tf32x3") == (*bench.BLOCKS[128], None)
    assert tiles(512, d=128, causal=False, dtype="tf32x3") == (*bench.BLOCKS[128], None)
    assert tiles(512, d=128, dtype="tf32") == (*bench.BLOCKS[128], None)  # 64 x 64 lost

    def tc_layout(block_q, **kind):
        return q_outer.layout(lo.make_problem("q_outer", n_q=512, d=128, block_q=block_q,
                                              block_k=64, causal=True, **kind))

    assert tc_layout(64, precision="tf32x3") == TensorCores("tf32x3", 1)
    assert tc_layout(64, precision="tf32") == TensorCores("tf32", 1)
    assert tc_layout(128, precision="tf32x3") == TensorCores("tf32x3", 2)
    # Hopper's wgmma (the simulator stands in for an H100), pipelined in q_outer's stream
    assert tc_layout(64, dtype="float16") == TensorCores("float16", 2, True, True)
    assert tiles(512, name="kv_outer") == (*bench.BLOCKS[64], None)
    sdpa = bench.sweep_problem("torch_sdpa_efficient", "efficient", "float32", 512, 64, True)
    assert (sdpa.block_q, sdpa.block_k) == bench.BLOCKS[64]
    assert q_outer.SHORT_TILES and lo.get_schedule("dense").short_tiles(sdpa) is None


def test_policy_takes_the_most_rows_whose_registers_fit():
    assert thread_layout(64, 64, 64) == Layout(8, 4)  # 32 scores + 32 accumulators
    assert thread_layout(64, 32, 64) == Layout(4, 4)  # RM = 8 would need 64 accumulators
    assert thread_layout(64, 64, 128) == Layout(4, 4)  # d = 128: 16 + 32
    assert thread_layout(5, 3, 4) == Layout(4, 3)  # rows past Br: two threads of rows
    assert thread_layout(1, 1, 1) == Layout(1, 1)
    assert thread_layout(512, 512, 8) == Layout(16, 16)  # grown until 1024 threads
    for block_q, block_k, dv in ((64, 64, 64), (64, 32, 64), (64, 64, 128), (64, 64, 256)):
        lay = thread_layout(block_q, block_k, dv)
        assert lay.data_registers(block_k, dv) <= DATA_REGISTERS or lay.rm == 1


def test_every_layout_fits_a_cta_and_covers_the_tile():
    for block_q in (1, 3, 16, 33, 64, 128, 255, 512):
        for block_k in (1, 5, 16, 32, 64, 100, 512):
            lay = thread_layout(block_q, block_k, 64)
            tr, tc = lay.grid(block_q, block_k)
            assert lay.threads(block_q, block_k) == tr * tc <= 1024
            assert tr * lay.rm >= block_q and tc * lay.kn >= block_k
            assert (tr - 1) * lay.rm < block_q and (tc - 1) * lay.kn < block_k


def test_forced_layout_is_used_or_refused(monkeypatch):
    monkeypatch.setattr(tuning, "CURRENT", tuning.Tuning(layout="4,2"))
    assert thread_layout(64, 32, 64) == Layout(4, 2)
    monkeypatch.setattr(tuning, "CURRENT", tuning.Tuning(layout="1,1"))
    with pytest.raises(ValueError, match="LOOP_ORDERS_LAYOUT=1,1 needs more than 1024"):
        thread_layout(64, 32, 64)


def test_registers_cap_follows_scores_and_accumulators():
    assert Layout(4, 4).registers(32, 64) == 128  # 16 scores + 32 accumulators
    assert Layout(4, 4).registers(32, 128) == 255  # 16 + 64


@pytest.mark.parametrize("reload", [False, True])
def test_shared_tiles_are_aligned_disjoint_and_padded(reload):
    lay = Layout(4, 4)
    sm = shared_layout(64, 32, 64, 64, lay, reload)
    # row strides: whole 16-byte chunks, an odd number of them (rows start in different banks)
    for stride in (sm.qs, sm.qts, sm.ks, sm.ps):
        assert stride % 4 == 0 and (stride // 4) % 2 == 1
    # P_ij^T: a row per key, a column per query row (64); Q_i^T: a row per head dim, as well
    assert sm.qs >= 64 and sm.ks >= 64 and sm.vs >= 64 and sm.ps >= 64 and sm.qts >= 64
    assert sm.k - sm.q == 64 * sm.qs and not sm.q_transposed
    starts = [sm.q, sm.k, sm.v, sm.p, sm.red, sm.stats, sm.size]
    assert starts == sorted(starts) and all(s % 4 == 0 for s in starts[:5])
    assert sm.v - sm.k == 32 * sm.ks
    assert sm.p - sm.v == 32 * sm.vs
    # kv_outer's O_i stage (64 rows of stride qs) takes P_ij^T's place (32 keys of stride ps),
    # which grows to hold it
    assert sm.red - sm.p == max(32 * sm.ps, 64 * sm.qs if reload else 0)
    assert sm.o == (sm.p if reload else 0)
    assert sm.stats - sm.red == lay.threads(64, 32) * lay.rm
    assert sm.size - sm.stats == (128 if reload else 0)
    assert sm.bytes == 4 * sm.size


@pytest.mark.parametrize("d", [128, 12])
def test_p_in_k_keeps_p_in_k_place_and_frees_its_region(d):
    """Layout.p_in_k: P_ij^T starts where K_j does, K_j's region grows to hold whichever is
    larger, and the buffer has no P_ij^T region of its own (at d = 128 and 64 x 64 tiles on
    8 x 4 threads, 104,448 bytes: two CTAs fit an SM's 228 KB); K_j and V_j arrive by cp.async
    (not staggered), a plain-load layout drops it, and kv_outer's O_i stage has no room."""
    apart, shared = Layout(8, 4, 2), Layout(8, 4, 2, p_in_k=True)
    own, in_k = (shared_layout(64, 64, d, d, lay, False) for lay in (apart, shared))
    assert in_k.p == in_k.k and in_k.v - in_k.k == 64 * max(in_k.ks, in_k.ps)
    assert own.size - in_k.size == 64 * own.ps - 64 * max(0, in_k.ps - in_k.ks)
    if d == 128:
        assert in_k.bytes == 104_448 and own.bytes > 228 * 1024 // 2
    assert shared.copies_rows(d, d) and not shared.staggered and apart.staggered
    assert shared.plain() == Layout(8, 4) and not shared.plain().copies_rows(d, d)
    assert not Layout(8, 4, 1, p_in_k=True).copies_rows(d + 1, d)  # odd rows: plain loads
    with pytest.raises(ValueError, match="no room for the O_i stage"):
        shared_layout(64, 64, d, d, shared, True)


def test_p_in_k_is_exact_and_counts_as_the_model(monkeypatch):
    """q_outer with P_ij^T in K_j's place (forced: LOOP_ORDERS_LAYOUT=4,4,1,1) against the
    float64 reference on the simulator: tails, causal, dv != d, an odd number of keys; the
    counted traffic equals the model."""
    import loop_orders as lo
    from loop_orders.reference import attention_reference

    monkeypatch.setattr(tuning, "CURRENT", tuning.Tuning(layout="4,4,1,1"))
    rng = np.random.default_rng(11)
    sched = lo.get_schedule("q_outer")
    for n, n_k, d, dv, causal in ((20, 19, 16, 12, False), (20, 20, 8, 8, True)):
        q, k = (rng.standard_normal((1, 2, m, d)).astype(np.float32) for m in (n, n_k))
        v = rng.standard_normal((1, 2, n_k, dv)).astype(np.float32)
        got = lo.attention(q, k, v, block_q=8, block_k=8, causal=causal, count=True)
        assert sched.layout(got.problem).p_in_k
        want, _ = attention_reference(q, k, v, causal=causal)
        assert np.abs(got.out - want).max() < 1e-5
        assert got.counts == sched.model(got.problem)


@pytest.mark.parametrize("rm, transposed", [(4, True), (8, True), (2, False), (1, False)])
def test_q_is_transposed_only_where_asked_and_rows_come_in_fours(rm, transposed):
    # 16 query rows, head dim 40: Q_i^T (40 rows of a 16-row stride) and Q_i (16 rows of a
    # 40-dim stride) differ in size, and the region holds the one the micro-kernel keeps
    lay = Layout(rm, 4)
    plain = shared_layout(16, 16, 40, 24, lay, False)
    asked = shared_layout(16, 16, 40, 24, lay, False, transpose_q=True)
    assert not plain.q_transposed and asked.q_transposed == transposed
    assert plain.k - plain.q == 16 * plain.qs
    assert asked.k - asked.q == (max(16 * asked.qs, 40 * asked.qts) if transposed
                                 else 16 * asked.qs)
    assert asked.qts % 4 == 0 and (asked.qts // 4) % 2 == 1 and asked.qts >= 16


@pytest.mark.parametrize("n, by", [(0, 2), (1, 2), (3, 2), (5, 4), (16, 2), (6, 6)])
def test_unrolled_calls_every_step_once_in_order(n, by):
    @cuda.jit(device=True, inline="always")
    def step(i, out, pos, _):
        out[pos[0]] = i
        pos[0] += 1

    run = unrolled(step, n, 3, by)

    @cuda.jit
    def kernel(out, pos):
        run(out, pos, 0)

    out, pos = np.full(n + 1, -1, np.int64), np.zeros(1, np.int64)
    kernel[1, 1](out, pos)
    assert out.tolist() == [*range(n), -1] and pos[0] == n


@pytest.mark.parametrize("causal, heavy_last", [(False, True), (True, True), (True, False)])
def test_causal_grids_start_the_heaviest_blocks_first_over_every_head(causal, heavy_last):
    """block_of on block_grid's grid: every (block, bh) once; causal, in CTA order, the blocks
    go from the heaviest end to the other over all heads (the last query blocks first, or the
    first K/V blocks), each block for every head before the next; else block x, head y."""
    n_blocks, n_bh = 5, 3
    block_of = make_block_of(causal, heavy_last)

    @cuda.jit
    def kernel(n_bh, out):
        block, bh = block_of(n_bh)
        cta = cuda.blockIdx.x + cuda.gridDim.x * cuda.blockIdx.y
        out[cta, 0] = block
        out[cta, 1] = bh

    grid = block_grid(n_blocks, n_bh, causal)
    out = np.full((n_blocks * n_bh, 2), -1, np.int64)
    kernel[grid, 1](n_bh, out)
    assert sorted(map(tuple, out.tolist())) == [(i, h) for i in range(n_blocks)
                                                for h in range(n_bh)]
    if not causal:
        assert grid == (n_blocks, n_bh)
        assert out[:, 0].tolist() == list(range(n_blocks)) * n_bh
        return
    assert grid == (n_blocks * n_bh,)
    heaviest_first = [n_blocks - 1 - i if heavy_last else i for i in range(n_blocks)]
    assert out[:, 0].tolist() == [i for i in heaviest_first for _ in range(n_bh)]


@pytest.mark.parametrize("rm, kn", [(8, 8), (8, 4), (4, 4), (6, 2), (3, 4), (2, 8), (1, 4)])
def test_a_threads_rows_come_in_groups_and_the_threads_cover_every_row_once(rm, kn):
    """row(tr, a): groups of 4 consecutive rows where RM allows (2, else 1), the groups G TR
    rows apart; over the CTA every tile row is one thread's, once."""
    block_q, block_k = 40, 16
    mk = make_micro_kernel(block_q, block_k, 8, 8, rm, kn, NO_MASK, False, Unroll.by(2))
    tr_count, _ = Layout(rm, kn).grid(block_q, block_k)
    row = mk.row_of

    @cuda.jit
    def kernel(out):
        for tr in range(tr_count):
            for a in range(rm):
                out[tr, a] = row(tr, a)

    out = np.full((tr_count, rm), -1, np.int64)
    kernel[1, 1](out)
    assert sorted(out.ravel().tolist()) == list(range(tr_count * rm)) == list(range(mk.ROWS))
    # a thread's rows rise with a (row 0 sees the fewest keys of a causal tile, row RM - 1
    # the most), consecutive within each group, each group starting at a multiple of its size
    assert (np.diff(out, axis=1) > 0).all()
    group = 4 if rm % 4 == 0 else 2 if rm % 2 == 0 else 1
    groups = out.reshape(tr_count, rm // group, group)
    assert (np.diff(groups, axis=2) == 1).all() and (groups[:, :, 0] % group == 0).all()


@pytest.mark.parametrize("size, threads", [(3, 1), (5, 8), (23, 2), (37, 4), (64, 16),
                                           (100, 3), (131, 32)])
def test_make_clear_zeroes_every_float_of_the_buffer_and_nothing_past_it(size, threads):
    """Whole rounds of 16-byte chunks, the chunks left over, then the floats past the last
    chunk, with fewer threads than those floats too."""
    clear = make_clear(size, threads)

    @cuda.jit
    def kernel(out):
        buf = cuda.shared.array(136, np.float32)
        for e in range(cuda.threadIdx.x, 136, threads):
            buf[e] = np.float32(7.0)
        cuda.syncthreads()
        clear(buf)
        cuda.syncthreads()
        for e in range(cuda.threadIdx.x, 136, threads):
            out[e] = buf[e]

    out = np.full(136, -1.0, np.float32)
    kernel[1, threads](out)
    assert (out[:size] == 0).all() and (out[size:] == 7).all()


def test_16_bit_inputs_pick_the_tensor_core_micro_kernel_where_a_schedule_has_it():
    """float16 runs kv_outer, q_outer and split_kv on tensor cores (q_outer double-buffers
    K/V), on Hopper's wgmma where the tiles allow (the simulator stands in for an H100; q_outer
    pipelines it through the ring, or as its HOPPER_BUILDS say: each product waited at d = 64
    on 128 x 64, the TMA producer at d = 128 on 128 x 128, one warpgroup more), else, or asked
    (`tuning` products="mma"), on mma.sync; float32 keeps the CUDA-core layout."""
    import loop_orders as lo
    from loop_orders.device.runtime import dynamic_shared_limit
    from loop_orders.microkernel import tuning
    from loop_orders.microkernel.tensor_cores import TensorCores, tc_shared_layout

    for name, stages in (("q_outer", 2), ("kv_outer", 1)):
        sched = lo.get_schedule(name)
        p16 = lo.make_problem(name, n_q=4096, d=64, block_q=128, block_k=64, dtype="float16")
        assert sched.layout(p16) == TensorCores("float16", stages, True)  # waited / one buffer
        with tuning.tuned(products="wgmma-ring"):
            assert sched.layout(p16) == TensorCores("float16", stages, True, stages == 2)
        wide = lo.make_problem(name, n_q=4096, d=128, block_q=128, block_k=128,
                               dtype="float16")
        producer = name == "q_outer"
        # ... on persistent CTAs up to HOPPER_PERSISTENT's N_q
        assert sched.layout(wide) == TensorCores("float16", stages, True, stages == 2, producer,
                                                 persistent=producer)
        assert sched.threads(wide) == 256 + 128 * producer
        long = lo.make_problem(name, n_q=16384, d=128, block_q=128, block_k=128,
                               dtype="float16")
        assert sched.layout(long) == TensorCores("float16", stages, True, stages == 2, producer)
        with tuning.tuned(products="wgmma-tma"):
            assert sched.layout(wide) == TensorCores("float16", stages, True, stages == 2,
                                                     producer)
        with tuning.tuned(products="wgmma-sync"):
            assert sched.layout(p16) == TensorCores("float16", stages, True)
        with tuning.tuned(products="mma"):
            assert sched.layout(p16) == TensorCores("float16", stages)
        odd = lo.make_problem(name, n_q=4096, d=40, block_q=128, block_k=64, dtype="float16")
        assert sched.layout(odd) == TensorCores("float16", stages)  # d not a whole 16
        assert sched.threads(p16) == 32 * 128 // 16  # a warp per 16 query rows
        assert sched.p_roundings(p16) == 1  # P rounded to float16 before P V_j
        p32 = lo.make_problem(name, n_q=4096, d=64, block_q=128, block_k=64)
        assert isinstance(sched.layout(p32), Layout) and sched.p_roundings(p32) == 0
        for d in (64, 128):  # the benchmark's tiles fit the opt-in shared memory
            assert tc_shared_layout(128, 64, d, d, name == "kv_outer",
                                    TensorCores("float16", stages)).bytes < \
                dynamic_shared_limit()
    split = lo.get_schedule("split_kv")
    p = lo.make_problem("split_kv", n_q=64, d=16, block_q=16, block_k=16, dtype="float16")
    assert split.layout(p) == TensorCores("float16", 1)  # 16 rows: less than a warpgroup
    p32 = lo.make_problem("split_kv", n_q=64, d=16, block_q=16, block_k=16)
    assert isinstance(split.layout(p32), Layout)


def test_a_call_naming_no_tiles_takes_the_measured_hopper_tiles_on_a_hopper_gpu(monkeypatch):
    """On a Hopper GPU (patched in: the simulator keeps 64 x 64) a forward call that names no
    tiles tries q_outer's HOPPER_TILES for its head dim, mask and N first (128 x 64 at d = 64
    but 128 x 128 without a mask from N = 4096 and 64 x 64 causal below N = 2048, 128 x 128
    at d = 128), where the sequences hold them whole and the inputs are 16-bit; other head
    dims, float32, mma.sync asked, short sequences and the other schedules keep
    DEFAULT_TILES; tiles named are kept."""
    import loop_orders as lo
    from loop_orders import api
    from loop_orders.microkernel import cuda_cores, tuning

    q_outer, kv_outer = lo.get_schedule("q_outer"), lo.get_schedule("kv_outer")

    def problem(d=128, n=1024, dtype="float16", causal=False):
        return lo.make_problem("q_outer", n_q=n, d=d, dtype=dtype, block_q=64, block_k=64,
                               causal=causal)

    assert q_outer.fast_tiles(problem()) is None  # the simulator
    monkeypatch.setattr(cuda_cores, "SIMULATOR", False)
    monkeypatch.setattr(cuda_cores, "has_wgmma", lambda: True)
    assert q_outer.fast_tiles(problem()) == (128, 128)
    assert q_outer.fast_tiles(problem(causal=True)) == (128, 128)
    assert q_outer.fast_tiles(problem(d=64, dtype="bfloat16")) == (128, 64)
    assert q_outer.fast_tiles(problem(d=64, n=4096)) == (128, 128)
    assert q_outer.fast_tiles(problem(d=64, n=4096, causal=True)) == (128, 64)
    assert q_outer.fast_tiles(problem(d=64, causal=True)) == (64, 64)
    assert q_outer.fast_tiles(problem(d=64, n=2048, causal=True)) == (128, 64)
    for d, bq, bk in ((64, 128, 64), (64, 64, 64), (64, 128, 128), (128, 128, 128)):
        p = lo.make_problem("q_outer", n_q=16384, d=d, block_q=bq, block_k=bk,
                            dtype="float16")
        assert q_outer.hopper_build(p) == q_outer.HOPPER_BUILDS[(bq, bk, d)]
        # ... on persistent CTAs up to HOPPER_PERSISTENT's N_q
        short = lo.make_problem("q_outer", n_q=4096, d=d, block_q=bq, block_k=bk,
                                dtype="float16")
        persistent = q_outer.HOPPER_PERSISTENT.get((bq, bk, d), 0) >= 4096
        assert q_outer.hopper_build(short) == ("persistent" if persistent else
                                               q_outer.HOPPER_BUILDS[(bq, bk, d)])
    assert q_outer.fast_tiles(problem(d=96)) is None  # not measured
    assert q_outer.fast_tiles(problem(dtype="float32")) is None
    assert q_outer.fast_tiles(problem(n=100)) is None  # a query block shorter than 128
    assert kv_outer.fast_tiles(problem()) is None
    with tuning.tuned(products="mma"):
        assert q_outer.fast_tiles(problem()) is None
    tried = []

    def check(p):
        tried.append((p.block_q, p.block_k))
        if p.block_q == 128:
            raise ValueError("block_q: too big here")

    def make(bq, bk):
        return lo.make_problem("q_outer", n_q=1024, d=128, dtype="float16", block_q=bq,
                               block_k=bk)

    chosen = api.fitting_tiles(make(64, 64), make, None, None, check, first=(128, 128))
    assert tried == [(128, 128), (64, 64)] and (chosen.block_q, chosen.block_k) == (64, 64)
    tried.clear()
    named = api.fitting_tiles(make(64, 32), make, 64, 32, check, first=(128, 128))
    assert tried == [(64, 32)] and named.block_k == 32


def test_q_outer_staggers_its_float32_loads_with_cp_async_where_rows_are_whole_copies(
        monkeypatch):
    """On CUDA cores q_outer (KV_STAGES 2) loads V_j under S_ij and K_j+1 under P_ij V_j;
    rows of whole 16-byte copies arrive by cp.async (from k and v 16-byte aligned: the launch
    takes the plain-load kernel otherwise), an odd head dim by plain loads. kv_outer and
    split_kv keep one stage; LOOP_ORDERS_KV_STAGES=1 turns the staggering off."""
    import loop_orders as lo

    q_outer = lo.get_schedule("q_outer")
    p = lo.make_problem("q_outer", n_q=4096, d=64, block_q=128, block_k=64)
    assert q_outer.layout(p) == Layout(8, 8, 2) and q_outer.layout(p).copies_rows(64, 64)
    assert not Layout(8, 8, 2).copies_rows(63, 64) and not Layout(8, 8, 1).copies_rows(64, 64)
    for name in ("kv_outer", "split_kv"):
        assert lo.get_schedule(name).layout(p).stages == 1
    mk = make_micro_kernel(32, 16, 8, 8, 4, 4, NO_MASK, False, Unroll.by(1), 2)
    assert mk.STAGGERED and mk.weigh is not None and mk.fold is not None
    assert not make_micro_kernel(32, 16, 8, 8, 4, 4, NO_MASK, False, Unroll.by(1)).STAGGERED
    monkeypatch.setattr(tuning, "CURRENT", tuning.Tuning(kv_stages=1))
    assert q_outer.layout(p) == Layout(8, 8, 1)


def test_misaligned_keys_get_the_plain_load_kernel_on_cuda_cores(monkeypatch):
    """The launch plan as on a GPU (the simulator has no cp.async alignment to keep): k and v
    at 16-byte aligned addresses launch the staggered cp.async kernel; a k 4 bytes off takes
    the plain-load kernel; on tensor cores the same k is refused with the reason; the
    warp-specialised kernel, which also stores O_i 16 bytes at a time, takes the plain-load
    kernel for an o 4 bytes off too. Tiles of their own (24 x 12, d = 8; 64 x 32, d = 64), so
    the kernels built here are no other test's."""
    import loop_orders as lo
    from loop_orders.device import runtime
    from loop_orders.device.arrays import DeviceView, c_strides
    from loop_orders.microkernel import cuda_cores as microkernel

    monkeypatch.setattr(microkernel, "SIMULATOR", False)
    sched = lo.get_schedule("q_outer")
    sched._launch_plan.cache_clear()  # plans made as on the simulator; cleared again after

    def at(ptr, p, width, dtype):
        shape = (p.bh, p.n_q, width)
        return DeviceView(ptr, shape, c_strides(shape, np.dtype(dtype).itemsize), dtype)

    def launched(p, dtype, k_ptr, o_ptr=4 << 20):
        q, k, v, o = (at(ptr, p, p.d, dtype) for ptr in (1 << 20, k_ptr, 3 << 20, o_ptr))
        with runtime.recording_launches() as launches:
            sched.launch_kernel(p, (p.tr, p.bh), False, 0.25, q, k, v, o)
        return launches[0][0]

    try:
        p = lo.make_problem("q_outer", n_q=48, d=8, block_q=24, block_k=12)
        lay = sched.layout(p)
        assert lay.stages == 2 and lay.copies_rows(8, 8)
        staggered = sched.micro_kernel(p, False, lay).fn
        plain = sched.micro_kernel(p, False, lay._replace(stages=1)).fn
        assert launched(p, "float32", 2 << 20) is staggered
        assert launched(p, "float32", (2 << 20) + 4) is plain
        p16 = lo.make_problem("q_outer", n_q=48, d=8, block_q=24, block_k=12, dtype="float16")
        with pytest.raises(ValueError, match="k: the tensor-core kernels need its data 16-byte"):
            launched(p16, "float16", (2 << 20) + 2)
        monkeypatch.setattr(tuning, "CURRENT", tuning.Tuning(layout="ws"))
        pw = lo.make_problem("q_outer", n_q=128, d=64, block_q=64, block_k=32)
        ws = sched.layout(pw)
        specialised = sched.micro_kernel(pw, False, ws).fn
        plain_ws = sched.micro_kernel(pw, False, ws.plain()).fn
        assert specialised is not plain_ws
        assert launched(pw, "float32", 2 << 20) is specialised
        assert launched(pw, "float32", 2 << 20, (4 << 20) + 4) is plain_ws
        assert launched(pw, "float32", (2 << 20) + 4) is plain_ws
    finally:
        sched._launch_plan.cache_clear()


def test_dense_runs_its_two_products_on_tensor_cores_for_16_bit_inputs():
    """dense: kernels 1 and 3 on tensor cores for float16 and bfloat16 (a warp per 16 query
    rows, P rounded to 16 bits: one more output rounding): on Hopper's wgmma where the tiles
    allow (the simulator stands in for an H100), else or asked (`tuning` products="mma") on
    mma.sync; the CUDA-core kernels for float32."""
    import loop_orders as lo
    from loop_orders.microkernel import tuning
    from loop_orders.microkernel.tensor_cores import TensorCores

    dense = lo.get_schedule("dense")
    for dtype in ("float16", "bfloat16"):
        p = lo.make_problem("dense", n_q=1024, d=64, block_q=64, block_k=64, dtype=dtype)
        assert dense.layout(p) == TensorCores(dtype, 1, True)
        with tuning.tuned(products="mma"):
            assert dense.layout(p) == TensorCores(dtype)
        odd = lo.make_problem("dense", n_q=1024, d=40, block_q=64, block_k=64, dtype=dtype)
        assert dense.layout(odd) == TensorCores(dtype)  # d not a whole 16
        assert [k.name for k in dense.kernels(p, False)] == [
            "dense_scores_tc", "dense_softmax", "dense_pv_tc"]
        assert dense.threads(p) == 128 and dense.output_roundings(p) == 2
        assert dense.warp_exchanges(p) > 0 and p.itemsize == 2
    p32 = lo.make_problem("dense", n_q=1024, d=64, block_q=64, block_k=64)
    assert dense.layout(p32) is None and dense.threads(p32) == 64
    assert dense.output_roundings(p32) == 1 and dense.warp_exchanges(p32) == 0


def test_the_launch_follows_a_tuning_override_set_between_calls(monkeypatch):
    """The launch plan is cached per problem *and* per tuning override: a sweep that sets
    kv_stages between calls launches the kernel it asked for (a cache keyed on
    the problem alone once timed the double-buffered kernel's single-buffered twin)."""
    import loop_orders as lo
    from loop_orders.device import runtime

    sched = lo.get_schedule("q_outer")
    p = lo.make_problem("q_outer", n_q=64, d=16, block_q=32, block_k=16, dtype="float16")
    launched = {}
    for stages in (1, 2):
        monkeypatch.setattr(tuning, "CURRENT", tuning.Tuning(kv_stages=stages))
        with runtime.recording_launches() as launches:
            sched.launch_kernel(p, (p.tr, p.bh), False, 0.25, None, None, None)
        launched[stages] = launches[0][0]
        assert launched[stages] is sched.kernels(p, False)[0].fn
    assert launched[1] is not launched[2]


def test_which_rows_the_tensor_cores_copy_with_cp_async():
    """cp.async moves 16 bytes: 8 16-bit elements or 4 float32 ones (TF32), so a head dim
    that is a multiple of 4 but not 8 takes it on TF32 only; the launch then checks the
    alignment of exactly those arrays (microkernel._launch_plan, dense.launch)."""
    from loop_orders.microkernel.tensor_cores import TensorCores

    f16, bf16, tf32 = TensorCores("float16"), TensorCores("bfloat16"), TensorCores("tf32")
    assert (f16.per_copy, bf16.per_copy, tf32.per_copy) == (8, 8, 4)
    assert f16.copies_rows(64, 128) and bf16.copies_rows(40) and tf32.copies_rows(36, 20)
    assert not f16.copies_rows(36) and not bf16.copies_rows(64, 20) and not tf32.copies_rows(6)
    assert f16.copies_rows(64, 0)  # dense's kernel 1 builds with dv = 0


def test_q_outer_takes_the_warp_specialised_kernel_where_it_was_measured_faster(monkeypatch):
    """float32 at d = 128 on 128 x 64 tiles, causal or not (q_outer's SPECIALISED): S warps
    and P V warps, 256 threads, 219,136 bytes, a CTA a query block, or persistent CTAs
    causal up to N = 2048 (PERSISTENT, unrolled as it says); other tiles and head dims,
    16-bit inputs, one K/V stage and a forced thread tile take the shared micro-kernel;
    LOOP_ORDERS_LAYOUT=ws is refused where the loop nest or the tiles have no such kernel;
    inputs cp.async cannot copy get the shared micro-kernel's plain loads."""
    import loop_orders as lo
    from loop_orders.microkernel.tensor_cores import TensorCores
    from loop_orders.schedules.q_outer.warp_specialised import Specialised, shared

    q_outer = lo.get_schedule("q_outer")

    def problem(d=128, n_q=4096, **kw):
        return lo.make_problem("q_outer", n_q=n_q, d=d, block_q=128, block_k=64, **kw)

    p = problem()
    assert q_outer.layout(p) == Specialised(128, 3, 4, even=True)  # 4 keys a trip
    assert str(q_outer.layout(p)) == "ws,3,4,1"
    assert q_outer.threads(p) == 256 and q_outer.dynamic_shared_bytes(p) == 219_136
    assert q_outer.layout(problem(causal=True)) == Specialised(128, even=True)
    for n, persistent in ((512, True), (1000, True), (2048, True), (2049, False)):
        causal = lo.make_problem("q_outer", n_q=n, d=128, block_q=128, block_k=64, causal=True)
        assert q_outer.layout(causal).persistent == persistent
    assert q_outer.layout(problem(causal=True, n_q=1024)) == Specialised(128, 3, 8, False, True,
                                                                        even=True)
    assert not q_outer.layout(problem(n_q=1024)).persistent  # without a mask, a CTA a block
    assert str(q_outer.layout(problem(causal=True, n_q=1024))) == "ws,3,8,0,1"
    assert q_outer.layout(lo.make_problem("q_outer", n_q=4096, d=128, block_q=64, block_k=64,
                                          causal=True)) == Layout(8, 4, 2, True)
    assert q_outer.layout(problem(64)) == Layout(8, 8, 2)
    assert isinstance(q_outer.layout(problem(dtype="float16")), TensorCores)
    assert Specialised(128).plain() == Layout(8, 4)
    assert Specialised.parse("ws,4,8,0", 128) == Specialised(128, 4, 8, False)
    assert Specialised.parse("ws,3,4,0,1", 128) == Specialised(128, 3, 4, False, True)
    assert not q_outer.layout(lo.make_problem("q_outer", n_q=4000, d=128, block_q=128,
                                              block_k=64)).even  # a tail: the tails' code
    assert str(Specialised(128, 4, 8, False)) == "ws,4,8,0"
    with pytest.raises(ValueError, match="expected ws or ws,CHUNKS,KEYS"):
        Specialised.parse("ws,4", 128)
    monkeypatch.setattr(tuning, "CURRENT", tuning.Tuning(kv_stages=1))
    assert q_outer.layout(problem()) == Layout(8, 4, 1)
    monkeypatch.setattr(tuning, "CURRENT", tuning.Tuning())
    monkeypatch.setattr(tuning, "CURRENT", tuning.Tuning(layout="8,4,2"))
    assert q_outer.layout(problem()) == Layout(8, 4, 2)
    monkeypatch.setattr(tuning, "CURRENT", tuning.Tuning(layout="ws"))
    with pytest.raises(ValueError, match="kv_outer has no warp-specialised kernel"):
        lo.get_schedule("kv_outer").layout(lo.make_problem("kv_outer", n_q=256, d=128,
                                                           block_q=128, block_k=64))
    with pytest.raises(ValueError, match="no warp-specialised kernel for block_q"):
        q_outer.layout(problem(d=126))
    assert Specialised.fits(64, 32, 20, 64) and not Specialised.fits(64, 32, 20, 48)
    assert not Specialised.fits(128, 128, 128, 128)  # 4 x 8 warps of S threads, 320 KB
    sm = shared(128, 64, 128, 128)
    regions = [sm.q, sm.k, sm.v, sm.p, sm.alpha, sm.l_row, sm.size]
    assert all(r % 4 == 0 for r in regions) and regions == sorted(regions)
    assert (sm.qs // 4) % 2 == 1 and (sm.ps // 4) % 2 == 1  # odd 16-byte chunks a row


def test_hoppers_causal_grid_by_groups_of_heads_where_measured_faster():
    """q_outer's causal wgmma build at d = 128 on 128 x 128 orders its grid by HOPPER_CAUSAL_
    HEADS' eight heads a group (measured faster); without a mask, at d = 64, on mma.sync
    and on float32 the grid runs over every head; a sweep's causal_heads overrides it, 0
    turning it off."""
    import loop_orders as lo
    from loop_orders.microkernel import tuning

    q_outer = lo.get_schedule("q_outer")

    def heads(d=128, tiles=(128, 128), causal=True, dtype="float16"):
        p = lo.make_problem("q_outer", n_q=1024, d=d, dtype=dtype, block_q=tiles[0],
                            block_k=tiles[1], causal=causal)
        return getattr(q_outer.layout(p), "causal_heads", 0)

    assert heads() == q_outer.HOPPER_CAUSAL_HEADS[(128, 128, 128)] == 8
    assert heads(causal=False) == heads(d=64, tiles=(128, 64)) == heads(tiles=(64, 64)) == 0
    assert heads(dtype="float32") == 0
    with tuning.tuned(products="mma"):
        assert heads() == 0
    with tuning.tuned(causal_heads=0):
        assert heads() == 0
    with tuning.tuned(causal_heads=16):
        assert heads() == heads(d=64, tiles=(128, 64)) == 16


def test_the_tensor_core_backward_double_buffers_q_and_do_where_two_ctas_fit_an_sm():
    """q_outer's K/V-outer backward kernel on tensor cores: two Q_i/dO_i buffers where two
    CTAs' buffers still fit an SM (16-bit, 64 x 64, d = 64 and 128), else one (TF32); a
    sweep's count (`tuning` q_stages) where it fits a CTA (TF32 at d = 128 on 64 x 64, one
    CTA an SM either way), else one (64 x 128: 308,736 bytes on two)."""
    import loop_orders as lo
    from loop_orders.microkernel.tensor_cores import TensorCores
    from loop_orders.schedules.q_outer import backward as qb

    cases = {("float16", "ieee", 64): 2, ("float16", "ieee", 128): 2,
             ("float32", "tf32x3", 64): 1, ("float32", "tf32x3", 128): 1}
    for (dtype, precision, d), stages in cases.items():
        p = lo.make_problem("q_outer", n_q=4096, d=d, block_q=64, block_k=64, dtype=dtype,
                            precision=precision)
        build = TensorCores(dtype if precision == "ieee" else precision)
        assert qb.tc_q_stages(p, build) == stages, (dtype, precision, d)
        for asked in (1, 2):
            with tuning.tuned(q_stages=asked):
                assert qb.tc_q_stages(p, build) == asked
    wide = lo.make_problem("q_outer", n_q=4096, d=128, block_q=64, block_k=128,
                           dtype="float32", precision="tf32x3")
    assert qb.tc.tc_shared_bytes(64, 128, 128, 128, 2, True) == 308736
    with tuning.tuned(q_stages=2):
        assert qb.tc_q_stages(wide, TensorCores("tf32x3")) == 1
