"""kv_outer's backward: FlashAttention Algorithm 4 as written. One CTA per (batch, head); the
K/V blocks are the outer loop, so dQ_i is read, updated and written back in HBM for every
(j, i), race-free because the j loop is serial inside the CTA.

    for each (batch, head):                                   # one CTA
        write dQ = 0, dK = 0, dV = 0                          # Algorithm 4 line 4, in HBM
        for j in 0 .. Tc - 1:
            load K_j, V_j;  dK_j, dV_j = 0                    # on chip (lines 6-7)
            for i in first_j .. end_j - 1:                    # the query blocks that see j
                load Q_i, O_i, dO_i, dQ_i, l_i, m_i           # line 8
                P = exp(tau Q_i K_j^T - m_i) / l_i            # lines 9-13, m_i in log2 units
                dV_j += P^T dO_i;  dP = dO_i V_j^T;  D_i = rowsum(dO_i o O_i)
                dS = P o (dP - D_i)
                dQ_i += tau dS K_j;  write dQ_i               # lines 21-22, back to HBM
                dK_j += tau dS^T Q_i
            write dK_j, dV_j                                  # line 24

Traffic (elements, per batch x head; R = sum over K/V blocks j of the query rows that see
block j, Tc N_q without a mask): initialisation writes dQ N_q d, dK N_k d, dV N_k dv; K, V are
read once per K/V block some query sees (N_k (d + dv) without a window; the others are
skipped); every visited (j, i) reads Q R d, O R dv, dO R dv, dQ R d, l R, m R and writes dQ
R d; dK, dV are written once more at the end of each j not skipped (N_k (d + dv)). With
Bc = M / (4d) this is Theta(N^2 d^2 / M) (Theorem 5). dQ is stored in the input dtype after
every visit, so with float16 inputs it is rounded Tc times (`output_roundings`).
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
from numba import float32, int64

from ...core.ledger import Ledger, slot
from ...core.schedule import Kernel, Problem, ceil_div, register, rows, sees
from ...device.runtime import (
    SHARED_ALIGN,
    SHARED_F32,
    SIMULATOR,
    cuda,
    dynamic_shared_limit,
    inlined,
    kernel_factory,
    kernel_options,
    launch,
)
from ...microkernel.grad_tensor_cores import TC_ROUNDINGS, tc_backward_spec
from ...microkernel.grad_tiles import (
    GradTileBackward,
    acc_layout,
    grad_layout,
    grad_shared_layout,
    make_dkdv_epilogue,
    make_grad_tile,
    make_row_fns,
)
from ...microkernel.tensor_cores import TensorCores, check_aligned
from ...microkernel.tiles import (
    counter_slots,
    counts_flusher,
    make_kv_head,
    make_q_blocks,
    make_tile_loader,
    make_tile_storer,
)
from ...microkernel.tiles import zero_counts as zero
from . import backward_tensor_cores as tc


def _make_grad_init(BR, BC, D, DV, COUNT):
    """init_grads(buf, dq, dk, dv, bh, n_q, n_k, cnt): Algorithm 4 line 4, dQ = 0, dK = 0,
    dV = 0 in HBM, stored from the cleared buffer's dQ_i, K_j, V_j tiles (zero tiles then);
    every thread calls it."""
    NT = grad_layout(BR, BC).threads
    sm = grad_shared_layout(BR, BC, D, DV, True, True)
    store_dQ_i = make_tile_storer(BR, D, NT, (sm.dq, sm.qs))
    store_dK_j = make_tile_storer(BC, D, NT, (sm.k, sm.qs))
    store_dV_j = make_tile_storer(BC, DV, NT, (sm.v, sm.os))
    DQ_W, DK_W, DV_W = slot("dq", "write"), slot("dk", "write"), slot("dv", "write")

    @inlined
    def init_grads(buf, dq, dk, dv, bh, n_q, n_k, cnt):
        # Algorithm 4 line 4: dQ = 0, dK = 0, dV = 0, initialised in HBM
        for i in range((n_q + BR - 1) // BR):
            moved = store_dQ_i(buf, dq, bh, i * BR, min(BR, n_q - i * BR), 0, D)
            if COUNT:
                cnt[DQ_W] += moved
        for j in range((n_k + BC - 1) // BC):
            moved_k = store_dK_j(buf, dk, bh, j * BC, min(BC, n_k - j * BC), 0, D)
            moved_v = store_dV_j(buf, dv, bh, j * BC, min(BC, n_k - j * BC), 0, DV)
            if COUNT:
                cnt[DK_W] += moved_k
                cnt[DV_W] += moved_v

    return init_grads


def _make_visit_loads(BR, BC, D, DV, COUNT):
    """load_visit(buf, q, o, do, dq, l_hbm, m_hbm, bh, row0, n_rows, cnt): the tiles of a
    visited (j, i) into shared memory, counted (Algorithm 4 line 8): Q_i, O_i, dO_i, dQ_i, and
    the stats rows base = m_i, inv = 1 / l_i; every thread calls it, the caller puts the
    barriers around it."""
    NT = grad_layout(BR, BC).threads
    sm = grad_shared_layout(BR, BC, D, DV, True, True)
    zero_outside = make_row_fns(BR, BC, D, DV, True, True).zero_outside
    load_Q_i = make_tile_loader(BR, D, NT, (sm.q, sm.qs))
    load_O_i = make_tile_loader(BR, DV, NT, (sm.o, sm.os))
    load_dO_i = make_tile_loader(BR, DV, NT, (sm.do, sm.os))
    load_dQ_i = make_tile_loader(BR, D, NT, (sm.dq, sm.qs))
    BASE, INV = sm.stats, sm.stats + sm.rows
    Q_R, O_R, DO_R = slot("q", "read"), slot("o", "read"), slot("do", "read")
    L_R, M_R, DQ_R = slot("l", "read"), slot("m", "read"), slot("dq", "read")

    @inlined
    def load_visit(buf, q, o, do, dq, l_hbm, m_hbm, bh, row0, n_rows, cnt):
        # Q_i, O_i, dO_i, dQ_i, l_i, m_i: reloaded from HBM per K/V block (line 8)
        moved_q = load_Q_i(buf, q, bh, row0, n_rows, 0, D)
        moved_o = load_O_i(buf, o, bh, row0, n_rows, 0, DV)
        moved_do = load_dO_i(buf, do, bh, row0, n_rows, 0, DV)
        moved_dq = load_dQ_i(buf, dq, bh, row0, n_rows, 0, D)
        zero_outside(buf, sm.q, sm.qs, n_rows, D, BR, D)  # a tail's stale rows
        zero_outside(buf, sm.do, sm.os, n_rows, DV, BR, DV)
        for r in range(cuda.threadIdx.x, n_rows, NT):
            buf[BASE + r] = m_hbm[bh, row0 + r]  # log2 units, as the forward keeps it
            buf[INV + r] = float32(1.0) / l_hbm[bh, row0 + r]
            if COUNT:
                cnt[L_R] += 1
                cnt[M_R] += 1
        if COUNT:
            cnt[Q_R] += moved_q
            cnt[O_R] += moved_o
            cnt[DO_R] += moved_do
            cnt[DQ_R] += moved_dq

    return load_visit


@kernel_factory
def make_kernel(BR, BC, D, DV, MASK, COUNT, GROUP):
    lay = grad_layout(BR, BC)
    NT = lay.threads
    NS = lay.rm * lay.kn  # scores per thread
    sm = grad_shared_layout(BR, BC, D, DV, True, True)
    gt = make_grad_tile(BR, BC, D, DV, MASK, True, True)
    q_blocks = make_q_blocks(BR, MASK)  # [first_j, end_j): the query blocks that see j
    MASKED = MASK.bounded
    clear, zero_outside, scores, grad_scores = gt.clear, gt.zero_outside, gt.scores, \
        gt.grad_scores
    probs, acc_dv, acc_dk, acc_dq = gt.probs, gt.acc_dv, gt.acc_dk, gt.acc_dq
    add_to_dq, row_dot = gt.add_to_dq, gt.row_dot
    init_grads = _make_grad_init(BR, BC, D, DV, COUNT)
    load_visit = _make_visit_loads(BR, BC, D, DV, COUNT)
    write_dkdv = make_dkdv_epilogue(BR, BC, D, DV, True, True, COUNT)
    ACC_K, ACC_V = acc_layout(BC, D, NT).size, acc_layout(BC, DV, NT).size
    ACC_Q = acc_layout(BR, D, NT).size
    load_K_j = make_tile_loader(BC, D, NT, (sm.k, sm.qs))
    load_V_j = make_tile_loader(BC, DV, NT, (sm.v, sm.os))
    store_dQ_i = make_tile_storer(BR, D, NT, (sm.dq, sm.qs))
    DELTA = sm.stats + 2 * sm.rows
    NCNT = counter_slots(COUNT)
    flush_counts = counts_flusher()
    K_R, V_R, DQ_W = slot("k", "read"), slot("v", "read"), slot("dq", "write")
    kv_head = make_kv_head(GROUP)

    @cuda.jit(**kernel_options(NT, 255))
    def kv_outer_bwd(q, k, v, o, do, l_hbm, m_hbm, dq, dk, dv, counts, scale, scale_log2):
        bh = cuda.blockIdx.x
        kv = kv_head(bh)  # query head bh's K/V head (grouped-query attention)
        n_q = q.shape[1]
        n_k = k.shape[1]
        T_c = (n_k + BC - 1) // BC
        buf = cuda.shared.array(0, SHARED_F32, alignment=SHARED_ALIGN)
        s = cuda.local.array(NS, float32)
        dp = cuda.local.array(NS, float32)
        dk_j = cuda.local.array(ACC_K, float32)
        dv_j = cuda.local.array(ACC_V, float32)
        dq_i = cuda.local.array(ACC_Q, float32)
        cnt = cuda.local.array(NCNT, int64)
        if COUNT:
            zero(cnt)
        clear(buf)
        cuda.syncthreads()  # the buffer is clear: its dQ_i, K_j, V_j tiles are zero tiles
        init_grads(buf, dq, dk, dv, bh, n_q, n_k, cnt)  # dQ = dK = dV = 0 in HBM (line 4)

        for j in range(T_c):
            key0 = j * BC
            bc = min(BC, n_k - key0)
            i0, i1 = q_blocks(key0, bc, n_q, n_k)  # other query blocks see no key of block j
            if MASKED and i0 >= i1:
                continue  # no query sees block j: its dK_j = dV_j = 0 are in HBM already
            for e in range(ACC_K):
                dk_j[e] = float32(0.0)
            for e in range(ACC_V):
                dv_j[e] = float32(0.0)
            cuda.syncthreads()  # every thread is done with the previous K_j, V_j (dK, dV)
            # K_j, V_j: read from HBM once, stay in shared memory for all i (lines 5-6)
            moved_k = load_K_j(buf, k, kv, key0, bc, 0, D)
            moved_v = load_V_j(buf, v, kv, key0, bc, 0, DV)
            zero_outside(buf, sm.k, sm.qs, bc, D, BC, D)  # a tail's stale keys
            zero_outside(buf, sm.v, sm.os, bc, DV, BC, DV)
            if COUNT:
                cnt[K_R] += moved_k
                cnt[V_R] += moved_v
            for i in range(i0, i1):
                row0 = i * BR
                n_rows = min(BR, n_q - row0)
                cuda.syncthreads()  # every thread is done with the last step's tiles
                load_visit(buf, q, o, do, dq, l_hbm, m_hbm, bh, row0, n_rows, cnt)  # line 8
                cuda.syncthreads()  # Q_i, O_i, dO_i, dQ_i, l_i, m_i are in shared memory
                row_dot(buf, sm.do, sm.o, sm.os, DELTA, n_rows)  # D_i = rowsum(dO_i o O_i)
                scores(buf, s)
                grad_scores(buf, dp)
                cuda.syncthreads()  # D_i is in the stats rows
                # row0 + N_k - N_q: the first row's diagonal key (bottom-right aligned)
                probs(buf, s, dp, row0 + n_k - n_q, key0, n_rows, bc, scale_log2)
                cuda.syncthreads()  # P_ij and dS_ij are complete in shared memory
                acc_dv(buf, dv_j)
                acc_dk(buf, dk_j)
                for e in range(ACC_Q):
                    dq_i[e] = float32(0.0)
                acc_dq(buf, dq_i)
                add_to_dq(buf, dq_i, scale)  # each thread its own entries of the dQ_i tile
                cuda.syncthreads()  # dQ_i is updated in shared memory
                # dQ_i: written back to HBM after every visited (j, i) (line 22)
                moved = store_dQ_i(buf, dq, bh, row0, n_rows, 0, D)
                if COUNT:
                    cnt[DQ_W] += moved
            write_dkdv(buf, dk_j, dv_j, dk, dv, bh, key0, bc, scale, cnt)  # line 24, per j
        if COUNT:
            flush_counts(cnt, counts)

    return kv_outer_bwd


@register
class KVOuterBackward(GradTileBackward):
    name = "kv_outer"
    summary = ("FlashAttention Algorithm 4: K/V block resident; Q, O, dO, dQ, l, m reloaded "
               "and dQ written back per K/V block; one CTA per head")
    EXPECTED_SLOPES = {"m": -1, "n": 2, "d": 2}
    TRAFFIC_CLASS = "flash"
    READS_FORWARD_WORKSPACE = True  # l and m
    LOOP_NEST = """
        for (b, h) in parallel:               # one CTA per head
            write dQ = 0, dK = 0, dV = 0      # HBM initialisation (Algorithm 4, line 4)
            for j in range(Tc):               # serial inside the CTA
                if no query sees block j: skip it   # (a mask; dK_j = dV_j = 0 already)
                load K_j, V_j                 # HBM -> shared, once
                dK_j, dV_j = 0
                for i in range(first_j, end_j):   # the query blocks that see block j
                    load Q_i, O_i, dO_i, dQ_i, l_i, m_i   # HBM -> shared, per (j, i)
                    P = exp(tau Q_i K_j^T - m_i) / l_i
                    dS = P o (dO_i V_j^T - rowsum(dO_i o O_i))
                    dV_j += P^T dO_i; dK_j += tau dS^T Q_i
                    dQ_i += tau dS K_j
                    write dQ_i                # -> HBM, per (j, i)
                write dK_j, dV_j              # -> HBM
    """

    def forward_saves(self) -> str:
        return "l and m (the forward's workspace)"

    def model(self, p: Problem) -> Ledger:
        r = int(p.visiting_rows().sum())
        first, end = p.q_block_ranges()
        keys = int(p.key_block_rows()[end > first].sum())  # the K/V blocks some query sees
        per_head = {
            "q": {"read": r * p.d},
            "k": {"read": keys * p.d},
            "v": {"read": keys * p.dv},
            "o": {"read": r * p.dv},
            "do": {"read": r * p.dv},
            "l": {"read": r},
            "m": {"read": r},
            "dq": {"read": r * p.d, "write": (p.n_q + r) * p.d},
            "dk": {"write": (p.n_k + keys) * p.d},
            "dv": {"write": (p.n_k + keys) * p.dv},
        }
        return self.ledger(per_head, p.bh)

    def walk(self, p: Problem) -> Counter:
        c = Counter()
        c["dq", "write"] += p.n_q * p.d
        c["dk", "write"] += p.n_k * p.d
        c["dv", "write"] += p.n_k * p.dv
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
                for tensor, width in (("q", p.d), ("o", p.dv), ("do", p.dv), ("dq", p.d),
                                      ("l", 1), ("m", 1)):
                    c[tensor, "read"] += len(queries) * width
                c["dq", "write"] += len(queries) * p.d
            c["dk", "write"] += len(keys) * p.d
            c["dv", "write"] += len(keys) * p.dv
        return c

    def tiles_for_sram(self, m: int, d: int) -> tuple[int, int]:
        # Algorithm 4, line 1 (as Algorithm 1): Bc = ceil(M / 4d), Br = min(Bc, d).
        bc = ceil_div(m, 4 * d)
        return min(bc, d), bc

    def ctas(self, p: Problem) -> int:
        return p.bh  # one CTA per head, as the forward

    def output_roundings(self, p: Problem) -> int:
        # dQ_i is stored in the input dtype after every K/V block that visits it; tensor
        # cores round P and dS to a 16-bit input's type too, for the products that read them
        # (TF32 keeps them float32; float32's tolerance counts no roundings)
        tc_roundings = TC_ROUNDINGS if self.tensor_cores(p) is not None else 0
        return int(p.visible_kv_blocks().max()) + tc_roundings

    @staticmethod
    def tensor_cores(p: Problem) -> TensorCores | None:
        """The tensor-core build p's kernel runs, or None (CUDA cores)."""
        return tc_backward_spec(p)

    def threads(self, p: Problem) -> int:
        if self.tensor_cores(p) is not None:
            return tc.tc_threads(p.block_k)
        return super().threads(p)

    def shared_bytes(self, p: Problem) -> int:
        """Dynamic shared bytes of the kernel (without the counters)."""
        if self.tensor_cores(p) is not None:
            return tc.tc_shared_bytes(p.block_q, p.block_k, p.d, p.dv,
                                      self.tensor_cores(p).tf32)
        return grad_shared_layout(p.block_q, p.block_k, p.d, p.dv, True, True).bytes

    def kernels(self, p: Problem, count: bool) -> list[Kernel]:
        spec = self.tensor_cores(p)
        if spec is None:
            fn = make_kernel(p.block_q, p.block_k, p.d, p.dv, p.mask, count, p.group)
        else:
            fn = tc.make_tc_kernel(p.block_q, p.block_k, p.d, p.dv, p.mask, spec, count,
                                   p.group)
        counters = 8 * counter_slots(True) if count else 0
        return [Kernel(fn.py_func.__name__, fn, self.shared_bytes(p) + counters,
                       dynamic_shared_limit())]

    def launch(self, p, q, k, v, o, do, lse, dq, dk, dv, counts, *, scale, count,
               forward_workspace, workspace=None):
        l_hbm, m_hbm = forward_workspace  # what kv_outer's forward kept in HBM
        spec = self.tensor_cores(p)
        if spec is not None and spec.copies_rows(p.d, p.dv) and not SIMULATOR:
            check_aligned(q=q, k=k, v=v, o=o, do=do)  # cp.async copies: before the launch
        (kernel,) = self.kernels(p, count)
        launch(kernel.fn, p.bh, self.threads(p), self.shared_bytes(p), q, k, v, o, do, l_hbm,
               m_hbm, dq, dk, dv, counts, np.float32(scale),
               np.float32(scale * math.log2(math.e)))
