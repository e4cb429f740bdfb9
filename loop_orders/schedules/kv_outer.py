"""kv_outer: FlashAttention Algorithm 1 as written. K/V blocks outer; Q, O, l, m reloaded.

    for each (batch, head):                                  # one CTA
        write O = 0, l = 0, m = -inf                         # Algorithm 1 line 2, in HBM
        for j in 0 .. Tc - 1:                                # serial: CTAs would race on O
            load K_j, V_j                                    # once per j
            for i in i0_j .. Tr - 1:                         # i0_j = 0, or the diagonal when causal
                load Q_i, O_i, l_i, m_i
                online-softmax update with S_ij = Q_i K_j^T
                write O_i (normalised), l_i, m_i             # back to HBM every time
                write lse_i = m_i + log l_i                  # only with save_lse, on i's last j

Traffic (elements, per batch x head): K, V read once (N_k (d + dv)); initialisation writes
N_q (dv + 2). Every visited (j, i) reads Q_i, O_i, l_i, m_i and writes O_i, l_i, m_i, so with
R = sum_j (rows of the query blocks j visits) = Tc N_q without a mask, Q reads are R d, O reads
R dv and writes R dv, l and m R each way. With Bc = M/(4d) this is Theta(N^2 d^2 / M).

HBM holds m_i in the kernel's log2 units (log2(e) times the max scaled score), so the exp2
update never converts it and a reloaded m_i is bit-identical to the stored one.
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np
from numba import float32, int64

from ..ledger import Ledger, slot
from ..microkernel import (
    Layout,
    make_online_update,
    make_row_io,
    share_from_part0,
    thread_layout,
)
from ..runtime import SHARED_ALIGN, cuda, kernel_options
from ..schedule import Problem, Schedule, ceil_div, register
from ..tiles import LN2, counter_slots, flush_counts, make_tile_loader, zero_counts

(Q_R, K_R, V_R, O_R, O_W, L_R, L_W, M_R, M_W, LSE_W) = (
    slot("q", "read"), slot("k", "read"), slot("v", "read"), slot("o", "read"),
    slot("o", "write"), slot("l", "read"), slot("l", "write"), slot("m", "read"),
    slot("m", "write"), slot("lse", "write"))


def stage_rows(block_q: int, d: int, dv: int) -> int:
    """Rows of the shared stage through which Q_i and O_i move: 8 KB of it, at most Br."""
    return max(1, min(block_q, 2048 // max(d, dv)))


@cache
def make_kernel(BR, BC, D, DV, RPT, TPR, CAUSAL, SAVE_LSE, COUNT):  # noqa: N803 - paper's names
    layout = Layout(RPT, TPR)
    NT = layout.threads(BR)  # noqa: N806 - threads per CTA
    RS = BR // RPT  # noqa: N806 - a thread's rows are RS apart
    DP, DVP = D // TPR, DV // TPR  # noqa: N806 - head dims per thread and row
    NQ, NACC = RPT * DP, RPT * DVP  # noqa: N806 - registers for the thread's q and acc
    SC, SW = stage_rows(BR, D, DV), max(D, DV)  # noqa: N806 - the stage's rows and width
    online_update = make_online_update(D, DV, RPT, RS, TPR, CAUSAL)
    load_q, load_o, store_o = make_row_io(BR, D, DV, RPT, TPR, SC)
    load_K_j = make_tile_loader(BC, D, NT)  # noqa: N806
    load_V_j = make_tile_loader(BC, DV, NT)  # noqa: N806
    NCNT = counter_slots(COUNT)  # noqa: N806

    @cuda.jit(device=True, inline="always")
    def init_stats(l_hbm, m_hbm, bh, row, part, cnt):
        """l = 0 and m = -inf for one row, by its part 0. Each row's l and m are only ever
        touched by its own part 0, in program order, so no barrier guards them."""
        if row < l_hbm.shape[1] and part == 0:
            l_hbm[bh, row] = float32(0.0)
            m_hbm[bh, row] = float32(-math.inf)
            if COUNT:
                cnt[L_W] += 1
                cnt[M_W] += 1

    @cuda.jit(device=True, inline="always")
    def load_stats(m_i, l_i, r, l_hbm, m_hbm, bh, row, part, cnt):
        """Row r's l_i, m_i from HBM (0 and -inf for a spare row past N_q, which computes
        on them and touches no HBM). Part 0 loads them; the other parts get them by shuffle."""
        l_i[r] = float32(0.0)
        m_i[r] = float32(-math.inf)
        if row < l_hbm.shape[1] and part == 0:
            # l_i, m_i: reloaded from HBM for every K/V block
            l_i[r] = l_hbm[bh, row]
            m_i[r] = m_hbm[bh, row]
            if COUNT:
                cnt[L_R] += 1
                cnt[M_R] += 1
        l_i[r] = share_from_part0(l_i[r], TPR)
        m_i[r] = share_from_part0(m_i[r], TPR)

    @cuda.jit(device=True, inline="always")
    def store_stats(l_hbm, m_hbm, lse, m_i, l_i, r, bh, row, part, last, cnt):
        """Row r's l_i, m_i back to HBM (by part 0), and lse_i once i is final."""
        if row < l_hbm.shape[1] and part == 0:
            # l_i, m_i: written back to HBM after every K/V block
            l_hbm[bh, row] = l_i[r]
            m_hbm[bh, row] = m_i[r]
            if COUNT:
                cnt[L_W] += 1
                cnt[M_W] += 1
            if last:
                # lse_i: the statistic the backward pass needs, once i is final
                lse[bh, row] = (m_i[r] + math.log2(l_i[r])) * float32(LN2)
                if COUNT:
                    cnt[LSE_W] += 1

    @cuda.jit(**kernel_options(NT, layout.registers(D, DV)))
    def kv_outer(q, k, v, o, l_hbm, m_hbm, lse, counts, scale_log2):
        bh = cuda.blockIdx.x
        t = cuda.threadIdx.x
        part = t % TPR
        slot = t // TPR  # this thread's rows of query block i: i Br + slot + r RS, r < RPT
        n_q = q.shape[1]
        n_k = k.shape[1]
        T_r = (n_q + BR - 1) // BR  # noqa: N806
        T_c = (n_k + BC - 1) // BC  # noqa: N806

        K_j = cuda.shared.array((BC, D), float32, alignment=SHARED_ALIGN)  # noqa: N806
        V_j = cuda.shared.array((BC, DV), float32, alignment=SHARED_ALIGN)  # noqa: N806
        stage = cuda.shared.array((SC, SW), float32, alignment=SHARED_ALIGN)  # Q_i, O_i pass
        Q_i = cuda.local.array(NQ, float32)  # noqa: N806 - this thread's slices of rows
        acc = cuda.local.array(NACC, float32)  # their slices of O_i, unnormalised (l_i O_i)
        m_i = cuda.local.array(RPT, float32)
        l_i = cuda.local.array(RPT, float32)
        cnt = cuda.local.array(NCNT, int64)
        if COUNT:
            zero_counts(cnt)

        # Algorithm 1 line 2: O = 0, l = 0, m = -inf, initialised in HBM (with acc = 0 and
        # l = 1, store_o writes O = acc / l = 0).
        for y in range(NACC):
            acc[y] = float32(0.0)
        for r in range(RPT):
            l_i[r] = float32(1.0)
        for i in range(T_r):
            moved = store_o(o, stage, acc, bh, i * BR, i * BR + slot, part, l_i)
            if COUNT:
                cnt[O_W] += moved
            for r in range(RPT):
                init_stats(l_hbm, m_hbm, bh, i * BR + slot + r * RS, part, cnt)

        for j in range(T_c):
            key0 = j * BC
            bc = min(BC, n_k - key0)
            cuda.syncthreads()  # every row is done with the previous K_j, V_j
            # K_j, V_j: read from HBM once, stay in shared memory for all i
            moved_k = load_K_j(K_j, k, bh, key0, bc, 0, D)
            moved_v = load_V_j(V_j, v, bh, key0, bc, 0, DV)
            if COUNT:
                cnt[K_R] += moved_k
                cnt[V_R] += moved_v
            cuda.syncthreads()  # K_j, V_j are in shared memory for all rows

            i0 = key0 // BR if CAUSAL else 0  # earlier query blocks see no key of block j
            for i in range(i0, T_r):
                row0 = i * BR + slot
                for y in range(NQ):
                    Q_i[y] = float32(0.0)  # spare rows past N_q compute on zeros
                for r in range(RPT):
                    load_stats(m_i, l_i, r, l_hbm, m_hbm, bh, row0 + r * RS, part, cnt)
                # Q_i, O_i: reloaded from HBM for every K/V block (staged, coalesced)
                moved_q = load_q(Q_i, stage, q, bh, i * BR, row0, part)
                moved_o = load_o(acc, stage, o, bh, i * BR, row0, part, l_i)
                if COUNT:
                    cnt[Q_R] += moved_q
                    cnt[O_R] += moved_o
                online_update(Q_i, K_j, V_j, bc, key0, row0, part, scale_log2, m_i, l_i,
                              acc)
                # O_i: written back to HBM after every K/V block, normalised
                moved_o = store_o(o, stage, acc, bh, i * BR, row0, part, l_i)
                if COUNT:
                    cnt[O_W] += moved_o
                last_j = T_c - 1
                if CAUSAL:
                    last_j = min(last_j, (min((i + 1) * BR, n_q) - 1) // BC)
                for r in range(RPT):
                    store_stats(l_hbm, m_hbm, lse, m_i, l_i, r, bh, row0 + r * RS, part,
                                SAVE_LSE and j == last_j, cnt)
        if COUNT:
            flush_counts(cnt, counts)

    return kv_outer


@register
class KVOuter(Schedule):
    name = "kv_outer"
    summary = "FlashAttention Algorithm 1: K/V block resident, Q/O/l/m reloaded; one CTA per head"
    LOOP_NEST = """
        for (b, h) in parallel:               # one CTA per head
            write O = 0, l = 0, m = -inf      # HBM initialisation (Algorithm 1, line 2)
            for j in range(Tc):               # serial inside the CTA
                load K_j, V_j                 # HBM -> shared, once
                for i in range(i0_j, Tr):     # i0_j = 0, or the diagonal block when causal
                    load Q_i, O_i, l_i, m_i   # HBM -> registers, per K/V block
                    S_ij = Q_i K_j^T * scale
                    m_new = max(m_i, rowmax(S_ij))
                    P_ij = exp(S_ij - m_new)
                    l_new = exp(m_i - m_new) l_i + rowsum(P_ij)
                    O_i = (l_i exp(m_i - m_new) O_i + P_ij V_j) / l_new
                    write O_i, l_i = l_new, m_i = m_new   # registers -> HBM, per K/V block
                    write lse_i = m_i + log(l_i)          # with save_lse, on i's last j
    """

    def model(self, p: Problem) -> Ledger:
        # Rows reloaded per K/V block j: all query rows from block i0_j on.
        rows_visited = int((p.n_q - p.first_visible_q_block() * p.block_q).sum())
        per_head = {
            "q": {"read": rows_visited * p.d},
            "k": {"read": p.n_k * p.d},
            "v": {"read": p.n_k * p.dv},
            "o": {"read": rows_visited * p.dv, "write": (p.n_q + rows_visited) * p.dv},
            "l": {"read": rows_visited, "write": p.n_q + rows_visited},
            "m": {"read": rows_visited, "write": p.n_q + rows_visited},
            "lse": {"write": p.n_q if p.save_lse else 0},
        }
        return Ledger(per_head).scaled(p.bh)

    def workspace_bytes(self, p: Problem) -> int:
        # l and m: one float32 each per query row, kept in HBM between K/V blocks.
        return 2 * p.bh * p.n_q * 4

    def output_roundings(self, p: Problem) -> int:
        # O_i is stored in the input dtype after every K/V block that visits it.
        return int(p.visible_kv_blocks().max())

    def tiles_for_sram(self, m: int, d: int) -> tuple[int, int]:
        # Algorithm 1, line 1: Bc = ceil(M / 4d), Br = min(ceil(M / 4d), d).
        bc = ceil_div(m, 4 * d)
        return min(bc, d), bc

    def shared_bytes(self, p: Problem, count: bool) -> int:
        stage = stage_rows(p.block_q, p.d, p.dv) * max(p.d, p.dv)
        return 4 * (p.block_k * (p.d + p.dv) + stage) + (8 * counter_slots(True) if count else 0)

    def allocate_workspace(self, p: Problem) -> tuple:
        from ..runtime import device_empty

        return device_empty((p.bh, p.n_q), np.float32), device_empty((p.bh, p.n_q), np.float32)

    def kernels(self, p: Problem, count: bool) -> list:
        rpt, tpr = thread_layout(p.d, p.dv, p.block_q)
        return [make_kernel(p.block_q, p.block_k, p.d, p.dv, rpt, tpr, p.causal, p.save_lse,
                            count)]

    def launch(self, p, q, k, v, out, lse, counts, *, scale, count, workspace=None):
        l_hbm, m_hbm = workspace or self.allocate_workspace(p)
        threads = thread_layout(p.d, p.dv, p.block_q).threads(p.block_q)
        (kernel,) = self.kernels(p, count)
        kernel[p.bh, threads](q, k, v, out, l_hbm, m_hbm, lse, counts,
                              np.float32(scale * math.log2(math.e)))
