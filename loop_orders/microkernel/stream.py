"""The K/V loop of a loop nest that keeps a query block on chip and streams K/V blocks past
it (q_outer's kernel, split_kv's partial pass), over any forward micro-kernel (`spec`):

    load Q_i                                   # load_Q_i_counted
    for j in j0 .. j1 - 1:                     # fold_tiles
        load K_j, V_j                          # one buffer, or two (K_j+1, V_j+1 landing
        online-softmax update with S_ij        #   under K_j, V_j's arithmetic), or staggered,
                                               #   or pipelined (P V_j a tile behind, a ring
                                               #   of buffers, warpgroups taking turns)

Each load adds the elements it moved to its counter slot in a counted build.
"""

from __future__ import annotations

from typing import NamedTuple

from numba import float32, int32

from ..core.ledger import slot
from ..device.runtime import cuda, inlined
from . import hopper

Q_R, K_R, V_R = slot("q", "read"), slot("k", "read"), slot("v", "read")


class CountedLoads(NamedTuple):
    """A streaming loop nest's tile loads with their counting (see `make_counted_loads`)."""

    k: object  # load_K_j_counted(buf, k, bh, key0, n_k, stage, cnt)
    v: object  # load_V_j_counted(buf, v, bh, key0, n_k, stage, cnt)
    kv: object  # load_KV_j(buf, k, v, bh, key0, n_k, stage, cnt)
    q: object  # load_Q_i_counted(buf, q, bh, row0, n_rows, scale_log2, cnt)


def make_counted_loads(BC, COUNT, mk) -> CountedLoads:
    """The micro-kernel mk's loads of K_j, V_j, both, and Q_i, each adding the elements it
    moved to its counter slot when COUNT."""
    load_Q_i, load_K_j, load_V_j = mk.load_q, mk.load_k, mk.load_v

    @inlined
    def load_K_j_counted(buf, k, bh, key0, n_k, stage, cnt):
        """K_j (keys key0 .. key0 + Bc - 1, fewer at the tail) into K buffer `stage`, counted;
        every thread calls it."""
        # K_j: reloaded from HBM by every query block
        moved = load_K_j(buf, k, bh, key0, min(BC, n_k - key0), stage)
        if COUNT:
            cnt[K_R] += moved

    @inlined
    def load_V_j_counted(buf, v, bh, key0, n_k, stage, cnt):
        """V_j, as load_K_j_counted."""
        # V_j: reloaded from HBM by every query block
        moved = load_V_j(buf, v, bh, key0, min(BC, n_k - key0), stage)
        if COUNT:
            cnt[V_R] += moved

    @inlined
    def load_KV_j(buf, k, v, bh, key0, n_k, stage, cnt):
        """K_j and V_j into K/V buffer `stage`, counted; every thread calls it."""
        load_K_j_counted(buf, k, bh, key0, n_k, stage, cnt)
        load_V_j_counted(buf, v, bh, key0, n_k, stage, cnt)

    @inlined
    def load_Q_i_counted(buf, q, bh, row0, n_rows, scale_log2, cnt):
        """Q_i into its tile, counted; every thread calls it."""
        # Q_i: read from HBM once, stays in shared memory for every K/V block
        moved = load_Q_i(buf, q, bh, row0, n_rows, scale_log2)
        if COUNT:
            cnt[Q_R] += moved

    return CountedLoads(load_K_j_counted, load_V_j_counted, load_KV_j, load_Q_i_counted)


def make_fold_tiles(BC, mk, loads: CountedLoads):
    """fold_tiles(buf, k, v, bh, n_k, j0, j1, diag0, m_i, l_i, acc, scale_log2, cnt): the K/V
    loop of a query block's kernel (q_outer's, split_kv's partial pass) over the micro-kernel
    mk, K/V blocks j0 .. j1 - 1: pipelined (`make_stream_kv_pipelined`) where mk.PIPELINED,
    staggered (`stream_kv_staggered`) where mk.STAGGERED, else `stream_kv`."""
    RM, STAGES = mk.RM, mk.STAGES
    SPANS = 2 * RM  # (first, end) of the keys each row of the thread sees
    weigh, fold = mk.weigh, mk.fold  # online_update's halves, where mk.STAGGERED
    online_update, wait_loads = mk.online_update, mk.wait_loads
    load_K_j_counted, load_V_j_counted, load_KV_j = loads.k, loads.v, loads.kv

    @inlined
    def stream_kv(buf, k, v, bh, n_k, j0, j1, diag0, m_i, l_i, acc, scale_log2, cnt):
        """Fold K_j, V_j for j0 <= j < j1 into (m_i, l_i, acc), in one K/V buffer or
        (STAGES 2) two, K_j+1, V_j+1 landing in the other while K_j, V_j are folded in."""
        if STAGES > 1 and j0 < j1:
            # K_j0, V_j0 ahead of the loop: each later pair lands under the previous one's
            # arithmetic
            load_KV_j(buf, k, v, bh, j0 * BC, n_k, 0, cnt)
        for j in range(j0, j1):
            key0 = j * BC
            bc = min(BC, n_k - key0)
            if STAGES == 1:
                cuda.syncthreads()  # every thread is done with the previous K_j, V_j and P_ij
                load_KV_j(buf, k, v, bh, key0, n_k, 0, cnt)
            wait_loads()
            # K_j, V_j (and Q_i) are in shared memory for all threads; double-buffered, every
            # thread is also done with the other buffer (K_j-1, V_j-1)
            cuda.syncthreads()
            if STAGES > 1 and j + 1 < j1:
                # the other buffer
                load_KV_j(buf, k, v, bh, key0 + BC, n_k, (j - j0 + 1) % STAGES, cnt)
            online_update(buf, bc, key0, diag0, m_i, l_i, acc, scale_log2, (j - j0) % STAGES)

    @cuda.jit(device=True, inline="always")
    def stream_kv_staggered(buf, k, v, bh, n_k, j0, j1, diag0, m_i, l_i, acc, scale_log2,
                            cnt):
        """Fold K_j, V_j for j0 <= j < j1 into (m_i, l_i, acc) in one K and one V buffer,
        their loads staggered: V_j lands while S_ij is computed, K_j+1 while P_ij V_j is
        (K_j0 from the kernel, before Q_i)."""
        vis = cuda.local.array(SPANS, int32)  # the span of keys each row of the thread sees
        for j in range(j0, j1):
            key0 = j * BC
            bc = min(BC, n_k - key0)
            wait_loads()
            # K_j (and Q_i) are in shared memory; every thread is done with V_j-1 and P_ij-1
            cuda.syncthreads()
            load_V_j_counted(buf, v, bh, key0, n_k, 0, cnt)  # lands under S_ij
            weigh(buf, bc, key0, diag0, m_i, l_i, acc, vis)
            wait_loads()
            # P_ij and V_j are in shared memory; every thread is done with K_j
            cuda.syncthreads()
            if j + 1 < j1:
                load_K_j_counted(buf, k, bh, key0 + BC, n_k, 0, cnt)  # K_j+1, under P_ij V_j
            fold(buf, acc, vis)

    if mk.PIPELINED:
        return make_stream_kv_pipelined(BC, mk, loads)
    return stream_kv_staggered if mk.STAGGERED else stream_kv


def make_stream_kv_pipelined(BC, mk, loads: CountedLoads, PERSISTENT: bool = False):
    """stream_kv_pipelined: `make_fold_tiles`' K/V loop over a micro-kernel with P_ij V_j a
    tile behind S_ij (mk.PIPELINED) and its ring of buffers (mk.ring, `hopper.StageRing`).
    PERSISTENT (a CTA folding query blocks in turn, its ring filled by a producer):
    fold_from(buf, k, v, bh, n_k, j0, j1, t0, diag0, m_i, l_i, acc, scale_log2, cnt), the
    block's tiles at ring positions from t0 on (the tiles the CTA folded before), Q_i's buffer
    released once every S_ij has landed, and the turns left running into the next block."""
    weigh_first, weigh_ahead, fold_last = mk.weigh_first, mk.weigh_ahead, mk.fold_last
    NS = mk.NS  # a thread's scores: the size of the pipelined update's weights
    KB, VB = hopper.K_BUFFERS, hopper.V_BUFFERS  # the ring's buffers
    begin, end = mk.ring.begin, mk.ring.end
    k_copied, k_landed, k_freed = mk.ring.k.copied, mk.ring.k.landed, mk.ring.k.freed
    v_copied, v_landed, v_freed = mk.ring.v.copied, mk.ring.v.landed, mk.ring.v.freed
    q_free, v_free = (mk.ring.q.free, mk.ring.v.free) if PERSISTENT else (None, None)
    load_K_j_counted, load_V_j_counted = loads.k, loads.v
    COPIES = mk.producer is None  # else a producer warpgroup fills the ring and began it
    if PERSISTENT and COPIES:
        raise ValueError("persistent CTAs fold a ring a producer fills (mk.producer)")

    @cuda.jit(device=True, inline="always")
    def fold_from(buf, k, v, bh, n_k, j0, j1, t0, diag0, m_i, l_i, acc, scale_log2, cnt):
        """Fold K_j, V_j for j0 <= j < j1 into (m_i, l_i, acc) with P_ij V_j a tile behind
        S_ij (`MicroKernel.PIPELINED`), K_j in K buffer t % KB and V_j in V buffer t % VB
        (ring position t = t0 + j - j0), each fill waited for and each buffer refilled through
        its mbarriers (`hopper.make_stage_ring`): no CTA-wide barrier, the warpgroups take
        turns at the tensor cores. K_j+1 and V_j are copied under tile j's arithmetic; K_j0
        (with Q_i) comes from the kernel. With a producer (mk.producer) the copies are its,
        and the kernel began the ring; PERSISTENT, Q_i came through its own buffer's
        mbarriers, which the kernel waited for."""
        p = cuda.local.array(NS, float32)  # P_i,j-1: the weights the next update multiplies
        if COPIES and j0 < j1:
            begin(buf)
        for j in range(j0, j1):
            t = t0 + j - j0
            key0 = j * BC
            if COPIES and j + 1 < j1:
                if t + 1 >= KB:  # K_j+1 where K_j+1-KB was, once every thread is done with it
                    k_freed(buf, (t + 1) % KB, (t + 1 - KB) // KB)
                load_K_j_counted(buf, k, bh, key0 + BC, n_k, (t + 1) % KB, cnt)
                k_copied(buf, (t + 1) % KB)
            if COPIES:
                if t >= VB:  # V_j where V_j-VB was, likewise
                    v_freed(buf, t % VB, (t - VB) // VB)
                load_V_j_counted(buf, v, bh, key0, n_k, t % VB, cnt)
                v_copied(buf, t % VB)
            # K_j (and with K_j0, Q_i, unless PERSISTENT) in shared memory
            k_landed(buf, t % KB, t // KB)
            if t == t0:  # nothing to multiply behind S_ij yet
                weigh_first(buf, min(BC, n_k - key0), key0, diag0, m_i, l_i, acc, p,
                            scale_log2, t % KB if PERSISTENT else 0, 0)
            else:
                v_landed(buf, (t - 1) % VB, (t - 1) // VB)  # V_j-1 in shared memory
                weigh_ahead(buf, min(BC, n_k - key0), key0, diag0, m_i, l_i, acc, p,
                            scale_log2, t % KB, (t - 1) % VB)
        if PERSISTENT:
            q_free(buf, 0)  # every S_ij has landed: the next Q_i may take Q_i's buffer
        if j0 < j1:
            t = t0 + j1 - 1 - j0
            v_landed(buf, t % VB, t // VB)
            fold_last(buf, acc, p, t % VB)
            if PERSISTENT:
                v_free(buf, t % VB)  # P V_j1-1 has landed: the next block's V may take it
            else:
                end()

    if PERSISTENT:
        return fold_from

    @cuda.jit(device=True, inline="always")
    def stream_kv_pipelined(buf, k, v, bh, n_k, j0, j1, diag0, m_i, l_i, acc, scale_log2,
                            cnt):
        """fold_from with the block's first tile at ring position 0: a CTA a query block."""
        fold_from(buf, k, v, bh, n_k, j0, j1, 0, diag0, m_i, l_i, acc, scale_log2, cnt)

    return stream_kv_pipelined
