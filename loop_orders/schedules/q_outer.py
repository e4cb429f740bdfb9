"""q_outer: the FlashAttention-2 forward order. A query block and its accumulator stay on chip.

    for each (batch, head), query block i in parallel       # one CTA each
        load Q_i                                             # once
        m_i = -inf, l_i = 0, acc_i = 0                       # registers
        for j in 0 .. c_i - 1:                               # c_i = Tc, or fewer when causal
            load K_j, V_j                                    # every query block reloads them
            online-softmax update of (m_i, l_i, acc_i) with S_ij = Q_i K_j^T
        write O_i = acc_i / l_i                              # once
        write lse_i = m_i + log l_i                          # only with save_lse

Traffic (elements, per batch x head): Q is read once (N_q d) and O written once (N_q dv).
Each query block reads the K/V rows it visits: sum_i min(c_i Bc, N_k) (d + dv), which is
Tr N_k (d + dv) without a mask. With Br = M/(4d) rows resident this is Theta(N^2 d^2 / M).
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np
from numba import float32, int64

from ..ledger import Ledger, slot
from ..microkernel import Layout, make_online_update, make_row_io, thread_layout
from ..runtime import SHARED_ALIGN, cuda, kernel_options
from ..schedule import Problem, Schedule, ceil_div, register
from ..tiles import (
    LN2,
    counter_slots,
    flush_counts,
    make_tile_loader,
    make_tile_prefetcher,
    zero_counts,
)

PREFETCH_REGISTERS = 16  # registers per thread that may hold the next K/V tile in flight

Q_R, K_R, V_R, O_W, LSE_W = (slot("q", "read"), slot("k", "read"), slot("v", "read"),
                             slot("o", "write"), slot("lse", "write"))


@cache
def make_kernel(BR, BC, D, DV, RPT, TPR, CAUSAL, SAVE_LSE, COUNT):  # noqa: N803 - paper's names
    layout = Layout(RPT, TPR)
    NT = layout.threads(BR)  # noqa: N806 - threads per CTA
    RS = BR // RPT  # noqa: N806 - a thread's rows are RS apart
    DP, DVP = D // TPR, DV // TPR  # noqa: N806 - head dims per thread and row
    NQ, NACC = RPT * DP, RPT * DVP  # noqa: N806 - registers for the thread's q and acc
    online_update = make_online_update(D, DV, RPT, RS, TPR, CAUSAL)
    load_q, _, store_o = make_row_io(BR, D, DV, RPT, TPR, BC)  # staged through K_j, V_j
    fetch_K, put_K, PK = make_tile_prefetcher(BC, D, NT)  # noqa: N806
    fetch_V, put_V, PV = make_tile_prefetcher(BC, DV, NT)  # noqa: N806
    # Fetch K_j+1, V_j+1 during block j's compute when the registers they hold meanwhile
    # fit beside q and acc without spilling (checked with ptxas); else load K_j, V_j in turn.
    PREFETCH = PK + PV <= PREFETCH_REGISTERS  # noqa: N806
    load_K_j = make_tile_loader(BC, D, NT)  # noqa: N806
    load_V_j = make_tile_loader(BC, DV, NT)  # noqa: N806
    NCNT = counter_slots(COUNT)  # noqa: N806

    @cuda.jit(**kernel_options(NT, layout.registers(D, DV)))
    def q_outer(q, k, v, o, lse, counts, scale_log2):
        i = cuda.blockIdx.x
        bh = cuda.blockIdx.y
        t = cuda.threadIdx.x
        part = t % TPR
        n_q = q.shape[1]
        n_k = k.shape[1]
        row0 = i * BR + t // TPR  # this thread's rows: row0 + r RS, r < RPT

        K_j = cuda.shared.array((BC, D), float32, alignment=SHARED_ALIGN)  # noqa: N806
        V_j = cuda.shared.array((BC, DV), float32, alignment=SHARED_ALIGN)  # noqa: N806
        Q_i = cuda.local.array(NQ, float32)  # noqa: N806 - this thread's slices of rows
        acc = cuda.local.array(NACC, float32)
        K_next = cuda.local.array(PK, float32)  # noqa: N806 - this thread's share of K_j+1
        V_next = cuda.local.array(PV, float32)  # noqa: N806
        m_i = cuda.local.array(RPT, float32)
        l_i = cuda.local.array(RPT, float32)
        cnt = cuda.local.array(NCNT, int64)
        if COUNT:
            zero_counts(cnt)

        for y in range(NQ):
            Q_i[y] = float32(0.0)  # rows past N_q compute on zeros and write nothing
        for y in range(NACC):
            acc[y] = float32(0.0)
        for r in range(RPT):
            m_i[r] = float32(-math.inf)
            l_i[r] = float32(0.0)
        # Q_i: read from HBM once (staged through K_j), stays in registers for every K/V block
        moved = load_q(Q_i, K_j, q, bh, i * BR, row0, part)
        if COUNT:
            cnt[Q_R] += moved

        last_query = min((i + 1) * BR, n_q) - 1
        c_i = (n_k + BC - 1) // BC
        if CAUSAL:
            c_i = min(c_i, last_query // BC + 1)  # later K/V blocks are all masked
        # K_j, V_j: reloaded from HBM by every query block (K_0, V_0 fetched here)
        moved_k = fetch_K(K_next, k, bh, 0, min(BC, n_k)) if PREFETCH else 0
        moved_v = fetch_V(V_next, v, bh, 0, min(BC, n_k)) if PREFETCH else 0
        for j in range(c_i):
            key0 = j * BC
            bc = min(BC, n_k - key0)
            cuda.syncthreads()  # every row is done with the previous K_j, V_j
            if PREFETCH:
                put_K(K_j, K_next, bc)  # waits for the loads fetched during block j - 1
                put_V(V_j, V_next, bc)
            else:
                moved_k = load_K_j(K_j, k, bh, key0, bc, 0, D)
                moved_v = load_V_j(V_j, v, bh, key0, bc, 0, DV)
            if COUNT:
                cnt[K_R] += moved_k
                cnt[V_R] += moved_v
            cuda.syncthreads()  # K_j, V_j are in shared memory for all rows
            if PREFETCH and j + 1 < c_i:
                # K_j+1, V_j+1: loads issued now, awaited only at the next put, so their
                # HBM latency overlaps this block's compute
                bc_next = min(BC, n_k - key0 - BC)
                moved_k = fetch_K(K_next, k, bh, key0 + BC, bc_next)
                moved_v = fetch_V(V_next, v, bh, key0 + BC, bc_next)
            online_update(Q_i, K_j, V_j, bc, key0, row0, part, scale_log2, m_i, l_i, acc)

        # O_i: written to HBM once, normalised (staged through V_j)
        moved = store_o(o, V_j, acc, bh, i * BR, row0, part, l_i)
        if COUNT:
            cnt[O_W] += moved
        if SAVE_LSE and part == 0:
            for r in range(RPT):
                row = row0 + r * RS
                if row < n_q:
                    # lse_i: the row statistic the backward pass needs, written once
                    lse[bh, row] = (m_i[r] + math.log2(l_i[r])) * float32(LN2)
                    if COUNT:
                        cnt[LSE_W] += 1
        if COUNT:
            flush_counts(cnt, counts)

    return q_outer


@register
class QOuter(Schedule):
    name = "q_outer"
    summary = "FlashAttention-2 order: Q block resident, K/V streamed; one CTA per query block"
    LOOP_NEST = """
        for (b, h, i) in parallel:            # one CTA per query block
            load Q_i                          # HBM -> registers, once
            m_i, l_i, acc_i = -inf, 0, 0
            for j in range(c_i):              # c_i = Tc, or up to the diagonal when causal
                load K_j, V_j                 # HBM -> shared, per query block
                S_ij = Q_i K_j^T * scale
                m_new = max(m_i, rowmax(S_ij))
                P_ij = exp(S_ij - m_new)
                l_i = exp(m_i - m_new) l_i + rowsum(P_ij)
                acc_i = exp(m_i - m_new) acc_i + P_ij V_j
                m_i = m_new
            write O_i = acc_i / l_i           # registers -> HBM, once
            write lse_i = m_i + log(l_i)      # only with save_lse
    """

    def model(self, p: Problem) -> Ledger:
        keys_read = int(np.minimum(p.visible_kv_blocks() * p.block_k, p.n_k).sum())
        per_head = {
            "q": {"read": p.n_q * p.d},
            "k": {"read": keys_read * p.d},
            "v": {"read": keys_read * p.dv},
            "o": {"write": p.n_q * p.dv},
            "lse": {"write": p.n_q if p.save_lse else 0},
        }
        return Ledger(per_head).scaled(p.bh)

    def workspace_bytes(self, p: Problem) -> int:
        return 0  # m_i, l_i and the accumulator live in registers only

    def tiles_for_sram(self, m: int, d: int) -> tuple[int, int]:
        # Algorithm 1's sizes with the roles swapped: the resident query block is the large one.
        big = ceil_div(m, 4 * d)
        return big, min(big, d)

    def shared_bytes(self, p: Problem, count: bool) -> int:
        return 4 * p.block_k * (p.d + p.dv) + (8 * counter_slots(True) if count else 0)

    def kernels(self, p: Problem, count: bool) -> list:
        rpt, tpr = thread_layout(p.d, p.dv, p.block_q)
        return [make_kernel(p.block_q, p.block_k, p.d, p.dv, rpt, tpr, p.causal, p.save_lse,
                            count)]

    def launch(self, p, q, k, v, out, lse, counts, *, scale, count, workspace=None):
        threads = thread_layout(p.d, p.dv, p.block_q).threads(p.block_q)
        (kernel,) = self.kernels(p, count)
        kernel[(p.tr, p.bh), threads](q, k, v, out, lse, counts,
                                      np.float32(scale * math.log2(math.e)))
