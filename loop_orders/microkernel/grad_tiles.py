"""Device functions of the backward pass over one (query block i, key block j) tile, shared
by the backward orders (and dense's backward products), so that measured differences come
from the loop order.

Per tile, with tau the softmax scale and P from the forward's statistics of row r:

    S_ij  = Q_i K_j^T                       scores (Q_i loaded unscaled)
    P_ij  = 2^(tau log2(e) S_ij - base_r) inv_r      base_r, inv_r: lse_r log2(e) and 1 (from
                                            the forward's lse), or m_r and 1 / l_r (kv_outer's)
    dP_ij = dO_i V_j^T
    dS_ij = P_ij o (dP_ij - D_r)            D_r = rowsum(dO_r o O_r)
    dV_j += P_ij^T dO_i;   dK_j += tau dS_ij^T Q_i;   dQ_i += tau dS_ij K_j

The two score-like products (S, dP) use the forward micro-kernel's register blocking: thread
(tr, tc) owns rows tr + a TR (a < RM) and keys tc + b TC (b < KN), from 16-byte shared loads
along the head dim. P_ij and dS_ij then go to shared memory, and the three accumulating
products read them there: each thread owns a block of its output, rows tm + a TM and 4-wide
column chunks tn + h TN (`AccLayout`), one scalar of the first operand and one 16-byte chunk
of the second per step. Masked entries (outside a row's span of keys, `core.mask`; keys past
N_k, rows past N_q) get P = dS = 0,
and tail rows of the tiles are zeroed on load, so padding never reaches a gradient.

Shared memory is one dynamic buffer (`GradSharedLayout`): K_j, V_j, Q_i, dO_i, P_ij, dS_ij,
the per-row statistics (base, inv, D), and for kv_outer O_i and dQ_i. Row strides are odd
numbers of 16-byte chunks (rows start in different banks); P and dS rows an odd number of
floats (their reads are scalar).
"""

from __future__ import annotations

from functools import cache
from typing import NamedTuple

from numba import float32, uint32, uint64

from ..core.backward_schedule import BackwardSchedule
from ..core.ledger import slot
from ..core.mask import Mask
from ..core.schedule import Problem
from ..device.intrinsics import exp2
from ..device.runtime import MAX_THREADS_PER_BLOCK, cuda, inlined
from .tiles import LOG2E, make_clear, make_tile_storer, make_visible

# Scores per thread in the score-like products (RM KN), for the layout policy.
SCORES_PER_THREAD = 16


def _round4(n: int) -> int:
    return -(-n // 4) * 4


def _odd_chunks(width: int) -> int:
    """A row stride for `width` floats: whole 16-byte chunks, an odd number of them."""
    s = _round4(width)
    return s if (s // 4) % 2 else s + 4


def _divisor_at_most(n: int, limit: int) -> int:
    """The largest divisor of n that is at most limit (>= 1)."""
    return max(d for d in range(1, min(n, max(1, limit)) + 1) if n % d == 0)


class GradLayout(NamedTuple):
    """Threads of a backward CTA: TR x TC over the Br x Bc tile, RM rows and KN keys each."""

    rm: int
    kn: int
    tr: int
    tc: int

    @property
    def threads(self) -> int:
        return self.tr * self.tc

    @property
    def rows(self) -> int:
        """Rows the score-like products cover (Br, or a few more)."""
        return self.tr * self.rm

    @property
    def keys(self) -> int:
        return self.tc * self.kn


@cache
def grad_layout(block_q: int, block_k: int) -> GradLayout:
    """KN = 4 keys per thread (at most Bc), RM = 4 rows (at most Br) so that a thread holds
    16 scores of S and 16 of dP, RM doubled while the CTA would exceed 1024 threads."""
    kn = min(4, block_k)
    rm = min(max(1, SCORES_PER_THREAD // kn), block_q)
    tc = -(-block_k // kn)
    while -(-block_q // rm) * tc > MAX_THREADS_PER_BLOCK:
        rm *= 2
    return GradLayout(rm, kn, -(-block_q // rm), tc)




class GradTileBackward(BackwardSchedule):
    """A backward order whose main kernel runs the shared backward tile (`make_grad_tile`):
    its CTA is `grad_layout`'s."""

    def threads(self, p: Problem) -> int:
        return grad_layout(p.block_q, p.block_k).threads

class AccLayout(NamedTuple):
    """How a CTA's NT threads own an M x N accumulator: thread t = (tm, tn), tm = t // TN,
    rows tm + a TM (a < RA), 4-wide column chunks tn + h TN (h < XH)."""

    tm: int
    tn: int
    ra: int
    xh: int

    @property
    def width(self) -> int:
        """Columns covered (whole chunks for every thread)."""
        return 4 * self.tn * self.xh

    @property
    def size(self) -> int:
        """Accumulators per thread."""
        return self.ra * 4 * self.xh


@cache
def acc_layout(m: int, n: int, threads: int) -> AccLayout:
    tn = _divisor_at_most(threads, -(-n // 4))
    tm = threads // tn
    return AccLayout(tm, tn, -(-m // tm), -(-n // (4 * tn)))


class GradSharedLayout(NamedTuple):
    """Offsets and row strides (floats) of the tiles in a backward CTA's shared buffer."""

    k: int  # K_j, Bc (or more) rows, stride qs
    v: int  # V_j, stride os
    q: int  # Q_i, Br (or more) rows, stride qs
    do: int  # dO_i, stride os
    p: int  # P_ij, rows of ps floats
    ds: int  # dS_ij, stride ps
    o: int  # kv_outer: O_i, stride os (for D_i)
    dq: int  # kv_outer: dQ_i, stride qs
    stats: int  # base, inv, D of the rows (3 ROWS floats)
    qs: int
    os: int
    ps: int
    rows: int  # rows of the query-side tiles
    keys: int  # rows of the key-side tiles
    size: int

    @property
    def bytes(self) -> int:
        return 4 * self.size


@cache
def grad_shared_layout(BR: int, BC: int, D: int, DV: int, with_o: bool,
                       with_dq: bool) -> GradSharedLayout:
    """The buffer of one backward CTA. `with_o`: an O_i tile (kv_outer computes D_i per
    visited pair); `with_dq`: a dQ_i tile (kv_outer's read-modify-write of dQ_i)."""
    lay = grad_layout(BR, BC)
    nt = lay.threads
    rows = max(lay.rows, acc_layout(BR, D, nt).tm * acc_layout(BR, D, nt).ra)
    keys = max(lay.keys, max(acc_layout(BC, w, nt).tm * acc_layout(BC, w, nt).ra
                             for w in (D, DV)))
    qs = _odd_chunks(max(D, acc_layout(BC, D, nt).width, acc_layout(BR, D, nt).width))
    os_ = _odd_chunks(max(DV, acc_layout(BC, DV, nt).width))
    ps = max(rows, keys) | 1
    sizes = [keys * qs, keys * os_, rows * qs, rows * os_, rows * ps, rows * ps,
             rows * os_ if with_o else 0, rows * qs if with_dq else 0, 3 * rows]
    offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    k, v, q, do, p, ds, o, dq, stats, size = offsets
    return GradSharedLayout(k, v, q, do, p, ds, o, dq, stats, qs, os_, ps, rows, keys, size)


class GradTile(NamedTuple):
    """The device functions of one backward build (see `make_grad_tile`)."""

    clear: object
    zero_outside: object
    scores: object
    grad_scores: object
    probs: object
    put_scores: object
    acc_dv: object
    acc_dk: object
    acc_dq: object
    stage_dk: object
    stage_dv: object
    stage_dq: object
    add_to_dq: object
    atomic_dq: object
    lse_stats: object
    row_dot: object
    coords: object


@cache
def make_grad_tile(BR: int, BC: int, D: int, DV: int, MASK: Mask,
                   WITH_O: bool, WITH_DQ: bool) -> GradTile:
    """Device functions over one backward CTA's shared buffer `buf`; every thread of the CTA
    calls each of them (the caller puts the barriers between):

    clear(buf)                          zero the buffer (once per CTA)
    zero_outside(buf, off, stride, n_rows, n_cols, rows, cols)
                                        zero a tail tile's stale rows and columns
    scores(buf, s) / grad_scores(buf, dp)
                                        s = Q_i K_j^T / dp = dO_i V_j^T for the thread's
                                        RM x KN entries (registers)
    put_scores(buf, dp)                 dense: dp into the P tile, to be stored
    probs(buf, s, dp, diag0, key0, n_rows, n_keys, scale_log2)
                                        P_ij and dS_ij into shared memory (masked: 0, the
                                        keys a row sees from `tiles.make_visible`; diag0 =
                                        row0 + N_k - N_q, the first row's diagonal key),
                                        from the stats rows (base, inv, D)
    acc_dv(buf, acc) / acc_dk(buf, acc) acc += P^T dO_i / dS^T Q_i (Bc x dv / Bc x d)
    acc_dq(buf, acc)                    acc += dS K_j (Br x d)
    stage_dk / stage_dv / stage_dq(buf, acc, factor)
                                        acc * factor into K_j's / V_j's / Q_i's tile,
                                        done with by then, for a coalesced store
    add_to_dq(buf, acc, factor)         kv_outer: dQ_i tile += acc * factor
    atomic_dq(dq_acc, bh, row0, n_rows, acc, factor)
                                        q_outer: dq_acc rows += acc * factor (atomics)
    lse_stats(buf, lse, delta, bh, row0, n_rows)
                                        q_outer: the stats rows from lse and delta
    row_dot(buf, a_off, b_off, stride, out_off, n_rows)
                                        out[r] = rowsum(A_r o B_r) over DV (D_i)
    coords()                            (tr, tc) of this thread in the score layout
    """
    sm = grad_shared_layout(BR, BC, D, DV, WITH_O, WITH_DQ)
    sc = make_score_fns(BR, BC, D, DV, MASK, WITH_O, WITH_DQ)
    ac = make_acc_fns(BR, BC, D, DV, WITH_O, WITH_DQ)
    rw = make_row_fns(BR, BC, D, DV, WITH_O, WITH_DQ)
    clear = make_clear(sm.size, grad_layout(BR, BC).threads)
    return GradTile(clear, rw.zero_outside, sc.scores, sc.grad_scores, sc.probs,
                    sc.put_scores, ac.acc_dv, ac.acc_dk, ac.acc_dq, ac.stage_dk, ac.stage_dv,
                    ac.stage_dq, ac.add_to_dq, rw.atomic_dq, rw.lse_stats, rw.row_dot,
                    sc.coords)


@cache
def make_dot_chunks(BR: int, BC: int):
    """coords() -> (tr, tc) of this thread in `grad_layout(BR, BC)`, and dot_chunks(out, buf,
    a_base, a_stride, b_base, b_stride, chunks, tr, tc): out[a KN + b] = sum over 4-wide
    chunks of A[row tr + a TR] . B[key tc + b TC]."""
    RM, KN, TR, TC = grad_layout(BR, BC)
    NS = RM * KN

    @inlined
    def coords():
        t = uint32(cuda.threadIdx.x)
        return t // uint32(TC), t % uint32(TC)

    @inlined
    def dot_chunks(out, buf, a_base, a_stride, b_base, b_stride, chunks, tr, tc):
        """out[a KN + b] = sum over 4-wide chunks of A[row a] . B[key b]."""
        for e in range(NS):
            out[e] = float32(0.0)
        for x4 in range(chunks):
            for a in range(RM):
                ra = uint64(a_base) + (uint64(tr) + uint64(a * TR)) * uint64(a_stride) \
                    + uint64(4 * x4)
                for b in range(KN):
                    kb = uint64(b_base) + (uint64(tc) + uint64(b * TC)) * uint64(b_stride) \
                        + uint64(4 * x4)
                    for u in range(4):
                        out[a * KN + b] += buf[ra + uint64(u)] * buf[kb + uint64(u)]

    return coords, dot_chunks


class ScoreFns(NamedTuple):
    """The score-like products of `make_grad_tile` and what follows them in registers."""

    coords: object
    scores: object
    grad_scores: object
    probs: object
    put_scores: object


@cache
def make_score_fns(BR: int, BC: int, D: int, DV: int, MASK: Mask,
                   WITH_O: bool, WITH_DQ: bool) -> ScoreFns:
    """coords, scores, grad_scores, probs and put_scores of `make_grad_tile`."""
    RM, KN, TR, TC = grad_layout(BR, BC)
    sm = grad_shared_layout(BR, BC, D, DV, WITH_O, WITH_DQ)
    QS, OS, PS = sm.qs, sm.os, sm.ps
    K, V, Q, DO, P, DS = sm.k, sm.v, sm.q, sm.do, sm.p, sm.ds
    BASE, INV, DELTA = sm.stats, sm.stats + sm.rows, sm.stats + 2 * sm.rows
    DX4, DVX4 = -(-D // 4), -(-DV // 4)
    coords, dot_chunks = make_dot_chunks(BR, BC)
    visible = make_visible(MASK)

    @cuda.jit(device=True)
    def scores(buf, s):
        tr, tc = coords()
        dot_chunks(s, buf, Q, QS, K, QS, DX4, tr, tc)

    @cuda.jit(device=True)
    def grad_scores(buf, dp):
        tr, tc = coords()
        dot_chunks(dp, buf, DO, OS, V, OS, DVX4, tr, tc)

    @cuda.jit(device=True)
    def probs(buf, s, dp, diag0, key0, n_rows, n_keys, scale_log2):
        tr, tc = coords()
        for a in range(RM):
            r = int(tr) + a * TR
            base = buf[BASE + r]
            inv = buf[INV + r]
            delta = buf[DELTA + r]
            first, end = visible(diag0 + r, key0, n_keys)  # the keys row r sees
            for b in range(KN):
                c = int(tc) + b * TC
                p = float32(0.0)
                ds = float32(0.0)
                if r < n_rows and first <= c < end:
                    p = exp2(s[a * KN + b] * scale_log2 - base) * inv
                    ds = p * (dp[a * KN + b] - delta)
                # P_ij, dS_ij: stay on chip, in shared memory for the accumulating products
                buf[P + r * PS + c] = p
                buf[DS + r * PS + c] = ds

    @cuda.jit(device=True)
    def put_scores(buf, dp):
        """dense: the thread's dP_ij entries into the P tile (for a coalesced store)."""
        tr, tc = coords()
        for a in range(RM):
            for b in range(KN):
                buf[P + (int(tr) + a * TR) * PS + int(tc) + b * TC] = dp[a * KN + b]

    return ScoreFns(coords, scores, grad_scores, probs, put_scores)


@cache
def make_acc(M, N, T, A_OFF, A_TS, A_MS, B_OFF, B_TS, NT):
    """acc[m, n] += sum_t A(t, m) B[t, n]: A(t, m) at A_OFF + t A_TS + m A_MS, B rows
    B_TS apart, t < T; the thread's entries as `acc_layout(M, N, NT)` says."""
    TM, TN, RA, XH = acc_layout(M, N, NT)

    @inlined
    def acc_fn(buf, acc):
        t = uint32(cuda.threadIdx.x)
        tm, tn = t // uint32(TN), t % uint32(TN)
        for s in range(T):
            b_row = uint64(B_OFF) + uint64(s * B_TS)
            for a in range(RA):
                x = buf[uint64(A_OFF + s * A_TS) + (uint64(tm) + uint64(a * TM))
                        * uint64(A_MS)]
                for h in range(XH):
                    col = b_row + (uint64(tn) + uint64(h * TN)) * uint64(4)
                    for w in range(4):
                        acc[a * 4 * XH + 4 * h + w] += x * buf[col + uint64(w)]

    return acc_fn


@cache
def make_writer(M, N, OFF, STRIDE, ADD, NT):
    """acc (an acc_layout(M, N, NT) accumulator) * factor into (ADD: added to) the tile at
    OFF, rows STRIDE apart; columns past N land in the tile's padding."""
    TM, TN, RA, XH = acc_layout(M, N, NT)

    @inlined
    def write(buf, acc, factor):
        t = uint32(cuda.threadIdx.x)
        tm, tn = t // uint32(TN), t % uint32(TN)
        for a in range(RA):
            row = uint64(OFF) + (uint64(tm) + uint64(a * TM)) * uint64(STRIDE)
            for h in range(XH):
                col = row + (uint64(tn) + uint64(h * TN)) * uint64(4)
                for w in range(4):
                    x = acc[a * 4 * XH + 4 * h + w] * factor
                    if ADD:
                        buf[col + uint64(w)] += x
                    else:
                        buf[col + uint64(w)] = x

    return write


class AccFns(NamedTuple):
    """The accumulating products of `make_grad_tile` and the writers of their results."""

    acc_dv: object
    acc_dk: object
    acc_dq: object
    stage_dk: object
    stage_dv: object
    stage_dq: object
    add_to_dq: object


@cache
def make_acc_fns(BR: int, BC: int, D: int, DV: int, WITH_O: bool,
                 WITH_DQ: bool) -> AccFns:
    """acc_dv, acc_dk, acc_dq, stage_dk, stage_dv, stage_dq and add_to_dq of
    `make_grad_tile`."""
    NT = grad_layout(BR, BC).threads
    sm = grad_shared_layout(BR, BC, D, DV, WITH_O, WITH_DQ)
    return AccFns(
        # dV_j += P^T dO_i: A(t = row, m = key) = P[row, key]; B = dO_i
        acc_dv=make_acc(BC, DV, BR, sm.p, sm.ps, 1, sm.do, sm.os, NT),
        # dK_j += dS^T Q_i (tau applied by the caller)
        acc_dk=make_acc(BC, D, BR, sm.ds, sm.ps, 1, sm.q, sm.qs, NT),
        # dQ_i += dS K_j: A(t = key, m = row) = dS[row, key]; B = K_j
        acc_dq=make_acc(BR, D, BC, sm.ds, 1, sm.ps, sm.k, sm.qs, NT),
        # the outputs, staged for coalesced stores in tiles that are done with by then
        stage_dk=make_writer(BC, D, sm.k, sm.qs, False, NT),  # into K_j's tile, after the last i
        stage_dv=make_writer(BC, DV, sm.v, sm.os, False, NT),  # into V_j's tile
        stage_dq=make_writer(BR, D, sm.q, sm.qs, False, NT),  # into Q_i's tile, after the last j
        add_to_dq=make_writer(BR, D, sm.dq, sm.qs, True, NT),  # kv_outer: dQ_i tile += tau dS K_j
    )


class RowFns(NamedTuple):
    """The row-wise helpers of `make_grad_tile`."""

    zero_outside: object
    atomic_dq: object
    lse_stats: object
    row_dot: object


@cache
def make_row_fns(BR: int, BC: int, D: int, DV: int, WITH_O: bool,
                 WITH_DQ: bool) -> RowFns:
    """zero_outside, atomic_dq, lse_stats and row_dot of `make_grad_tile`."""
    NT = grad_layout(BR, BC).threads
    sm = grad_shared_layout(BR, BC, D, DV, WITH_O, WITH_DQ)
    BASE, INV, DELTA = sm.stats, sm.stats + sm.rows, sm.stats + 2 * sm.rows
    TMQ, TNQ, RAQ, XHQ = acc_layout(BR, D, NT)

    @cuda.jit(device=True)
    def zero_outside(buf, off, stride, n_rows, n_cols, rows, cols):
        """Zero the entries of a rows x cols tile outside its first n_rows x n_cols (a tail
        tile's stale rows and columns); touches nothing a load of the tile writes."""
        if n_rows < rows or n_cols < cols:
            for e in range(cuda.threadIdx.x, rows * cols, NT):
                r = e // cols
                c = e % cols
                if r >= n_rows or c >= n_cols:
                    buf[off + r * stride + c] = float32(0.0)

    @cuda.jit(device=True)
    def atomic_dq(dq_acc, bh, row0, n_rows, acc, factor):
        """dq_acc[bh, row0 + r] += acc * factor for the thread's valid entries (float32
        atomics, FlashAttention-2's dQ); returns how many elements it added."""
        t = uint32(cuda.threadIdx.x)
        tm, tn = t // uint32(TNQ), t % uint32(TNQ)
        added = 0
        for a in range(RAQ):
            r = int(tm) + a * TMQ
            if r < n_rows:
                for h in range(XHQ):
                    for w in range(4):
                        col = (int(tn) + h * TNQ) * 4 + w
                        if col < D:
                            cuda.atomic.add(dq_acc, (bh, row0 + r, col),
                                            acc[a * 4 * XHQ + 4 * h + w] * factor)
                            added += 1
        return added

    @cuda.jit(device=True)
    def lse_stats(buf, lse, delta, bh, row0, n_rows):
        """The stats rows from the forward's lse and the preprocess's delta: base = lse
        log2(e), inv = 1, D = delta; returns how many rows this thread loaded."""
        loaded = 0
        for r in range(cuda.threadIdx.x, n_rows, NT):
            buf[BASE + r] = lse[bh, row0 + r] * float32(LOG2E)
            buf[INV + r] = float32(1.0)
            buf[DELTA + r] = delta[bh, row0 + r]
            loaded += 1
        return loaded

    @cuda.jit(device=True)
    def row_dot(buf, a_off, b_off, stride, out_off, n_rows):
        for r in range(cuda.threadIdx.x, n_rows, NT):
            total = float32(0.0)
            for x in range(DV):
                total += buf[a_off + r * stride + x] * buf[b_off + r * stride + x]
            buf[out_off + r] = total

    return RowFns(zero_outside, atomic_dq, lse_stats, row_dot)


def make_dkdv_epilogue(BR: int, BC: int, D: int, DV: int, WITH_O: bool,
                       WITH_DQ: bool, COUNT: bool):
    """write_dkdv(buf, dk_j, dv_j, dk, dv, bh, key0, bc, scale, cnt): a K/V-outer backward's
    end of a K/V block j (dense's dK/dV kernel, q_outer's, kv_outer's): dK_j = dk_j * scale
    and dV_j = dv_j staged in K_j's and V_j's tiles, stored to HBM rows key0 .. key0 + bc - 1,
    counted in cnt. Every thread calls it; it has its own barriers."""
    NT = grad_layout(BR, BC).threads
    sm = grad_shared_layout(BR, BC, D, DV, WITH_O, WITH_DQ)
    ac = make_acc_fns(BR, BC, D, DV, WITH_O, WITH_DQ)
    stage_dk, stage_dv = ac.stage_dk, ac.stage_dv
    store_dK_j = make_tile_storer(BC, D, NT, (sm.k, sm.qs))
    store_dV_j = make_tile_storer(BC, DV, NT, (sm.v, sm.os))
    DK_W, DV_W = slot("dk", "write"), slot("dv", "write")

    @inlined
    def write_dkdv(buf, dk_j, dv_j, dk, dv, bh, key0, bc, scale, cnt):
        cuda.syncthreads()  # every thread is done with K_j and V_j: their tiles stage dK, dV
        stage_dk(buf, dk_j, scale)
        stage_dv(buf, dv_j, float32(1.0))
        cuda.syncthreads()  # dK_j and dV_j are complete in shared memory
        # dK_j, dV_j: written to HBM once per K/V block
        moved_k = store_dK_j(buf, dk, bh, key0, bc, 0, D)
        moved_v = store_dV_j(buf, dv, bh, key0, bc, 0, DV)
        if COUNT:
            cnt[DK_W] += moved_k
            cnt[DV_W] += moved_v

    return write_dkdv
