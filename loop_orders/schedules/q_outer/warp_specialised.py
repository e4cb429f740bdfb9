"""q_outer's float32 forward on CUDA cores with its warps specialised: S warps and P V warps.

The shared micro-kernel (`cuda_cores`) has every thread compute both products of a tile, so
its registers hold a thread's scores and its accumulators at once, and at d = 128 that leaves
an 8 x 4 thread tile for S_ij: 12 shared loads per 128 FMAs. Here the CTA's warps split:

    S warps   (NS = Br/8 x Bc/8 threads, 8 rows x 8 keys each: 16 loads per 256 FMAs)
    PV warps  (NP = Br/8 x dv/16 threads, 8 rows x 16 dims of O_i each: 6 loads per 128)

    all:       Q_i -> shared, pre-scaled by scale log2 e                     # once
    S warps:   for j < c_i:
                   K_j landed (two K buffers; K_j+1 copied under S_ij)
                   S_ij = Q_i K_j^T, masked; lazy row max m_i (as the micro-kernel's);
                   alpha = 2^(m_old - m_i); l_i = alpha l_i + rowsum(P_ij), P_ij = 2^(S - m_i)
                   [wait: P buffer empty]  P_ij^T, alpha -> shared  [signal: full]
               l_i -> shared  [signal]; lse_i (save_lse)
    PV warps:  for j < c_i:
                   [wait: full]  acc_i *= alpha
                   acc_i += P_ij V_j, over V_j's two halves of Bc/2 keys (a ring of three
                   halves, each copied two halves ahead)
                   [signal: P buffer empty]
               [wait: l_i]  O_i = acc_i / l_i -> HBM

P_ij^T has one buffer: the S warps compute S_ij+1 in registers while the PV warps fold in
P_ij, and only its store waits for them. With Br = 128, Bc = 64, d = dv = 128 the buffer is
219,136 bytes, one CTA an SM, and each of the 4 schedulers holds one S warp and one P V warp.
The hot loops are kept short (`Specialised`: 3 chunks of S_ij's dims, 4 or 8 keys of P_ij V_j
a trip, per mask as q_outer's SPECIALISED says): each scheduler runs both loops at once, and
longer ones evicted each other from the instruction cache.

Where N_q and N_k are whole numbers of tiles the kernel is built without the tails' code, and
then, unless causal, without any masking (`Specialised.even`): that code slowed the tile
loops. On a tail tile or the causal diagonal a P V thread takes the keys all 8 of its rows
see 8 rows a key, as on any other tile, then each group of 4 consecutive rows apart: the
further keys all four see at 64 FMAs a key, then key by key the few only some see (a row sees
a prefix of the tile's keys). Key by key for all 8 rows, a branch a row, the diagonal's two
tiles cost about two tiles' time more a query block, and without the common keys 8 rows a
key, the warp holding the rows just below the diagonal's middle took most of the first
diagonal tile's keys by groups and set the step.

The traffic is q_outer's, element for element: Q_i once, each visited K_j and V_j once (V_j
by halves), O_i once, lse_i once; each role counts what it copies. Masks and tails are the
micro-kernel's: a masked score is -inf (weight 0), a row multiplies in only the keys it sees
(on a tail tile or the causal diagonal, the keys all of a thread's rows see 8 rows a key, the
rest by row groups), K and V rows past N_k arrive as zeros.

Persistent CTAs (`Specialised.persistent`; q_outer takes them causal at short N, PERSISTENT):
as many CTAs as SMs (`persistent_grid`), and the roles run on from one query block into the
next. While the P V warps fold in a block's last P_ij V_j and write O_i, the S warps load the
next Q_i (they alone read it) and K_0 and compute its first S_ij, so that a block no longer
pays the pipeline's fill and drain. CTA c takes work item c first (a query block and batch x
head, heaviest first when causal, as `tiles.block_grid`), then draws the next from a counter in
HBM (`tickets`) while it folds the one before, so that the SMs finish together. Causal, the S
warps there also skip the scores of the block's first half of rows on a tile whose keys all lie
past them (the diagonal's second when Br = 2 Bc): `s_row` puts a thread's rows a < 4 in the
block's second half. Which code surrounds the tile loops moves ptxas's register assignment
inside them, so the unrolling PERSISTENT names is the one whose loops compiled with few
register-bank conflicts (`experiments.sass_loops`), not the CTA a block's.

What each of these choices measured against the others, and the logs:
results/tuning_history/warp_specialised.md.

Named barriers (`intrinsics.named_barrier`): FULL and EMPTY between the roles (all threads),
S_ONLY and PV_ONLY within a role (its K or V copies have landed for all of it, and all of it
is done with the buffer the next copies take), L_READY for l_i at a block's end.
"""

from __future__ import annotations

import math
from functools import cache
from typing import NamedTuple

from numba import float32, int32, int64, uint32, uint64

from ...core.mask import NO_MASK, mask_of
from ...device.intrinsics import (
    cp_async_commit,
    cp_async_wait_all,
    cp_async_wait_one,
    exp2,
    named_barrier,
    shfl_xor,
    st_global_v4,
    vote_any,
)
from ...device.runtime import (
    SHARED_ALIGN,
    SHARED_F32,
    cuda,
    inlined,
    kernel_options,
)
from ...microkernel.persistent import make_items, persistent_grid, tickets
from ...microkernel.spec import Layout
from ...microkernel.tiles import (
    LN2,
    counter_slots,
    counts_flusher,
    make_block_of,
    make_clear,
    make_row_copier,
    make_scores,
    make_tile_loader,
    odd_stride,
    unrolled,
    zero_counts,
)

NEG_INF = float32(-math.inf)
MAX_SLACK = float32(8.0)  # the micro-kernel's lazy row max (`cuda_cores.MAX_SLACK`)
S_RM, S_KN = 8, 8  # an S thread's rows and keys
P_RM, P_XN = 8, 16  # a P V thread's rows and dims of O_i (4 chunks of 4)
FULL, EMPTY, S_ONLY, PV_ONLY, L_READY = 1, 2, 3, 4, 5  # named barrier ids
class Specialised(NamedTuple):
    """The warp-specialised kernel as a micro-kernel choice (`MicroKernelSchedule.layout`),
    for tiles `fits` takes, with the steps per trip of its two hot loops; `plain()` is the
    shared micro-kernel with plain loads, which takes inputs cp.async cannot copy (the steps'
    timings: results/tuning_history/warp_specialised.md)."""

    dv: int
    chunks: int = 3  # 4-wide chunks of head dims per trip of S_ij's loop
    keys: int = 8  # keys per trip of P_ij V_j's loop
    peel: bool = True  # S_ij's first chunk sets the scores (else they start at zero)
    # a CTA an SM, folding query blocks in turn (`q_outer_ws_persistent`), else a CTA a block
    persistent: bool = False
    # N_q and N_k whole numbers of tiles: the kernel is built without the tails' code (and,
    # without a mask, without any masking), as FlashAttention's Is_even_MN
    even: bool = False

    # as a `cuda_cores.Layout` reads: K/V copies under the arithmetic (K_j+1 under S_ij, V_j
    # by halves two ahead), and P_ij^T in a region of its own
    stages: int = 2
    p_in_k: bool = False

    @classmethod
    def parse(cls, text: str, dv: int) -> Specialised:
        """LOOP_ORDERS_LAYOUT's "ws" or "ws,CHUNKS,KEYS[,PEEL[,PERSISTENT]]" (a ValueError
        otherwise)."""
        name, *steps = text.split(",")
        if name != "ws" or len(steps) not in (0, 2, 3, 4):
            raise ValueError(f"LOOP_ORDERS_LAYOUT={text}: expected ws or "
                             "ws,CHUNKS,KEYS[,PEEL[,PERSISTENT]]")
        values = [int(x) for x in steps]
        return cls(dv, *values[:2], *map(bool, values[2:]))

    def for_problem(self, n_q: int, n_k: int, block_q: int, block_k: int) -> Specialised:
        """This choice with `even` set for p's lengths."""
        return self._replace(even=n_q % block_q == 0 and n_k % block_k == 0)

    def threads(self, block_q: int, block_k: int) -> int:
        return (block_q // S_RM) * (block_k // S_KN) + (block_q // P_RM) * (self.dv // P_XN)

    # K/V rows by cp.async, O_i by 16-byte stores: those arrays 16-byte aligned (`Layout`)
    ALIGNED = "kvo"
    falls_back = True  # unaligned inputs take the shared micro-kernel with plain loads

    def buffer_bytes(self, block_q: int, block_k: int, d: int, dv: int, reload: bool,
                     transpose_q: bool) -> int:
        """Bytes of a CTA's dynamic shared buffer (`shared_floats`)."""
        return 4 * shared_floats(block_q, block_k, d, dv)

    def work_grid(self, grid: tuple, args: tuple, p=None) -> tuple[tuple, tuple]:
        """The launch's grid and kernel arguments: persistent CTAs, one an SM, drawing the
        work items of `grid` from a counter in HBM (`tickets`); else a CTA per item."""
        if self.persistent:
            return persistent_grid(grid), (*args, tickets())
        return grid, args

    def copies_rows(self, d: int, dv: int) -> bool:
        return True

    def plain(self):
        return Layout(8, 4)

    def __str__(self) -> str:
        default = Specialised(self.dv, even=self.even)
        if self == default:
            return "ws"
        text = f"ws,{self.chunks},{self.keys},{int(self.peel)}"
        return f"{text},1" if self.persistent else text

    @staticmethod
    def fits(block_q: int, block_k: int, d: int, dv: int) -> bool:
        """Whether the kernel can run these tiles: whole thread tiles, each role whole warps
        whose lanes hold whole rows of S, 16-byte rows, and the buffer under 227 KB."""
        ns = (block_q // S_RM) * (block_k // S_KN)
        np_ = (block_q // P_RM) * (dv // P_XN)
        return (block_q % S_RM == 0 and block_k % (2 * S_KN) == 0 and dv % P_XN == 0
                and d % 4 == 0 and ns % 32 == 0 and np_ % 32 == 0 and ns + np_ <= 1024
                and 32 % (block_k // S_KN) == 0
                and 4 * shared_floats(block_q, block_k, d, dv) <= 232_448)


class Shared(NamedTuple):
    """Offsets (floats) and row strides of the CTA's buffer."""

    q: int  # Q_i, Br rows
    qs: int
    k: int  # K_j, two buffers of Bc rows
    ks: int
    v: int  # V_j, a ring of three halves of Bc/2 rows
    p: int  # P_ij^T, a row per key
    ps: int
    alpha: int  # the rows' rescale factors of the tile
    l_row: int  # the rows' l_i, at the end
    size: int


@cache
def shared(BR: int, BC: int, D: int, DV: int) -> Shared:
    qs, ks, ps = odd_stride(D), odd_stride(D), odd_stride(BR)
    sizes = [BR * qs, 2 * BC * ks, 3 * (BC // 2) * DV, BC * ps, BR, BR]
    q, k, v, p, alpha, l_row, size = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    return Shared(q, qs, k, ks, v, p, ps, alpha, l_row, size)


def shared_floats(block_q: int, block_k: int, d: int, dv: int) -> int:
    return shared(block_q, block_k, d, dv).size


class Barriers(NamedTuple):
    """The named barriers between and within the roles (their ids: FULL .. L_READY)."""

    full_sync: object
    full_arrive: object
    empty_sync: object
    empty_arrive: object
    s_sync: object
    pv_sync: object
    l_sync: object
    l_arrive: object


@cache
def make_barriers(NS: int, NP: int) -> Barriers:
    """FULL, EMPTY and L_READY for all NS + NP threads, S_ONLY for the S warps' NS, PV_ONLY for
    the P V warps' NP."""
    full_sync, full_arrive = named_barrier(FULL, NS + NP)
    empty_sync, empty_arrive = named_barrier(EMPTY, NS + NP)
    s_sync, _ = named_barrier(S_ONLY, NS)
    pv_sync, _ = named_barrier(PV_ONLY, NP)
    l_sync, l_arrive = named_barrier(L_READY, NS + NP)
    return Barriers(full_sync, full_arrive, empty_sync, empty_arrive, s_sync, pv_sync, l_sync,
                    l_arrive)


# The masks this kernel's roles implement: none, and causal with N_q = N_k (query row r sees
# keys c <= r; `visible` below); q_outer's `specialised` gives every other problem the
# micro-kernel, whose mask is `core.mask`'s.
SQUARE_MASKS = (NO_MASK, mask_of(True))


@cache
def make_kv_prefix(BC: int, CAUSAL: bool):
    """kv_blocks(row0, n_rows, n_k) -> c_i: the K/V blocks j < c_i the query block of rows
    row0 .. row0 + n_rows - 1 visits under this kernel's masks (`SQUARE_MASKS`): all, or
    (causal, N_q = N_k) those up to its last row; `tiles.make_kv_blocks` for any mask."""

    @inlined
    def kv_blocks(row0, n_rows, n_k):
        c_i = (n_k + BC - 1) // BC
        if CAUSAL:
            c_i = min(c_i, (row0 + n_rows - 1) // BC + 1)  # later K/V blocks are all masked
        return c_i

    return kv_blocks


@cache
def make_visible(CAUSAL: bool):
    """visible(row, key0, n_keys), both roles' mask."""

    @inlined
    def visible(row, key0, n_keys):
        """How many of the tile's keys a row sees: all, or (causal) those up to the row."""
        if CAUSAL:
            return max(0, min(n_keys, row - key0 + 1))
        return n_keys

    return visible


class Copies(NamedTuple):
    """The CTA's copies into its buffer: Q_i (zeroed first on a tail block), K_j, V_j's halves."""

    clear_q: object
    load_q_tile: object
    load_k: object
    load_v_half: object


@cache
def make_copies(BR, BC, D, DV, PERSISTENT, EVEN, COUNT, slots) -> Copies:
    """Q_i's loader (every thread, or persistent the S warps, under the P V warps' last tile),
    the S warps' K_j copies and the P V warps' V_j halves; `slots` as q_outer's."""
    _, K_R, V_R, _, _ = slots
    sm = shared(BR, BC, D, DV)
    Q, QS, K, KS, V = sm.q, sm.qs, sm.k, sm.ks, sm.v
    HK = BC // 2  # keys of a V half
    NS, NP = (BR // S_RM) * (BC // S_KN), (BR // P_RM) * (DV // P_XN)
    Q_THREADS = NS if PERSISTENT else NS + NP
    clear_q = make_clear(BR * QS, Q_THREADS)
    load_q_tile = make_tile_loader(BR, D, Q_THREADS, (Q, QS), scaled=True, in_flight=True)
    copy_k_rows = make_row_copier(BC, D, KS, NS, 4, WHOLE=EVEN)
    copy_v_rows = make_row_copier(HK, DV, DV, NP, 4, FIRST=NS, WHOLE=EVEN)

    @inlined
    def load_k(buf, k, bh, key0, n_k, stage, cnt):
        # K_j: reloaded from HBM by every query block (the S warps copy it)
        moved = copy_k_rows(buf, uint64(K + stage * BC * KS), k, bh, key0, min(BC, n_k - key0))
        if COUNT:
            cnt[K_R] += moved

    @inlined
    def load_v_half(buf, v, bh, key0, n_k, half, cnt):
        """Keys key0 .. key0 + Bc/2 - 1 of V into the ring's slot half % 3 (zeros past N_k)."""
        n_rows = HK if EVEN else max(0, min(HK, n_k - key0))
        # V_j: reloaded from HBM by every query block, by halves (the P V warps copy it)
        moved = copy_v_rows(buf, uint64(V + (half % 3) * HK * DV), v, bh,
                            key0 if n_rows > 0 else 0, n_rows)
        if COUNT:
            cnt[V_R] += moved

    return Copies(clear_q, load_q_tile, load_k, load_v_half)


# --- the S warps -----------------------------------------------------------------------


class SScores(NamedTuple):
    """An S thread's rows (`s_row`) and its scores S_ij, of all its rows or (persistent,
    causal) of those in the block's second half only."""

    s_row: object
    scores: object
    scores_second_half: object


@cache
def make_s_scores(BR, BC, D, DV, SP, HALF) -> SScores:
    """HALF (persistent, causal): a tile whose keys all lie past the block's first half of rows
    (the diagonal's second when Br = 2 Bc) takes the scores of the S threads' rows in its
    second half only."""
    sm = shared(BR, BC, D, DV)
    Q, QS, KS = sm.q, sm.qs, sm.ks
    S_TR, S_TC = BR // S_RM, BC // S_KN
    DX4 = D // 4

    @inlined
    def s_row(tr, a):
        """An S thread's row a: pairs of rows in the block's quarters, 2 tr + a % 2 +
        2 S_TR quarter(a), so that the 4 rows a warp loads of Q_i at once sit in different
        banks; quarter(a) = a // 2, or (HALF) rows a < S_RM/2 in the block's second half
        (quarters 2, 3) and the rest in its first."""
        quarter = (a // 2 + S_RM // 4) % (S_RM // 2) if HALF else a // 2
        return uint64(quarter * 2 * S_TR + a % 2) + uint64(2) * uint64(tr)

    def make_q_chunk(rows):
        @inlined
        def q_chunk(x4, buf, tr, qq):
            for a in range(rows):
                at = uint64(Q) + s_row(tr, a) * uint64(QS) + uint64(4) * uint64(x4)
                for u in range(4):
                    qq[a * 4 + u] = buf[at + uint64(u)]

        return q_chunk

    @inlined
    def k_chunk(x4, buf, k_at, tc, kk):
        for b in range(S_KN):
            at = k_at + (uint64(tc) + uint64(b * S_TC)) * uint64(KS) + uint64(4) * uint64(x4)
            for u in range(4):
                kk[b * 4 + u] = buf[at + uint64(u)]

    scores = make_scores(S_RM, S_KN, DX4, SP.chunks, SP.peel, make_q_chunk(S_RM), k_chunk)
    # (HALF) the scores of the thread's rows in the block's second half (a < S_RM/2)
    scores_second_half = make_scores(S_RM // 2, S_KN, DX4, SP.chunks, SP.peel,
                                     make_q_chunk(S_RM // 2), k_chunk)
    return SScores(s_row, scores, scores_second_half)


class STile(NamedTuple):
    """An S thread's steps on S_ij once computed: `weigh` it, `give_p` its P_ij^T."""

    weigh: object
    give_p: object


@cache
def make_s_tile(BR, BC, D, DV, MASKED, FIRST_ROW, s_row, visible) -> STile:
    """FIRST_ROW: the thread's row that sees the fewest keys of a tile (its first in the
    block)."""
    sm = shared(BR, BC, D, DV)
    P, PS, ALPHA = sm.p, sm.ps, sm.alpha
    S_TC = BC // S_KN
    LOG_TC = S_TC.bit_length() - 1

    @inlined
    def weigh(s, m, l, alpha, tr, tc, row0, key0, n_keys):  # noqa: E741
        """Mask, the lazy row max, alpha, l_i, and the weights 2^(s - m) in place of s."""
        # a tail tile, or the causal diagonal (the thread's first row sees the fewest keys)
        if MASKED and visible(row0 + int(s_row(tr, FIRST_ROW)), key0, n_keys) < BC:
            for a in range(S_RM):
                seen = visible(row0 + int(s_row(tr, a)), key0, n_keys)
                for b in range(S_KN):
                    if int(tc) + b * S_TC >= seen:
                        s[a * S_KN + b] = NEG_INF  # weight 0, whatever its K row holds
        moved = False  # a score above its row's running max by more than MAX_SLACK
        part = cuda.local.array(S_RM, float32)
        for a in range(S_RM):
            x = s[a * S_KN]
            for b in range(1, S_KN):
                x = max(x, s[a * S_KN + b])
            part[a] = x
            alpha[a] = float32(1.0)
            moved |= x > m[a] + MAX_SLACK
        if vote_any(moved):  # a warp holds whole rows of S threads
            for a in range(S_RM):
                x = part[a]
                for r in range(LOG_TC):
                    x = max(x, shfl_xor(x, 1 << r))
                if x > m[a]:
                    alpha[a] = exp2(m[a] - x)  # 0 before the first key
                    l[a] *= alpha[a]
                    m[a] = x
        for a in range(S_RM):
            shift = m[a] if m[a] > NEG_INF else float32(0.0)  # no key seen yet: 2^-inf = 0
            for b in range(S_KN):
                w = exp2(s[a * S_KN + b] - shift)
                l[a] += w
                s[a * S_KN + b] = w

    @inlined
    def give_p(buf, s, alpha, tr, tc):
        """P_ij^T (a row per key) and the rows' alpha into shared memory."""
        for b in range(S_KN):
            at = uint64(P) + (uint64(tc) + uint64(b * S_TC)) * uint64(PS)
            for a in range(S_RM):
                buf[at + s_row(tr, a)] = s[a * S_KN + b]
        if tc == uint32(0):
            for a in range(S_RM):
                buf[uint64(ALPHA) + s_row(tr, a)] = alpha[a]

    return STile(weigh, give_p)


@cache
def make_s_role(BR, BC, D, DV, SP, CAUSAL, SAVE_LSE, COUNT, slots, bars, load_k):
    """s_role(buf, k, lse, bh, row0, n_rows, n_k, c_i, t, cnt): the S warps' part of a query
    block, K_0 copied and Q_i in shared memory."""
    LSE_W = slots[4]
    sm = shared(BR, BC, D, DV)
    K, KS, L_ROW = sm.k, sm.ks, sm.l_row
    S_TC = BC // S_KN
    LOG_TC = S_TC.bit_length() - 1
    S_NS = S_RM * S_KN  # local arrays take literal sizes: a thread's scores
    PERSISTENT = SP.persistent
    HALF = PERSISTENT and CAUSAL
    FIRST_ROW = S_RM // 2 if HALF else 0  # an S thread's first row in the block
    s_row, scores, scores_second_half = make_s_scores(BR, BC, D, DV, SP, HALF)
    weigh, give_p = make_s_tile(BR, BC, D, DV, CAUSAL or not SP.even, FIRST_ROW, s_row,
                                make_visible(CAUSAL))
    empty_sync, full_arrive, s_sync = bars.empty_sync, bars.full_arrive, bars.s_sync
    l_arrive = bars.l_arrive

    @inlined
    def s_role(buf, k, lse, bh, row0, n_rows, n_k, c_i, t, cnt):
        tr, tc = t // uint32(S_TC), t % uint32(S_TC)
        m = cuda.local.array(S_RM, float32)
        l = cuda.local.array(S_RM, float32)  # noqa: E741 - this thread's partial row sums
        s = cuda.local.array(S_NS, float32)
        alpha = cuda.local.array(S_RM, float32)
        for a in range(S_RM):
            m[a] = NEG_INF
            l[a] = float32(0.0)
        for j in range(c_i):
            key0 = j * BC
            cp_async_wait_all()  # this thread's copies of K_j have landed
            s_sync()  # ... every S thread's; all are done with the other buffer (K_j-1)
            if j + 1 < c_i:
                load_k(buf, k, bh, key0 + BC, n_k, (j + 1) % 2, cnt)  # lands under S_ij
            k_at = uint64(K) + uint64((j % 2) * BC * KS)
            if HALF and row0 + BR // 2 <= key0:  # the block's first half sees no key here
                scores_second_half(s, buf, k_at, tr, tc)  # (the rest: masked in weigh)
            else:
                scores(s, buf, k_at, tr, tc)
            weigh(s, m, l, alpha, tr, tc, row0, key0, min(BC, n_k - key0))
            if PERSISTENT or j > 0:
                # the P V warps are done with the P_ij^T before (this block's or the last
                # one's) and its alpha
                empty_sync()
            give_p(buf, s, alpha, tr, tc)
            full_arrive()  # P_ij^T and alpha are in shared memory
        for a in range(S_RM):
            x = l[a]
            for r in range(LOG_TC):
                x += shfl_xor(x, 1 << r)
            l[a] = x
            if tc == uint32(0):
                buf[uint64(L_ROW) + s_row(tr, a)] = x
        l_arrive()  # every row's l_i is in shared memory
        if SAVE_LSE and tc == uint32(0):
            for a in range(S_RM):
                local = int(s_row(tr, a))
                if local < n_rows:
                    # lse_i: the row statistic the backward pass needs, written once
                    lse[bh, row0 + local] = (m[a] + math.log2(l[a])) * float32(LN2)
                    if COUNT:
                        cnt[LSE_W] += 1

    return s_role


# --- the P V warps ---------------------------------------------------------------------


class PvTile(NamedTuple):
    """A P V thread's rows and dims, and acc += P_ij V_j over a half's keys: one key, or the
    whole half unrolled by SP.keys."""

    pv_row: object
    dim: object
    v_key: object
    accumulate_key: object
    accumulate_half: object


@cache
def make_pv_tile(BR, BC, D, DV, SP) -> PvTile:
    """The P V thread's tile steps, SP.keys keys a trip of the half's loop."""
    PS = shared(BR, BC, D, DV).ps
    HK = BC // 2  # keys of a V half
    P_TR, P_TC = BR // P_RM, DV // P_XN

    @inlined
    def pv_row(tr, a):
        """A P V thread's row a: groups of 4 rows (one 16-byte load of P_ij^T a group and
        key), 4 tr + a % 4 + 4 P_TR (a // 4)."""
        return uint64((a // 4) * 4 * P_TR + a % 4) + uint64(4) * uint64(tr)

    @inlined
    def dim(tc, h, w):
        """Head dim of the thread's w-th element of chunk h: 16-byte chunks tc + h P_TC."""
        return (uint64(tc) + uint64(h * P_TC)) * uint64(4) + uint64(w)

    @inlined
    def p_key(at, buf, tr, pp):
        for a in range(P_RM):
            pp[a] = buf[at + pv_row(tr, a)]

    @inlined
    def v_key(at, buf, tc, vv):
        for h in range(P_XN // 4):
            for w in range(4):
                vv[4 * h + w] = buf[at + dim(tc, h, w)]

    @inlined
    def accumulate_dim(y, acc, pp, vv):
        for a in range(P_RM):
            acc[a * P_XN + y] += pp[a] * vv[y]

    accumulate_dims = unrolled(accumulate_dim, P_XN, 3, P_XN)

    @inlined
    def accumulate_key(key, buf, p_at, v_at, tr, tc, acc):
        """acc += P_ij[:, key] V_j[key] (key within the half)."""
        pp = cuda.local.array(P_RM, float32)
        vv = cuda.local.array(P_XN, float32)
        p_key(p_at + uint64(key) * uint64(PS), buf, tr, pp)
        v_key(v_at + uint64(key) * uint64(DV), buf, tc, vv)
        accumulate_dims(acc, pp, vv)

    accumulate_half = unrolled(accumulate_key, HK, 6, SP.keys)
    return PvTile(pv_row, dim, v_key, accumulate_key, accumulate_half)


class PvMasked(NamedTuple):
    """acc += P_ij V_j on a tail tile or the causal diagonal, rows seeing different keys."""

    seen_in_half: object
    accumulate_first: object
    accumulate_seen: object


@cache
def make_pv_masked(BR, BC, D, DV, pv) -> PvMasked:
    """The keys every row of a P V thread sees 8 rows a key (`accumulate_first`), then a group
    of 4 rows at a time (`accumulate_seen`); `pv`: `make_pv_tile`'s."""
    PS = shared(BR, BC, D, DV).ps
    HK = BC // 2  # keys of a V half
    pv_row, v_key, accumulate_key = pv.pv_row, pv.v_key, pv.accumulate_key

    @inlined
    def row_group_operands(g, key, buf, p_at, v_at, tr, tc, pp, vv):
        """pp = P_ij[rows of group g, key], vv = the thread's dims of V_j[key]: the group's 4
        rows a P V thread holds (a = 4 g .. 4 g + 3, consecutive rows: one 16-byte load of
        P_ij^T)."""
        at = p_at + uint64(key) * uint64(PS)
        for a in range(4):
            pp[a] = buf[at + pv_row(tr, 4 * g + a)]
        v_key(v_at + uint64(key) * uint64(DV), buf, tc, vv)

    @inlined
    def seen_in_half(seen, first):
        """Of the V half starting at key `first` of the tile, the keys a row that sees the
        tile's first `seen` keys sees."""
        return min(max(seen - first, 0), HK)

    @inlined
    def accumulate_first(n, buf, p_at, v_at, tr, tc, acc):
        """acc += the half's first n keys, all 8 rows (n at run time: the keys every row of
        the thread sees on a tail tile or the causal diagonal)."""
        key = uint32(0)
        while key < uint32(n):
            accumulate_key(key, buf, p_at, v_at, tr, tc, acc)
            key = uint32(key + uint32(1))

    @inlined
    def row_group_seen(g, buf, p_at, v_at, tr, tc, acc, first, vis, start):
        """acc += the half's keys from `start` on that rows of group g see: those all 4 see
        (a row sees a prefix of the tile's keys, the later row the longer one) 4 rows at a
        time, then key by key the few that only some see; a key no row sees is never
        multiplied in."""
        every = seen_in_half(vis[4 * g], first)  # keys all 4 rows see
        some = seen_in_half(vis[4 * g + 3], first)  # keys the last row sees
        pp = cuda.local.array(4, float32)
        vv = cuda.local.array(P_XN, float32)
        key = int32(start)
        while key < every:
            row_group_operands(g, key, buf, p_at, v_at, tr, tc, pp, vv)
            for a in range(4):
                for y in range(P_XN):
                    acc[(4 * g + a) * P_XN + y] += pp[a] * vv[y]
            key = int32(key + 1)
        while key < some:
            row_group_operands(g, key, buf, p_at, v_at, tr, tc, pp, vv)
            for a in range(4):
                if first + key < vis[4 * g + a]:
                    for y in range(P_XN):
                        acc[(4 * g + a) * P_XN + y] += pp[a] * vv[y]
            key = int32(key + 1)

    # acc += the half's keys from `start` on that each row sees, on a tail tile or the causal
    # diagonal, a group of 4 rows at a time: accumulate_seen(buf, p_at, v_at, tr, tc, acc,
    # first, vis, start), with `first` the half's first key in the tile and vis the keys each
    # row sees
    accumulate_seen = unrolled(row_group_seen, P_RM // 4, 9, P_RM // 4)
    return PvMasked(seen_in_half, accumulate_first, accumulate_seen)


@cache
def make_pv_role(BR, BC, D, DV, SP, CAUSAL, COUNT, slots, bars, load_v_half):
    """pv_role(buf, v, o, bh, row0, n_rows, n_k, c_i, t, items, slot, cnt): the P V warps'
    part of a query block, V_0's halves copied."""
    O_W = slots[3]
    sm = shared(BR, BC, D, DV)
    P, PS, V, ALPHA, L_ROW = sm.p, sm.ps, sm.v, sm.alpha, sm.l_row
    HK = BC // 2  # keys of a V half
    P_TC = DV // P_XN
    P_NACC = P_RM * P_XN  # local arrays take literal sizes: a thread's accumulators
    PERSISTENT = SP.persistent
    MASKED = CAUSAL or not SP.even  # some tiles hold keys a row does not see
    visible = make_visible(CAUSAL)
    pv = make_pv_tile(BR, BC, D, DV, SP)
    pv_row, dim, accumulate_half = pv.pv_row, pv.dim, pv.accumulate_half
    seen_in_half, accumulate_first, accumulate_seen = make_pv_masked(BR, BC, D, DV, pv)
    full_sync, empty_arrive, pv_sync = bars.full_sync, bars.empty_arrive, bars.pv_sync
    l_sync = bars.l_sync

    @inlined
    def pv_role(buf, v, o, bh, row0, n_rows, n_k, c_i, t, items, slot, cnt):
        """The P V warps' part of query block i (V_0's halves copied), O_i written; persistent,
        `items[slot]` holds the CTA's next block (-1: none)."""
        tr, tc = t // uint32(P_TC), t % uint32(P_TC)
        acc = cuda.local.array(P_NACC, float32)
        vis = cuda.local.array(P_RM, int32)
        for y in range(P_NACC):
            acc[y] = float32(0.0)
        for j in range(c_i):
            key0 = j * BC
            n_keys = min(BC, n_k - key0)
            if MASKED:
                for a in range(P_RM):
                    vis[a] = visible(row0 + int(pv_row(tr, a)), key0, n_keys)
            full_sync()  # P_ij^T and the rows' alpha are in shared memory
            for a in range(P_RM):
                alpha = buf[uint64(ALPHA) + pv_row(tr, a)]
                if alpha != float32(1.0):  # the row's max rose (most tiles it does not)
                    for y in range(P_XN):
                        acc[a * P_XN + y] *= alpha
            for hh in range(2):
                half = 2 * j + hh
                cp_async_wait_one()  # this thread's copies of the half have landed
                pv_sync()  # ... every P V thread's; all are done with the half before
                if half + 2 < 2 * c_i:
                    load_v_half(buf, v, bh, (half + 2) * HK, n_k, half + 2, cnt)
                else:
                    cp_async_commit()  # an empty group: the wait above counts one a half
                p_at = uint64(P) + uint64(hh * HK) * uint64(PS)
                v_at = uint64(V) + uint64((half % 3) * HK * DV)
                if not MASKED or vis[0] == BC:
                    accumulate_half(buf, p_at, v_at, tr, tc, acc)
                else:  # the keys all 8 rows see (the first row's) 8 rows a key, then groups
                    every = seen_in_half(vis[0], hh * HK)
                    accumulate_first(every, buf, p_at, v_at, tr, tc, acc)
                    accumulate_seen(buf, p_at, v_at, tr, tc, acc, hh * HK, vis, every)
            if j + 1 < c_i:
                empty_arrive()  # done with P_ij^T and alpha
        l_sync()  # every row's l_i is in shared memory
        inv_l = cuda.local.array(P_RM, float32)
        if PERSISTENT:  # 1 / l_i before the next block's l_i takes its place
            for a in range(P_RM):
                inv_l[a] = float32(1.0) / buf[uint64(L_ROW) + pv_row(tr, a)]
            if items[slot] >= 0:
                # done with the last P_ij^T, its alpha and l_i: the S warps' next block's
                # first P_ij^T may take their place
                empty_arrive()
        for a in range(P_RM):
            local = int(pv_row(tr, a))
            if local < n_rows:
                inv = inv_l[a] if PERSISTENT else float32(1.0) / buf[uint64(L_ROW) + uint64(local)]
                for h in range(P_XN // 4):
                    y = a * P_XN + 4 * h
                    # O_i: written to HBM once, normalised, 16 bytes a thread and store (a
                    # warp's 8 pieces of a row consecutive: whole sectors)
                    st_global_v4(o, bh, row0 + local, dim(tc, h, 0), acc[y] * inv,
                                 acc[y + 1] * inv, acc[y + 2] * inv, acc[y + 3] * inv)
                if COUNT:
                    cnt[O_W] += P_XN

    return pv_role


# --- the kernels -----------------------------------------------------------------------


class Roles(NamedTuple):
    """What both kernels share: the barriers, the copies, and the two roles' parts of a
    query block."""

    bars: Barriers
    copies: Copies
    s_role: object
    pv_role: object


@cache
def make_roles(BR, BC, D, DV, SP, CAUSAL, SAVE_LSE, COUNT, slots) -> Roles:
    """The parts both kernels build on, for `make_specialised_kernel`'s arguments."""
    bars = make_barriers((BR // S_RM) * (BC // S_KN), (BR // P_RM) * (DV // P_XN))
    copies = make_copies(BR, BC, D, DV, SP.persistent, SP.even, COUNT, slots)
    s_role = make_s_role(BR, BC, D, DV, SP, CAUSAL, SAVE_LSE, COUNT, slots, bars,
                         copies.load_k)
    pv_role = make_pv_role(BR, BC, D, DV, SP, CAUSAL, COUNT, slots, bars, copies.load_v_half)
    return Roles(bars, copies, s_role, pv_role)


@cache
def make_block_kernel(BR, BC, D, DV, SP, CAUSAL, COUNT, slots, roles):
    """q_outer_ws(q, k, v, o, lse, counts, scale_log2): a CTA per query block."""
    Q_R = slots[0]
    HK = BC // 2  # keys of a V half
    NS, NP = (BR // S_RM) * (BC // S_KN), (BR // P_RM) * (DV // P_XN)
    NT = NS + NP
    NCNT = counter_slots(COUNT)
    EVEN = SP.even
    flush_counts = counts_flusher()
    block_of = make_block_of(CAUSAL, HEAVY_LAST=True)
    kv_blocks = make_kv_prefix(BC, CAUSAL)
    clear_q, load_q_tile, load_k, load_v_half = roles.copies
    s_role, pv_role = roles.s_role, roles.pv_role

    @cuda.jit(**kernel_options(NT, 255))
    def q_outer_ws(q, k, v, o, lse, counts, scale_log2):
        # causal: the query blocks that see the most K/V blocks start first (`block_grid`)
        i, bh = block_of(q.shape[0])
        n_q, n_k = q.shape[1], k.shape[1]
        row0 = i * BR
        n_rows = min(BR, n_q - row0)
        c_i = kv_blocks(row0, n_rows, n_k)
        buf = cuda.shared.array(0, SHARED_F32, alignment=SHARED_ALIGN)  # Q_i, K_j, V_j, ...
        cnt = cuda.local.array(NCNT, int64)
        if COUNT:
            zero_counts(cnt)
        t = uint32(cuda.threadIdx.x)
        if not EVEN and n_rows < BR:
            clear_q(buf)  # Q_i's rows past N_q stay zero
            cuda.syncthreads()  # ... before Q_i lands
        if t < uint32(NS):
            load_k(buf, k, bh, 0, n_k, 0, cnt)  # K_0 while Q_i loads
        else:  # V_0's halves, two ahead of the first
            load_v_half(buf, v, bh, 0, n_k, 0, cnt)
            load_v_half(buf, v, bh, HK, n_k, 1, cnt)
        # Q_i: read from HBM once, stays in shared memory for every K/V block
        moved = load_q_tile(buf, q, bh, row0, n_rows, 0, D, scale_log2)
        if COUNT:
            cnt[Q_R] += moved
        cuda.syncthreads()  # Q_i is in shared memory
        if t < uint32(NS):
            s_role(buf, k, lse, bh, row0, n_rows, n_k, c_i, t, cnt)
        else:
            pv_role(buf, v, o, bh, row0, n_rows, n_k, c_i, t - uint32(NS), None, 0, cnt)
        if COUNT:
            flush_counts(cnt, counts)

    return q_outer_ws


# --- persistent CTAs -------------------------------------------------------------------


class ItemRoles(NamedTuple):
    """The two roles' parts of a persistent CTA's work item."""

    s_item: object
    pv_item: object


@cache
def make_item_roles(BR, BC, D, SP, CAUSAL, COUNT, slots, roles) -> ItemRoles:
    """Each role's part of a work item with the copies it takes on, the S warps drawing the
    CTA's next item."""
    Q_R = slots[0]
    HK = BC // 2  # keys of a V half
    EVEN = SP.even
    kv_blocks = make_kv_prefix(BC, CAUSAL)
    publish = make_items(BR, CAUSAL).publish
    clear_q, load_q_tile, load_k, load_v_half = roles.copies
    s_sync, pv_sync = roles.bars.s_sync, roles.bars.pv_sync
    s_role, pv_role = roles.s_role, roles.pv_role

    @inlined
    def s_item(buf, q, k, lse, tickets, next_item, i, bh, slot, scale_log2, t, cnt):
        """The S warps' part of query block i, head bh, with its Q_i and K_0; the CTA's next
        item drawn, into next_item[slot], for both roles."""
        n_q, n_k = q.shape[1], k.shape[1]
        row0 = i * BR
        n_rows = min(BR, n_q - row0)
        load_k(buf, k, bh, 0, n_k, 0, cnt)  # K_0 while Q_i loads
        drawn = int32(0)
        if t == uint32(0):  # the next item, drawn now, back under Q_i's load
            drawn = cuda.atomic.add(tickets, 0, 1)
        if not EVEN and n_rows < BR:
            clear_q(buf)  # Q_i's rows past N_q stay zero
            s_sync()  # ... before Q_i lands
        # Q_i: read from HBM once, stays in shared memory for every K/V block (the S warps
        # alone read it)
        moved = load_q_tile(buf, q, bh, row0, n_rows, 0, D, scale_log2)
        if COUNT:
            cnt[Q_R] += moved
        if t == uint32(0):  # the P V warps read it after FULL
            publish(drawn, tickets, q, next_item, slot)
        # (s_role's first barrier waits for every S thread's rows of Q_i and K_0)
        s_role(buf, k, lse, bh, row0, n_rows, n_k, kv_blocks(row0, n_rows, n_k), t, cnt)
        s_sync()  # every S thread is done with Q_i and K's buffers, and has the next item

    @inlined
    def pv_item(buf, q, v, o, next_item, i, bh, slot, t, cnt):
        """The P V warps' part of query block i, head bh, with V_0's halves."""
        n_q, n_k = q.shape[1], v.shape[1]
        row0 = i * BR
        n_rows = min(BR, n_q - row0)
        # V_0's halves, two ahead of the first
        load_v_half(buf, v, bh, 0, n_k, 0, cnt)
        load_v_half(buf, v, bh, HK, n_k, 1, cnt)
        pv_role(buf, v, o, bh, row0, n_rows, n_k, kv_blocks(row0, n_rows, n_k), t, next_item,
                slot, cnt)
        pv_sync()  # every P V thread is done with V's ring: the next V_0 may take it

    return ItemRoles(s_item, pv_item)


@cache
def make_persistent_kernel(BR, BC, D, DV, SP, CAUSAL, COUNT, slots, roles):
    """q_outer_ws_persistent(q, k, v, o, lse, counts, tickets, scale_log2) on
    `persistent_grid`'s grid: a CTA an SM, folding query blocks in turn."""
    NS, NP = (BR // S_RM) * (BC // S_KN), (BR // P_RM) * (DV // P_XN)
    NT = NS + NP
    NCNT = counter_slots(COUNT)
    flush_counts = counts_flusher()
    item_of = make_items(BR, CAUSAL).item_of
    s_item, pv_item = make_item_roles(BR, BC, D, SP, CAUSAL, COUNT, slots, roles)
    empty_arrive = roles.bars.empty_arrive

    @cuda.jit(**kernel_options(NT, 255))
    def q_outer_ws_persistent(q, k, v, o, lse, counts, tickets, scale_log2):
        buf = cuda.shared.array(0, SHARED_F32, alignment=SHARED_ALIGN)  # Q_i, K_j, V_j, ...
        # the items drawn, (query block, batch x head), by the parity of the CTA's blocks
        next_item = cuda.shared.array(4, int32)
        cnt = cuda.local.array(NCNT, int64)
        if COUNT:
            zero_counts(cnt)
        t = uint32(cuda.threadIdx.x)
        if t >= uint32(NS):
            empty_arrive()  # the P buffer is empty: the S warps' first P_ij^T may take it
        i, bh = item_of(int32(cuda.blockIdx.x), q)  # (every CTA has a first item)
        folded = int32(0)  # query blocks the CTA has folded in
        while i >= 0:
            slot = 2 * ((folded + 1) % 2)  # where the next item goes
            if t < uint32(NS):
                s_item(buf, q, k, lse, tickets, next_item, i, bh, slot, scale_log2, t, cnt)
            else:
                pv_item(buf, q, v, o, next_item, i, bh, slot, t - uint32(NS), cnt)
            folded = int32(folded + 1)
            i, bh = next_item[2 * (folded % 2)], next_item[2 * (folded % 2) + 1]
        if COUNT:
            flush_counts(cnt, counts)

    return q_outer_ws_persistent


@cache
def make_specialised_kernel(BR, BC, D, DV, SP, MASK, SAVE_LSE, COUNT, slots):
    """The kernel q_outer(q, k, v, o, lse, counts, scale_log2) for these compile-time sizes
    (`Specialised.fits`) and SP's unrolling, a CTA per query block; where SP.persistent,
    q_outer(q, k, v, o, lse, counts, tickets, scale_log2) on `persistent_grid`'s grid with
    `tickets()`. `slots`: the counter slots (q, k, v, o, lse), as q_outer's. MASK: no mask,
    or causal with N_q = N_k (`SQUARE_MASKS`; q_outer runs any other on the micro-kernel)."""
    if MASK not in SQUARE_MASKS:
        raise ValueError(f"the warp-specialised kernel has no mask {MASK}: it runs "
                         f"{SQUARE_MASKS} with as many queries as keys")
    CAUSAL = MASK.bounded
    roles = make_roles(BR, BC, D, DV, SP, CAUSAL, SAVE_LSE, COUNT, slots)
    make = make_persistent_kernel if SP.persistent else make_block_kernel
    return make(BR, BC, D, DV, SP, CAUSAL, COUNT, slots, roles)
