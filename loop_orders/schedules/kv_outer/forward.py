"""kv_outer: FlashAttention Algorithm 1 as written. K/V blocks outer; Q, O, l, m reloaded.

    for each (batch, head):                                  # one CTA
        write O = 0, l = 0, m = -inf                         # Algorithm 1 line 2, in HBM
        for j in 0 .. Tc - 1:                                # serial: CTAs would race on O
            if no query sees block j: skip it                # (a mask)
            load K_j, V_j                                    # once per j
            for i in first_j .. end_j - 1:                   # all Tr, or those the mask shows j
                load Q_i, O_i, l_i, m_i
                online-softmax update with S_ij = Q_i K_j^T
                write O_i (normalised), l_i, m_i             # back to HBM every time
                write lse_i = m_i + log l_i                  # only with save_lse, on i's last j
        (with save_lse, a query block no K/V block shows writes lse_i = -inf at the start)

Traffic (elements, per batch x head): K, V read once per K/V block some query sees (N_k
(d + dv) without a window); initialisation writes N_q (dv + 2). Every visited (j, i) reads Q_i,
O_i, l_i, m_i and writes O_i, l_i, m_i, so with R = sum_j (rows of the query blocks j visits) =
Tc N_q without a mask, Q reads are R d, O reads R dv and writes R dv, l and m R each way. With
Bc = M/(4d) this is Theta(N^2 d^2 / M).

HBM holds m_i in the kernel's log2 units (log2(e) times the max scaled score), so the exp2
update never converts it and a reloaded m_i is bit-identical to the stored one.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
from numba import float32, int64

from ...core.ledger import Ledger, slot
from ...core.schedule import Problem, ceil_div, register, rows, sees
from ...device.runtime import (
    SHARED_F32,
    cuda,
    inlined,
    kernel_factory,
    kernel_options,
)
from ...microkernel.cuda_cores import MicroKernelSchedule, Unroll, micro_kernel
from ...microkernel.hopper import buffer_align
from ...microkernel.tiles import (
    counter_slots,
    counts_flusher,
    make_kv_blocks,
    make_kv_head,
    make_lse_of,
    make_q_blocks,
    zero_counts,
)

# Chunks per trip of the micro-kernel's hot loops: 1. This loop nest keeps more values live
# across the update than q_outer's (the i loop inside the j loop, the l, m and O pointers),
# and at 2 ptxas spills 88 bytes at d = 64 (measured: results/tuning_history/kv_outer.md).
UNROLL = Unroll.by(1)

(Q_R, K_R, V_R, O_R, O_W, L_R, L_W, M_R, M_W, LSE_W) = (
    slot("q", "read"), slot("k", "read"), slot("v", "read"), slot("o", "read"),
    slot("o", "write"), slot("l", "read"), slot("l", "write"), slot("m", "read"),
    slot("m", "write"), slot("lse", "write"))


def _make_load_stats(NT, ROWS, STATS, COUNT):
    """load_stats(buf, l_hbm, m_hbm, bh, row0, n_rows, cnt): l_i, m_i of the block's rows
    into the stats rows, thread t taking row t, counted."""

    @inlined
    def load_stats(buf, l_hbm, m_hbm, bh, row0, n_rows, cnt):
        for r in range(cuda.threadIdx.x, n_rows, NT):
            # l_i, m_i: reloaded from HBM for every K/V block
            buf[STATS + r] = l_hbm[bh, row0 + r]
            buf[STATS + ROWS + r] = m_hbm[bh, row0 + r]
            if COUNT:
                cnt[L_R] += 1
                cnt[M_R] += 1

    return load_stats


@kernel_factory
def make_kernel(BR, BC, D, DV, MK, MASK, SAVE_LSE, COUNT, GROUP):
    mk = micro_kernel(BR, BC, D, DV, MK, MASK, True, UNROLL)
    ALIGN = buffer_align(MK)  # as the micro-kernel's views of the buffer
    MASKED = MASK.bounded
    lse_of = make_lse_of(MASKED)  # -inf for a row that saw no key
    kv_blocks, q_blocks = make_kv_blocks(BC, MASK), make_q_blocks(BR, MASK)
    NT, RM, NACC = mk.NT, mk.RM, mk.NACC
    ROWS, STATS = mk.ROWS, mk.STATS
    # Numba compiles closure variables as constants: take the device functions by name
    clear, online_update, row_sums = mk.clear, mk.online_update, mk.row_sums
    reciprocal, give_o, take_o, keep_stats = mk.reciprocal, mk.give_o, mk.take_o, mk.keep_stats
    load_Q_i, load_K_j, load_V_j, wait_loads = mk.load_q, mk.load_k, mk.load_v, mk.wait_loads
    load_O_i, store_O_i = mk.load_o, mk.store_o
    flush_counts = counts_flusher()
    NCNT = counter_slots(COUNT)

    load_stats = _make_load_stats(NT, ROWS, STATS, COUNT)
    @inlined
    def store_stats(buf, l_hbm, m_hbm, lse, bh, row0, n_rows, last, cnt):
        """l_i, m_i of the block's rows back to HBM from the stats rows; lse_i once final."""
        for r in range(cuda.threadIdx.x, n_rows, NT):
            l_r = buf[STATS + r]
            m_r = buf[STATS + ROWS + r]
            # l_i, m_i: written back to HBM after every K/V block
            l_hbm[bh, row0 + r] = l_r
            m_hbm[bh, row0 + r] = m_r
            if COUNT:
                cnt[L_W] += 1
                cnt[M_W] += 1
            if last:
                # lse_i: the statistic the backward pass needs, once i is final
                lse[bh, row0 + r] = lse_of(m_r, l_r)
                if COUNT:
                    cnt[LSE_W] += 1
    kv_head = make_kv_head(GROUP)

    @cuda.jit(**kernel_options(NT, MK.registers(BC, DV, reload=True)))
    def kv_outer(q, k, v, o, l_hbm, m_hbm, lse, counts, scale_log2):
        bh = cuda.blockIdx.x
        kv = kv_head(bh)  # query head bh's K/V head (grouped-query attention)
        n_q = q.shape[1]
        n_k = k.shape[1]
        T_r = (n_q + BR - 1) // BR
        T_c = (n_k + BC - 1) // BC

        buf = cuda.shared.array(0, SHARED_F32, alignment=ALIGN)  # all tiles
        acc = cuda.local.array(NACC, float32)  # this thread's part of O_i, unnormalised
        m_i = cuda.local.array(RM, float32)
        l_i = cuda.local.array(RM, float32)  # this thread's partial sums of its rows
        l_row = cuda.local.array(RM, float32)
        inv_l = cuda.local.array(RM, float32)
        cnt = cuda.local.array(NCNT, int64)
        if COUNT:
            zero_counts(cnt)
        clear(buf)  # padding stays zero; the O_i stage starts as O = 0, l = 0, m = -inf
        cuda.syncthreads()  # the buffer is clear (by other threads) before m_i's rows are set
        for r in range(cuda.threadIdx.x, ROWS, NT):
            buf[STATS + ROWS + r] = float32(-math.inf)
        cuda.syncthreads()  # the initial O_i, l_i, m_i are in shared memory
        # Algorithm 1 line 2: O = 0, l = 0, m = -inf, initialised in HBM
        for i in range(T_r):
            n_rows = min(BR, n_q - i * BR)
            moved = store_O_i(buf, o, bh, i * BR, n_rows)
            if COUNT:
                cnt[O_W] += moved
            # masked, a query block no K/V block shows is final now: lse_i = -inf
            unseen = False
            if MASKED:
                j0, j1 = kv_blocks(i * BR, n_rows, n_q, n_k)
                unseen = j0 >= j1
            store_stats(buf, l_hbm, m_hbm, lse, bh, i * BR, n_rows, SAVE_LSE and unseen, cnt)

        for j in range(T_c):
            key0 = j * BC
            bc = min(BC, n_k - key0)
            i0, i1 = q_blocks(key0, bc, n_q, n_k)  # the query blocks that see block j
            if MASKED and i0 >= i1:
                continue  # no query sees a key of block j: K_j, V_j are not loaded
            cuda.syncthreads()  # every thread is done with the previous K_j, V_j
            # K_j, V_j: read from HBM once, stay in shared memory for all i
            moved_k = load_K_j(buf, k, kv, key0, bc, 0)
            moved_v = load_V_j(buf, v, kv, key0, bc, 0)
            if COUNT:
                cnt[K_R] += moved_k
                cnt[V_R] += moved_v
            for i in range(i0, i1):
                row0 = i * BR
                n_rows = min(BR, n_q - row0)
                cuda.syncthreads()  # every thread is done with the last step's Q_i, O_i, l, m
                # Q_i, O_i, l_i, m_i: reloaded from HBM for every K/V block
                moved_q = load_Q_i(buf, q, bh, row0, n_rows, scale_log2)
                moved_o = load_O_i(buf, o, bh, row0, n_rows)
                load_stats(buf, l_hbm, m_hbm, bh, row0, n_rows, cnt)
                if COUNT:
                    cnt[Q_R] += moved_q
                    cnt[O_R] += moved_o
                wait_loads()
                cuda.syncthreads()  # K_j, V_j, Q_i, O_i, l_i and m_i are in shared memory
                take_o(buf, acc, l_i, l_row, m_i)
                cuda.syncthreads()  # every thread has taken its O_i: P_ij may overwrite the stage
                # the first row's diagonal key (bottom-right aligned)
                online_update(buf, bc, key0, row0 + n_k - n_q, m_i, l_i, acc, scale_log2, 0)
                row_sums(buf, l_i, l_row)
                reciprocal(l_row, inv_l)
                give_o(buf, acc, inv_l)  # normalised, as Algorithm 1 stores O_i
                keep_stats(buf, l_row, m_i)
                cuda.syncthreads()  # O_i, l_i, m_i are complete in shared memory
                # O_i: written back to HBM after every K/V block, normalised
                moved_o = store_O_i(buf, o, bh, row0, n_rows)
                if COUNT:
                    cnt[O_W] += moved_o
                last_j = kv_blocks(row0, n_rows, n_q, n_k)[1] - 1  # i's last K/V block
                store_stats(buf, l_hbm, m_hbm, lse, bh, row0, n_rows,
                            SAVE_LSE and j == last_j, cnt)
        if COUNT:
            flush_counts(cnt, counts)

    return kv_outer


@register
class KVOuter(MicroKernelSchedule):
    name = "kv_outer"
    BACKWARD = "kv_outer"
    RELOAD = True
    TENSOR_CORES = True
    make_kernel = staticmethod(make_kernel)
    summary = "FlashAttention Algorithm 1: K/V block resident, Q/O/l/m reloaded; one CTA per head"
    EXPECTED_SLOPES = {"m": -1, "n": 2, "d": 2}
    TRAFFIC_CLASS = "flash"
    # The seed explainer's example: initialisation writes O, l, m (12 + 6 + 6); K, V once
    # (12 + 12); each of the Tc = 3 K/V blocks reloads and rewrites all 6 rows: Q 36, O 36 + 36,
    # l and m 18 + 18 each.
    WORKED_EXAMPLE = ({"n_q": 6, "d": 2, "block_q": 2, "block_k": 2}, 228)
    LOOP_NEST = """
        for (b, h) in parallel:               # one CTA per head
            write O = 0, l = 0, m = -inf      # HBM initialisation (Algorithm 1, line 2)
            for j in range(Tc):               # serial inside the CTA
                load K_j, V_j                 # HBM -> shared, once
                for i in range(first_j, end_j):   # all Tr, or the query blocks that see j
                    load Q_i, O_i, l_i, m_i   # HBM -> shared memory, per K/V block
                    S_ij = Q_i K_j^T * scale
                    m_new = max(m_i, rowmax(S_ij))
                    P_ij = exp(S_ij - m_new)
                    l_new = exp(m_i - m_new) l_i + rowsum(P_ij)
                    O_i = (l_i exp(m_i - m_new) O_i + P_ij V_j) / l_new
                    write O_i, l_i = l_new, m_i = m_new   # registers -> HBM, per K/V block
                    write lse_i = m_i + log(l_i)          # with save_lse, on i's last j
    """

    def model(self, p: Problem) -> Ledger:
        # Rows reloaded per K/V block j: the query rows of blocks first_j .. end_j - 1; K_j,
        # V_j read where that range is not empty.
        rows_visited = int(p.visiting_rows().sum())
        first, end = p.q_block_ranges()
        keys = int(p.key_block_rows()[end > first].sum())
        per_head = {
            "q": {"read": rows_visited * p.d},
            "k": {"read": keys * p.d},
            "v": {"read": keys * p.dv},
            "o": {"read": rows_visited * p.dv, "write": (p.n_q + rows_visited) * p.dv},
            "l": {"read": rows_visited, "write": p.n_q + rows_visited},
            "m": {"read": rows_visited, "write": p.n_q + rows_visited},
            "lse": {"write": p.n_q if p.save_lse else 0},
        }
        return self.ledger(per_head, p.bh)

    def walk(self, p: Problem) -> Counter:
        c = Counter()
        c["o", "write"] += p.n_q * p.dv
        c["l", "write"] += p.n_q
        c["m", "write"] += p.n_q
        for j in range(0, p.n_k, p.block_k):
            keys = rows(j, p.block_k, p.n_k)
            if not sees(p, range(p.n_q), keys):
                continue  # no query sees block j
            c["k", "read"] += len(keys) * p.d
            c["v", "read"] += len(keys) * p.dv
            for i in range(0, p.n_q, p.block_q):
                queries = rows(i, p.block_q, p.n_q)
                if not sees(p, queries, keys):
                    continue
                for tensor, width in (("q", p.d), ("o", p.dv), ("l", 1), ("m", 1)):
                    c[tensor, "read"] += len(queries) * width
                for tensor, width in (("o", p.dv), ("l", 1), ("m", 1)):
                    c[tensor, "write"] += len(queries) * width
        if p.save_lse:
            c["lse", "write"] += p.n_q
        return c

    def workspace_bytes(self, p: Problem) -> int:
        # l and m: one float32 each per query row, kept in HBM between K/V blocks.
        return 2 * p.bh * p.n_q * 4

    def ctas(self, p: Problem) -> int:
        return p.bh  # one CTA per head: the j loop is serial inside it

    def output_roundings(self, p: Problem) -> int:
        # O_i is stored in the input dtype after every K/V block that visits it.
        return int(p.visible_kv_blocks().max()) + self.p_roundings(p)

    def tiles_for_sram(self, m: int, d: int) -> tuple[int, int]:
        # Algorithm 1, line 1: Bc = ceil(M / 4d), Br = min(ceil(M / 4d), d).
        bc = ceil_div(m, 4 * d)
        return min(bc, d), bc

    def allocate_workspace(self, p: Problem, empty=None) -> tuple:
        from ...device.runtime import device_empty

        empty = empty or device_empty
        return empty((p.bh, p.n_q), np.float32), empty((p.bh, p.n_q), np.float32)

    def launch(self, p, q, k, v, out, lse, counts, *, scale, count, workspace=None):
        l_hbm, m_hbm = workspace or self.allocate_workspace(p)
        self.launch_kernel(p, p.bh, count, scale, q, k, v, out, l_hbm, m_hbm, lse, counts)
