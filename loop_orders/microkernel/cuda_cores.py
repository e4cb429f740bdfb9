"""The tile micro-kernel shared by kv_outer and q_outer: one query block against one K/V tile.

Both flash orders fold a K/V tile into a query block's running (m_i, l_i, acc_i) with the same
device functions; only the loops around them differ, so measured differences come from the
loop order. The tiling is the register blocking of a GEMM ("outer product"):

    thread t = (tr, tc), tr = t // TC, tc = t % TC;  TR = ceil(Br / RM), TC = ceil(Bc / KN)
    its RM query rows:   G tr + (a mod G) + (a // G) G TR  (a < RM; `row_of`): groups of
                         G consecutive rows, G = 4 where 4 divides RM (else 2, else 1)
    its KN keys of S:    tc + b TC         (b < KN)        -> RM x KN scores in registers
    its head dims of O:  4-wide chunks tc + h TC (h < XH)  -> RM x 4 XH accumulators

    S = Q_i K_j^T:  for each 4 dims: RM + KN 16-byte shared loads, then one dim at a time
                    over every (row, key): 4 RM KN FMAs
    row max:        each thread's partial max of its KN keys, combined over the row's TC
                    threads (a shuffle butterfly on a GPU, shared memory on the simulator)
                    only when some row's partial max passes m_i + MAX_SLACK (a vote)
    P:              2^(S - m) written to shared, transposed (P_ij^T: a row per key; P_ij
                    never leaves the chip), one store a key and group of G rows
    acc += P V_j:   for each key: RM / G loads of P_ij^T and XH of V feed 4 RM XH FMAs

With RM, KN >= 4 every 16-byte load from shared memory feeds 8 or more FMAs (a thread
owning one row, as in a naive kernel, gets 4): shared-memory bandwidth stops being the limit.
In S each 16-byte load of K_j holds four dims of one key, and each load of Q_i four dims of
one row or, where the caller keeps Q_i transposed (TRANSPOSE_Q: Q_i^T, a row per head dim, as
P_ij^T) and G = 4, one dim of a group of four rows. In P V_j each 16-byte load of P_ij^T holds
one key's weights for four rows (G = 4), so a key's operands are only RM + 4 XH floats and
the loads of the next key can go out under the FMAs of this one. The two hot loops go
UNROLL.chunks 4-wide chunks of dims (S) or UNROLL.keys keys (P V) per trip of a 32-bit
counter (`unrolled`): Numba's own `range` loops cost 14 instructions of loop control per trip.
The row sums l_i stay per-thread partials, summed over the TC threads of a row (through shared
memory) only when O_i is written. The row max is the one step whose GPU and simulator code
differ: the simulator has no warp shuffles or votes, so it takes the shared-memory reduction
and a voting barrier (the CTA's vote, not the warp's) where the GPU code takes a shuffle
butterfly and a warp vote; the GPU tests (tests/test_gpu.py) cover the shuffle path.

The update, per row and tile (Q_i is loaded pre-scaled by scale log2 e, so scores need no
multiply and exp is exp2, one MUFU.EX2 instruction: `intrinsics.exp2`):
    if some s_c > m + MAX_SLACK (for any row of the warp, or of the CTA on the simulator):
        m' = max(m, max_c s_c);  if m' > m: l, acc *= 2^(m - m')   (skipped otherwise)
    else m' = m  (a stale max: weights up to 2^MAX_SLACK, no reduction, no rescale)
    l += sum_c 2^(s_c - m');  acc += sum_c 2^(s_c - m') V_c
Keys outside a row's span [lo_r, hi_r) (the mask, `core.mask`: after the diagonal when
causal, outside a window) or past N_k get score -inf and weight 0, and are never multiplied
into acc (on a masked or tail tile P V_j goes key by key from the first key any of the
thread's rows sees to the last, each row multiplying in only the keys it sees), so a NaN in
a masked row of K or V cannot reach the output.

Shared memory is one dynamic buffer (`SharedLayout`): Q_i, K_j, V_j, P_ij^T and the row
reductions, each at a compile-time offset and row stride. Row strides are padded to an odd
number of 16-byte chunks so that a warp's loads (and P_ij^T's stores) of different rows hit
different banks (where 8 or more threads share a row, TC >= 8, as at the benchmark's tiles;
with fewer, the grouped rows cost 2- to 4-way conflicts on P_ij^T's stores and Q_i's loads,
speed only); the padding columns are zero (the buffer is cleared once per CTA), so the dot
products can run over whole 4-wide chunks. All indices are unsigned (no negative-index
fix-ups) and every loop over a thread's scores, accumulators and statistics has a
compile-time trip count, so they stay in registers.
"""

from __future__ import annotations

import functools
import math
from abc import abstractmethod
from functools import cache
from typing import ClassVar, NamedTuple

import numpy as np
from numba import float32, int32, uint32, uint64

from ..core.mask import NO_MASK, Mask
from ..core.schedule import Kernel, Problem, Schedule
from ..device.intrinsics import cp_async_wait_all, exp2
from ..device.runtime import (
    MAX_THREADS_PER_BLOCK,
    SIMULATOR,
    cuda,
    data_pointer,
    dynamic_shared_limit,
    has_wgmma,
    inlined,
    launch,
)
from . import hopper, tuning
from .spec import DATA_REGISTERS, Layout, MicroKernel, SharedLayout, shared_layout
from .tensor_cores import (
    TensorCores,
    check_aligned,
    make_tc_micro_kernel,
    warp_exchanges_per_tile,
)
from .tiles import (
    LOG2E,
    counter_slots,
    make_clear,
    make_lse_of,
    make_reciprocal,
    make_row_copier,
    make_scores,
    make_tile_loader,
    make_tile_storer,
    make_visible,
    unrolled,
)

NEG_INF = float32(-math.inf)
# How far (log2 units) a row's scores may rise above its running max m_i before m_i is raised:
# weights up to 2^8 = 256 keep l_i and acc_i far inside float32, and a tile whose scores all
# stay under m_i + 8 (after a row's first tile, nearly every one) skips the row-max reduction
# and the rescale of acc_i. Any m_i gives the same O_i = acc_i / l_i and lse_i = m_i + log l_i.
MAX_SLACK = float32(8.0)


TENSOR_CORE_DTYPES = ("float16", "bfloat16")


def thread_layout(block_q: int, block_k: int, dv: int, tuned: dict | None = None) -> Layout:
    """The thread tile `tuned` names for these tiles ((block_q, block_k, dv) -> (RM, KN): a
    schedule's TUNED_LAYOUTS, measured fastest for its loop nest), else KN = 4 keys
    (at most Bc) and the most query rows RM of 8, 4, 2, 1 (at most Br) whose scores and
    accumulators fit in DATA_REGISTERS, RM doubled while the CTA would exceed 1024 threads
    (KN in turn). `LOOP_ORDERS_LAYOUT=RM,KN[,STAGES[,P_IN_K]]` forces a layout (for tuning;
    P_IN_K 1: `Layout.p_in_k`)."""
    forced = tuning.current().layout
    if forced:
        rm, kn, *rest = map(int, forced.split(","))
        lay = Layout(rm, kn, *rest[:1], *map(bool, rest[1:2]))
        if lay.threads(block_q, block_k) > MAX_THREADS_PER_BLOCK:
            raise ValueError(f"LOOP_ORDERS_LAYOUT={forced} needs more than "
                             f"{MAX_THREADS_PER_BLOCK} threads at block_q={block_q}, "
                             f"block_k={block_k}")
        return lay
    if tuned and (block_q, block_k, dv) in tuned:
        return Layout(*tuned[block_q, block_k, dv])
    kn = min(4, block_k)
    fits = [rm for rm in (8, 4, 2, 1)
            if rm <= block_q and Layout(rm, kn).data_registers(block_k, dv) <= DATA_REGISTERS]
    lay = Layout(fits[0] if fits else 1, kn)
    while lay.threads(block_q, block_k) > MAX_THREADS_PER_BLOCK:
        lay = Layout(2 * lay.rm, lay.kn) if lay.rm <= lay.kn else Layout(lay.rm, 2 * lay.kn)
    return lay


class Unroll(NamedTuple):
    """Steps per trip of the micro-kernel's two hot loops (`unrolled`)."""

    chunks: int  # 4-wide chunks of head dims per trip of S_ij's loop
    keys: int  # keys per trip of P_ij V_j's loop (a full tile's)

    @classmethod
    def by(cls, n: int) -> Unroll:
        """n chunks of S_ij's dims and 4 n keys of P_ij V_j a trip."""
        return cls(n, 4 * n)


class Tiling(NamedTuple):
    """The compile-time sizes of one CUDA-core micro-kernel build (`tiling`), which its parts
    (the `make_*` factories below, composed by `make_micro_kernel`) close over."""

    BR: int
    BC: int
    D: int
    DV: int
    RM: int
    KN: int
    TR: int  # rows of threads
    TC: int  # threads sharing a row
    NT: int
    ROWS: int  # rows of Q_i, O_i; columns of P_ij^T (Br or a few more)
    XH: int  # 4-wide chunks of O per thread and row
    XN: int  # accumulators per row
    NS: int  # scores per thread
    # a thread's rows come in groups of G consecutive rows (one 16-byte load of P_ij^T a
    # group and key when G = 4), the groups G TR rows apart
    G: int
    QT: bool  # Q_i^T in shared memory (TRANSPOSE_Q, G = 4), else Q_i
    DX4: int  # 4-wide chunks of the head dim (padding is zero)
    EXACT: bool  # no thread owns keys past Bc (to be masked)
    # On a GPU a row's max is a shuffle butterfly over its TC lanes, when every warp holds
    # whole rows of threads (TC | 32, and no partial warp); else, and on the simulator (no
    # shuffles), it goes through shared memory.
    SHUFFLE: bool
    LOG_TC: int
    RELOAD: bool
    lay: Layout
    sm: SharedLayout


@cache
def tiling(BR: int, BC: int, D: int, DV: int, lay: Layout, RELOAD: bool,
           TRANSPOSE_Q: bool) -> Tiling:
    """The `Tiling` of a CTA of layout `lay` over Br x Bc tiles (its buffer `shared_layout`)."""
    TR, TC = lay.grid(BR, BC)
    NT = TR * TC
    sm = shared_layout(BR, BC, D, DV, lay, RELOAD, TRANSPOSE_Q)
    XH = sm.vs // (4 * TC)
    return Tiling(BR, BC, D, DV, lay.rm, lay.kn, TR, TC, NT, TR * lay.rm, XH, 4 * XH,
                  lay.rm * lay.kn, lay.groups, sm.q_transposed, -(-D // 4),
                  TC * lay.kn == BC, not SIMULATOR and 32 % TC == 0 and NT % 32 == 0,
                  TC.bit_length() - 1, RELOAD, lay, sm)


class Indexing(NamedTuple):
    """Where a thread's rows, keys and dims are (`make_indexing`)."""

    coords: object  # coords() -> (tr, tc) of this thread, unsigned
    red_at: object  # red_at(tr, tc) -> index of the thread's RM partials in the reduction rows
    row_of: object  # row_of(tr, a) -> the tile row of the thread's row a (uint64)
    q_at: object  # q_at(tr, a) -> index of row a of the thread in a tile of stride QS at 0
    dim: object  # dim(tc, h, w) -> head dim of the thread's w-th element of chunk h


@cache
def make_indexing(t: Tiling) -> Indexing:
    """The thread's place in the layout and the indices of its rows and dims."""
    TR, TC, RM, G, RED, QS = t.TR, t.TC, t.RM, t.G, t.sm.red, t.sm.qs

    @inlined
    def coords():
        """(tr, tc) of this thread, unsigned."""
        t = uint32(cuda.threadIdx.x)
        return t // uint32(TC), t % uint32(TC)

    @inlined
    def red_at(tr, tc):
        """Index of the thread's RM partials in the reduction rows (a row's TC threads'
        partials contiguous)."""
        return uint64(RED) + (uint64(tr) * uint64(TC) + uint64(tc)) * uint64(RM)

    @inlined
    def row_of(tr, a):
        """The tile row of the thread's row a: G tr + (a mod G) in group a // G."""
        return uint64((a // G) * G * TR + a % G) + uint64(G) * uint64(tr)

    @inlined
    def q_at(tr, a):
        """Index of row a of the thread in a Br-row tile of stride QS at 0."""
        return row_of(tr, a) * uint64(QS)

    @inlined
    def dim(tc, h, w):
        """Head dim of the thread's w-th element of chunk h."""
        return (uint64(tc) + uint64(h * TC)) * uint64(4) + uint64(w)

    return Indexing(coords, red_at, row_of, q_at, dim)


class SharedOperands(NamedTuple):
    """A thread's operands, from shared memory into registers (`make_shared_operands`)."""

    q_chunk: object  # q_chunk(x4, buf, tr, qq): Q_i's rows at one 4-wide chunk of dims
    k_chunk: object  # k_chunk(x4, buf, k_at, tc, kk): K_j's keys at one chunk
    p_key: object  # p_key(key, buf, tr, pp): P_ij's weights of the thread's rows for a key
    v_key: object  # v_key(key, buf, tc, vv): V_j[key] at the thread's head dims


@cache
def make_shared_operands(t: Tiling) -> SharedOperands:
    """The operand loads of S_ij (Q_i, K_j) and of P_ij V_j (P_ij^T, V_j)."""
    RM, KN, TC, XH, QT = t.RM, t.KN, t.TC, t.XH, t.QT
    Q, QTS, KS, P, PS, V, VS = t.sm.q, t.sm.qts, t.sm.ks, t.sm.p, t.sm.ps, t.sm.v, t.sm.vs
    ix = make_indexing(t)
    row_of, q_at, dim = ix.row_of, ix.q_at, ix.dim

    @inlined
    def q_chunk(x4, buf, tr, qq):
        """qq[a 4 + u] = Q_i[row a, dim 4 x4 + u]: the thread's rows at one 4-wide chunk of
        head dims; from Q_i^T one 16-byte load a group of 4 rows and dim, else one a row."""
        if QT:
            for u in range(4):
                at = uint64(Q) + (uint64(4) * uint64(x4) + uint64(u)) * uint64(QTS)
                for a in range(RM):
                    qq[a * 4 + u] = buf[at + row_of(tr, a)]
        else:
            for a in range(RM):
                qa = uint64(Q) + q_at(tr, a) + uint64(4) * uint64(x4)
                for u in range(4):
                    qq[a * 4 + u] = buf[qa + uint64(u)]

    @inlined
    def k_chunk(x4, buf, k_at, tc, kk):
        """kk[b 4 + u] = K_j[key b, dim 4 x4 + u], as q_chunk for the thread's keys (K_j's
        tile at k_at)."""
        for b in range(KN):
            kb = k_at + (uint64(tc) + uint64(b * TC)) * uint64(KS) + uint64(4) * uint64(x4)
            for u in range(4):
                kk[b * 4 + u] = buf[kb + uint64(u)]

    @inlined
    def p_key(key, buf, tr, pp):
        """pp[a] = P_ij[row a, key]: the weights of the thread's rows for one key, one 16-byte
        load of P_ij^T a group of G = 4 rows."""
        at = uint64(P) + uint64(key) * uint64(PS)
        for a in range(RM):
            pp[a] = buf[at + row_of(tr, a)]

    @inlined
    def v_key(key, buf, tc, vv):
        """vv[y] = V_j[key] at the thread's y-th head dim."""
        at = uint64(V) + uint64(key) * uint64(VS)
        for h in range(XH):
            for w in range(4):
                vv[4 * h + w] = buf[at + dim(tc, h, w)]

    return SharedOperands(q_chunk, k_chunk, p_key, v_key)


@cache
def make_fold(t: Tiling, UNROLL: Unroll, MASK: Mask = NO_MASK):
    """fold(buf, acc, vis): the second half of online_update, acc_i += P_ij V_j (UNROLL.keys
    keys a trip of a full tile's loop); vis as `make_weigh` fills it."""
    RM, XN, BC = t.RM, t.XN, t.BC
    LEFT = MASK.left >= 0  # rows may see a span that starts after the tile's first key
    coords = make_indexing(t).coords
    ops = make_shared_operands(t)
    p_key, v_key = ops.p_key, ops.v_key

    @inlined
    def accumulate_row(a, acc, pp, vv):
        """acc[row a] += P_ij[row a, key] V_j[key]: one weight in XN FMAs in a row."""
        for y in range(XN):
            acc[a * XN + y] += pp[a] * vv[y]

    @inlined
    def accumulate_dim(y, acc, pp, vv):
        """acc[row a, dim y] += P_ij[row a, key] V_j[key, dim y] for every row a of the
        thread: one operand of V_j in RM FMAs in a row."""
        for a in range(RM):
            acc[a * XN + y] += pp[a] * vv[y]

    # a full tile's key goes dims outer, rows inner, in straight-line code (measured faster
    # than rows outer: results/tuning_history/micro_kernel.md)
    accumulate_dims = unrolled(accumulate_dim, XN, 3, XN)

    @inlined
    def accumulate_key(key, buf, acc, tr, tc):
        """acc += P_ij[:, key] V_j[key]: the key's operands loaded first (RM + XN floats),
        then every row."""
        pp = cuda.local.array(RM, float32)
        vv = cuda.local.array(XN, float32)
        p_key(key, buf, tr, pp)
        v_key(key, buf, tc, vv)
        accumulate_dims(acc, pp, vv)

    accumulate_full = unrolled(accumulate_key, BC, 4, UNROLL.keys)  # every key visible

    @inlined
    def accumulate_row_seen(a, key, acc, pp, vv, vis):
        """accumulate_row where row a sees the key (vis[a] its span's end, vis[RM + a] its
        first key): a key the row does not see is never multiplied in."""
        if LEFT:
            if uint32(vis[RM + a]) <= key < uint32(vis[a]):
                accumulate_row(a, acc, pp, vv)
        elif key < uint32(vis[a]):
            accumulate_row(a, acc, pp, vv)

    accumulate_rows_seen = unrolled(accumulate_row_seen, RM, 5, RM)

    @inlined
    def accumulate_seen(buf, acc, tr, tc, vis):
        """acc += P_ij V_j, each row over the keys it sees (a tail tile or a masked tile),
        key by key from the first row's first key to the last row's end (spans never move
        back as rows go on)."""
        pp = cuda.local.array(RM, float32)
        vv = cuda.local.array(XN, float32)
        n_seen = uint32(vis[RM - 1])
        key = uint32(vis[RM]) if LEFT else uint32(0)
        while key < n_seen:
            p_key(key, buf, tr, pp)
            v_key(key, buf, tc, vv)
            accumulate_rows_seen(key, acc, pp, vv, vis)
            key = uint32(key + uint32(1))

    @inlined
    def fold(buf, acc, vis):
        """The second half of online_update: acc_i += P_ij V_j, each row over the keys it
        sees (vis, from weigh)."""
        tr, tc = coords()
        # the first row's end is the rows' smallest, the last row's first key their largest
        if vis[0] == BC and (not LEFT or vis[2 * RM - 1] == 0):
            accumulate_full(buf, acc, tr, tc)
        else:  # a tail tile or a masked tile
            accumulate_seen(buf, acc, tr, tc, vis)

    return fold


class RowStats(NamedTuple):
    """The row statistics over a row's TC threads (`make_row_stats`)."""

    rescale: object  # rescale(m, l, acc, a, new_max): raise row a's running max
    reduce_rows: object  # reduce_rows(buf, tr, out, is_max): max or sum of the row partials
    shuffle_max: object  # shuffle_max(x): max of x over the TC lanes of one row
    row_sums: object  # `MicroKernel.row_sums`
    reciprocal: object  # `MicroKernel.reciprocal`


@cache
def make_row_stats(t: Tiling) -> RowStats:
    """The running max's rescale and the reductions of the row partials."""
    RM, TC, XN, LOG_TC, RED = t.RM, t.TC, t.XN, t.LOG_TC, t.sm.red
    ix = make_indexing(t)
    coords, red_at = ix.coords, ix.red_at

    @inlined
    def rescale(m, l, acc, a, new_max):  # noqa: E741
        """Raise row a's running max to new_max: scale l and acc by 2^(m - new_max)."""
        if new_max > m[a]:  # skipped whenever the max is unchanged (most tiles)
            alpha = exp2(m[a] - new_max)  # 0 before the first key
            l[a] *= alpha
            for y in range(XN):
                acc[a * XN + y] *= alpha
            m[a] = new_max

    @inlined
    def reduce_rows(buf, tr, out, is_max):
        """out[a] = the max or sum of row a's partials over its TC threads (from the
        reduction rows; a thread's RM partials are contiguous, so they load 16 bytes at a
        time)."""
        base = uint64(RED) + uint64(tr) * uint64(TC * RM)
        for a in range(RM):
            out[a] = buf[base + uint64(a)]
        for c in range(1, TC):
            for a in range(RM):
                y = buf[base + uint64(c * RM + a)]
                out[a] = max(out[a], y) if is_max else out[a] + y

    @inlined
    def shuffle_max(x):
        """Max of x over the TC lanes of one row (every lane of the warp takes part)."""
        for k in range(LOG_TC):
            x = max(x, cuda.shfl_xor_sync(uint32(0xFFFFFFFF), x, 1 << k))
        return x

    @cuda.jit(device=True)
    def row_sums(buf, l, l_row):  # noqa: E741
        tr, tc = coords()
        cuda.syncthreads()  # every thread is done with the reduction rows
        for a in range(RM):
            buf[red_at(tr, tc) + uint64(a)] = l[a]
        cuda.syncthreads()  # every thread's partial row sums are in shared memory
        reduce_rows(buf, tr, l_row, False)

    @inlined
    def reciprocal(x, out):
        for a in range(RM):
            out[a] = float32(1.0) / x[a]

    return RowStats(rescale, reduce_rows, shuffle_max, row_sums, reciprocal)


@cache
def make_weigh(t: Tiling, MASK: Mask, UNROLL: Unroll, PEEL: bool):
    """weigh(buf, n_keys, key0, diag0, m, l, acc, vis): the first half of online_update
    (`MicroKernel.weigh`); S_ij UNROLL.chunks chunks of dims a trip, PEEL as
    `make_micro_kernel`'s; the keys a row sees from `tiles.make_visible` (MASK)."""
    RM, KN, TC, BC, NS, EXACT, SHUFFLE = t.RM, t.KN, t.TC, t.BC, t.NS, t.EXACT, t.SHUFFLE
    K, P, PS, P_IN_K = t.sm.k, t.sm.p, t.sm.ps, t.lay.p_in_k
    ix, ops, st = make_indexing(t), make_shared_operands(t), make_row_stats(t)
    coords, red_at, row_of = ix.coords, ix.red_at, ix.row_of
    rescale, reduce_rows, shuffle_max = st.rescale, st.reduce_rows, st.shuffle_max
    scores = make_scores(RM, KN, t.DX4, UNROLL.chunks, PEEL, ops.q_chunk, ops.k_chunk)
    visible = make_visible(MASK)
    LEFT = MASK.left >= 0  # rows may see a span that starts after the tile's first key

    @inlined
    def weigh(buf, n_keys, key0, diag0, m, l, acc, vis):  # noqa: E741
        """The first half of online_update: S_ij, the row maxima, l_i and acc_i rescaled, and
        P_ij into shared memory; row a sees the tile's keys [vis[RM + a], vis[a]) (diag0: the
        diagonal key of the block's first row, row0 + N_k - N_q). P_ij is complete for all
        rows after the caller's barrier."""
        tr, tc = coords()
        s = cuda.local.array(NS, float32)  # the thread's scores, then weights
        row_max = cuda.local.array(RM, float32)
        scores(s, buf, uint64(K), tr, tc)
        for a in range(RM):
            first, end = visible(diag0 + int(row_of(tr, a)), key0, n_keys)
            vis[a] = end
            vis[RM + a] = first
        # the first row's end is the rows' smallest, the last row's first key their largest
        full = vis[0] == BC and (not LEFT or vis[2 * RM - 1] == 0)
        if not (EXACT and full):
            for a in range(RM):
                for b in range(KN):
                    # a masked key gets -inf: weight 0 (its score may be garbage or NaN)
                    key = int(tc) + b * TC
                    if key >= vis[a] or (LEFT and key < vis[RM + a]):
                        s[a * KN + b] = NEG_INF
        moved = False  # a score of the thread's rows above its running max by > MAX_SLACK
        for a in range(RM):
            part_max = s[a * KN]
            for b in range(1, KN):
                part_max = max(part_max, s[a * KN + b])
            moved |= part_max > m[a] + MAX_SLACK
            if SHUFFLE:
                row_max[a] = part_max
            else:
                buf[red_at(tr, tc) + uint64(a)] = part_max
        if SHUFFLE:
            reduce = cuda.any_sync(uint32(0xFFFFFFFF), moved)  # a warp holds whole rows
            if reduce:
                for a in range(RM):
                    row_max[a] = shuffle_max(row_max[a])
        else:
            # every thread's partial row maxima are in shared memory (a barrier that votes)
            reduce = cuda.syncthreads_or(int32(moved))
            if reduce:
                reduce_rows(buf, tr, row_max, True)
        if reduce:
            for a in range(RM):
                rescale(m, l, acc, a, row_max[a])
        for a in range(RM):
            shift = m[a] if m[a] > NEG_INF else float32(0.0)  # no key seen yet: 2^-inf = 0
            for b in range(KN):
                p = exp2(s[a * KN + b] - shift)
                l[a] += p
                s[a * KN + b] = p
        if P_IN_K:
            cuda.syncthreads()  # every thread is done reading K_j: P_ij^T takes its place
        for b in range(KN):
            key_at = uint64(P) + (uint64(tc) + uint64(b * TC)) * uint64(PS)
            for a in range(RM):
                # P_ij: stays on chip, in shared memory (transposed) for the P V_j product
                buf[key_at + row_of(tr, a)] = s[a * KN + b]

    return weigh


class OStage(NamedTuple):
    """O_i and the row statistics through shared memory (`make_o_stage`): the
    `MicroKernel` fields of the same names."""

    give_o: object
    take_o: object
    keep_stats: object
    store_lse: object


@cache
def make_o_stage(t: Tiling, MASKED: bool = False) -> OStage:
    """O_i into and out of its stage (kv_outer's, else the Q_i tile), kv_outer's l_i, m_i
    rows, and lse_i to HBM (MASKED: -inf for a row that saw no key, `tiles.make_lse_of`)."""
    lse_of = make_lse_of(MASKED)
    RM, XH, XN, DV, ROWS = t.RM, t.XH, t.XN, t.DV, t.ROWS
    O, STATS = t.sm.o, t.sm.stats  # noqa: E741
    OUT = O if t.RELOAD else t.sm.q  # where O_i is staged on its way out
    ix = make_indexing(t)
    coords, row_of, q_at, dim = ix.coords, ix.row_of, ix.q_at, ix.dim

    @inlined
    def give_o(buf, acc, factor):
        tr, tc = coords()
        for a in range(RM):
            for h in range(XH):
                for w in range(4):
                    x = dim(tc, h, w)
                    if x < DV:
                        buf[uint64(OUT) + q_at(tr, a) + x] = acc[a * XN + 4 * h + w] * factor[a]

    @inlined
    def take_o(buf, acc, l, l_row, m):  # noqa: E741
        tr, tc = coords()
        for a in range(RM):
            r = row_of(tr, a)
            l_row[a] = buf[uint64(STATS) + r]
            m[a] = buf[uint64(STATS + ROWS) + r]
            l[a] = l_row[a] if tc == 0 else float32(0.0)  # one partial per row holds it all
            for h in range(XH):
                for w in range(4):
                    x = dim(tc, h, w)
                    o = buf[uint64(O) + q_at(tr, a) + x] if x < DV else float32(0.0)
                    acc[a * XN + 4 * h + w] = o * l_row[a]

    @inlined
    def keep_stats(buf, l_row, m):
        tr, tc = coords()
        if tc == 0:
            for a in range(RM):
                r = row_of(tr, a)
                buf[uint64(STATS) + r] = l_row[a]
                buf[uint64(STATS + ROWS) + r] = m[a]

    @inlined
    def store_lse(lse, bh, row0, n_rows, m, l_row):
        tr, tc = coords()
        moved = 0
        if tc == 0:
            for a in range(RM):
                local = int(row_of(tr, a))  # rows past Br belong to the next block
                if local < n_rows:
                    # lse_i: the row statistic the backward pass needs, written once
                    lse[bh, row0 + local] = lse_of(m[a], l_row[a])
                    moved += 1
        return moved

    return OStage(give_o, take_o, keep_stats, store_lse)


class TileIO(NamedTuple):
    """The tiles between HBM and shared memory (`make_tile_io`): the `MicroKernel` fields of
    the same names."""

    load_q: object
    load_k: object
    load_v: object
    wait_loads: object
    load_o: object
    store_o: object


@cache
def make_tile_io(t: Tiling) -> TileIO:
    """Q_i, K_j, V_j and O_i between HBM and their tiles (K_j, V_j by cp.async where
    `Layout.copies_rows`)."""
    BR, BC, D, DV, NT, RELOAD, QT = t.BR, t.BC, t.D, t.DV, t.NT, t.RELOAD, t.QT
    Q, QS, QTS, K, KS, V, VS = t.sm.q, t.sm.qs, t.sm.qts, t.sm.k, t.sm.ks, t.sm.v, t.sm.vs
    O = t.sm.o  # noqa: E741
    OUT = O if RELOAD else Q  # where O_i is staged on its way out
    # Q_i, where the loop nest loads it once per CTA (not RELOAD), before any K/V block is
    # folded in: nothing runs under its loads, so they all go out before the first wait
    # (measured: results/tuning_history/micro_kernel.md)
    load_q_tile = make_tile_loader(BR, D, NT, (Q, 1, QTS) if QT else (Q, QS), scaled=True,
                                   in_flight=not RELOAD)
    load_k_tile = make_tile_loader(BC, D, NT, (K, KS))
    load_v_tile = make_tile_loader(BC, DV, NT, (V, VS))
    ASYNC = t.lay.copies_rows(D, DV)  # K/V rows by cp.async
    if ASYNC:
        copy_k_rows = make_row_copier(BC, D, KS, NT, 4)
        copy_v_rows = make_row_copier(BC, DV, VS, NT, 4)
    load_o_tile = make_tile_loader(BR, DV, NT, (O, QS))
    store_o_tile = make_tile_storer(BR, DV, NT, (OUT, QS))

    @inlined
    def load_q(buf, q, bh, row0, n_rows, scale_log2):
        return load_q_tile(buf, q, bh, row0, n_rows, 0, D, scale_log2)

    @inlined
    def load_k_plain(buf, k, bh, key0, n_keys, stage):
        return load_k_tile(buf, k, bh, key0, n_keys, 0, D)

    @inlined
    def load_v_plain(buf, v, bh, key0, n_keys, stage):
        return load_v_tile(buf, v, bh, key0, n_keys, 0, DV)

    @inlined
    def load_k_async(buf, k, bh, key0, n_keys, stage):
        return copy_k_rows(buf, uint64(K), k, bh, key0, n_keys)  # HBM -> shared, 16 B a copy

    @inlined
    def load_v_async(buf, v, bh, key0, n_keys, stage):
        return copy_v_rows(buf, uint64(V), v, bh, key0, n_keys)  # HBM -> shared, 16 B a copy

    @inlined
    def wait_plain():
        return  # the copies are plain loads and stores: done when they return

    @inlined
    def wait_async():
        cp_async_wait_all()  # this thread's copies have landed (the barrier then shares)

    @inlined
    def load_o(buf, o, bh, row0, n_rows):
        return load_o_tile(buf, o, bh, row0, n_rows, 0, DV)

    @inlined
    def store_o(buf, o, bh, row0, n_rows):
        return store_o_tile(buf, o, bh, row0, n_rows, 0, DV)

    if ASYNC:
        return TileIO(load_q, load_k_async, load_v_async, wait_async, load_o, store_o)
    return TileIO(load_q, load_k_plain, load_v_plain, wait_plain, load_o, store_o)


@cache
def make_micro_kernel(BR: int, BC: int, D: int, DV: int, RM: int, KN: int,
                      MASK: Mask, RELOAD: bool, UNROLL: Unroll,
                      STAGES: int = 1, PEEL: bool = False,
                      TRANSPOSE_Q: bool = False, P_IN_K: bool = False) -> MicroKernel:
    """The micro-kernel's device functions for these compile-time sizes (`MicroKernel`),
    composed of its parts over the build's `Tiling`: `make_indexing`, `make_weigh` (S_ij, the
    row statistics, P_ij), `make_fold` (P_ij V_j), `make_row_stats`, `make_o_stage` and
    `make_tile_io`. MASK: which keys each row sees (`core.mask`).
    UNROLL is the steps per trip of the hot loops (`Unroll`): more take fewer instructions
    of loop control and more registers, which the caller's loop nest decides.
    STAGES 2: staggered K/V loads (`Layout`), by cp.async where the rows allow.
    PEEL: S_ij's first 4-dim chunk sets the scores (the rest add to them) instead of every
    chunk adding to zeroed scores; the caller decides per head dim, as for UNROLL.
    TRANSPOSE_Q: Q_i is kept transposed in shared memory (Q_i^T, a row per head dim) where the
    thread's rows come in groups of G = 4, so that S_ij's Q operands come one 16-byte load a
    group and dim (as P_ij^T's in P V_j), else a row per query row; the caller decides. (Its
    stores, once per Q_i, then conflict 4-way in shared memory: consecutive dims are a row
    stride apart.)
    P_IN_K: P_ij^T is written into K_j's place (`Layout.p_in_k`), after a barrier.
    """
    lay = Layout(RM, KN, STAGES, P_IN_K)
    t = tiling(BR, BC, D, DV, lay, RELOAD, TRANSPOSE_Q)
    ix, st, io = make_indexing(t), make_row_stats(t), make_tile_io(t)
    ost = make_o_stage(t, MASK.bounded)
    weigh, fold = make_weigh(t, MASK, UNROLL, PEEL), make_fold(t, UNROLL, MASK)
    clear = make_clear(t.sm.size, t.NT)
    SPANS = 2 * RM  # (first, end) of the keys each row of the thread sees

    @cuda.jit(device=True)
    def online_update(buf, n_keys, key0, diag0, m, l, acc, scale_log2, stage):  # noqa: E741
        vis = cuda.local.array(SPANS, int32)  # the span of keys each row sees
        weigh(buf, n_keys, key0, diag0, m, l, acc, vis)
        cuda.syncthreads()  # P_ij is complete (and any row maxima in shared memory are read)
        fold(buf, acc, vis)

    return MicroKernel(clear, online_update, st.row_sums, ost.give_o,
                       make_reciprocal(RM, MASK.bounded),
                       ost.take_o, ost.keep_stats, ix.coords, io.load_q, io.load_k, io.load_v,
                       io.wait_loads, io.load_o, io.store_o, ost.store_lse, t.NT, RM,
                       t.XN * RM, t.ROWS, t.sm.stats, 1, lay.staggered, weigh, fold,
                       ix.row_of)


def tensor_core_kind(sched: Schedule, p: Problem) -> str | None:
    """The tensor cores' operand type for p ('float16', 'bfloat16', or for float32 inputs its
    precision 'tf32' or 'tf32x3'), or None where p runs on CUDA cores (float32 at precision
    "ieee", or a schedule without TENSOR_CORES)."""
    if not sched.TENSOR_CORES:
        return None
    if p.dtype in TENSOR_CORE_DTYPES:
        return p.dtype
    return None if p.precision == "ieee" else p.precision


def uses_wgmma(kind: str, p: Problem) -> bool:
    """Whether p's tensor-core products run on Hopper's wgmma (`hopper`): where the device has
    it and the build takes p's tiles, unless a sweep asks for mma.sync (`tuning`)."""
    return (tuning.current().products != "mma" and has_wgmma()
            and hopper.supports(kind, p.block_q, p.block_k, p.d, p.dv))


def micro_kernel(BR: int, BC: int, D: int, DV: int, MK, MASK: Mask,
                 RELOAD: bool, UNROLL: Unroll, PEEL: bool = False,
                 TRANSPOSE_Q: bool = False) -> MicroKernel:
    """The micro-kernel MK names: a `Layout` (CUDA cores, `make_micro_kernel`) or a
    `tensor_cores.TensorCores` (16-bit inputs on mma.sync, `make_tc_micro_kernel`)."""
    if isinstance(MK, TensorCores):
        return make_tc_micro_kernel(BR, BC, D, DV, MK, MASK, RELOAD)
    return make_micro_kernel(BR, BC, D, DV, MK.rm, MK.kn, MASK, RELOAD, UNROLL, MK.stages,
                             PEEL, TRANSPOSE_Q, MK.p_in_k)


class LaunchPlan(NamedTuple):
    """What a micro-kernel launch needs, worked out once per problem."""

    fn: object  # the compiled kernel
    threads: int
    shared: int  # dynamic shared bytes
    # the arrays (of "qkvo") moved 16 bytes at a time (cp.async copies, the warp-specialised
    # kernel's O_i stores): 16-byte aligned, or ...
    aligned: str
    # the build (`Layout`, `TensorCores`, or a loop nest's own, e.g. q_outer's `Specialised`):
    # its `falls_back` says whether unaligned arrays take plain loads or are refused, its
    # `work_grid` how the CTAs take the work items
    spec: object


class MicroKernelSchedule(Schedule):
    """A schedule whose main kernel runs a micro-kernel: the CUDA-core one (thread layout
    `thread_layout`, buffer `shared_layout`) or, for 16-bit inputs where the schedule has
    TENSOR_CORES, the tensor-core one (`tensor_cores`); kv_outer's O_i stage is in the
    buffer when RELOAD. A subclass gives `make_kernel` (tile sizes, micro-kernel and flags as
    compile-time constants) and `launch` (grid and arguments, through `launch_kernel`); a
    schedule with more kernels adds them to `kernels`."""

    uses_micro_kernel = True
    RELOAD: ClassVar[bool]  # the loop nest reloads O_i, l_i, m_i (an O_i stage in the buffer)
    # 2: the loop nest loads K/V under the arithmetic, in a second K/V buffer on tensor cores,
    # staggered in one on CUDA cores (`Layout`)
    KV_STAGES: ClassVar[int] = 1
    # (block_q, block_k, dv) -> (RM, KN): CUDA-core thread tiles this loop nest was measured
    # fastest with (results/bench_layouts.csv); `thread_layout`'s rule elsewhere
    TUNED_LAYOUTS: ClassVar[dict] = {}
    # (d, causal) -> ((largest N_q, (block_q, block_k)), ...): CUDA-core tiles this loop nest
    # was measured faster with at short sequences than the benchmark's (`short_tiles`)
    SHORT_TILES: ClassVar[dict] = {}
    # The same on tensor cores, keyed (operand type, d, causal): `tensor_core_kind`'s names
    TC_SHORT_TILES: ClassVar[dict] = {}
    # (operand type, block_q, block_k, d, dv) -> K/V buffers: tensor-core tiles this loop nest
    # was measured faster with on fewer buffers than KV_STAGES (one, where two would leave a
    # CTA alone on its SM)
    TC_KV_STAGES: ClassVar[dict] = {}
    # the loop nest has a kernel with a producer warpgroup for Hopper's pipelined build
    # (`hopper_build` "tma")
    PRODUCED_KERNEL: ClassVar[bool] = False
    # (block_q, block_k, d) -> `hopper_build`: Hopper builds this loop nest was measured
    # fastest with (results/bench_hopper.csv); "ring" elsewhere
    HOPPER_BUILDS: ClassVar[dict] = {}
    # (block_q, block_k, d) -> the largest N_q at which the TMA build runs on persistent CTAs
    # (`hopper_build` "persistent"), where that was measured faster:
    # results/bench_hopper_persistent.csv
    HOPPER_PERSISTENT: ClassVar[dict] = {}
    # (d, causal) -> ((from N_q, (block_q, block_k)), ...): the Hopper tiles measured fastest
    # for 16-bit inputs, which a call naming no tiles takes (`fast_tiles`)
    HOPPER_TILES: ClassVar[dict] = {}
    # the tensor-core kernels can order a causal grid by groups of heads (`causal_heads`)
    GROUPS_HEADS: ClassVar[bool] = False
    # (block_q, block_k, d) -> heads a group: the causal grids measured faster by groups of
    # heads on Hopper's wgmma build (results/bench_hopper_grid.csv); over every head elsewhere
    HOPPER_CAUSAL_HEADS: ClassVar[dict] = {}
    @staticmethod
    @abstractmethod
    def make_kernel(BR, BC, D, DV, MK, MASK, SAVE_LSE, COUNT, GROUP):
        """The compiled kernel for these compile-time constants (MK: `micro_kernel`; MASK:
        `core.mask.Mask`; GROUP: query heads per K/V head, query head bh reading K/V head
        bh // GROUP)."""

    def layout(self, p: Problem):
        """The micro-kernel p runs: tensor cores for float16 and bfloat16 inputs, and for
        float32 ones at precision "tf32" or "tf32x3", where the schedule has them, else the
        loop nest's own kernel where it has one for p (`specialised`), else the CUDA-core
        thread layout."""
        # a sweep's kv_stages=1 turns off a loop nest's double-buffered (tensor cores) or
        # staggered (CUDA cores) K/V loads, where it has them (`tuning`)
        stages = min(self.KV_STAGES, tuning.current().kv_stages or 2)
        kind = tensor_core_kind(self, p)
        if kind is not None:
            tuned = self.TC_KV_STAGES.get((kind, p.block_q, p.block_k, p.d, p.dv), stages)
            stages, wgmma = min(stages, tuned), uses_wgmma(kind, p)
            build = self.hopper_build(p) if wgmma and stages == 2 else "sync"
            return TensorCores(kind, stages, wgmma, pipelined=build != "sync",
                               producer=build in ("tma", "persistent"),
                               causal_heads=self.causal_heads(p, wgmma),
                               persistent=build == "persistent")
        specialised = self.specialised(p, stages)
        if specialised is not None:
            return specialised
        lay = thread_layout(p.block_q, p.block_k, p.dv, self.TUNED_LAYOUTS)
        return lay._replace(stages=stages)

    def hopper_build(self, p: Problem) -> str:
        """How p's wgmma build (two K/V buffers) runs its K/V loop: "sync" (each product
        waited for, the K/V tiles double-buffered), "ring" (the pipelined update, K/V through
        a ring every thread copies into), "tma" (the same ring filled by a producer
        warpgroup's TMA copies, where the loop nest has that kernel (PRODUCED_KERNEL) and a
        CTA two computing warpgroups) or "persistent" (that kernel on a CTA an SM, folding
        query blocks in turn): a sweep's choice (`tuning` products "wgmma-sync",
        "wgmma-ring", "wgmma-tma", "wgmma-persistent"), else HOPPER_BUILDS' for p's tiles and
        head dim (its "tma" on persistent CTAs up to the N_q HOPPER_PERSISTENT gives), else
        "ring"."""
        forced = {"wgmma-sync": "sync", "wgmma-ring": "ring", "wgmma-tma": "tma",
                  "wgmma-persistent": "persistent"}.get(tuning.current().products or "")
        tiles = (p.block_q, p.block_k, p.d)
        build = forced or self.HOPPER_BUILDS.get(tiles, "ring")
        if not forced and build == "tma" and p.n_q <= self.HOPPER_PERSISTENT.get(tiles, 0):
            build = "persistent"
        if build in ("tma", "persistent") and not (
                self.PRODUCED_KERNEL and p.block_q == 2 * hopper.WARPGROUP_ROWS):
            return "ring"
        return build

    def causal_heads(self, p: Problem, wgmma: bool) -> int:
        """Heads p's tensor-core grid takes at a time, its heaviest query blocks first within
        each group (0: first over every head; `tiles.grouped_block`): a sweep's (`tuning`
        causal_heads, 0 turning it off), else HOPPER_CAUSAL_HEADS' for p's tiles and head
        dim where p is causal on Hopper's wgmma build, else 0."""
        if not (self.GROUPS_HEADS and p.mask.bounded):
            return 0
        forced = tuning.current().causal_heads
        if forced is not None:
            return forced
        if not (wgmma and p.causal):
            return 0
        return self.HOPPER_CAUSAL_HEADS.get((p.block_q, p.block_k, p.d), 0)

    def fast_tiles(self, p: Problem) -> tuple[int, int] | None:
        """HOPPER_TILES' tiles for p's head dim, mask and N_q where p's 16-bit products run
        on a Hopper GPU's wgmma (64 x 64 leaves a CTA one warpgroup) and the sequences hold
        them whole; None on the simulator, whose calls keep 64 x 64 (its Hopper is a
        stand-in, not a speed)."""
        if (SIMULATOR or tensor_core_kind(self, p) not in hopper.OPERAND_KINDS
                or tuning.current().products == "mma" or not has_wgmma()):
            return None
        reached = [tiles for from_n, tiles in self.HOPPER_TILES.get((p.d, p.causal), ())
                   if p.n_q >= from_n]
        if not reached or reached[-1][0] > p.n_q or reached[-1][1] > p.n_k:
            return None
        return reached[-1]

    def specialised(self, p: Problem, stages: int):
        """A build of the loop nest's own for p (q_outer's warp-specialised kernel), or None
        for the shared micro-kernel. LOOP_ORDERS_LAYOUT=ws forces one (for tuning): refused
        here, where the loop nest has none."""
        forced = tuning.current()
        if forced.forces_own_kernel():
            tiles = (p.block_q, p.block_k, p.d, p.dv)
            raise ValueError(f"LOOP_ORDERS_LAYOUT={forced.layout}: {self.name} has no warp-"
                             f"specialised kernel for block_q, block_k, d, dv = {tiles} "
                             f"under {p.mask}")
        return None

    def threads(self, p: Problem) -> int:
        return self.layout(p).threads(p.block_q, p.block_k)

    def short_tiles(self, p: Problem) -> tuple[int, int] | None:
        """The tiles for p's head dim, mask and N_q: SHORT_TILES' on CUDA cores,
        TC_SHORT_TILES' for p's operand type on tensor cores, else None."""
        kind = tensor_core_kind(self, p)
        short = self.SHORT_TILES.get((p.d, p.causal), ()) if kind is None else \
            self.TC_SHORT_TILES.get((kind, p.d, p.causal), ())
        for largest_n, blocks in short:
            if p.n_q <= largest_n:
                return blocks
        return None

    def warp_exchanges(self, p: Problem) -> int:
        """Warp-collective calls of the forward pass, summed over warps: the tensor-core
        micro-kernel's, per visited tile (0 on CUDA cores)."""
        lay = self.layout(p)
        if not isinstance(lay, TensorCores):
            return 0
        per_tile = warp_exchanges_per_tile(lay, p.block_k, p.d, p.dv)
        return p.bh * p.visited_pairs() * lay.warps(p.block_q) * per_tile

    def p_roundings(self, p: Problem) -> int:
        """1 where the tensor-core micro-kernel rounds P (to 16 bits, or TF32) before P V_j
        (each row's weights sum to 1 over all its K/V blocks: one rounding of max|V| in
        all), else 0."""
        return int(isinstance(self.layout(p), TensorCores))

    def output_roundings(self, p: Problem) -> int:
        return super().output_roundings(p) + self.p_roundings(p)

    @functools.lru_cache(maxsize=1024)  # noqa: B019 - the registry keeps one instance
    def _launch_plan(self, p: Problem, count: bool, forced: tuple,
                     plain: bool = False) -> LaunchPlan:
        """p's `LaunchPlan`, worked out once per problem and tuning override (`forced`: the
        sweep's `tuning.Tuning`), as a call's host time
        counts. `plain`: the CUDA-core kernel with plain K/V loads, for inputs cp.async
        cannot copy."""
        lay = self.layout(p)
        if plain:
            lay = lay.plain()
        aligned = "" if SIMULATOR or not lay.copies_rows(p.d, p.dv) else lay.ALIGNED
        return LaunchPlan(self.micro_kernel(p, count, lay).fn,
                          lay.threads(p.block_q, p.block_k), self.dynamic_shared_bytes(p, lay),
                          aligned, lay)

    def dynamic_shared_bytes(self, p: Problem, lay=None) -> int:
        """Bytes of the dynamic shared buffer of p's build (`layout`, unless given)."""
        lay = lay or self.layout(p)
        return lay.buffer_bytes(p.block_q, p.block_k, p.d, p.dv, self.RELOAD,
                                self.transposes_q(p))

    def transposes_q(self, p: Problem) -> bool:
        """Whether this loop nest keeps Q_i transposed in shared memory for p (the CUDA-core
        micro-kernel's TRANSPOSE_Q); none does unless it says so."""
        return False

    def micro_kernel(self, p: Problem, count: bool, lay=None) -> Kernel:
        """The kernel running the micro-kernel for p, with its shared memory: the dynamic
        buffer and, counted, the CTA's counter totals (`tiles.flush_counts`)."""
        lay = lay or self.layout(p)
        fn = self.make_kernel(p.block_q, p.block_k, p.d, p.dv, lay, p.mask, p.save_lse, count,
                              p.group)
        shared = self.dynamic_shared_bytes(p, lay) + (8 * counter_slots(True) if count else 0)
        return Kernel(fn.py_func.__name__, fn, shared, dynamic_shared_limit())

    def kernels(self, p: Problem, count: bool) -> list[Kernel]:
        return [self.micro_kernel(p, count)]

    def launch_kernel(self, p: Problem, grid, count: bool, scale: float, *args) -> None:
        """The micro-kernel's kernel for p on `grid` (a CTA per work item; persistent CTAs
        draw the items in turn), with `args` and then the softmax scale
        in log2 units (the CUDA-core micro-kernel loads Q_i pre-scaled by it, the tensor-core
        one scales S). Arrays it would move 16 bytes at a time from or to an address that is
        not 16-byte aligned get the CUDA-core kernel with plain loads, or are refused on
        tensor cores."""
        forced = tuning.current()
        plan = self._launch_plan(p, count, forced)
        if plan.aligned:  # some arrays move 16 bytes at a time: they must be 16-byte aligned
            copied = {name: a for name, a in zip("qkvo", args[:4], strict=True)
                      if name in plan.aligned}
            if any(data_pointer(a) % 16 for a in copied.values()):
                if plan.spec.falls_back:
                    plan = self._launch_plan(p, count, forced, plain=True)
                else:
                    check_aligned(**copied)  # refused, with the reason
        grid, args = plan.spec.work_grid(grid, args, p)
        launch(plan.fn, grid, plan.threads, plan.shared, *args, np.float32(scale * LOG2E))
