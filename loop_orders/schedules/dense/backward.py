"""dense's backward: standard attention's backward pass (Algorithm 3 of the FlashAttention
paper). P from the forward stays in HBM; dP and dS are materialised there too.

    kernel 1, per (batch, head, query block i):   load dO_i
                                                  for j: load V_j; write dP_ij = dO_i V_j^T
    kernel 2, per (batch, head, query row r):     load P_r, dP_r
                                                  write dS_r = P_r o (dP_r - rowsum(dP_r o P_r))
    kernel 3, per (batch, head, K/V block j):     for i: load P_ij, dS_ij, dO_i, Q_i
                                                      dV_j += P_ij^T dO_i; dK_j += tau dS_ij^T Q_i
                                                  write dK_j, dV_j
    kernel 4, per (batch, head, query block i):   for j: load dS_ij, K_j; dQ_i += tau dS_ij K_j
                                                  write dQ_i

The matmul kernels' input reloads follow their tiling: kernel 1 keeps dO_i on chip and reads
every V_j per query block; kernel 3 keeps dK_j, dV_j on chip and reads every dO_i, Q_i per K/V
block; kernel 4 keeps dQ_i and reads every K_j per query block. Traffic (elements, per batch
x head): dO read N_q dv (kernel 1) + Tc N_q dv (kernel 3); V Tr N_k dv; Q Tc N_q d; K Tr N_k
d; P read twice (kernels 2 and 3), dP written once and read once, dS written once and read
twice (kernels 3 and 4), each N_q N_k; dQ, dK, dV written once. A causal mask reduces none of
it (masked entries are zeros of P and dS, still moved), as in the forward. This is
Theta(N d + N^2) for fixed tiles: Theorem 5's standard-attention baseline. The products share
the flash backward's device functions (grad_tiles; on tensor cores for 16-bit inputs and TF32,
`backward_tensor_cores`, the same loop nests and traffic), so the baseline is not slowed by a
naive inner loop.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import numpy as np
from numba import float32, int64

from ...core.ledger import Ledger, slot
from ...core.mask import NO_MASK
from ...core.schedule import Kernel, Problem, register, rows
from ...device.runtime import (
    SHARED_ALIGN,
    SHARED_F32,
    SIMULATOR,
    cuda,
    device_empty,
    dynamic_shared_limit,
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
)
from ...microkernel.tensor_cores import TensorCores, check_aligned
from ...microkernel.tiles import (
    counter_slots,
    counts_flusher,
    make_kv_head,
    make_tile_loader,
    make_tile_storer,
)
from ...microkernel.tiles import zero_counts as zero
from . import backward_tensor_cores as tc

DS_MAX_THREADS = 128


class MatmulKernels(NamedTuple):
    """Kernels 1, 3 and 4 of one build, with their threads and dynamic shared bytes."""

    fns: tuple
    threads: tuple
    shared: tuple


def ds_threads(n_k: int) -> int:
    """Threads of a kernel-2 CTA: a power of two giving each about 8 columns, at most 128."""
    return min(DS_MAX_THREADS, 1 << (-(-n_k // 8) - 1).bit_length())


def ds_shared_bytes(n_k: int) -> int:
    """Kernel 2's shared memory: the rows of P and dP, the per-thread partials, D_r."""
    return 4 * (2 * n_k + ds_threads(n_k) + 1)


def _tile(BR, BC, D, DV):
    """Layout, shared plan and device functions every dense backward kernel shares."""
    lay = grad_layout(BR, BC)
    return lay, grad_shared_layout(BR, BC, D, DV, False, False), make_grad_tile(
        BR, BC, D, DV, NO_MASK, False, False)  # dense's P (0 where masked) holds the mask


@kernel_factory
def make_dp_kernel(BR, BC, D, DV, COUNT, GROUP):
    lay, sm, gt = _tile(BR, BC, D, DV)
    NT, NS = lay.threads, lay.rm * lay.kn
    clear, grad_scores, put_scores = gt.clear, gt.grad_scores, gt.put_scores
    load_dO_i = make_tile_loader(BR, DV, NT, (sm.do, sm.os))
    load_V_j = make_tile_loader(BC, DV, NT, (sm.v, sm.os))
    store_dP_ij = make_tile_storer(BR, BC, NT, (sm.p, sm.ps))
    NCNT = counter_slots(COUNT)
    flush_counts = counts_flusher()
    DO_R, V_R, DP_W = slot("do", "read"), slot("v", "read"), slot("dp", "write")
    kv_head = make_kv_head(GROUP)

    @cuda.jit(**kernel_options(NT, 128))
    def dense_bwd_dp(do, v, dp_hbm, counts):
        i = cuda.blockIdx.x
        bh = cuda.blockIdx.y
        kv = kv_head(bh)  # query head bh's K/V head (grouped-query attention)
        n_k = v.shape[1]
        row0 = i * BR
        n_rows = min(BR, do.shape[1] - row0)
        buf = cuda.shared.array(0, SHARED_F32, alignment=SHARED_ALIGN)
        dp = cuda.local.array(NS, float32)
        cnt = cuda.local.array(NCNT, int64)
        if COUNT:
            zero(cnt)
        clear(buf)
        cuda.syncthreads()  # the buffer is clear before any tile lands in it
        # dO_i: read from HBM once, stays in shared memory for every K/V block
        moved = load_dO_i(buf, do, bh, row0, n_rows, 0, DV)
        if COUNT:
            cnt[DO_R] += moved
        for j in range((n_k + BC - 1) // BC):
            key0 = j * BC
            bc = min(BC, n_k - key0)
            cuda.syncthreads()  # every thread is done with the previous V_j and dP_ij
            # V_j: every query block reads all of V
            moved = load_V_j(buf, v, kv, key0, bc, 0, DV)
            if COUNT:
                cnt[V_R] += moved
            cuda.syncthreads()  # V_j (and dO_i) are in shared memory
            grad_scores(buf, dp)
            put_scores(buf, dp)
            cuda.syncthreads()  # dP_ij is complete in shared memory
            # dP_ij: a quadratic intermediate, written to HBM (whole rows, coalesced)
            moved = store_dP_ij(buf, dp_hbm, bh, row0, n_rows, key0, bc)
            if COUNT:
                cnt[DP_W] += moved
        if COUNT:
            flush_counts(cnt, counts)

    return dense_bwd_dp


@kernel_factory
def make_ds_kernel(T, COUNT):
    NCNT = counter_slots(COUNT)
    flush_counts = counts_flusher()
    P_R, DP_R, DS_W = slot("p", "read"), slot("dp", "read"), slot("ds", "write")

    @cuda.jit
    def dense_bwd_ds(p_hbm, dp_hbm, ds_hbm, counts):
        row = cuda.blockIdx.x
        bh = cuda.blockIdx.y
        t = cuda.threadIdx.x
        n_k = p_hbm.shape[2]
        # the rows of P and dP (2 n_k floats), then the partial sums (T) and D_r
        sh = cuda.shared.array(0, dtype=SHARED_F32)
        cnt = cuda.local.array(NCNT, int64)
        if COUNT:
            zero(cnt)
        part = float32(0.0)
        for c in range(t, n_k, T):
            # P_r, dP_r: read from HBM once each
            sh[c] = p_hbm[bh, row, c]
            sh[n_k + c] = dp_hbm[bh, row, c]
            part += sh[c] * sh[n_k + c]
            if COUNT:
                cnt[P_R] += 1
                cnt[DP_R] += 1
        sh[2 * n_k + t] = part
        cuda.syncthreads()  # every partial sum of rowsum(dP o P) is in shared memory
        if t == 0:
            total = float32(0.0)
            for u in range(T):  # in thread order: the same D_r on every run
                total += sh[2 * n_k + u]
            sh[2 * n_k + T] = total
        cuda.syncthreads()  # D_r is in shared memory
        d_r = sh[2 * n_k + T]
        for c in range(t, n_k, T):
            # dS_r: the third quadratic intermediate, written to HBM
            ds_hbm[bh, row, c] = sh[c] * (sh[n_k + c] - d_r)
            if COUNT:
                cnt[DS_W] += 1
        if COUNT:
            flush_counts(cnt, counts)

    return dense_bwd_ds


@kernel_factory
def make_dkdv_kernel(BR, BC, D, DV, COUNT):
    lay, sm, gt = _tile(BR, BC, D, DV)
    NT = lay.threads
    clear, zero_outside, acc_dv, acc_dk = gt.clear, gt.zero_outside, gt.acc_dv, gt.acc_dk
    write_dkdv = make_dkdv_epilogue(BR, BC, D, DV, False, False, COUNT)
    ACC_K, ACC_V = acc_layout(BC, D, NT).size, acc_layout(BC, DV, NT).size
    load_P_ij = make_tile_loader(BR, BC, NT, (sm.p, sm.ps))
    load_dS_ij = make_tile_loader(BR, BC, NT, (sm.ds, sm.ps))
    load_Q_i = make_tile_loader(BR, D, NT, (sm.q, sm.qs))
    load_dO_i = make_tile_loader(BR, DV, NT, (sm.do, sm.os))
    NCNT = counter_slots(COUNT)
    flush_counts = counts_flusher()
    P_R, DS_R, Q_R, DO_R = (slot("p", "read"), slot("ds", "read"), slot("q", "read"),
                            slot("do", "read"))

    @cuda.jit(**kernel_options(NT, 255))
    def dense_bwd_dkdv(p_hbm, ds_hbm, q, do, dk, dv, counts, scale):
        j = cuda.blockIdx.x
        bh = cuda.blockIdx.y
        n_q = q.shape[1]
        key0 = j * BC
        bc = min(BC, dk.shape[1] - key0)
        buf = cuda.shared.array(0, SHARED_F32, alignment=SHARED_ALIGN)
        dk_j = cuda.local.array(ACC_K, float32)
        dv_j = cuda.local.array(ACC_V, float32)
        cnt = cuda.local.array(NCNT, int64)
        if COUNT:
            zero(cnt)
        for e in range(ACC_K):
            dk_j[e] = float32(0.0)
        for e in range(ACC_V):
            dv_j[e] = float32(0.0)
        clear(buf)
        for i in range((n_q + BR - 1) // BR):
            row0 = i * BR
            n_rows = min(BR, n_q - row0)
            cuda.syncthreads()  # every thread is done with the last step's tiles
            # P_ij, dS_ij: read back from HBM once per element; dO_i, Q_i: per K/V block
            moved_p = load_P_ij(buf, p_hbm, bh, row0, n_rows, key0, bc)
            moved_ds = load_dS_ij(buf, ds_hbm, bh, row0, n_rows, key0, bc)
            moved_q = load_Q_i(buf, q, bh, row0, n_rows, 0, D)
            moved_do = load_dO_i(buf, do, bh, row0, n_rows, 0, DV)
            zero_outside(buf, sm.p, sm.ps, n_rows, bc, BR, BC)  # a tail's stale entries
            zero_outside(buf, sm.ds, sm.ps, n_rows, bc, BR, BC)
            zero_outside(buf, sm.q, sm.qs, n_rows, D, BR, D)
            zero_outside(buf, sm.do, sm.os, n_rows, DV, BR, DV)
            if COUNT:
                cnt[P_R] += moved_p
                cnt[DS_R] += moved_ds
                cnt[Q_R] += moved_q
                cnt[DO_R] += moved_do
            cuda.syncthreads()  # P_ij, dS_ij, Q_i and dO_i are in shared memory
            acc_dv(buf, dv_j)
            acc_dk(buf, dk_j)
        write_dkdv(buf, dk_j, dv_j, dk, dv, bh, key0, bc, scale, cnt)  # dK_j, dV_j: once
        if COUNT:
            flush_counts(cnt, counts)

    return dense_bwd_dkdv


@kernel_factory
def make_dq_kernel(BR, BC, D, DV, COUNT, GROUP):
    lay, sm, gt = _tile(BR, BC, D, DV)
    NT = lay.threads
    clear, zero_outside, acc_dq, stage_dq = gt.clear, gt.zero_outside, gt.acc_dq, gt.stage_dq
    ACC_Q = acc_layout(BR, D, NT).size
    load_dS_ij = make_tile_loader(BR, BC, NT, (sm.ds, sm.ps))
    load_K_j = make_tile_loader(BC, D, NT, (sm.k, sm.qs))
    store_dQ_i = make_tile_storer(BR, D, NT, (sm.q, sm.qs))
    NCNT = counter_slots(COUNT)
    flush_counts = counts_flusher()
    DS_R, K_R, DQ_W = slot("ds", "read"), slot("k", "read"), slot("dq", "write")
    kv_head = make_kv_head(GROUP)

    @cuda.jit(**kernel_options(NT, 128))
    def dense_bwd_dq(ds_hbm, k, dq, counts, scale):
        i = cuda.blockIdx.x
        bh = cuda.blockIdx.y
        kv = kv_head(bh)  # query head bh's K/V head (grouped-query attention)
        n_k = k.shape[1]
        row0 = i * BR
        n_rows = min(BR, dq.shape[1] - row0)
        buf = cuda.shared.array(0, SHARED_F32, alignment=SHARED_ALIGN)
        dq_i = cuda.local.array(ACC_Q, float32)
        cnt = cuda.local.array(NCNT, int64)
        if COUNT:
            zero(cnt)
        for e in range(ACC_Q):
            dq_i[e] = float32(0.0)
        clear(buf)
        for j in range((n_k + BC - 1) // BC):
            key0 = j * BC
            bc = min(BC, n_k - key0)
            cuda.syncthreads()  # every thread is done with the previous dS_ij and K_j
            # dS_ij: read back from HBM once per element; K_j: every query block reads all of K
            moved_ds = load_dS_ij(buf, ds_hbm, bh, row0, n_rows, key0, bc)
            moved_k = load_K_j(buf, k, kv, key0, bc, 0, D)
            zero_outside(buf, sm.ds, sm.ps, n_rows, bc, BR, BC)  # a tail's stale entries
            zero_outside(buf, sm.k, sm.qs, bc, D, BC, D)
            if COUNT:
                cnt[DS_R] += moved_ds
                cnt[K_R] += moved_k
            cuda.syncthreads()  # dS_ij and K_j are in shared memory
            acc_dq(buf, dq_i)
        cuda.syncthreads()  # the Q_i tile (unused here) stages dQ_i
        stage_dq(buf, dq_i, scale)
        cuda.syncthreads()  # dQ_i is complete in shared memory
        # dQ_i: written to HBM once
        moved = store_dQ_i(buf, dq, bh, row0, n_rows, 0, D)
        if COUNT:
            cnt[DQ_W] += moved
            flush_counts(cnt, counts)

    return dense_bwd_dq


@register
class DenseBackward(GradTileBackward):
    name = "dense"
    summary = "standard attention backward (Algorithm 3): P, dP, dS in HBM; four kernels"
    TENSORS = {"dp": "float32", "ds": "float32"}
    EXPECTED_SLOPES = {"n": 2}
    TRAFFIC_CLASS = "standard"
    READS_FORWARD_WORKSPACE = True  # P
    LOOP_NEST = """
        # kernel 1: dP
        for (b, h, i) in parallel:            # one CTA per query block
            load dO_i                         # HBM -> shared, once
            for j in range(Tc):
                load V_j                      # HBM -> shared, per query block
                write dP_ij = dO_i V_j^T      # -> HBM
        # kernel 2: dS
        for (b, h, r) in parallel:            # one CTA per query row
            load P_r, dP_r                    # HBM -> shared, once
            write dS_r = P_r o (dP_r - rowsum(dP_r o P_r))   # -> HBM
        # kernel 3: dK, dV
        for (b, h, j) in parallel:            # one CTA per K/V block
            for i in range(Tr):
                load P_ij, dS_ij, dO_i, Q_i   # HBM -> shared
                dV_j += P_ij^T dO_i; dK_j += tau dS_ij^T Q_i
            write dK_j, dV_j                  # -> HBM
        # kernel 4: dQ
        for (b, h, i) in parallel:            # one CTA per query block
            for j in range(Tc):
                load dS_ij, K_j               # HBM -> shared
                dQ_i += tau dS_ij K_j
            write dQ_i                        # -> HBM
    """

    def forward_saves(self) -> str:
        return "P (the forward's workspace)"

    @staticmethod
    def tensor_cores(p: Problem) -> TensorCores | None:
        """The tensor-core build kernels 1, 3 and 4 run for p (16-bit inputs, or float32 at a
        TF32 precision), or None (CUDA cores)."""
        return tc_backward_spec(p)

    def threads(self, p: Problem) -> int:
        if self.tensor_cores(p) is not None:
            return max(tc.tc_threads(p.block_q, p.block_k))
        return super().threads(p)

    def output_roundings(self, p: Problem) -> int:
        # tensor cores round P and dS to the operand type for the products that read them
        return 1 + (TC_ROUNDINGS if self.tensor_cores(p) is not None else 0)

    def model(self, p: Problem) -> Ledger:
        scores = p.n_q * p.n_k
        per_head = {
            "q": {"read": p.tc * p.n_q * p.d},
            "k": {"read": p.tr * p.n_k * p.d},
            "v": {"read": p.tr * p.n_k * p.dv},
            "do": {"read": (1 + p.tc) * p.n_q * p.dv},
            "p": {"read": 2 * scores},
            "dp": {"read": scores, "write": scores},
            "ds": {"read": 2 * scores, "write": scores},
            "dq": {"write": p.n_q * p.d},
            "dk": {"write": p.n_k * p.d},
            "dv": {"write": p.n_k * p.dv},
        }
        return self.ledger(per_head, p.bh)

    def walk(self, p: Problem) -> Counter:
        c = Counter()
        for i in range(0, p.n_q, p.block_q):  # kernel 1
            queries = rows(i, p.block_q, p.n_q)
            c["do", "read"] += len(queries) * p.dv
            for j in range(0, p.n_k, p.block_k):
                keys = rows(j, p.block_k, p.n_k)
                c["v", "read"] += len(keys) * p.dv
                c["dp", "write"] += len(queries) * len(keys)
        for _r in range(p.n_q):  # kernel 2
            c["p", "read"] += p.n_k
            c["dp", "read"] += p.n_k
            c["ds", "write"] += p.n_k
        for j in range(0, p.n_k, p.block_k):  # kernel 3
            keys = rows(j, p.block_k, p.n_k)
            for i in range(0, p.n_q, p.block_q):
                queries = rows(i, p.block_q, p.n_q)
                c["p", "read"] += len(queries) * len(keys)
                c["ds", "read"] += len(queries) * len(keys)
                c["do", "read"] += len(queries) * p.dv
                c["q", "read"] += len(queries) * p.d
            c["dk", "write"] += len(keys) * p.d
            c["dv", "write"] += len(keys) * p.dv
        for i in range(0, p.n_q, p.block_q):  # kernel 4
            queries = rows(i, p.block_q, p.n_q)
            for j in range(0, p.n_k, p.block_k):
                keys = rows(j, p.block_k, p.n_k)
                c["ds", "read"] += len(queries) * len(keys)
                c["k", "read"] += len(keys) * p.d
            c["dq", "write"] += len(queries) * p.d
        return c

    def tiles_for_sram(self, m: int, d: int) -> tuple[int, int]:
        return self.forward().tiles_for_sram(m, d)

    def workspace_bytes(self, p: Problem) -> int:
        # dP and dS: N_q x N_k float32 per (batch, head), materialised in HBM
        return 2 * p.bh * p.n_q * p.n_k * 4

    def allocate_workspace(self, p: Problem, empty=device_empty) -> tuple:
        shape = (p.bh, p.n_q, p.n_k)
        return empty(shape, np.float32), empty(shape, np.float32)

    def check(self, p: Problem) -> None:
        need = ds_shared_bytes(p.n_k)
        if need > dynamic_shared_limit():
            most = (dynamic_shared_limit() // 4 - DS_MAX_THREADS - 1) // 2
            raise ValueError(
                f"n_k: dense's backward keeps rows of P and dP in shared memory ({need} "
                f"bytes for n_k={p.n_k}); the limit is {dynamic_shared_limit()} bytes, so "
                f"n_k <= {most}")

    def kernels(self, p: Problem, count: bool) -> list[Kernel]:
        counters = 8 * counter_slots(True) if count else 0
        plan = self._plan(p, count)
        shared = [plan.shared[0], ds_shared_bytes(p.n_k), *plan.shared[1:]]
        fns = [plan.fns[0], make_ds_kernel(ds_threads(p.n_k), count), *plan.fns[1:]]
        return [Kernel(fn.py_func.__name__, fn, b + counters, dynamic_shared_limit())
                for fn, b in zip(fns, shared, strict=True)]

    def _plan(self, p: Problem, count: bool) -> MatmulKernels:
        """Kernels 1, 3 and 4 for p, with their threads and dynamic shared bytes: on tensor
        cores (`tensor_cores`) or on the CUDA-core backward tile."""
        spec = self.tensor_cores(p)
        if spec is not None:
            return MatmulKernels(
                (tc.make_tc_dp_kernel(p.block_q, p.block_k, p.dv, spec, count, p.group),
                 tc.make_tc_dkdv_kernel(p.block_q, p.block_k, p.d, p.dv, spec, count),
                 tc.make_tc_dq_kernel(p.block_q, p.block_k, p.d, spec, count, p.group)),
                tc.tc_threads(p.block_q, p.block_k),
                tc.tc_shared_bytes(p.block_q, p.block_k, p.d, p.dv, spec))
        threads = grad_layout(p.block_q, p.block_k).threads
        tiles = grad_shared_layout(p.block_q, p.block_k, p.d, p.dv, False, False).bytes
        return MatmulKernels(
            (make_dp_kernel(p.block_q, p.block_k, p.d, p.dv, count, p.group),
             make_dkdv_kernel(p.block_q, p.block_k, p.d, p.dv, count),
             make_dq_kernel(p.block_q, p.block_k, p.d, p.dv, count, p.group)),
            (threads,) * 3, (tiles,) * 3)

    def launch(self, p, q, k, v, o, do, lse, dq, dk, dv, counts, *, scale, count,
               forward_workspace, workspace=None):
        _, p_hbm = forward_workspace  # the forward's (S, P): P stays in HBM for the backward
        dp_hbm, ds_hbm = workspace or self.allocate_workspace(p)
        spec = self.tensor_cores(p)
        if spec is not None and not SIMULATOR:  # cp.async copies: before any launch
            check_aligned(**{name: x for name, x, width in (
                ("q", q, p.d), ("k", k, p.d), ("v", v, p.dv), ("do", do, p.dv))
                if spec.copies_rows(width)})
        dp_k, ds_k, dkdv_k, dq_k = (kern.fn for kern in self.kernels(p, count))
        plan = self._plan(p, count)
        threads, shared = plan.threads, plan.shared
        tau = np.float32(scale)
        launch(dp_k, (p.tr, p.bh), threads[0], shared[0], do, v, dp_hbm, counts)
        launch(ds_k, (p.n_q, p.bh), ds_threads(p.n_k), ds_shared_bytes(p.n_k), p_hbm, dp_hbm,
               ds_hbm, counts)
        launch(dkdv_k, (p.tc, p.bh), threads[1], shared[1], p_hbm, ds_hbm, q, do, dk, dv,
               counts, tau)
        launch(dq_k, (p.tr, p.bh), threads[2], shared[2], ds_hbm, k, dq, counts, tau)
