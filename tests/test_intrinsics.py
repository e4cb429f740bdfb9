"""The inline-PTX layer (loop_orders.device.intrinsics), one warp per test: on a GPU the
instructions themselves, on the simulator their emulation, against NumPy in both cases. The fragment
layouts the tensor-core micro-kernel relies on are exactly what these check."""

import numpy as np
import pytest
from numba import float32, uint32

from loop_orders.device import intrinsics as ptx
from loop_orders.device.runtime import SIMULATOR, cuda, kernel_options, to_device
from loop_orders.microkernel import hopper


def _bf16_round(x):
    """float32 -> the nearest bfloat16, as float32 (ties to even)."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.astype(np.uint32).view(np.float32)


def _fragments_kernel(kind):
    mma = ptx.mma_f16 if kind == "f16" else ptx.mma_bf16
    pack = ptx.pack_f16x2 if kind == "f16" else ptx.pack_bf16x2

    @cuda.jit
    def kernel(a, b, c, d):
        lane = cuda.threadIdx.x
        g, t = lane // 4, lane % 4
        a0 = pack(a[g, 2 * t], a[g, 2 * t + 1])
        a1 = pack(a[g + 8, 2 * t], a[g + 8, 2 * t + 1])
        a2 = pack(a[g, 8 + 2 * t], a[g, 9 + 2 * t])
        a3 = pack(a[g + 8, 8 + 2 * t], a[g + 8, 9 + 2 * t])
        b0 = pack(b[2 * t, g], b[2 * t + 1, g])
        b1 = pack(b[8 + 2 * t, g], b[9 + 2 * t, g])
        d0, d1, d2, d3 = mma(a0, a1, a2, a3, b0, b1, c[g, 2 * t], c[g, 2 * t + 1],
                             c[g + 8, 2 * t], c[g + 8, 2 * t + 1])
        d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1] = d0, d1, d2, d3

    return kernel


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_mma_m16n8k16_and_packing(kind, rng):
    """D = A B + C for 16-bit A, B packed in-kernel from float32 (exactly representable, so
    the only error is the float32 accumulation)."""
    rnd = (lambda x: x.astype(np.float16).astype(np.float32)) if kind == "f16" else _bf16_round
    a = rnd(rng.standard_normal((16, 16)).astype(np.float32))
    b = rnd(rng.standard_normal((16, 8)).astype(np.float32))
    c = rng.standard_normal((16, 8)).astype(np.float32)
    d = to_device(np.zeros((16, 8), np.float32))
    _fragments_kernel(kind)[1, 32](to_device(a), to_device(b), to_device(c), d)
    expect = a.astype(np.float64) @ b + c
    np.testing.assert_allclose(d.copy_to_host(), expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("as_bits", [False, True])
def test_mma_m16n8k8_tf32(as_bits, rng):
    """TF32 keeps 10 mantissa bits of each input: error about 2^-11 relative per product.
    Operands go in as float32 values (the micro-kernel's shared tiles) or as their bits."""

    @cuda.jit
    def kernel(a, b, c, d):
        lane = cuda.threadIdx.x
        g, t = lane // 4, lane % 4
        d0, d1, d2, d3 = ptx.mma_tf32(a[g, t], a[g + 8, t], a[g, t + 4], a[g + 8, t + 4],
                                      b[t, g], b[t + 4, g], c[g, 2 * t], c[g, 2 * t + 1],
                                      c[g + 8, 2 * t], c[g + 8, 2 * t + 1])
        d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1] = d0, d1, d2, d3

    a = rng.standard_normal((16, 8)).astype(np.float32)
    b = rng.standard_normal((8, 8)).astype(np.float32)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    d = to_device(np.zeros((16, 8), np.float32))
    ops = (a.view(np.uint32), b.view(np.uint32)) if as_bits else (a, b)
    kernel[1, 32](*(to_device(x) for x in ops), to_device(c), d)
    expect = a.astype(np.float64) @ b + c
    err = np.abs(d.copy_to_host() - expect).max() / np.abs(expect).max()
    assert 0 < err <= 8 * 2.0**-11  # TF32, not float32 (which would give about 1e-7)


def _tf32_rna(x):
    """float32 -> the nearest TF32 (10 mantissa bits; ties away from zero), as float32."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return (((bits + 0x1000) & 0xFFFFE000).astype(np.uint32)).view(np.float32)


def test_tf32_round_and_the_3xtf32_split(rng):
    """tf32_round is round-to-nearest (ties away) to 10 mantissa bits; the tail x - head is
    exact, and three m16n8k8 products of heads and tails (what precision "tf32x3" takes)
    give A B + C to about float32's accuracy, a thousand times closer than one TF32 product."""

    @cuda.jit
    def kernel(x, heads, a, b, c, d):
        lane = cuda.threadIdx.x
        heads[lane] = ptx.tf32_round(x[lane])
        g, t = lane // 4, lane % 4
        ops = (a[g, t], a[g + 8, t], a[g, t + 4], a[g + 8, t + 4], b[t, g], b[t + 4, g])
        hd = (ptx.tf32_round(ops[0]), ptx.tf32_round(ops[1]), ptx.tf32_round(ops[2]),
              ptx.tf32_round(ops[3]), ptx.tf32_round(ops[4]), ptx.tf32_round(ops[5]))
        tl = (ops[0] - hd[0], ops[1] - hd[1], ops[2] - hd[2], ops[3] - hd[3], ops[4] - hd[4],
              ops[5] - hd[5])
        d0, d1, d2, d3 = ptx.mma_tf32(tl[0], tl[1], tl[2], tl[3], hd[4], hd[5], c[g, 2 * t],
                                      c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1])
        d0, d1, d2, d3 = ptx.mma_tf32(hd[0], hd[1], hd[2], hd[3], tl[4], tl[5], d0, d1, d2, d3)
        d0, d1, d2, d3 = ptx.mma_tf32(hd[0], hd[1], hd[2], hd[3], hd[4], hd[5], d0, d1, d2, d3)
        d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1] = d0, d1, d2, d3

    # random values, and ties: the dropped 13 bits exactly half an ulp of TF32 (away: up)
    x = rng.standard_normal(32).astype(np.float32)
    x[:4] = (np.array([1.0, -1.0, 3.0, -5.0], np.float32).view(np.uint32) + 0x1000).view(
        np.float32)
    a = rng.standard_normal((16, 8)).astype(np.float32)
    b = rng.standard_normal((8, 8)).astype(np.float32)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    heads, d = to_device(np.zeros(32, np.float32)), to_device(np.zeros((16, 8), np.float32))
    kernel[1, 32](to_device(x), heads, to_device(a), to_device(b), to_device(c), d)
    got = heads.copy_to_host()
    np.testing.assert_array_equal(got, _tf32_rna(x))
    assert (np.abs(got[:4]) > np.abs(x[:4])).all()  # ties go away from zero
    expect = a.astype(np.float64) @ b + c
    err = np.abs(d.copy_to_host() - expect).max() / np.abs(expect).max()
    assert err <= 2.0**-18  # one TF32 product: about 2^-11 (test_mma_m16n8k8_tf32)


@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix_x4(trans, rng):
    """Four 8x8 float16 matrices (rows 8 apart in a padded tile): lane 4g + t gets row g,
    columns 2t, 2t+1 of each (transposed: rows 2t, 2t+1 of column g)."""
    stride = 24  # 16 columns + 8 of padding, as the micro-kernel's tiles
    tile = rng.standard_normal((16, stride)).astype(np.float16)
    load = ptx.ldmatrix_x4_trans if trans else ptx.ldmatrix_x4

    @cuda.jit
    def kernel(src, out):
        lane = cuda.threadIdx.x
        sh = cuda.shared.array((16 * 24,), np.float16)
        for e in range(lane, 16 * 24, 32):
            sh[e] = src[e // 24, e % 24]
        cuda.syncthreads()  # the tile is in shared memory
        mat, r = lane // 8, lane % 8  # matrix `mat` = rows 8 (mat % 2) .., columns 8 (mat // 2) ..
        w0, w1, w2, w3 = load(sh, (8 * (mat % 2) + r) * 24 + 8 * (mat // 2))
        out[lane, 0], out[lane, 1], out[lane, 2], out[lane, 3] = w0, w1, w2, w3

    out = to_device(np.zeros((32, 4), np.uint32))
    kernel[1, 32](to_device(tile), out)
    words = out.copy_to_host()
    for lane in range(32):
        g, t = divmod(lane, 4)
        for mat in range(4):
            block = tile[8 * (mat % 2):8 * (mat % 2) + 8, 8 * (mat // 2):8 * (mat // 2) + 8]
            pair = block[g, 2 * t:2 * t + 2] if not trans else block[2 * t:2 * t + 2, g]
            assert words[lane, mat] == np.ascontiguousarray(pair).view(np.uint32)[0]


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided rows"])
def test_cp_async16_copies_and_zero_fills(strided, rng):
    """Rows of 8 float16 (16 bytes) into shared memory; n_bytes = 0 zero-fills the row. Each
    lane copies its row as columns 8 .. 15 of the row before it (col past the row's end:
    the next row), from C-contiguous rows or from rows 24 elements apart (a varlen view)."""
    rows = rng.standard_normal((1, 33, 24 if strided else 8)).astype(np.float16)
    src = rows[:, :, 8:16] if strided else rows

    @cuda.jit
    def kernel(src, out):
        lane = cuda.threadIdx.x
        sh = cuda.shared.array((32 * 8,), np.float16)
        ptx.cp_async16(sh, lane * 8, src, 0, lane, 8, 16 if lane % 3 else 0, 8)
        ptx.cp_async_commit()
        ptx.cp_async_wait_all()
        cuda.syncthreads()  # every lane's copy has landed
        for u in range(8):
            out[lane, u] = sh[lane * 8 + u]

    out = to_device(np.full((32, 8), 7, np.float16))
    kernel[1, 32](to_device(rows)[:, :, 8:16] if strided else to_device(src), out)
    expect = src[0, 1:].copy()
    expect[::3] = 0
    np.testing.assert_array_equal(out.copy_to_host(), expect)


def test_shfl_xor_and_exp2():
    @cuda.jit
    def kernel(out):
        lane = cuda.threadIdx.x
        x = float32(lane)
        out[lane, 0] = ptx.shfl_xor(x, uint32(1))
        out[lane, 1] = ptx.shfl_xor(x, uint32(2))
        out[lane, 2] = ptx.exp2(float32(lane % 4) - float32(2.0))

    out = to_device(np.zeros((32, 3), np.float32))
    kernel[1, 32](out)
    got = out.copy_to_host()
    lanes = np.arange(32)
    np.testing.assert_array_equal(got[:, 0], lanes ^ 1)
    np.testing.assert_array_equal(got[:, 1], lanes ^ 2)
    np.testing.assert_allclose(got[:, 2], 2.0 ** (lanes % 4 - 2.0), rtol=2**-22)


def test_named_barriers_hand_data_between_warps_and_vote_any():
    """Two warps, as the warp-specialised kernel's: warp 0 writes a value for each round into
    shared memory and arrives on barrier 1 (`full`), warp 1 waits there, reads it, and arrives
    on barrier 2 (`empty`), which warp 0 waits on before it writes the next round; warp 1's
    lanes then vote on whether any of them saw an odd round total."""
    full_sync, full_arrive = ptx.named_barrier(1, 64)
    empty_sync, empty_arrive = ptx.named_barrier(2, 64)

    @cuda.jit
    def kernel(out):
        slot = cuda.shared.array(32, float32)
        t = cuda.threadIdx.x
        lane = t % 32
        total = float32(0.0)
        for r in range(4):
            if t < 32:
                if r > 0:
                    empty_sync()  # warp 1 is done reading the previous round
                slot[lane] = float32(100 * r + lane)
                full_arrive()  # this round is in shared memory
            else:
                full_sync()
                total += slot[31 - lane]
                if r < 3:
                    empty_arrive()
        if t >= 32:
            out[lane, 0] = total
            out[lane, 1] = float32(ptx.vote_any(lane == 5 and total > 0))

    out = to_device(np.zeros((32, 2), np.float32))
    kernel[1, 64](out)
    got = out.copy_to_host()
    lanes = np.arange(32)
    np.testing.assert_array_equal(got[:, 0], 600 + 4 * (31 - lanes))
    np.testing.assert_array_equal(got[:, 1], 1)


def test_named_barriers_take_ptx_ids_and_whole_warps():
    for ident, count in ((0, 64), (16, 64), (1, 48), (1, 2048)):
        with pytest.raises(ValueError, match="ids are 1 .. 15"):
            ptx.named_barrier(ident, count)


ALIGN = None if SIMULATOR else hopper.ALIGN  # the simulator takes no alignment


def _up(x: int, m: int) -> int:
    return -(-x // m) * m


def _hopper_or_simulator():
    """wgmma needs sm_90a: on a GPU, a Hopper; the simulator emulates it."""
    from loop_orders.device import runtime

    return runtime.SIMULATOR or runtime.compute_capability()[:2] == (9, 0)


@pytest.mark.parametrize("kind", ["f16", "bf16"])
@pytest.mark.parametrize("n, ksteps, nv", [(32, 2, 32), (64, 4, 64), (48, 5, 80)])
def test_wgmma_scores_then_accumulate(kind, n, ksteps, nv, rng):
    """One warpgroup: S = A B^T from shared memory (both K-major), then O = C + P V with P
    the scores rounded to 16 bits from registers and V MN-major, as the Hopper micro-kernel
    takes them (swizzled, `hopper.k_major` and `mn_major`: 32-byte rows at k = 32, 64-byte
    V rows at nv = 32, 128-byte ones at k, nv = 64): against NumPy on the rounded inputs."""
    if not _hopper_or_simulator():
        pytest.skip("wgmma needs a Hopper GPU (sm_90a)")
    k = 16 * ksteps
    rnd = (lambda x: x.astype(np.float16).astype(np.float32)) if kind == "f16" else _bf16_round
    a = rnd(rng.standard_normal((64, k)).astype(np.float32))
    b = rnd(rng.standard_normal((n, k)).astype(np.float32))
    v = rnd(rng.standard_normal((n, nv)).astype(np.float32))
    c = rng.standard_normal((64, nv)).astype(np.float32)
    op_a, op_b = hopper.k_major(64, k), hopper.k_major(n, k)
    op_v = hopper.mn_major(n, nv)  # V's rows (keys) are the K of P V
    # each operand from a multiple of 1024 bytes (where the swizzle's pattern starts)
    a_at, b_at = 0, _up(64 * k, 512)
    v_at = b_at + _up(n * k, 512)
    tile_host = np.zeros(v_at + n * nv, np.float32)
    tile_host[op_a.addresses(a_at, 64, k)] = a
    tile_host[op_b.addresses(b_at, n, k)] = b
    tile_host[op_v.addresses(v_at, nv, n)] = v.T
    bits = tile_host.astype(np.float16) if kind == "f16" else \
        (tile_host.view(np.uint32) >> 16).astype(np.uint16)
    size = bits.size
    scores = ptx.wgmma_scores(kind, n, ksteps, op_a, op_b)
    ns, nacc = n // 2, nv // 2  # a thread's scores, accumulators (constants for the kernel)
    accumulate = ptx.wgmma_accumulate(kind, nv, n // 16, op_v)

    @cuda.jit
    def kernel(src, c, s_out, o_out):
        thread = cuda.threadIdx.x
        tile = cuda.shared.array(size, bits.dtype, alignment=ALIGN)
        for e in range(thread, size, 128):
            tile[e] = src[e]
        ptx.fence_async_shared()  # the stores are seen by wgmma's reads ...
        cuda.syncthreads()  # ... of every thread's, once all have stored
        u, lane = thread // 32, thread % 32
        g, t = lane // 4, lane % 4
        s = cuda.local.array(ns, float32)
        acc = cuda.local.array(nacc, float32)
        scores(s, tile, a_at, b_at)
        for j in range(nv // 8):
            for h in range(2):
                for x in range(2):
                    acc[4 * j + 2 * h + x] = c[16 * u + g + 8 * h, 8 * j + 2 * t + x]
        accumulate(acc, s, tile, v_at)
        for j in range(n // 8):
            for h in range(2):
                for x in range(2):
                    s_out[16 * u + g + 8 * h, 8 * j + 2 * t + x] = s[4 * j + 2 * h + x]
        for j in range(nv // 8):
            for h in range(2):
                for x in range(2):
                    o_out[16 * u + g + 8 * h, 8 * j + 2 * t + x] = acc[4 * j + 2 * h + x]

    s_out = to_device(np.zeros((64, n), np.float32))
    o_out = to_device(np.zeros((64, nv), np.float32))
    kernel[1, 128](to_device(bits), to_device(c), s_out, o_out)
    s_expect = a.astype(np.float64) @ b.T
    np.testing.assert_allclose(s_out.copy_to_host(), s_expect, rtol=1e-5, atol=1e-4)
    p = rnd(s_out.copy_to_host())  # P as the instruction rounds it
    np.testing.assert_allclose(o_out.copy_to_host(), p.astype(np.float64) @ v + c,
                               rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("rows, cols, tail", [(64, 64, False), (40, 128, True), (16, 32, True),
                                              (24, 16, False)])
def test_hopper_tma_load_lays_tiles_out_as_the_copier(rows, cols, tail, rng):
    """One thread's TMA copies of a tile (a box per column block, counted at an mbarrier) lay
    it out in shared memory exactly as the cp.async copier (`hopper.make_swizzled_copier`) does:
    the 128-, 64- and 32-byte swizzles, rows past the source's end zero (`tail`)."""
    if not _hopper_or_simulator():
        pytest.skip("TMA needs a Hopper GPU (sm_90)")
    from loop_orders.device import tensor_map

    n = 3 * rows + 5
    src = rng.standard_normal((3, n, cols)).astype(np.float16)
    row0 = n - rows // 2 if tail else rows
    n_rows = min(rows, n - row0)
    width = hopper.swizzle_width(cols)
    size = _up(rows * cols, 512)  # each tile from a multiple of 1024 bytes
    both = 2 * size  # a constant of the kernel's
    copy_rows = hopper.make_swizzled_copier(rows, cols, 128)
    load = ptx.tma_load(rows, width)
    n_bytes, blocks = 2 * rows * cols, cols // width

    @cuda.jit
    def kernel(src, maps, out):
        thread = cuda.threadIdx.x
        tile = cuda.shared.array(both, np.float16, alignment=ALIGN)
        bars = cuda.shared.array(1, np.uint64)
        if thread == 0:
            ptx.mbarrier_init(bars, 0, 1)
        cuda.syncthreads()  # the mbarrier is set up before the copy counts at it
        copy_rows(tile, 0, src, 1, row0, n_rows)
        if thread == 0:
            ptx.fence_tensor_map(maps, 0)
            ptx.mbarrier_expect_tx(bars, 0, n_bytes)
            for c in range(blocks):
                load(tile, size + c * rows * width, bars, 0, maps, 0, src, c * width, row0, 1)
        ptx.cp_async_wait_all()
        ptx.mbarrier_wait(bars, 0, 0)
        cuda.syncthreads()  # both tiles have landed, every thread's part of the first
        for e in range(thread, both, 128):
            out[e] = tile[e]

    src_dev = to_device(src)
    maps = tensor_map.device_maps([tensor_map.encode(src_dev, rows, width)])
    out = to_device(np.full(2 * size, 7, np.float16))
    kernel[1, 128](src_dev, maps, out)
    got = out.copy_to_host()
    copied, loaded = got[:rows * cols], got[size:size + rows * cols]
    np.testing.assert_array_equal(loaded, copied)
    expect = np.zeros((rows, cols), np.float16)
    expect[:n_rows] = src[1, row0:row0 + n_rows]
    np.testing.assert_array_equal(loaded[hopper.k_major(rows, cols).addresses(0, rows, cols)],
                                  expect)


def test_hopper_set_max_registers_moves_registers_between_warpgroups():
    """Three warpgroups at 168 registers a thread: the first gives registers back (40), the
    others take them (232), the whole pool (the producer/consumer split FlashAttention-3
    makes); each thread's work after it lands."""
    if not _hopper_or_simulator():
        pytest.skip("setmaxnreg needs a Hopper GPU (sm_90a)")
    fewer, more = ptx.set_max_registers(40, False), ptx.set_max_registers(232, True)

    @cuda.jit(**kernel_options(384, 168))  # 168 registers a thread at launch
    def kernel(out):
        thread = cuda.threadIdx.x
        if thread < 128:
            fewer()
        else:
            more()
        out[thread] = 3 * thread + 1

    out = to_device(np.zeros(384, np.int32))
    kernel[1, 384](out)
    np.testing.assert_array_equal(out.copy_to_host(), 3 * np.arange(384) + 1)
