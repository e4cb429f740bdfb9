"""The tensor-core micro-kernel for 16-bit inputs, shared by kv_outer and q_outer.

The same device functions as the CUDA-core micro-kernel (`microkernel.MicroKernel`), so the
two loop nests run either unchanged; this one multiplies on tensor cores, FlashAttention-2
style (mma.sync m16n8k16, float32 accumulators; `intrinsics`):

    warp w of W = ceil(Br / 16) owns query rows 16 w .. 16 w + 15 of the block;
    lane 4 g + t holds rows 16 w + g and 16 w + g + 8 (a = 0, 1) of every fragment
    S = Q_i K_j^T:  per 16 head dims: Q_i's A fragment by ldmatrix, then per 16 keys one
                    ldmatrix of K_j (B of two 8-key n-tiles) and two mma
    row max, sum:   the 4 lanes of a row (t = 0..3) by two xor shuffles
    P:              2^(S scale log2 e - m) rounded to 16 bits in registers, where the S
                    accumulator fragment already is P's A fragment for P V_j (no shared round)
    acc += P V_j:   per 16 keys and 16 dims of V: one ldmatrix.trans (B of two n-tiles), two mma

Tiles arrive in shared memory as 16-bit rows through `cp.async` (16 bytes a copy, rows past
the tile's valid ones zero-filled; a head dim that is not a multiple of 8 takes plain loads),
padded to whole 16s of head dims and keys (zero, cleared once per CTA) with each row stride
8 elements over that, so the 8 rows one ldmatrix reads fall in different banks. The 16-bit
tiles come first in the dynamic buffer; the float32 part after them holds the O_i stage (O_i
leaves, and for kv_outer comes back, through it with the same row copies as the CUDA-core
path) and kv_outer's l_i, m_i rows.

Masked keys (past N_k, past Bc, or after the query when causal) get weight exactly 0, and V_j's
rows past the tile are zero, so 0 x V adds nothing; a NaN or inf in a *visible-but-masked* V row
would still reach the output through 0 x NaN, unlike the CUDA-core path, which skips masked
keys (float16 inputs only carry what float16 holds; the NaN tests run in float32).

P is rounded to 16 bits before P V_j (l_i sums the unrounded weights, as FlashAttention-2
does): one more rounding of 2^-11 (float16) or 2^-8 (bfloat16) of max|V| in the output.
"""

from __future__ import annotations

import math
from functools import cache
from typing import NamedTuple

import numpy as np
from numba import float32, uint16, uint32, uint64

from .intrinsics import (
    cp_async16,
    cp_async_commit,
    cp_async_wait_all,
    exp2,
    ldmatrix_x4,
    ldmatrix_x4_trans,
    mma_bf16,
    mma_f16,
    pack_bf16x2,
    pack_f16x2,
    shfl_xor,
)
from .runtime import SIMULATOR, cuda
from .tiles import LN2, make_tile_loader, make_tile_storer

NEG_INF = float32(-math.inf)
MMA_ROWS = 16  # the m of m16n8k16: rows of one m-tile


class TensorCores(NamedTuple):
    """The tensor-core micro-kernel for one 16-bit input type ('float16' or 'bfloat16'): the
    counterpart of `microkernel.Layout` (which picks the CUDA-core one). A warp owns
    `warp_rows` query rows (whole m-tiles: each K_j, V_j fragment it loads from shared memory
    feeds warp_rows / 16 mma); `stages` K/V buffers (2: the next tile's copies run under this
    tile's arithmetic)."""

    dtype: str
    warp_rows: int = 16
    stages: int = 1

    def warps(self, block_q: int) -> int:
        return -(-block_q // self.warp_rows)

    def threads(self, block_q: int, block_k: int) -> int:
        return 32 * self.warps(block_q)

    def registers(self, block_k: int, dv: int) -> int:
        """The register cap: 255 (S and O accumulators, warp_rows / 32 (Bc + dv) floats per
        thread, plus fragments); ptxas takes what it needs below it
        (results/kernels_ptxas.json)."""
        return 255

    def __str__(self) -> str:
        kind = "f16" if self.dtype == "float16" else "bf16"
        return f"mma.{kind}:{self.warp_rows}x{self.stages}"


def warp_exchanges_per_tile(spec: TensorCores, block_k: int, d: int, dv: int) -> int:
    """Warp-collective calls (ldmatrix, mma, shuffles) one warp makes per K/V tile: what the
    simulator's emulation costs (`api.simulated_seconds`)."""
    mt, kp = spec.warp_rows // MMA_ROWS, _up(block_k, 16)
    dk, nkt, dvt = _up(d, 16) // 16, kp // 8, _up(dv, 16) // 8
    return dk * mt + dk * nkt // 2 * (1 + 2 * mt) + 4 * mt + kp // 16 * dvt // 2 * (1 + 2 * mt)


def tc_warp_rows(block_q: int, dv: int) -> int:
    """Query rows per warp: 32 (two m-tiles, as FlashAttention-2's forward) where the block
    has at least 64 rows and dv <= 64, else 16: at dv = 128 two m-tiles' accumulators and
    scores take more than 255 registers (ptxas spills; results/kernels_ptxas.json).
    `LOOP_ORDERS_WARP_ROWS` forces it (tuning)."""
    return 32 if block_q >= 64 and dv <= 64 else MMA_ROWS


def _up(n: int, to: int) -> int:
    return -(-n // to) * to


class TcSharedLayout(NamedTuple):
    """The dynamic buffer of one CTA: 16-bit tiles at element offsets (q, k, v, row strides
    qs, ks, vs), then float32 regions at float offsets (o: the O_i stage, stride os; stats:
    kv_outer's l_i, m_i rows)."""

    q: int
    qs: int
    k: int
    ks: int
    v: int
    vs: int
    o: int
    os: int
    stats: int
    size: int  # floats in all

    @property
    def bytes(self) -> int:
        return 4 * self.size


@cache
def tc_shared_layout(BR: int, BC: int, D: int, DV: int, reload: bool,  # noqa: N803
                     spec: TensorCores) -> TcSharedLayout:
    rows, keys = spec.warps(BR) * spec.warp_rows, _up(BC, 16)
    qs, ks, vs = _up(D, 16) + 8, _up(D, 16) + 8, _up(DV, 16) + 8
    k = rows * qs
    v = k + spec.stages * keys * ks
    halves = v + spec.stages * keys * vs
    o = _up(-(-halves // 2), 4)  # floats, 16-byte aligned
    os = _up(DV, 4)
    stats = o + rows * os
    size = stats + (2 * rows if reload else 0)
    return TcSharedLayout(0, qs, k, ks, v, vs, o, os, stats, size)


@cache
def make_tc_micro_kernel(BR: int, BC: int, D: int, DV: int, SPEC: TensorCores,  # noqa: N803
                         CAUSAL: bool, RELOAD: bool):
    """The tensor-core micro-kernel's device functions (`microkernel.MicroKernel`); `stage`
    arguments pick the K/V buffer (0 .. SPEC.stages - 1)."""
    from .microkernel import MicroKernel, unrolled

    WR = SPEC.warp_rows  # noqa: N806 - query rows of a warp
    MT = WR // MMA_ROWS  # noqa: N806 - its m-tiles
    RM = 2 * MT  # noqa: N806 - rows of a thread: g and g + 8 of each m-tile
    W = SPEC.warps(BR)  # noqa: N806
    NT = 32 * W  # noqa: N806
    ROWS = W * WR  # noqa: N806
    KP = _up(BC, 16)  # noqa: N806 - keys of a tile, padded
    DK = _up(D, 16) // 16  # noqa: N806 - k-steps of S = Q K^T
    NKT = KP // 8  # noqa: N806 - 8-key n-tiles of S
    DVT = _up(DV, 16) // 8  # noqa: N806 - 8-dim n-tiles of O
    NS = 4 * NKT  # noqa: N806 - a thread's scores per m-tile
    NA = 4 * DVT  # noqa: N806 - a thread's accumulators per m-tile
    NSM = MT * NS  # noqa: N806 - a thread's scores (a local array's size must be a name)
    NF = 4 * MT  # noqa: N806 - registers of a thread's A fragments (Q_i or P)
    VEC = D % 8 == 0 and DV % 8 == 0  # noqa: N806 - rows in whole 16-byte copies
    sm = tc_shared_layout(BR, BC, D, DV, RELOAD, SPEC)
    Q, QS, K, KS, V, VS = sm.q, sm.qs, sm.k, sm.ks, sm.v, sm.vs  # noqa: N806
    O, OS, STATS, SIZE = sm.o, sm.os, sm.stats, sm.size  # noqa: N806, E741
    K_STAGE, V_STAGE = KP * KS, KP * VS  # noqa: N806 - elements between K/V buffers
    BF16 = SPEC.dtype == "bfloat16"  # noqa: N806
    mma = mma_bf16 if BF16 else mma_f16
    pack = pack_bf16x2 if BF16 else pack_f16x2
    HALF = (np.dtype(np.uint16) if BF16 else np.dtype(np.float16)) if SIMULATOR else (  # noqa: N806
        uint16 if BF16 else _numba_f16())
    load_o_stage = make_tile_loader(BR, DV, NT, (O, OS))
    store_o_stage = make_tile_storer(BR, DV, NT, (O, OS))

    @cuda.jit(device=True, inline="always")
    def halves():
        """The buffer's 16-bit view (dynamic shared arrays alias)."""
        return cuda.shared.array(0, HALF)

    @cuda.jit(device=True, inline="always")
    def coords():
        """(warp, lane) of this thread, unsigned."""
        t = uint32(cuda.threadIdx.x)
        return t // uint32(32), t % uint32(32)

    @cuda.jit(device=True, inline="always")
    def local_row(w, lane, a):
        """Row of the block that the thread's row a (m-tile a // 2, half a % 2) is."""
        return w * uint32(WR) + (lane >> uint32(2)) + uint32(16 * (a // 2) + 8 * (a % 2))

    @cuda.jit(device=True)
    def clear(buf):
        for e in range(cuda.threadIdx.x, SIZE, NT):
            buf[e] = float32(0.0)

    def make_loader(R: int, C: int, AT: int, S: int, STAGE: int):  # noqa: N803
        """load(src, bh, row0, n_rows, stage): rows row0 .. row0 + R - 1 of src[bh] (columns
        < C) into the 16-bit tile at AT + stage STAGE, stride S; rows past n_rows become
        zero. Returns the elements this thread counts (thread 0 counts the tile)."""
        CH = C // 8  # noqa: N806 - 16-byte copies per row
        TRIPS = -(-R * CH // NT)  # noqa: N806

        @cuda.jit(device=True, inline="always")
        def load(src, bh, row0, n_rows, stage):
            tile = halves()
            t = uint32(cuda.threadIdx.x)
            at = uint64(AT) + uint64(stage) * uint64(STAGE)
            if VEC:
                for u in range(TRIPS):
                    e = t + uint32(u * NT)
                    if e < uint32(R * CH):
                        r, c = e // uint32(CH), e % uint32(CH)
                        inside = r < uint32(n_rows)
                        src_row = row0 + (r if inside else uint32(0))
                        # HBM -> shared, 16 bytes without passing through registers
                        cp_async16(tile, at + uint64(r) * uint64(S) + uint64(8 * c),
                                   src, bh, src_row, 8 * c, 16 if inside else 0)
                cp_async_commit()
            else:
                for e in range(t, R * C, NT):
                    r, c = uint32(e) // uint32(C), uint32(e) % uint32(C)
                    x = src[bh, row0 + r, c] if r < uint32(n_rows) else 0
                    tile[at + uint64(r) * uint64(S) + uint64(c)] = x
            return n_rows * C if t == 0 else 0

        return load

    load_q_tile = make_loader(BR, D, Q, QS, 0)
    load_k_tile = make_loader(BC, D, K, KS, K_STAGE)
    load_v_tile = make_loader(BC, DV, V, VS, V_STAGE)

    @cuda.jit(device=True, inline="always")
    def load_q(buf, q, bh, row0, n_rows, scale_log2):
        return load_q_tile(q, bh, row0, n_rows, 0)

    @cuda.jit(device=True, inline="always")
    def load_k(buf, k, bh, key0, n_keys, stage):
        return load_k_tile(k, bh, key0, n_keys, stage)

    @cuda.jit(device=True, inline="always")
    def load_v(buf, v, bh, key0, n_keys, stage):
        return load_v_tile(v, bh, key0, n_keys, stage)

    @cuda.jit(device=True, inline="always")
    def wait_loads():
        if VEC:
            cp_async_wait_all()  # this thread's copies have landed (the barrier then shares)

    @cuda.jit(device=True, inline="always")
    def load_o(buf, o, bh, row0, n_rows):
        return load_o_stage(buf, o, bh, row0, n_rows, 0, DV)

    @cuda.jit(device=True, inline="always")
    def store_o(buf, o, bh, row0, n_rows):
        return store_o_stage(buf, o, bh, row0, n_rows, 0, DV)

    @cuda.jit(device=True, inline="always")
    def visible(row, key0, n_keys):
        if CAUSAL:
            return max(0, min(n_keys, row - key0 + 1))
        return n_keys

    # The hot loops go through `unrolled` (straight-line calls with constant indices): left
    # to LLVM, the nest of k-steps, n-tiles and m-tiles stays a loop at two m-tiles per warp,
    # and the scores and accumulators it indexes move to local memory.
    @cuda.jit(device=True, inline="always")
    def k_pair(n2, tile, s, qa, k_base):
        """S's n-tiles 2 n2, 2 n2 + 1 (16 keys) at the k-step k_base points into K_j at."""
        b = ldmatrix_x4(tile, k_base + uint64(16 * KS) * uint64(n2))
        for mt in range(MT):
            for h in range(2):
                e = mt * NS + 4 * (2 * int(n2) + h)
                s[e], s[e + 1], s[e + 2], s[e + 3] = mma(
                    qa[4 * mt], qa[4 * mt + 1], qa[4 * mt + 2], qa[4 * mt + 3],
                    b[2 * h], b[2 * h + 1], s[e], s[e + 1], s[e + 2], s[e + 3])

    k_pairs = unrolled(k_pair, NKT // 2, 4, NKT // 2)

    @cuda.jit(device=True, inline="always")
    def k_step(kk, tile, s, qa, q_base, k_base):
        """Head dims 16 kk .. 16 kk + 15 of S = Q_i K_j^T: Q_i's A fragments, then K_j's."""
        for mt in range(MT):
            qa[4 * mt], qa[4 * mt + 1], qa[4 * mt + 2], qa[4 * mt + 3] = ldmatrix_x4(
                tile, q_base + uint64(16 * mt * QS) + uint64(16) * uint64(kk))
        k_pairs(tile, s, qa, k_base + uint64(16) * uint64(kk))

    k_steps = unrolled(k_step, DK, 5, DK)

    @cuda.jit(device=True, inline="always")
    def scores(tile, s, w, lane, k_at):
        """s = Q_i K_j^T of the warp's rows: m-tile mt, n-tile n of 8 keys in
        s[mt NS + 4 n .. + 3]. Each K_j fragment feeds the MT m-tiles."""
        qa = cuda.local.array(NF, uint32)
        for e in range(NSM):
            s[e] = float32(0.0)
        q_base = (uint64(Q) + uint64(w * uint32(WR) + (lane & uint32(15))) * uint64(QS)
                  + uint64(8) * uint64(lane >> uint32(4)))
        k_base = (k_at + uint64(8 * (lane >> uint32(4)) + (lane & uint32(7))) * uint64(KS)
                  + uint64(8) * uint64((lane >> uint32(3)) & uint32(1)))
        k_steps(tile, s, qa, q_base, k_base)

    @cuda.jit(device=True, inline="always")
    def v_pair(n2, tile, acc, pa, v_base):
        """O's n-tiles 2 n2, 2 n2 + 1 (16 dims) += P V_j at the 16 keys v_base points at."""
        b = ldmatrix_x4_trans(tile, v_base + uint64(16) * uint64(n2))
        for mt in range(MT):
            for h in range(2):
                e = mt * NA + 4 * (2 * int(n2) + h)
                acc[e], acc[e + 1], acc[e + 2], acc[e + 3] = mma(
                    pa[4 * mt], pa[4 * mt + 1], pa[4 * mt + 2], pa[4 * mt + 3],
                    b[2 * h], b[2 * h + 1], acc[e], acc[e + 1], acc[e + 2], acc[e + 3])

    v_pairs = unrolled(v_pair, DVT // 2, 4, DVT // 2)

    @cuda.jit(device=True, inline="always")
    def p_step(kk, tile, s, acc, pa, v_base):
        """Keys 16 kk .. 16 kk + 15 of acc += P V_j: P's A fragments from s, then V_j's."""
        for mt in range(MT):
            e = mt * NS + 8 * int(kk)
            pa[4 * mt] = pack(s[e], s[e + 1])
            pa[4 * mt + 1] = pack(s[e + 2], s[e + 3])
            pa[4 * mt + 2] = pack(s[e + 4], s[e + 5])
            pa[4 * mt + 3] = pack(s[e + 6], s[e + 7])
        v_pairs(tile, acc, pa, v_base + uint64(16 * VS) * uint64(kk))

    p_steps = unrolled(p_step, KP // 16, 5, KP // 16)

    @cuda.jit(device=True, inline="always")
    def accumulate(tile, s, acc, lane, v_at):
        """acc += P V_j, P's A fragments packed from the weights in s; each V_j fragment
        feeds the MT m-tiles."""
        pa = cuda.local.array(NF, uint32)
        v_base = (v_at + uint64((lane & uint32(7)) + uint32(8) * ((lane >> uint32(3)) & uint32(1)))
                  * uint64(VS) + uint64(8) * uint64(lane >> uint32(4)))
        p_steps(tile, s, acc, pa, v_base)

    @cuda.jit(device=True, inline="always")
    def row_max4(x):
        """Max over the 4 lanes of a row."""
        x = max(x, shfl_xor(x, 1))
        return max(x, shfl_xor(x, 2))

    @cuda.jit(device=True, inline="always")
    def row_step(a, s, m, l, acc, w, lane, row0, key0, n_keys, scale_log2, full):  # noqa: E741
        """The online-softmax update of the thread's row a: scale and mask its scores, the
        row max over the row's 4 lanes, rescale l and acc, the weights into s."""
        mt, half = int(a) // 2, int(a) % 2
        t2 = 2 * (lane & uint32(3))
        vis = visible(row0 + int(local_row(w, lane, a)), key0, n_keys)
        part = NEG_INF
        for n in range(NKT):
            for c in range(2):
                e = mt * NS + 4 * n + 2 * half + c
                x = s[e] * scale_log2
                # a masked key gets -inf: weight 0 (its score may be garbage)
                if not full and int(uint32(8 * n + c) + t2) >= vis:
                    x = NEG_INF
                s[e] = x
                part = max(part, x)
        new_max = max(m[a], row_max4(part))
        shift = new_max if new_max > NEG_INF else float32(0.0)  # no key seen: 2^-inf = 0
        alpha = exp2(m[a] - shift)
        m[a] = new_max
        l[a] *= alpha
        for n in range(DVT):
            acc[mt * NA + 4 * n + 2 * half] *= alpha
            acc[mt * NA + 4 * n + 2 * half + 1] *= alpha
        for n in range(NKT):
            for c in range(2):
                e = mt * NS + 4 * n + 2 * half + c
                p = exp2(s[e] - shift)
                l[a] += p
                s[e] = p

    row_steps = unrolled(row_step, RM, 11, RM)

    @cuda.jit(device=True)
    def online_update(buf, n_keys, key0, row0, m, l, acc, scale_log2, stage):  # noqa: E741
        tile = halves()
        w, lane = coords()
        s = cuda.local.array(NSM, float32)
        scores(tile, s, w, lane, uint64(K) + uint64(stage) * uint64(K_STAGE))
        # every key is visible to every row of the warp (its first row sees the fewest)
        full = visible(row0 + int(w * uint32(WR)), key0, n_keys) == KP
        row_steps(s, m, l, acc, w, lane, row0, key0, n_keys, scale_log2, full)
        accumulate(tile, s, acc, lane, uint64(V) + uint64(stage) * uint64(V_STAGE))

    @cuda.jit(device=True)
    def row_sums(buf, l, l_row):  # noqa: E741
        for a in range(RM):
            x = l[a] + shfl_xor(l[a], 1)
            l_row[a] = x + shfl_xor(x, 2)

    @cuda.jit(device=True, inline="always")
    def reciprocal(x, out):
        for a in range(RM):
            out[a] = float32(1.0) / x[a]

    @cuda.jit(device=True, inline="always")
    def acc_at(a, n, c):
        """Index of the accumulator of the thread's row a, n-tile n, column c (0, 1)."""
        return (a // 2) * NA + 4 * n + 2 * (a % 2) + c

    @cuda.jit(device=True, inline="always")
    def give_o(buf, acc, factor):
        w, lane = coords()
        t2 = 2 * (lane & uint32(3))
        for a in range(RM):
            at = uint64(O) + uint64(local_row(w, lane, a)) * uint64(OS)
            for n in range(DVT):
                for c in range(2):
                    x = uint32(8 * n + c) + t2
                    if x < uint32(DV):
                        buf[at + uint64(x)] = acc[acc_at(a, n, c)] * factor[a]

    @cuda.jit(device=True, inline="always")
    def take_o(buf, acc, l, l_row, m):  # noqa: E741
        w, lane = coords()
        t2 = 2 * (lane & uint32(3))
        for a in range(RM):
            r = uint64(local_row(w, lane, a))
            l_row[a] = buf[uint64(STATS) + r]
            m[a] = buf[uint64(STATS + ROWS) + r]
            l[a] = l_row[a] if (lane & uint32(3)) == 0 else float32(0.0)  # one partial per row
            for n in range(DVT):
                for c in range(2):
                    x = uint32(8 * n + c) + t2
                    o = buf[uint64(O) + r * uint64(OS) + uint64(x)] if x < uint32(DV) else \
                        float32(0.0)
                    acc[acc_at(a, n, c)] = o * l_row[a]

    @cuda.jit(device=True, inline="always")
    def keep_stats(buf, l_row, m):
        w, lane = coords()
        if (lane & uint32(3)) == 0:
            for a in range(RM):
                r = uint64(local_row(w, lane, a))
                buf[uint64(STATS) + r] = l_row[a]
                buf[uint64(STATS + ROWS) + r] = m[a]

    @cuda.jit(device=True, inline="always")
    def store_lse(lse, bh, row0, n_rows, m, l_row):
        w, lane = coords()
        moved = 0
        if (lane & uint32(3)) == 0:
            for a in range(RM):
                r = int(local_row(w, lane, a))
                if r < n_rows:
                    # lse_i: the row statistic the backward pass needs, written once
                    lse[bh, row0 + r] = (m[a] + math.log2(l_row[a])) * float32(LN2)
                    moved += 1
        return moved

    return MicroKernel(clear, online_update, row_sums, give_o, reciprocal, take_o, keep_stats,
                       coords, load_q, load_k, load_v, wait_loads, load_o, store_o, store_lse,
                       NT, RM, MT * NA, ROWS, STATS, SPEC.stages)


def _numba_f16():
    from numba.core import types

    return types.float16

