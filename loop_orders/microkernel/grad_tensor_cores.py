"""The backward pass's tensor-core micro-kernel for 16-bit inputs (and float32 on TF32, below),
shared by the backward
orders: FlashAttention-2's five products on mma.sync m16n8k16 (float32 accumulators), with P
and dS rounded to the input type for the products that read them.

A K/V-outer step (one CTA per K/V block j, W = ceil(Bc / 16) warps; `kv_step`, `dq_partial`):

    warp w owns keys 16 w .. 16 w + 15 of K_j, V_j; lane 4 g + t holds keys g, g + 8 (a = 0, 1)
    S^T  = K_j Q_i^T      A: K_j rows by ldmatrix; B: Q_i's rows (n = query) by ldmatrix
    dP^T = V_j dO_i^T     the same with V_j, dO_i
    P^T  = 2^(tau log2(e) S^T - base_r) inv_r,  dS^T = P^T o (dP^T - D_r)
                          (r a query: its column's stats rows; masked entries exactly 0)
    dV_j += P^T dO_i      P^T's accumulator fragment packed to 16 bits is the A fragment;
    dK_j += dS^T Q_i      B: dO_i, Q_i rows (k = query) by ldmatrix.trans
    dS^T -> shared        16 bits, for the one product whose rows are queries:
    dQ_i += tau dS K_j    warps over 16-row slices of Q_i: A: dS by ldmatrix.trans of dS^T,
                          B: K_j by ldmatrix.trans; into HBM by float32 atomics (q_outer) or
                          added to dQ_i's rows there (kv_outer: one CTA per head, serial j)

A Q-outer step (one CTA per query block i, W = ceil(Br / 16) warps; `q_step`): warp w owns
query rows 16 w .. 16 w + 15, as in the forward: S = Q_i K_j^T, dP = dO_i V_j^T, P, dS in
registers, dQ_i += dS K_j with dS's fragment packed from the accumulators.

Under a mask (`core.mask`: bottom-right causal, sliding windows) a query row sees the keys
[first, end) of a tile that its diagonal key gives (`tiles.make_visible`), the same rule as
the forward's and the CUDA-core backward's; the loop nests visit only the blocks some row
sees (`tiles.make_q_blocks`, `make_kv_blocks`).

Tiles arrive in shared memory as 16-bit rows by cp.async (16 bytes a copy; rows past the tile
zero-filled; a head dim that is not a multiple of 8 takes plain loads), padded to whole 16s of
rows and head dims (zero, cleared once per CTA), each row stride 8 elements over that, so the 8
rows one ldmatrix reads fall in different banks. After the 16-bit tiles come the float32 rows
of the query block's statistics (base, inv, D). The operand fragments are those of
`tensor_cores` (intrinsics: `mma_f16`, `ldmatrix_x4`).

P and dS are rounded to 16 bits before the products that read them (as FlashAttention-2
does): one more rounding each, of 2^-11 (float16) or 2^-8 (bfloat16) of their magnitude
(`TC_ROUNDINGS`).

TF32 (float32 inputs at precision "tf32" or "tf32x3", `TensorCores("tf32")`): the same steps
on m16n8k8 over float32 tiles (cp.async 4 floats a copy; rows padded for scalar fragment
loads, `tc_grad_layout`), each fragment by plain shared loads (`make_tf32_smem_product`); the
products whose A is P^T, dS^T or dS in registers read their accumulator fragment with k
permuted (`make_tf32_reg_product`, as the forward's P V_j does). 3xTF32 splits each operand
into a TF32 head and tail (`tensor_cores.make_tf32_mma`) and sums each step's register
products from zero before adding them to dK_j, dV_j or dQ_i. P and dS stay float32.
"""

from __future__ import annotations

from functools import cache
from typing import NamedTuple

from numba import float32, int32, int64, uint32, uint64

from ..core.mask import Mask
from ..device.intrinsics import (
    cp_async_wait_all,
    exp2,
    ldmatrix_x4,
    ldmatrix_x4_trans,
    mma_bf16,
    mma_f16,
    narrow,
    pack_bf16x2,
    pack_f16x2,
    widen,
)
from ..device.runtime import cuda, inlined
from .tensor_cores import (
    WARP_ROWS,
    TensorCores,
    _tile_type,
    _up,
    make_tc_tile_loader,
    make_tf32_mma,
)
from .tiles import LOG2E, make_clear, make_visible, unrolled


def tc_backward_spec(p) -> TensorCores | None:
    """The tensor-core build a backward runs for Problem p, under any mask (the tile steps
    take each row's keys from `core.mask`): 16-bit inputs, and float32 ones at precision
    "tf32" or "tf32x3"; else None (float32 FMA on CUDA cores)."""
    if p.dtype in ("float16", "bfloat16"):
        return TensorCores(p.dtype)
    return None if p.precision == "ieee" else TensorCores(p.precision)


# The extra roundings to 16 bits on tensor cores that a gradient sees: P (dV's operand) and
# dS (dK's and dQ's)
TC_ROUNDINGS = 1


def tc_grad_warps(rows: int) -> int:
    """Warps of a CTA whose warps own 16 of `rows` each."""
    return -(-rows // WARP_ROWS)


class TcGradLayout(NamedTuple):
    """A backward CTA's dynamic buffer: 16-bit tiles at element offsets (K_j, V_j: KP rows;
    Q_i, dO_i, O_i: RP rows; dS^T: KP rows of RP queries), row strides ks, vs, dss; then
    float32 rows of the query block (base, inv, D: RP each) from float offset `stats`."""

    k: int
    v: int
    q: int
    do: int
    o: int
    ds: int
    ks: int  # K_j's and Q_i's stride (head dim d)
    vs: int  # V_j's, dO_i's and O_i's stride (head dim dv)
    dss: int
    rows: int  # RP: query rows, whole 16s
    keys: int  # KP: keys, whole 16s
    stats: int
    size: int  # floats in all
    stages: int  # buffers of Q_i, dO_i and the stats rows (2: the next block's land early)

    @property
    def bytes(self) -> int:
        return 4 * self.size

    @property
    def q_stage(self) -> int:
        """Elements between Q_i's buffers."""
        return self.rows * self.ks

    @property
    def do_stage(self) -> int:
        return self.rows * self.vs

    @property
    def stats_stage(self) -> int:
        """Floats between the stats rows' buffers (base, inv, D: RP each)."""
        return 3 * self.rows


@cache
def tc_grad_layout(BR: int, BC: int, D: int, DV: int, WITH_O: bool,
                   STAGES: int = 1, TF32: bool = False) -> TcGradLayout:
    """The buffer of a tensor-core backward CTA; WITH_O: an O_i tile (kv_outer computes D_i
    per visited pair); STAGES buffers of Q_i, dO_i and the stats rows. TF32: float32 tiles,
    rows 4 floats over whole 32s (lane 4 g + t reads row g, column t of a row-major operand
    in 32 different banks, and rows 2 t, 2 t + 1 of a k x n one in 32 too; K_j read k x n by
    dQ's product, row t column g, meets 2-way conflicts: no one stride serves both)."""
    rows, keys = _up(BR, WARP_ROWS), _up(BC, WARP_ROWS)
    if TF32:
        ks, vs, dss = _up(D, 32) + 4, _up(DV, 32) + 4, rows + 8
    else:
        ks, vs, dss = _up(D, 16) + 8, _up(DV, 16) + 8, rows + 8
    k = 0
    v = k + keys * ks
    q = v + keys * vs
    do = q + STAGES * rows * ks
    o = do + STAGES * rows * vs
    ds = o + (rows * vs if WITH_O else 0)
    elements = ds + keys * dss
    stats = _up(elements if TF32 else -(-elements // 2), 4)  # float offset, 16-byte aligned
    return TcGradLayout(k, v, q, do, o, ds, ks, vs, dss, rows, keys, stats,
                        stats + STAGES * 3 * rows, STAGES)


class TcFragments(NamedTuple):
    """Warp products on shared tiles and register fragments (`make_tc_products`)."""

    smem_product: object  # smem_product(tile, acc, a_at, b_at, lane): acc += A B, both shared
    reg_product: object  # reg_product(tile, acc, s, b_at, lane): acc += pack(s) B


@cache
def make_smem_product(MK: int, NN: int, AS: int, A_TRANS: bool, BS: int, B_TRANS: bool,
                      SPEC: TensorCores):
    """smem_product(tile, acc, a_at, b_at, lane): acc (16 x 8 NN, an accumulator fragment,
    n-tile n in acc[4 n .. 4 n + 3]) += A B, A 16 x 16 MK and B 16 MK x 8 NN from shared
    tiles at element offsets a_at, b_at, rows AS and BS elements apart. A is stored m x k
    (row-major), or k x m where A_TRANS; B is stored n x k (a row per output column, as K_j
    for Q K^T), or k x n where B_TRANS (as V_j for P V). TF32: `make_tf32_smem_product`."""
    if SPEC.tf32:
        return make_tf32_smem_product(MK, NN, AS, A_TRANS, BS, B_TRANS, SPEC.split)
    mma = mma_bf16 if SPEC.dtype == "bfloat16" else mma_f16
    A_STEP = 16 * AS if A_TRANS else 16  # elements between A's k-steps
    B_KSTEP, B_NSTEP = (16 * BS, 16) if B_TRANS else (16, 16 * BS)

    @inlined
    def a_offset(lane):
        """This lane's ldmatrix row of A's 16 x 16 block: m-row lane & 15, k-half lane >> 4;
        stored k x m, k-row (lane & 7) + 8 (lane >> 4), m-half (lane >> 3) & 1."""
        if A_TRANS:
            return uint64((lane & uint32(7)) + uint32(8) * (lane >> uint32(4))) * uint64(AS) \
                + uint64(8) * uint64((lane >> uint32(3)) & uint32(1))
        return uint64(lane & uint32(15)) * uint64(AS) + uint64(8) * uint64(lane >> uint32(4))

    @inlined
    def b_offset(lane):
        """This lane's ldmatrix row of B's two 8-column n-tiles over 16 k."""
        if B_TRANS:
            return uint64((lane & uint32(7)) + uint32(8) * ((lane >> uint32(3)) & uint32(1))) \
                * uint64(BS) + uint64(8) * uint64(lane >> uint32(4))
        return uint64(uint32(8) * (lane >> uint32(4)) + (lane & uint32(7))) * uint64(BS) \
            + uint64(8) * uint64((lane >> uint32(3)) & uint32(1))

    @inlined
    def smem_product(tile, acc, a_at, b_at, lane):
        a_lane, b_lane = a_at + a_offset(lane), b_at + b_offset(lane)
        for kk in range(MK):
            if A_TRANS:
                a0, a1, a2, a3 = ldmatrix_x4_trans(tile, a_lane + uint64(kk * A_STEP))
            else:
                a0, a1, a2, a3 = ldmatrix_x4(tile, a_lane + uint64(kk * A_STEP))
            for n2 in range(NN // 2):
                at = b_lane + uint64(kk * B_KSTEP + n2 * B_NSTEP)
                b = ldmatrix_x4_trans(tile, at) if B_TRANS else ldmatrix_x4(tile, at)
                for h in range(2):
                    n = 2 * n2 + h
                    acc[4 * n], acc[4 * n + 1], acc[4 * n + 2], acc[4 * n + 3] = mma(
                        a0, a1, a2, a3, b[2 * h], b[2 * h + 1],
                        acc[4 * n], acc[4 * n + 1], acc[4 * n + 2], acc[4 * n + 3])

    return smem_product


@cache
def make_reg_product(MK: int, NN: int, BS: int, SPEC: TensorCores):
    """reg_product(tile, acc, s, b_at, lane): acc (16 x 8 NN) += A B with A (16 x 16 MK) the
    accumulator fragment s (2 MK n-tiles of 8 columns) rounded to 16 bits, which is A's
    fragment as it stands, and B stored k x n at b_at, rows BS apart (ldmatrix.trans). TF32:
    `make_tf32_reg_product`."""
    if SPEC.tf32:
        return make_tf32_reg_product(MK, NN, BS, SPEC.split)
    BF16 = SPEC.dtype == "bfloat16"
    mma = mma_bf16 if BF16 else mma_f16
    pack = pack_bf16x2 if BF16 else pack_f16x2

    @inlined
    def reg_product(tile, acc, s, b_at, lane):
        b_lane = b_at + uint64((lane & uint32(7)) + uint32(8) * ((lane >> uint32(3))
                                                                  & uint32(1))) * uint64(BS) \
            + uint64(8) * uint64(lane >> uint32(4))
        for kk in range(MK):
            a0 = pack(s[8 * kk], s[8 * kk + 1])
            a1 = pack(s[8 * kk + 2], s[8 * kk + 3])
            a2 = pack(s[8 * kk + 4], s[8 * kk + 5])
            a3 = pack(s[8 * kk + 6], s[8 * kk + 7])
            for n2 in range(NN // 2):
                b = ldmatrix_x4_trans(tile, b_lane + uint64(16 * kk * BS + 16 * n2))
                for h in range(2):
                    n = 2 * n2 + h
                    acc[4 * n], acc[4 * n + 1], acc[4 * n + 2], acc[4 * n + 3] = mma(
                        a0, a1, a2, a3, b[2 * h], b[2 * h + 1],
                        acc[4 * n], acc[4 * n + 1], acc[4 * n + 2], acc[4 * n + 3])

    return reg_product


@cache
def make_tf32_smem_product(MK: int, NN: int, AS: int, A_TRANS: bool, BS: int, B_TRANS: bool,
                           SPLIT: bool):
    """`make_smem_product` on m16n8k8 TF32 (2 MK k-steps of 8), the fragments by plain
    shared loads: lane 4 g + t takes A's rows g, g + 8 and B's column g, each at k = t and
    t + 4 of the step (`tensor_cores.make_tf32_mma`'s operands; SPLIT: 3xTF32)."""
    tm = make_tf32_mma(SPLIT)
    tf32_operand, mma_f32 = tm.tf32_operand, tm.mma_f32
    A_M, A_K = (1, AS) if A_TRANS else (AS, 1)  # elements between A's rows, A's k
    B_K, B_N = (BS, 1) if B_TRANS else (1, BS)  # elements between B's k, B's columns

    @inlined
    def ntile(n, a0, a1, a2, a3, tile, acc, b_at):
        """acc's n-tile n += the A fragment times B's columns 8 n .. 8 n + 7 (b_at: the
        lane's column g, k = t of the step)."""
        b = b_at + uint64(8 * n * B_N)
        acc[4 * n], acc[4 * n + 1], acc[4 * n + 2], acc[4 * n + 3] = mma_f32(
            a0, a1, a2, a3, tf32_operand(tile[b]), tf32_operand(tile[b + uint64(4 * B_K)]),
            acc[4 * n], acc[4 * n + 1], acc[4 * n + 2], acc[4 * n + 3])

    # the n-tiles in straight-line code (acc is indexed by n: a loop left rolled would send
    # it to local memory)
    ntiles = unrolled(ntile, NN, 7, NN)

    @inlined
    def smem_product(tile, acc, a_at, b_at, lane):
        g, t = lane >> uint32(2), lane & uint32(3)
        a_lane = a_at + uint64(g) * uint64(A_M) + uint64(t) * uint64(A_K)
        b_lane = b_at + uint64(g) * uint64(B_N) + uint64(t) * uint64(B_K)
        for kk in range(2 * MK):
            a = a_lane + uint64(8 * kk * A_K)
            a0 = tf32_operand(tile[a])
            a1 = tf32_operand(tile[a + uint64(8 * A_M)])
            a2 = tf32_operand(tile[a + uint64(4 * A_K)])
            a3 = tf32_operand(tile[a + uint64(8 * A_M + 4 * A_K)])
            ntiles(a0, a1, a2, a3, tile, acc, b_lane + uint64(8 * kk * B_K))

    return smem_product


@cache
def make_tf32_reg_product(MK: int, NN: int, BS: int, SPLIT: bool):
    """`make_reg_product` on m16n8k8 TF32: A's k-step of 8 is an 8-column n-tile of the
    accumulator fragment s, read in the order the lanes hold it (k-index t is column 2 t,
    t + 4 is 2 t + 1: a sum over k in any order), and B's rows follow (2 t, 2 t + 1, column
    g; B stored k x n, rows BS apart). 3xTF32 (SPLIT) sums the call's products from zero and
    adds them to acc in float32, as the forward's P V_j does (`accumulate_tf32`): acc carries
    a whole loop's sum, which the mma's own accumulation would let drift."""
    tm = make_tf32_mma(SPLIT)
    tf32_operand, mma_f32 = tm.tf32_operand, tm.mma_f32
    NACC = 4 * NN

    @inlined
    def ntile(n, p0, p1, p2, p3, tile, acc, b_at):
        """acc's n-tile n (columns 8 n ..) += the A fragment p0 .. p3 times B's rows of its
        8 k (b_at: the lane's row 2 t, column g of them)."""
        b = b_at + uint64(8 * n)
        acc[4 * n], acc[4 * n + 1], acc[4 * n + 2], acc[4 * n + 3] = mma_f32(
            p0, p1, p2, p3, tf32_operand(tile[b]), tf32_operand(tile[b + uint64(BS)]),
            acc[4 * n], acc[4 * n + 1], acc[4 * n + 2], acc[4 * n + 3])

    ntiles = unrolled(ntile, NN, 7, NN)  # acc is indexed by n

    @inlined
    def kstep(kk, tile, s, acc, b_row):
        """acc += s's columns 8 kk .. 8 kk + 7 times B's rows of them."""
        p0, p1 = tf32_operand(s[4 * kk]), tf32_operand(s[4 * kk + 2])
        p2, p3 = tf32_operand(s[4 * kk + 1]), tf32_operand(s[4 * kk + 3])
        ntiles(p0, p1, p2, p3, tile, acc, b_row + uint64(8 * kk) * uint64(BS))

    ksteps = unrolled(kstep, 2 * MK, 4, 2 * MK)  # s is indexed by kk

    @cuda.jit(device=True, inline="always")
    def reg_product(tile, acc, s, b_at, lane):
        g, t = lane >> uint32(2), lane & uint32(3)
        b_row = b_at + uint64(2 * t) * uint64(BS) + uint64(g)
        if SPLIT:
            part = cuda.local.array(NACC, float32)  # this call's products alone
            for e in range(NACC):
                part[e] = float32(0.0)
            ksteps(tile, s, part, b_row)
            for e in range(NACC):
                acc[e] += part[e]
        else:
            ksteps(tile, s, acc, b_row)

    return reg_product


class TcGradIO(NamedTuple):
    """A backward CTA's buffer and its traffic (`make_tc_grad_io`)."""

    clear: object  # clear(buf): the buffer zero (the tiles' padding stays so)
    tiles: object  # tiles() -> the buffer in the inputs' 16-bit type
    coords: object  # coords() -> (warp, lane), unsigned
    load_k: object  # load_k(src, bh, key0, n_keys) -> elements counted; K_j
    load_v: object  # load_v(...): V_j
    load_q: object  # load_q(src, bh, row0, n_rows, stage): Q_i into buffer `stage`
    load_do: object  # load_do(...): dO_i
    load_o: object  # load_o(...): O_i (WITH_O)
    wait_loads: object  # wait_loads(): this thread's copies have landed
    lse_stats: object  # lse_stats(buf, lse, delta, bh, row0, n_rows, stage) -> rows loaded
    row_stats: object  # row_stats(buf, at) -> (base, inv, delta) of the stats row at `at`
    store_dk: object  # store_dk(dst, bh, row0, n_rows, acc, factor, w, lane): `store_rows`
    store_dv: object  # store_dv(...): the same for dv wide rows


@cache
def make_tc_grad_io(BR: int, BC: int, D: int, DV: int, WITH_O: bool, SPEC: TensorCores,
                    NT: int, STAGES: int = 1) -> TcGradIO:
    """The buffer `tc_grad_layout(BR, BC, D, DV, WITH_O, STAGES)` for NT threads: cleared,
    its tiles loaded from HBM, the stats rows from the forward's lse and the preprocess's
    delta."""
    sm = tc_grad_layout(BR, BC, D, DV, WITH_O, STAGES, SPEC.tf32)
    ELEMENT = _tile_type("float32" if SPEC.tf32 else SPEC.dtype)
    BASE, INV, DELTA = sm.stats, sm.stats + sm.rows, sm.stats + 2 * sm.rows
    STATS_STAGE = sm.stats_stage  # (a plain int: device code reads no NamedTuple property)
    clear = make_clear(sm.size, NT)

    @cuda.jit(device=True, inline="always")
    def tiles():
        """The buffer in the tiles' element type (dynamic shared arrays alias)."""
        return cuda.shared.array(0, ELEMENT)

    @inlined
    def coords():
        t = uint32(cuda.threadIdx.x)
        return t // uint32(32), t % uint32(32)

    VEC = SPEC.copies_rows(D, DV)  # every tile by cp.async, or every tile by plain loads

    def loader(R, C, AT, S, STAGE=0):
        return make_tc_tile_loader(R, C, AT, S, STAGE, NT, SPEC.per_copy, VEC, tiles)

    load_k_tile, load_v_tile = loader(BC, D, sm.k, sm.ks), loader(BC, DV, sm.v, sm.vs)
    load_q_tile = loader(BR, D, sm.q, sm.ks, sm.q_stage)
    load_do_tile = loader(BR, DV, sm.do, sm.vs, sm.do_stage)
    load_o_tile = loader(BR, DV, sm.o, sm.vs)

    @inlined
    def load_k(src, bh, key0, n_keys):
        return load_k_tile(src, bh, key0, n_keys, 0)

    @inlined
    def load_v(src, bh, key0, n_keys):
        return load_v_tile(src, bh, key0, n_keys, 0)

    @inlined
    def load_q(src, bh, row0, n_rows, stage):
        return load_q_tile(src, bh, row0, n_rows, stage)

    @inlined
    def load_do(src, bh, row0, n_rows, stage):
        return load_do_tile(src, bh, row0, n_rows, stage)

    @inlined
    def load_o(src, bh, row0, n_rows):
        return load_o_tile(src, bh, row0, n_rows, 0)

    @inlined
    def wait_loads():
        if VEC:
            cp_async_wait_all()  # this thread's copies have landed (the barrier then shares)

    @inlined
    def lse_stats(buf, lse, delta, bh, row0, n_rows, stage):
        """base = lse log2(e), inv = 1, D = delta for the block's rows, into buffer stage."""
        loaded = 0
        at = stage * STATS_STAGE
        for r in range(cuda.threadIdx.x, n_rows, NT):
            buf[at + BASE + r] = lse[bh, row0 + r] * float32(LOG2E)
            buf[at + INV + r] = float32(1.0)
            buf[at + DELTA + r] = delta[bh, row0 + r]
            loaded += 1
        return loaded

    @inlined
    def row_stats(buf, at):
        """The stats row at `at` (a stage's offset plus the row; unsigned, so indexing adds
        no negative-index wraparound, and a mixed-sign compare none of float64)."""
        return buf[at + uint64(BASE)], buf[at + uint64(INV)], buf[at + uint64(DELTA)]

    return TcGradIO(clear, tiles, coords, load_k, load_v, load_q, load_do, load_o, wait_loads,
                    lse_stats, row_stats, make_row_store(D), make_row_store(DV))


@cache
def make_row_store(WIDTH: int):
    """store_rows(dst, bh, row0, n_rows, acc, factor, w, lane): warp w's 16 rows of an
    accumulator fragment (rows 16 w + g + 8 a, columns 8 n + 2 t + c, WIDTH of them) times
    factor into dst[bh, row0 + row, col] in dst's type, where row < n_rows; returns the
    elements this thread wrote. Each output row is written once, from registers."""
    NN = _up(WIDTH, 16) // 8

    @inlined
    def store_rows(dst, bh, row0, n_rows, acc, factor, w, lane):
        g, t2 = lane >> uint32(2), uint32(2) * (lane & uint32(3))
        moved = 0
        for a in range(2):
            r = int(w * uint32(WARP_ROWS) + g) + 8 * a
            if r < n_rows:
                for n in range(NN):
                    for c in range(2):
                        x = int(uint32(8 * n + c) + t2)
                        if x < WIDTH:
                            dst[bh, row0 + r, x] = narrow(acc[4 * n + 2 * a + c] * factor, dst)
                            moved += 1
        return moved

    return store_rows


@cache
def make_sees(MASK: Mask):
    """visible(row, key, n_rows, first, end): does query `row` of the block see `key` of the
    tile, of which it sees [first, end) (`tiles.make_visible`)? Rows past the block see none;
    with no left bound `first` is 0 and goes untested. Compared in 32 bits: every operand is
    a row or key within one tile (the span clamped to [0, n_keys])."""
    LEFT_BOUNDED = MASK.left >= 0

    @inlined
    def visible(row, key, n_rows, first, end):
        row, key = int32(row), int32(key)
        if LEFT_BOUNDED:
            return row < int32(n_rows) and int32(first) <= key and key < int32(end)
        return row < int32(n_rows) and key < int32(end)

    return visible


class TcGradSteps(NamedTuple):
    """The tile steps of the tensor-core backward (`make_tc_grad_steps`)."""

    kv_step: object  # kv_step(buf, dk_j, dv_j, diag0, key0, n_rows, n_keys, scale_log2,
    #                           stage, keep_ds): Q_i, dO_i, stats from buffer `stage`; dS^T
    #                           into shared memory where keep_ds (a dQ product follows);
    #                           diag0: the block's first row's diagonal key, row0 + N_k - N_q
    dq_partial: object  # dq_partial(buf, acc, m): acc = dS K_j for Q_i's rows 16 m ..
    q_step: object  # q_step(buf, dq_i, diag0, key0, n_rows, n_keys, scale_log2)
    row_dot: object  # row_dot(buf, n_rows): D_i = rowsum(dO_i o O_i) into the stats rows


@cache
def make_tc_grad_steps(BR: int, BC: int, D: int, DV: int, MASK: Mask, WITH_O: bool,
                       SPEC: TensorCores, NT: int, STAGES: int = 1) -> TcGradSteps:
    """The products of one (i, j) tile: `kv_step` and `dq_partial` for a K/V-outer CTA,
    `q_step` for a Q-outer one (see the module docstring), over the buffer
    `tc_grad_layout(BR, BC, D, DV, WITH_O, STAGES)` (`q_step` and `row_dot` read buffer 0);
    a row sees the keys of the tile `tiles.make_visible(MASK)` gives it."""
    sm = tc_grad_layout(BR, BC, D, DV, WITH_O, STAGES, SPEC.tf32)
    RP, KP = sm.rows, sm.keys
    DT, DVT, QT, KT = _up(D, 16) // 8, _up(DV, 16) // 8, RP // 8, KP // 8  # 8-wide n-tiles
    NSQ, NSK = 4 * QT, 4 * KT  # a thread's scores: K/V-outer (RP queries), Q-outer (KP keys)
    NDQ = 4 * DT  # a thread's accumulators of 16 rows of dQ_i
    DELTA = sm.stats + 2 * sm.rows  # row_dot's D_i row
    Q_STAGE, DO_STAGE, STATS_STAGE = sm.q_stage, sm.do_stage, sm.stats_stage  # plain ints
    io = make_tc_grad_io(BR, BC, D, DV, WITH_O, SPEC, NT, STAGES)
    tiles, coords, row_stats = io.tiles, io.coords, io.row_stats
    # K/V-outer: S^T = K_j Q_i^T and dP^T = V_j dO_i^T (16 keys x RP queries a warp)
    s_t = make_smem_product(DT // 2, QT, sm.ks, False, sm.ks, False, SPEC)
    dp_t = make_smem_product(DVT // 2, QT, sm.vs, False, sm.vs, False, SPEC)
    # dV_j += P^T dO_i, dK_j += dS^T Q_i (k = the RP queries)
    acc_dv = make_reg_product(QT // 2, DVT, sm.vs, SPEC)
    acc_dk = make_reg_product(QT // 2, DT, sm.ks, SPEC)
    # dQ_i's 16 rows = dS K_j: dS from the dS^T tile (stored k x m), K_j stored k x n
    dq_rows = make_smem_product(KT // 2, DT, sm.dss, True, sm.ks, True, SPEC)
    # Q-outer: S = Q_i K_j^T, dP = dO_i V_j^T (16 queries x KP keys a warp), dQ_i += dS K_j
    s_q = make_smem_product(DT // 2, KT, sm.ks, False, sm.ks, False, SPEC)
    dp_q = make_smem_product(DVT // 2, KT, sm.vs, False, sm.vs, False, SPEC)
    acc_dq = make_reg_product(KT // 2, DT, sm.ks, SPEC)

    span, visible = make_visible(MASK), make_sees(MASK)

    @cuda.jit(device=True, inline="always")
    def kv_step(buf, dk_j, dv_j, diag0, key0, n_rows, n_keys, scale_log2, stage, keep_ds):
        tile = tiles()
        q_at = uint64(sm.q) + uint64(stage) * uint64(Q_STAGE)
        do_at = uint64(sm.do) + uint64(stage) * uint64(DO_STAGE)
        stats = uint64(stage) * uint64(STATS_STAGE)
        w, lane = coords()
        g, t2 = lane >> uint32(2), uint32(2) * (lane & uint32(3))
        s = cuda.local.array(NSQ, float32)
        dp = cuda.local.array(NSQ, float32)
        for e in range(NSQ):
            s[e] = float32(0.0)
            dp[e] = float32(0.0)
        keys_at = uint64(w * uint32(WARP_ROWS))
        s_t(tile, s, uint64(sm.k) + keys_at * uint64(sm.ks), q_at, lane)
        dp_t(tile, dp, uint64(sm.v) + keys_at * uint64(sm.vs), do_at, lane)
        for n in range(QT):
            for c in range(2):
                # the query of this column: unsigned to index, signed to compare
                ru = uint64(8 * n + c) + uint64(t2)
                r = int64(ru)
                base, inv, delta = row_stats(buf, stats + ru)
                first, end = span(diag0 + r, key0, n_keys)  # the keys query r sees
                for a in range(2):
                    key = int64(keys_at + uint64(g)) + 8 * a
                    e = 4 * n + 2 * a + c
                    p = float32(0.0)
                    if visible(r, key, n_rows, first, end):
                        p = exp2(s[e] * scale_log2 - base) * inv
                    s[e] = p
                    dp[e] = p * (dp[e] - delta)
        acc_dv(tile, dv_j, s, do_at, lane)
        acc_dk(tile, dk_j, dp, q_at, lane)
        if not keep_ds:  # no dQ product follows in this kernel
            return
        for n in range(QT):
            for c in range(2):
                for a in range(2):
                    key = uint64(keys_at + uint64(g) + uint64(8 * a))
                    # dS^T: stays on chip, in shared memory for dQ_i's product
                    tile[uint64(sm.ds) + key * uint64(sm.dss) + uint64(8 * n + c) + t2] = \
                        narrow(dp[4 * n + 2 * a + c], tile)

    @inlined
    def dq_partial(buf, acc, m):
        tile = tiles()
        w, lane = coords()
        for e in range(NDQ):
            acc[e] = float32(0.0)
        dq_rows(tile, acc, uint64(sm.ds) + uint64(16 * m), uint64(sm.k), lane)

    @cuda.jit(device=True, inline="always")
    def q_step(buf, dq_i, diag0, key0, n_rows, n_keys, scale_log2):
        tile = tiles()
        w, lane = coords()
        g, t2 = lane >> uint32(2), uint32(2) * (lane & uint32(3))
        s = cuda.local.array(NSK, float32)
        dp = cuda.local.array(NSK, float32)
        for e in range(NSK):
            s[e] = float32(0.0)
            dp[e] = float32(0.0)
        rows_at = uint64(w * uint32(WARP_ROWS))
        s_q(tile, s, uint64(sm.q) + rows_at * uint64(sm.ks), uint64(sm.k), lane)
        dp_q(tile, dp, uint64(sm.do) + rows_at * uint64(sm.vs), uint64(sm.v), lane)
        for a in range(2):
            ru = rows_at + uint64(g) + uint64(8 * a)  # unsigned to index, signed to compare
            r = int64(ru)
            base, inv, delta = row_stats(buf, ru)
            first, end = span(diag0 + r, key0, n_keys)  # the keys row r sees
            for n in range(KT):
                for c in range(2):
                    key = int64(uint32(8 * n + c) + t2)
                    e = 4 * n + 2 * a + c
                    p = float32(0.0)
                    if visible(r, key, n_rows, first, end):
                        p = exp2(s[e] * scale_log2 - base) * inv
                    dp[e] = p * (dp[e] - delta)
        acc_dq(tile, dq_i, dp, uint64(sm.k), lane)

    @inlined
    def row_dot(buf, n_rows):
        tile = tiles()
        for r in range(cuda.threadIdx.x, n_rows, NT):
            total = float32(0.0)
            for x in range(DV):
                total += widen(tile[uint64(sm.do + r * sm.vs + x)]) * \
                    widen(tile[uint64(sm.o + r * sm.vs + x)])
            buf[DELTA + r] = total

    return TcGradSteps(kv_step, dq_partial, q_step, row_dot)
