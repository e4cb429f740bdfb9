"""q_outer's backward: FlashAttention-2's backward pass, with dQ by float32 atomics (option
dq="atomic", the default) or by a second, Q-outer kernel (dq="separate", deterministic).

    preprocess, per (batch, head), 4 query rows per CTA:
        load O_r, dO_r;  write delta_r = rowsum(dO_r o O_r)       # float32
        atomic: write dq_acc_r = 0                                # float32 accumulator of dQ
    K/V-outer, per (batch, head), K/V block j in parallel:        # one CTA each
        load K_j, V_j                                             # once
        dK_j, dV_j = 0                                            # registers
        for i in first_j .. end_j - 1:                            # the query blocks j is seen by
            load Q_i, dO_i, lse_i, delta_i
            S = Q_i K_j^T;  P = exp(tau S - lse_i);  dP = dO_i V_j^T;  dS = P o (dP - delta_i)
            dV_j += P^T dO_i;  dK_j += tau dS^T Q_i
            atomic: dq_acc_i += tau dS K_j                        # read-modify-write, atomics
        write dK_j, dV_j
    atomic, convert, per row block:  load dq_acc;  write dQ (input dtype)
    separate, Q-outer, per (batch, head), query block i in parallel:
        load Q_i, dO_i, lse_i, delta_i                            # once
        for j in first_i .. end_i - 1:                            # the K/V blocks i sees
            load K_j, V_j;  dQ_i += tau dS K_j                    # S, P, dP, dS recomputed
        write dQ_i

Traffic (elements, per batch x head; R = sum over K/V blocks j of the query rows that see
block j, Tc N_q without a mask): preprocess O and dO N_q dv read each, delta N_q written (and
dq_acc N_q d written with atomic). K/V-outer: K, V N_k (d + dv) read; Q R d, dO R dv, lse R,
delta R read; dK, dV N_k (d + dv) written; atomic: dq_acc R d read and R d written (an atomic
add counts one of each). Convert: dq_acc N_q d read, dQ N_q d written. Separate: Q N_q d, dO
N_q dv, lse N_q, delta N_q read once; K, V read sum_i (the keys of the blocks i sees)
(d + dv), as the forward; dQ N_q d written. With Bc = M / (4d) this is Theta(N^2 d^2 / M)
(Theorem 5).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import NamedTuple

import numpy as np
from numba import float32, int64

from ...core.ledger import Ledger, slot
from ...core.schedule import Kernel, Option, Problem, ceil_div, choice_option, register, rows, sees
from ...device.intrinsics import narrow, widen
from ...device.runtime import (
    SHARED_ALIGN,
    SHARED_BYTES_PER_SM,
    SHARED_F32,
    SIMULATOR,
    cuda,
    device_empty,
    dynamic_shared_limit,
    has_wgmma,
    kernel_factory,
    kernel_options,
    launch,
)
from ...microkernel import tuning
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
    block_grid,
    counter_slots,
    counts_flusher,
    make_block_of,
    make_kv_blocks,
    make_kv_head,
    make_q_blocks,
    make_tile_loader,
    make_tile_storer,
)
from ...microkernel.tiles import zero_counts as zero
from . import backward_tensor_cores as tc

PRE_ROWS, PRE_LANES = 4, 32  # preprocess: 4 rows per CTA, 32 lanes per row
# Tensor cores: Q_i, dO_i buffers of the K/V-outer kernel (a second lets the next block land
# early), where two CTAs' buffers still fit an SM (their registers allow two; one CTA an SM
# loses more than the early loads win: results/backward_tensor_cores.gpu.json, "atomic1")
TC_Q_STAGES = 2
CONVERT_THREADS = 256
# Tiles a gradient call naming none gives the tensor-core backward on a Hopper GPU, where a
# sweep on an H100 measured them faster than 64 x 64 (results/bench_backward_tiles.csv: B 4,
# H 16, N 4096, causal or not), by (operands, dq, d): 16-bit on 128 keys a CTA (each load of
# Q_i, dO_i and each dQ_i atomic then serves twice the keys), except separate dQ at d = 128;
# TF32x3 at d = 128 on 32 query rows (112,000 bytes of shared memory a CTA against 64 x 64's
# 154,368: two CTAs an SM instead of one)
FAST_TILES = {("16-bit", "atomic", 64): (64, 128), ("16-bit", "atomic", 128): (64, 128),
              ("16-bit", "separate", 64): (64, 128),
              ("tf32x3", "atomic", 128): (32, 64), ("tf32x3", "separate", 128): (32, 64)}


def tc_q_stages(p: Problem, spec: TensorCores) -> int:
    """Q_i/dO_i buffers of p's tensor-core K/V-outer kernel: a sweep's (`tuning` q_stages,
    where that many fit a CTA), else TC_Q_STAGES where two CTAs' buffers fit an SM, else
    one."""
    def bytes_on(stages: int) -> int:
        return tc.tc_shared_bytes(p.block_q, p.block_k, p.d, p.dv, stages, spec.tf32)

    asked = tuning.current().q_stages
    if asked is not None:
        asked = min(asked, TC_Q_STAGES)
        return asked if asked == 1 or bytes_on(asked) <= dynamic_shared_limit() else 1
    return TC_Q_STAGES if 2 * bytes_on(TC_Q_STAGES) <= SHARED_BYTES_PER_SM else 1


@kernel_factory
def make_preprocess_kernel(ZERO_DQ, COUNT):
    NT = PRE_ROWS * PRE_LANES
    NCNT = counter_slots(COUNT)
    flush_counts = counts_flusher()
    O_R, DO_R, DELTA_W = slot("o", "read"), slot("do", "read"), slot("delta", "write")
    ACC_W = slot("dq_acc", "write")

    @cuda.jit
    def q_outer_bwd_preprocess(o, do, delta, dq_acc, counts):
        bh = cuda.blockIdx.y
        t = cuda.threadIdx.x
        n_q = o.shape[1]
        dv = o.shape[2]
        row0 = cuda.blockIdx.x * PRE_ROWS
        n_rows = min(PRE_ROWS, n_q - row0)
        r, lane = t // PRE_LANES, t % PRE_LANES
        part = cuda.shared.array(NT, float32)
        cnt = cuda.local.array(NCNT, int64)
        if COUNT:
            zero(cnt)
        total = float32(0.0)
        if r < n_rows:
            for x in range(lane, dv, PRE_LANES):
                # O_r, dO_r: read once each, for delta_r (lanes read consecutive columns)
                total += widen(o[bh, row0 + r, x]) * widen(do[bh, row0 + r, x])
                if COUNT:
                    cnt[O_R] += 1
                    cnt[DO_R] += 1
        part[t] = total
        cuda.syncthreads()  # every lane's partial sum is in shared memory
        if lane == 0 and r < n_rows:
            for u in range(1, PRE_LANES):  # in lane order: the same sum on every run
                total += part[t + u]
            # delta_r: rowsum(dO o O), the backward's row statistic, written once
            delta[bh, row0 + r] = total
            if COUNT:
                cnt[DELTA_W] += 1
        if ZERO_DQ:
            d = dq_acc.shape[2]
            for e in range(t, n_rows * d, NT):
                # dq_acc: zeroed in HBM before the K/V-outer kernel adds into it
                dq_acc[bh, row0 + e // d, e % d] = float32(0.0)
                if COUNT:
                    cnt[ACC_W] += 1
        if COUNT:
            flush_counts(cnt, counts)

    return q_outer_bwd_preprocess


@kernel_factory
def make_kv_kernel(BR, BC, D, DV, MASK, ATOMIC, COUNT, GROUP):
    lay = grad_layout(BR, BC)
    NT = lay.threads
    NS = lay.rm * lay.kn
    sm = grad_shared_layout(BR, BC, D, DV, False, False)
    gt = make_grad_tile(BR, BC, D, DV, MASK, False, False)
    clear, zero_outside, scores, grad_scores = gt.clear, gt.zero_outside, gt.scores, \
        gt.grad_scores
    probs, acc_dv, acc_dk, acc_dq = gt.probs, gt.acc_dv, gt.acc_dk, gt.acc_dq
    q_blocks = make_q_blocks(BR, MASK)  # [first_j, end_j): the query blocks that see j
    atomic_dq, lse_stats = gt.atomic_dq, gt.lse_stats
    write_dkdv = make_dkdv_epilogue(BR, BC, D, DV, False, False, COUNT)
    ACC_K, ACC_V = acc_layout(BC, D, NT).size, acc_layout(BC, DV, NT).size
    ACC_Q = acc_layout(BR, D, NT).size if ATOMIC else 1
    load_K_j = make_tile_loader(BC, D, NT, (sm.k, sm.qs))
    load_V_j = make_tile_loader(BC, DV, NT, (sm.v, sm.os))
    load_Q_i = make_tile_loader(BR, D, NT, (sm.q, sm.qs))
    load_dO_i = make_tile_loader(BR, DV, NT, (sm.do, sm.os))
    NCNT = counter_slots(COUNT)
    flush_counts = counts_flusher()
    block_of = make_block_of(MASK.bounded, HEAVY_LAST=False)
    Q_R, K_R, V_R, DO_R = (slot("q", "read"), slot("k", "read"), slot("v", "read"),
                           slot("do", "read"))
    LSE_R, DELTA_R = slot("lse", "read"), slot("delta", "read")
    ACC_R, ACC_W = slot("dq_acc", "read"), slot("dq_acc", "write")
    kv_head = make_kv_head(GROUP)

    @cuda.jit(**kernel_options(NT, 255))
    def q_outer_bwd(q, k, v, do, lse, delta, dq_acc, dk, dv, counts, scale, scale_log2):
        # masked: the K/V blocks the most query blocks see start first (`block_grid`)
        j, bh = block_of(q.shape[0])
        kv = kv_head(bh)  # query head bh's K/V head (grouped-query attention)
        n_q = q.shape[1]
        n_k = k.shape[1]
        key0 = j * BC
        bc = min(BC, n_k - key0)
        buf = cuda.shared.array(0, SHARED_F32, alignment=SHARED_ALIGN)
        s = cuda.local.array(NS, float32)
        dp = cuda.local.array(NS, float32)
        dk_j = cuda.local.array(ACC_K, float32)
        dv_j = cuda.local.array(ACC_V, float32)
        dq_i = cuda.local.array(ACC_Q, float32)
        cnt = cuda.local.array(NCNT, int64)
        if COUNT:
            zero(cnt)
        for e in range(ACC_K):
            dk_j[e] = float32(0.0)
        for e in range(ACC_V):
            dv_j[e] = float32(0.0)
        clear(buf)
        cuda.syncthreads()  # the buffer is clear before any tile lands in it
        # K_j, V_j: read from HBM once, stay in shared memory for every query block
        moved_k = load_K_j(buf, k, kv, key0, bc, 0, D)
        moved_v = load_V_j(buf, v, kv, key0, bc, 0, DV)
        if COUNT:
            cnt[K_R] += moved_k
            cnt[V_R] += moved_v
        i0, i1 = q_blocks(key0, bc, n_q, n_k)  # other query blocks see no key of block j
        for i in range(i0, i1):
            row0 = i * BR
            n_rows = min(BR, n_q - row0)
            cuda.syncthreads()  # every thread is done with the last Q_i, dO_i, P, dS, stats
            # Q_i, dO_i, lse_i, delta_i: read per visited (j, i)
            moved_q = load_Q_i(buf, q, bh, row0, n_rows, 0, D)
            moved_do = load_dO_i(buf, do, bh, row0, n_rows, 0, DV)
            zero_outside(buf, sm.q, sm.qs, n_rows, D, BR, D)  # a tail's stale rows
            zero_outside(buf, sm.do, sm.os, n_rows, DV, BR, DV)
            rows_in = lse_stats(buf, lse, delta, bh, row0, n_rows)
            if COUNT:
                cnt[Q_R] += moved_q
                cnt[DO_R] += moved_do
                cnt[LSE_R] += rows_in
                cnt[DELTA_R] += rows_in
            cuda.syncthreads()  # Q_i, dO_i and the row statistics are in shared memory
            scores(buf, s)
            grad_scores(buf, dp)
            # row0 + N_k - N_q: the first row's diagonal key (bottom-right aligned)
            probs(buf, s, dp, row0 + n_k - n_q, key0, n_rows, bc, scale_log2)
            cuda.syncthreads()  # P_ij and dS_ij are complete in shared memory
            acc_dv(buf, dv_j)
            acc_dk(buf, dk_j)
            if ATOMIC:
                for e in range(ACC_Q):
                    dq_i[e] = float32(0.0)
                acc_dq(buf, dq_i)
                # dq_acc_i: float32 atomic adds of tau dS K_j (each a read and a write)
                added = atomic_dq(dq_acc, bh, row0, n_rows, dq_i, scale)
                if COUNT:
                    cnt[ACC_R] += added
                    cnt[ACC_W] += added
        write_dkdv(buf, dk_j, dv_j, dk, dv, bh, key0, bc, scale, cnt)  # dK_j, dV_j: once
        if COUNT:
            flush_counts(cnt, counts)

    return q_outer_bwd


@kernel_factory
def make_q_kernel(BR, BC, D, DV, MASK, COUNT, GROUP):
    lay = grad_layout(BR, BC)
    NT = lay.threads
    NS = lay.rm * lay.kn
    sm = grad_shared_layout(BR, BC, D, DV, False, False)
    gt = make_grad_tile(BR, BC, D, DV, MASK, False, False)
    kv_blocks = make_kv_blocks(BC, MASK)  # [first_i, end_i): the K/V blocks i sees
    clear, zero_outside, scores, grad_scores = gt.clear, gt.zero_outside, gt.scores, \
        gt.grad_scores
    probs, acc_dq, stage_dq, lse_stats = gt.probs, gt.acc_dq, gt.stage_dq, gt.lse_stats
    ACC_Q = acc_layout(BR, D, NT).size
    load_K_j = make_tile_loader(BC, D, NT, (sm.k, sm.qs))
    load_V_j = make_tile_loader(BC, DV, NT, (sm.v, sm.os))
    load_Q_i = make_tile_loader(BR, D, NT, (sm.q, sm.qs))
    load_dO_i = make_tile_loader(BR, DV, NT, (sm.do, sm.os))
    store_dQ_i = make_tile_storer(BR, D, NT, (sm.q, sm.qs))
    NCNT = counter_slots(COUNT)
    flush_counts = counts_flusher()
    block_of = make_block_of(MASK.bounded, HEAVY_LAST=True)
    Q_R, K_R, V_R, DO_R = (slot("q", "read"), slot("k", "read"), slot("v", "read"),
                           slot("do", "read"))
    LSE_R, DELTA_R, DQ_W = slot("lse", "read"), slot("delta", "read"), slot("dq", "write")
    kv_head = make_kv_head(GROUP)

    @cuda.jit(**kernel_options(NT, 255))
    def q_outer_bwd_dq(q, k, v, do, lse, delta, dq, counts, scale, scale_log2):
        # masked: the query blocks that see the most K/V blocks start first (`block_grid`)
        i, bh = block_of(q.shape[0])
        kv = kv_head(bh)  # query head bh's K/V head (grouped-query attention)
        n_q = q.shape[1]
        n_k = k.shape[1]
        row0 = i * BR
        n_rows = min(BR, n_q - row0)
        buf = cuda.shared.array(0, SHARED_F32, alignment=SHARED_ALIGN)
        s = cuda.local.array(NS, float32)
        dp = cuda.local.array(NS, float32)
        dq_i = cuda.local.array(ACC_Q, float32)
        cnt = cuda.local.array(NCNT, int64)
        if COUNT:
            zero(cnt)
        for e in range(ACC_Q):
            dq_i[e] = float32(0.0)
        clear(buf)
        cuda.syncthreads()  # the buffer is clear before any tile lands in it
        # Q_i, dO_i, lse_i, delta_i: read from HBM once, stay on chip for every K/V block
        moved_q = load_Q_i(buf, q, bh, row0, n_rows, 0, D)
        moved_do = load_dO_i(buf, do, bh, row0, n_rows, 0, DV)
        rows_in = lse_stats(buf, lse, delta, bh, row0, n_rows)
        if COUNT:
            cnt[Q_R] += moved_q
            cnt[DO_R] += moved_do
            cnt[LSE_R] += rows_in
            cnt[DELTA_R] += rows_in
        j0, j1 = kv_blocks(row0, n_rows, n_q, n_k)  # other K/V blocks are all masked
        for j in range(j0, j1):
            key0 = j * BC
            bc = min(BC, n_k - key0)
            cuda.syncthreads()  # every thread is done with the previous K_j, V_j, dS
            # K_j, V_j: reloaded from HBM by every query block
            moved_k = load_K_j(buf, k, kv, key0, bc, 0, D)
            moved_v = load_V_j(buf, v, kv, key0, bc, 0, DV)
            zero_outside(buf, sm.k, sm.qs, bc, D, BC, D)  # a tail's stale keys
            zero_outside(buf, sm.v, sm.os, bc, DV, BC, DV)
            if COUNT:
                cnt[K_R] += moved_k
                cnt[V_R] += moved_v
            cuda.syncthreads()  # K_j, V_j (and Q_i, dO_i, stats) are in shared memory
            scores(buf, s)
            grad_scores(buf, dp)
            # row0 + N_k - N_q: the first row's diagonal key (bottom-right aligned)
            probs(buf, s, dp, row0 + n_k - n_q, key0, n_rows, bc, scale_log2)
            cuda.syncthreads()  # dS_ij is complete in shared memory
            acc_dq(buf, dq_i)
        cuda.syncthreads()  # every thread is done with Q_i: its tile stages dQ_i
        stage_dq(buf, dq_i, scale)
        cuda.syncthreads()  # dQ_i is complete in shared memory
        # dQ_i: written to HBM once
        moved = store_dQ_i(buf, dq, bh, row0, n_rows, 0, D)
        if COUNT:
            cnt[DQ_W] += moved
            flush_counts(cnt, counts)

    return q_outer_bwd_dq


@kernel_factory
def make_convert_kernel(COUNT):
    NCNT = counter_slots(COUNT)
    flush_counts = counts_flusher()
    ACC_R, DQ_W = slot("dq_acc", "read"), slot("dq", "write")

    @cuda.jit
    def q_outer_bwd_convert(dq_acc, dq, counts):
        bh = cuda.blockIdx.y
        n_q, d = dq.shape[1], dq.shape[2]
        cnt = cuda.local.array(NCNT, int64)
        if COUNT:
            zero(cnt)
        e = cuda.blockIdx.x * CONVERT_THREADS + cuda.threadIdx.x
        if e < n_q * d:
            # dq_acc -> dQ: read once, written once in the input dtype
            dq[bh, e // d, e % d] = narrow(dq_acc[bh, e // d, e % d], dq)
            if COUNT:
                cnt[ACC_R] += 1
                cnt[DQ_W] += 1
        if COUNT:
            flush_counts(cnt, counts)

    return q_outer_bwd_convert


class MainKernels(NamedTuple):
    """q_outer's backward kernels between the preprocess and the convert, for one problem."""

    main: object  # the K/V-outer kernel (dK, dV; dQ by atomics)
    threads: int
    dq: object  # dq="separate": the Q-outer dQ kernel, else None
    dq_threads: int
    shared: int  # dynamic shared bytes of the K/V-outer kernel
    dq_shared: int  # and of the dQ kernel


@register
class QOuterBackward(GradTileBackward):
    name = "q_outer"
    summary = ("FlashAttention-2 backward: one CTA per K/V block for dK, dV; dQ by float32 "
               "atomics, or a Q-outer kernel (dq=separate)")
    OPTIONS = {"dq": Option(
        default="atomic", help="how dQ is accumulated", backward=True,
        allowed="'atomic' (float32 atomic adds) or 'separate' (a Q-outer kernel; "
                "deterministic)",
        check=choice_option("atomic", "separate"), examples=("atomic", "separate"))}
    EXPECTED_SLOPES = {"m": -1, "n": 2, "d": 2}
    TRAFFIC_CLASS = "flash"
    LOOP_NEST = """
        preprocess: delta = rowsum(dO o O)    # atomic: dq_acc = 0 in HBM too
        for (b, h, j) in parallel:            # one CTA per K/V block
            load K_j, V_j                     # HBM -> shared, once
            dK_j, dV_j = 0
            for i in range(first_j, end_j):   # the query blocks that see block j
                load Q_i, dO_i, lse_i, delta_i   # HBM -> shared, per (j, i)
                P = exp(tau Q_i K_j^T - lse_i); dS = P o (dO_i V_j^T - delta_i)
                dV_j += P^T dO_i; dK_j += tau dS^T Q_i
                dq_acc_i += tau dS K_j        # atomic: float32 atomics in HBM
            write dK_j, dV_j                  # -> HBM, once
        atomic:   dQ = dq_acc                 # convert kernel
        separate: for (b, h, i) in parallel:  # one CTA per query block
                      load Q_i, dO_i, lse_i, delta_i   # once
                      for j in range(first_i, end_i): load K_j, V_j; dQ_i += tau dS K_j
                      write dQ_i
    """

    def expected_slopes(self, options: dict) -> dict:
        # separate: the Q-outer dQ kernel reads K, V once per query block of
        # Br = min(M / 4d, d) rows, N^2 (d + dv) / Br in all, which stops falling with M
        # once M > 4 d^2: only the slope against N is Theorem 5's
        if options.get("dq") == "separate":
            return {"n": 2}
        return dict(self.EXPECTED_SLOPES)

    def forward_saves(self) -> str:
        return "lse"

    def model(self, p: Problem) -> Ledger:
        atomic = p.option("dq") == "atomic"
        rows_per_j = int(p.visiting_rows().sum())
        keys_read = int(p.visited_keys().sum())
        per_head = {
            "q": {"read": rows_per_j * p.d + (0 if atomic else p.n_q * p.d)},
            "k": {"read": p.n_k * p.d + (0 if atomic else keys_read * p.d)},
            "v": {"read": p.n_k * p.dv + (0 if atomic else keys_read * p.dv)},
            "o": {"read": p.n_q * p.dv},
            "do": {"read": p.n_q * p.dv + rows_per_j * p.dv + (0 if atomic else p.n_q * p.dv)},
            "lse": {"read": rows_per_j + (0 if atomic else p.n_q)},
            "delta": {"read": rows_per_j + (0 if atomic else p.n_q), "write": p.n_q},
            "dq": {"write": p.n_q * p.d},
            "dk": {"write": p.n_k * p.d},
            "dv": {"write": p.n_k * p.dv},
            "dq_acc": ({"read": (rows_per_j + p.n_q) * p.d, "write": (rows_per_j + p.n_q) * p.d}
                       if atomic else {}),
        }
        return self.ledger(per_head, p.bh)

    def walk(self, p: Problem) -> Counter:
        atomic = p.option("dq") == "atomic"
        c = Counter()
        c["o", "read"] += p.n_q * p.dv  # preprocess
        c["do", "read"] += p.n_q * p.dv
        c["delta", "write"] += p.n_q
        if atomic:
            c["dq_acc", "write"] += p.n_q * p.d
        for j in range(0, p.n_k, p.block_k):  # K/V-outer
            keys = rows(j, p.block_k, p.n_k)
            c["k", "read"] += len(keys) * p.d
            c["v", "read"] += len(keys) * p.dv
            for i in range(0, p.n_q, p.block_q):
                queries = rows(i, p.block_q, p.n_q)
                if not sees(p, queries, keys):
                    continue
                for tensor, width in (("q", p.d), ("do", p.dv), ("lse", 1), ("delta", 1)):
                    c[tensor, "read"] += len(queries) * width
                if atomic:
                    c["dq_acc", "read"] += len(queries) * p.d
                    c["dq_acc", "write"] += len(queries) * p.d
            c["dk", "write"] += len(keys) * p.d
            c["dv", "write"] += len(keys) * p.dv
        if atomic:  # convert
            c["dq_acc", "read"] += p.n_q * p.d
            c["dq", "write"] += p.n_q * p.d
            return c
        for i in range(0, p.n_q, p.block_q):  # separate: Q-outer
            queries = rows(i, p.block_q, p.n_q)
            for tensor, width in (("q", p.d), ("do", p.dv), ("lse", 1), ("delta", 1)):
                c[tensor, "read"] += len(queries) * width
            for j in range(0, p.n_k, p.block_k):
                keys = rows(j, p.block_k, p.n_k)
                if sees(p, queries, keys):
                    c["k", "read"] += len(keys) * p.d
                    c["v", "read"] += len(keys) * p.dv
            c["dq", "write"] += len(queries) * p.d
        return c

    def tiles_for_sram(self, m: int, d: int) -> tuple[int, int]:
        # The K/V block is the resident one: Algorithm 4's sizes, Bc = ceil(M / 4d).
        bc = ceil_div(m, 4 * d)
        return min(bc, d), bc

    def workspace_bytes(self, p: Problem) -> int:
        # delta (float32 per query row), and dq_acc (float32 N_q d) with atomic
        acc = p.n_q * p.d if p.option("dq") == "atomic" else 0
        return 4 * p.bh * (p.n_q + acc)

    def allocate_workspace(self, p: Problem, empty=device_empty) -> tuple:
        shape = (p.bh, p.n_q, p.d) if p.option("dq") == "atomic" else (1, 1, 1)
        return empty((p.bh, p.n_q), np.float32), empty(shape, np.float32)

    @staticmethod
    def tensor_cores(p: Problem) -> TensorCores | None:
        """The tensor-core build p's main kernels run, or None (CUDA cores)."""
        return tc_backward_spec(p)

    def fast_tiles(self, p: Problem) -> tuple[int, int] | None:
        """FAST_TILES' tiles for p's operands, dQ option and head dim on tensor cores of a
        Hopper GPU (where they were measured); None on the simulator (not a speed), other
        GPUs and what no sweep measured."""
        spec = self.tensor_cores(p)
        if spec is None or SIMULATOR or not has_wgmma():
            return None
        operands = spec.dtype if spec.tf32 else "16-bit"
        return FAST_TILES.get((operands, p.option("dq"), p.d))

    def threads(self, p: Problem) -> int:
        if self.tensor_cores(p) is not None:
            return tc.tc_kv_threads(p.block_k)
        return super().threads(p)

    def output_roundings(self, p: Problem) -> int:
        # tensor cores round P and dS to 16-bit inputs' type for the products that read them
        # (TF32 keeps them float32; float32's tolerance counts no roundings)
        return 1 + (TC_ROUNDINGS if self.tensor_cores(p) is not None else 0)

    def main_kernels(self, p: Problem, count: bool) -> MainKernels:
        """The K/V-outer kernel and (separate) the Q-outer dQ kernel: on tensor cores for
        16-bit inputs and TF32, else on CUDA cores."""
        separate = p.option("dq") == "separate"
        spec = self.tensor_cores(p)
        sizes = (p.block_q, p.block_k, p.d, p.dv, p.mask)
        if spec is not None:
            stages = tc_q_stages(p, spec)
            return MainKernels(
                tc.make_tc_kv_kernel(*sizes, not separate, spec, stages, count, p.group),
                tc.tc_kv_threads(p.block_k),
                tc.make_tc_q_kernel(*sizes, spec, count, p.group) if separate else None,
                tc.tc_q_threads(p.block_q), tc.tc_shared_bytes(*sizes[:4], stages, spec.tf32),
                tc.tc_shared_bytes(*sizes[:4], 1, spec.tf32))
        threads = grad_layout(p.block_q, p.block_k).threads
        shared = grad_shared_layout(*sizes[:4], False, False).bytes
        return MainKernels(make_kv_kernel(*sizes, not separate, count, p.group), threads,
                           make_q_kernel(*sizes, count, p.group) if separate else None,
                           threads,
                           shared, shared)

    def kernels(self, p: Problem, count: bool) -> list[Kernel]:
        atomic = p.option("dq") == "atomic"
        counters = 8 * counter_slots(True) if count else 0
        pre = make_preprocess_kernel(atomic, count)
        mk = self.main_kernels(p, count)
        last = make_convert_kernel(count) if atomic else mk.dq
        limit = dynamic_shared_limit()
        return [Kernel(pre.py_func.__name__, pre, 4 * PRE_ROWS * PRE_LANES + counters, limit),
                Kernel(mk.main.py_func.__name__, mk.main, mk.shared + counters, limit),
                Kernel(last.py_func.__name__, last,
                       (0 if atomic else mk.dq_shared) + counters, limit)]

    def launch(self, p, q, k, v, o, do, lse, dq, dk, dv, counts, *, scale, count,
               forward_workspace, workspace=None):
        spec = self.tensor_cores(p)
        if spec is not None and spec.copies_rows(p.d, p.dv) and not SIMULATOR:
            check_aligned(q=q, k=k, v=v, do=do)  # cp.async copies: before any launch
        delta, dq_acc = workspace or self.allocate_workspace(p)
        pre, main, last = (kern.fn for kern in self.kernels(p, count))
        mk = self.main_kernels(p, count)
        threads, q_threads, shared = mk.threads, mk.dq_threads, mk.shared
        tau, tau_log2 = np.float32(scale), np.float32(scale * math.log2(math.e))
        launch(pre, (ceil_div(p.n_q, PRE_ROWS), p.bh), PRE_ROWS * PRE_LANES, 0, o, do, delta,
               dq_acc, counts)
        launch(main, block_grid(p.tc, p.bh, p.mask.bounded), threads, shared, q, k, v, do, lse,
               delta, dq_acc, dk, dv, counts, tau, tau_log2)
        if p.option("dq") == "atomic":
            launch(last, (ceil_div(p.n_q * p.d, CONVERT_THREADS), p.bh), CONVERT_THREADS, 0,
                   dq_acc, dq, counts)
        else:
            launch(last, block_grid(p.tr, p.bh, p.mask.bounded), q_threads, mk.dq_shared, q,
                   k, v, do, lse, delta, dq, counts, tau, tau_log2)
