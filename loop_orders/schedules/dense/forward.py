"""dense: standard attention (Algorithm 0). S and P are materialised in HBM by three kernels.

    kernel 1, per (batch, head, query block i):   load Q_i
                                                  for j: load K_j; write S_ij = scale Q_i K_j^T
    kernel 2, per (batch, head, query row r):     load S_r; write P_r = softmax(S_r)
    kernel 3, per (batch, head, query block i):   for j: load V_j, P_ij; acc += P_ij V_j
                                                  write O_i

Traffic (elements, per batch x head): Q read once (N_q d); every query block reads all of K
and V (Tr N_k d, Tr N_k dv); S and P are each written once and read once (N_q N_k each way);
O written once. A mask (causal, a window) does not reduce it: masked scores are still
written as -inf. A row that sees no key gets P = 0, O = 0 and lse = -inf.
This is Theta(N d + N^2) for fixed tiles, the baseline of Theorem 2.

Kernel 2 keeps one row of S in shared memory so that S is read exactly once; that bounds N_k
to what 48 KB of shared memory holds.

16-bit inputs run kernels 1 and 3 on tensor cores, with the flash orders' matmul operands
(`tensor_cores.make_tc_operands`): a warp per 16 query rows, S_ij = Q_i K_j^T on mma.sync (on
Hopper's wgmma where the tiles allow, `hopper.supports`) written from its accumulator
fragments, and acc += P_ij V_j with P_ij read from HBM straight into the A fragment (rounded
to 16 bits, as the flash orders' P is). S and P stay float32 in HBM, so the traffic in
elements is the same on either path (in bytes, a 16-bit S and P would halve the quadratic
terms; we keep one declared type per tensor).
"""

from __future__ import annotations

import math
from collections import Counter
from functools import cache

import numpy as np
from numba import float32, int64, uint32, uint64

from ...core.ledger import Ledger, slot
from ...core.mask import NO_MASK
from ...core.schedule import Kernel, Problem, Schedule, ceil_div, register, rows
from ...device.intrinsics import narrow, widen
from ...device.runtime import (
    SHARED_BYTES_LIMIT,
    SHARED_F32,
    SIMULATOR,
    cuda,
    device_empty,
    dynamic_shared_limit,
    kernel_factory,
    launch,
)
from ...microkernel.cuda_cores import tensor_core_kind, uses_wgmma
from ...microkernel.hopper import buffer_align
from ...microkernel.tensor_cores import (
    TensorCores,
    check_aligned,
    make_tc_micro_kernel,
    make_tc_operands,
    tc_shared_layout,
    warp_exchanges_per_tile,
)
from ...microkernel.tiles import (
    counter_slots,
    counts_flusher,
    make_kv_head,
    make_tile_loader,
    make_tile_storer,
    make_visible,
    zero_counts,
)

(Q_R, K_R, V_R, O_W, S_R, S_W, P_R, P_W, LSE_W) = (
    slot("q", "read"), slot("k", "read"), slot("v", "read"), slot("o", "write"),
    slot("s", "read"), slot("s", "write"), slot("p", "read"), slot("p", "write"),
    slot("lse", "write"))

SOFTMAX_MAX_THREADS = 128
SCORE_CHUNK = 32  # columns of S_ij or P_ij staged in shared memory at a time


def score_chunk(block_k: int) -> int:
    """Columns of S_ij (kernel 1) or P_ij (kernel 3) that pass through shared memory at once."""
    return min(block_k, SCORE_CHUNK)


def softmax_threads(n_k: int) -> int:
    """Threads of a kernel-2 CTA: a power of two giving each about 8 columns, at most 128."""
    return min(SOFTMAX_MAX_THREADS, 1 << (ceil_div(n_k, 8) - 1).bit_length())


def softmax_shared_bytes(n_k: int) -> int:
    """Kernel 2's shared memory: the row of S, the per-thread partials, max and sum."""
    return 4 * (n_k + softmax_threads(n_k) + 2)


@cache
def make_row_io(BR: int, W: int, SC: int):
    """(load_rows, store_rows): a query block's rows of width W between HBM and one thread
    per row's registers, staged through a shared tile of SC rows so that HBM sees whole
    rows, coalesced. Every thread of the CTA calls them (barriers inside); they return the
    elements this thread moved."""
    load_chunk = make_tile_loader(SC, W, BR)
    store_chunk = make_tile_storer(SC, W, BR)

    @cuda.jit(device=True)
    def load_rows(regs, stage, src, bh, block0, row):
        moved = 0
        end = min(block0 + BR, src.shape[1])
        for chunk0 in range(block0, end, SC):
            n = min(SC, end - chunk0)
            cuda.syncthreads()  # every thread is done with the stage's previous contents
            moved += load_chunk(stage, src, bh, chunk0, n, 0, W)
            cuda.syncthreads()  # the chunk is in shared memory
            if 0 <= row - chunk0 < n:
                for x in range(W):
                    regs[x] = stage[row - chunk0, x]
        return moved

    @cuda.jit(device=True)
    def store_rows(dst, stage, regs, bh, block0, row):
        moved = 0
        end = min(block0 + BR, dst.shape[1])
        for chunk0 in range(block0, end, SC):
            n = min(SC, end - chunk0)
            cuda.syncthreads()  # every thread is done with the stage's previous contents
            if 0 <= row - chunk0 < n:
                for x in range(W):
                    stage[row - chunk0, x] = regs[x]
            cuda.syncthreads()  # the chunk is complete in shared memory
            moved += store_chunk(stage, dst, bh, chunk0, n, 0, W)
        return moved

    return load_rows, store_rows


@kernel_factory
def make_scores_kernel(BR, BC, D, MASK, COUNT, GROUP):
    NCNT = counter_slots(COUNT)
    visible = make_visible(MASK)  # the keys of a K/V block a row sees
    MASKED = MASK.bounded  # (the unmasked build tests no key)
    flush_counts = counts_flusher()
    load_K_j = make_tile_loader(BC, D, BR)
    SW = score_chunk(BC)
    store_S_ij = make_tile_storer(BR, SW, BR)
    load_q, _ = make_row_io(BR, D, BC)  # one thread per row, staged through K_j
    SW1 = SW + 1
    kv_head = make_kv_head(GROUP)

    @cuda.jit
    def dense_scores(q, k, s_hbm, counts, scale):
        i = cuda.blockIdx.x
        bh = cuda.blockIdx.y
        kv = kv_head(bh)  # query head bh's K/V head (grouped-query attention)
        t = cuda.threadIdx.x
        n_q = q.shape[1]
        n_k = k.shape[1]
        row = i * BR + t
        n_rows = min(BR, n_q - i * BR)
        K_j = cuda.shared.array((BC, D), float32)
        # SW columns of S_ij at a time, padded by one column so that each row starts in
        # its own bank
        S_ij = cuda.shared.array((BR, SW1), float32)
        Q_i = cuda.local.array(D, float32)
        cnt = cuda.local.array(NCNT, int64)
        if COUNT:
            zero_counts(cnt)
        # Q_i: read from HBM once (staged through K_j, coalesced)
        moved = load_q(Q_i, K_j, q, bh, i * BR, row)
        if COUNT:
            cnt[Q_R] += moved
        for j in range((n_k + BC - 1) // BC):
            key0 = j * BC
            bc = min(BC, n_k - key0)
            cuda.syncthreads()  # every thread is done with the previous K_j and S_ij
            # K_j: every query block reads all of K
            moved = load_K_j(K_j, k, kv, key0, bc, 0, D)
            if COUNT:
                cnt[K_R] += moved
            cuda.syncthreads()  # K_j is in shared memory for all rows
            first, end = visible(row + n_k - n_q, key0, bc)  # row + N_k - N_q: its diagonal
            for c0 in range(0, bc, SW):
                width = min(SW, bc - c0)
                for c in range(width if t < n_rows else 0):  # rows past N_q store nothing
                    score = float32(-math.inf)  # masked scores are written too
                    if not MASKED or first <= c0 + c < end:
                        dot = float32(0.0)
                        for x in range(D):
                            dot += Q_i[x] * K_j[c0 + c, x]
                        score = dot * scale
                    S_ij[t, c] = score
                cuda.syncthreads()  # this chunk of S_ij is complete in shared memory
                # S_ij: the quadratic intermediate, written to HBM (whole rows, coalesced)
                moved = store_S_ij(S_ij, s_hbm, bh, i * BR, n_rows, key0 + c0, width)
                if COUNT:
                    cnt[S_W] += moved
                cuda.syncthreads()  # the chunk is stored: S_ij may be overwritten
        if COUNT:
            flush_counts(cnt, counts)

    return dense_scores


@kernel_factory
def make_softmax_kernel(T, SAVE_LSE, COUNT, MASKED=False):
    """Kernel 2 with T threads a row; MASKED: a row may see no key (all its scores -inf),
    and then gets P = 0 and lse = -inf."""
    NCNT = counter_slots(COUNT)
    flush_counts = counts_flusher()

    @cuda.jit
    def dense_softmax(s_hbm, p_hbm, lse, counts):
        row = cuda.blockIdx.x
        bh = cuda.blockIdx.y
        t = cuda.threadIdx.x
        n_k = s_hbm.shape[2]
        s_row = cuda.shared.array(0, dtype=SHARED_F32)  # this row of S, n_k floats
        partial = cuda.shared.array(T, float32)
        stat = cuda.shared.array(2, float32)  # row max, row sum
        cnt = cuda.local.array(NCNT, int64)
        if COUNT:
            zero_counts(cnt)

        # S_r: read from HBM once; each thread keeps the columns c = t (mod T)
        row_max = float32(-math.inf)
        for c in range(t, n_k, T):
            s_row[c] = s_hbm[bh, row, c]
            row_max = max(row_max, s_row[c])
            if COUNT:
                cnt[S_R] += 1
        partial[t] = row_max
        cuda.syncthreads()  # all partial maxima are written
        if t == 0:
            for u in range(1, T):
                row_max = max(row_max, partial[u])
            stat[0] = row_max
        cuda.syncthreads()  # stat[0] holds the row max; partial[] may be reused
        row_max = stat[0]
        if MASKED and row_max == float32(-math.inf):
            row_max = float32(0.0)  # a row that sees no key: exp(-inf - 0) = 0
        row_sum = float32(0.0)
        for c in range(t, n_k, T):
            s_row[c] = math.exp(s_row[c] - row_max)
            row_sum += s_row[c]
        partial[t] = row_sum
        cuda.syncthreads()  # all partial sums are written
        if t == 0:
            for u in range(1, T):
                row_sum += partial[u]
            stat[1] = row_sum
        cuda.syncthreads()  # stat[1] holds the row sum
        empty = MASKED and stat[1] == float32(0.0)  # the row sees no key: P = 0
        inv_sum = float32(0.0) if empty else float32(1.0) / stat[1]
        for c in range(t, n_k, T):
            # P_r: the second quadratic intermediate, written to HBM
            p_hbm[bh, row, c] = s_row[c] * inv_sum
            if COUNT:
                cnt[P_W] += 1
        if SAVE_LSE and t == 0:
            lse_r = float32(-math.inf)  # a row that sees no key (log 0: the simulator raises)
            if not MASKED or stat[1] != float32(0.0):
                lse_r = row_max + math.log(stat[1])
            lse[bh, row] = lse_r
            if COUNT:
                cnt[LSE_W] += 1
        if COUNT:
            flush_counts(cnt, counts)

    return dense_softmax


@kernel_factory
def make_pv_kernel(BR, BC, DV, MASK, COUNT, GROUP):
    NCNT = counter_slots(COUNT)
    visible = make_visible(MASK)  # the keys of a K/V block a row sees
    MASKED = MASK.bounded  # (the unmasked build tests no key)
    flush_counts = counts_flusher()
    load_V_j = make_tile_loader(BC, DV, BR)
    SW = score_chunk(BC)
    load_P_ij = make_tile_loader(BR, SW, BR)
    _, store_o = make_row_io(BR, DV, BC)  # one thread per row, staged through V_j
    SW1 = SW + 1
    kv_head = make_kv_head(GROUP)

    @cuda.jit
    def dense_pv(p_hbm, v, o, counts):
        i = cuda.blockIdx.x
        bh = cuda.blockIdx.y
        kv = kv_head(bh)  # query head bh's K/V head (grouped-query attention)
        t = cuda.threadIdx.x
        n_q = p_hbm.shape[1]
        n_k = v.shape[1]
        row = i * BR + t
        n_rows = min(BR, n_q - i * BR)
        V_j = cuda.shared.array((BC, DV), float32)
        # SW columns of P_ij at a time, padded by one column so that each row starts in
        # its own bank
        P_ij = cuda.shared.array((BR, SW1), float32)
        acc = cuda.local.array(DV, float32)
        cnt = cuda.local.array(NCNT, int64)
        if COUNT:
            zero_counts(cnt)
        for x in range(DV):
            acc[x] = float32(0.0)
        for j in range((n_k + BC - 1) // BC):
            key0 = j * BC
            bc = min(BC, n_k - key0)
            cuda.syncthreads()  # every row is done with the previous V_j
            # V_j: every query block reads all of V
            moved = load_V_j(V_j, v, kv, key0, bc, 0, DV)
            if COUNT:
                cnt[V_R] += moved
            for c0 in range(0, bc, SW):
                width = min(SW, bc - c0)
                cuda.syncthreads()  # every row is done with the previous chunk of P_ij
                # P_ij: read back from HBM once per element (whole rows, coalesced)
                moved = load_P_ij(P_ij, p_hbm, bh, i * BR, n_rows, key0 + c0, width)
                if COUNT:
                    cnt[P_R] += moved
                cuda.syncthreads()  # V_j and this chunk of P_ij are in shared memory
                first, end = visible(row + n_k - n_q, key0, bc)  # its diagonal: row + N_k - N_q
                for c in range(width if t < n_rows else 0):  # rows past N_q store nothing
                    if not MASKED or first <= c0 + c < end:
                        # a masked key (P = 0) never touches V: 0 * NaN would be NaN
                        p = P_ij[t, c]
                        for x in range(DV):
                            acc[x] += p * V_j[c0 + c, x]
        # O_i: written to HBM once (staged through V_j, coalesced)
        moved = store_o(o, V_j, acc, bh, i * BR, row)
        if COUNT:
            cnt[O_W] += moved
        if COUNT:
            flush_counts(cnt, counts)

    return dense_pv


@kernel_factory
def make_tc_scores_kernel(BR, BC, D, SPEC, MASK, COUNT, GROUP):
    """Kernel 1 on tensor cores (SPEC: `tensor_cores.TensorCores`)."""
    visible = make_visible(MASK)  # the keys of a K/V block a row sees
    NCNT = counter_slots(COUNT)
    flush_counts = counts_flusher()
    ops = make_tc_operands(BR, BC, D, 0, SPEC)
    K = tc_shared_layout(BR, BC, D, 0, False, SPEC).k
    NKT = -(-BC // 16) * 2
    NS = 4 * NKT
    NEG_INF = float32(-math.inf)
    kv_head = make_kv_head(GROUP)
    ALIGN = buffer_align(SPEC) if SPEC.wgmma else None  # as the operands' views

    @cuda.jit
    def dense_scores_tc(q, k, s_hbm, counts, scale):
        i = cuda.blockIdx.x
        bh = cuda.blockIdx.y
        kv = kv_head(bh)  # query head bh's K/V head (grouped-query attention)
        n_q = q.shape[1]
        n_k = k.shape[1]
        row0 = i * BR
        n_rows = min(BR, n_q - row0)
        buf = cuda.shared.array(0, SHARED_F32, alignment=ALIGN)
        tile = ops.tiles()
        w, lane = ops.coords()
        t2 = 2 * (lane & uint32(3))
        s = cuda.local.array(NS, float32)
        cnt = cuda.local.array(NCNT, int64)
        if COUNT:
            zero_counts(cnt)
        ops.clear(buf)
        cuda.syncthreads()  # the tiles' padding is zero before any copy lands
        # Q_i: read from HBM once
        moved = ops.load_q(q, bh, row0, n_rows)
        if COUNT:
            cnt[Q_R] += moved
        for j in range((n_k + BC - 1) // BC):
            key0 = j * BC
            bc = min(BC, n_k - key0)
            cuda.syncthreads()  # every warp is done with the previous K_j
            # K_j: every query block reads all of K
            moved = ops.load_k(k, kv, key0, bc, 0)
            if COUNT:
                cnt[K_R] += moved
            ops.wait_loads()
            cuda.syncthreads()  # Q_i and K_j are in shared memory
            ops.scores(tile, s, w, lane, uint64(K))
            for a in range(2):
                r = int(ops.local_row(w, lane, a))
                first, end = visible(row0 + r + n_k - n_q, key0, bc)  # its diagonal key
                for n in range(NKT):
                    for c in range(2):
                        col = int(uint32(8 * n + c) + t2)
                        if r < n_rows and col < bc:
                            x = s[4 * n + 2 * a + c] * scale
                            if not first <= col < end:
                                x = NEG_INF  # masked scores are written too
                            # S_ij: the quadratic intermediate, written to HBM from the
                            # accumulator fragment (a warp's lanes fill whole sectors)
                            s_hbm[bh, row0 + r, key0 + col] = narrow(x, s_hbm)
                            if COUNT:
                                cnt[S_W] += 1
        if COUNT:
            flush_counts(cnt, counts)

    return dense_scores_tc


@kernel_factory
def make_tc_pv_kernel(BR, BC, DV, SPEC, COUNT, GROUP):
    """Kernel 3 on tensor cores (SPEC: `tensor_cores.TensorCores`)."""
    NCNT = counter_slots(COUNT)
    flush_counts = counts_flusher()
    ops = make_tc_operands(BR, BC, 0, DV, SPEC)
    mk = make_tc_micro_kernel(BR, BC, 0, DV, SPEC, NO_MASK, False)
    V = tc_shared_layout(BR, BC, 0, DV, False, SPEC).v
    NKT = -(-BC // 16) * 2
    NS = 4 * NKT
    NACC = mk.NACC
    kv_head = make_kv_head(GROUP)
    ALIGN = buffer_align(SPEC) if SPEC.wgmma else None  # as the operands' views

    @cuda.jit
    def dense_pv_tc(p_hbm, v, o, counts):
        i = cuda.blockIdx.x
        bh = cuda.blockIdx.y
        kv = kv_head(bh)  # query head bh's K/V head (grouped-query attention)
        n_q = p_hbm.shape[1]
        n_k = v.shape[1]
        row0 = i * BR
        n_rows = min(BR, n_q - row0)
        buf = cuda.shared.array(0, SHARED_F32, alignment=ALIGN)
        tile = ops.tiles()
        w, lane = ops.coords()
        t2 = 2 * (lane & uint32(3))
        s = cuda.local.array(NS, float32)
        acc = cuda.local.array(NACC, float32)
        one = cuda.local.array(2, float32)
        cnt = cuda.local.array(NCNT, int64)
        if COUNT:
            zero_counts(cnt)
        for x in range(NACC):
            acc[x] = float32(0.0)
        one[0] = float32(1.0)
        one[1] = float32(1.0)
        ops.clear(buf)
        for j in range((n_k + BC - 1) // BC):
            key0 = j * BC
            bc = min(BC, n_k - key0)
            cuda.syncthreads()  # the padding is zero; every warp is done with the last V_j
            # V_j: every query block reads all of V
            moved = ops.load_v(v, kv, key0, bc, 0)
            if COUNT:
                cnt[V_R] += moved
            for a in range(2):
                r = int(ops.local_row(w, lane, a))
                for n in range(NKT):
                    for c in range(2):
                        col = int(uint32(8 * n + c) + t2)
                        x = float32(0.0)
                        if r < n_rows and col < bc:
                            # P_ij: read back from HBM once per element, straight into the
                            # A fragment of P_ij V_j
                            x = widen(p_hbm[bh, row0 + r, key0 + col])
                            if COUNT:
                                cnt[P_R] += 1
                        s[4 * n + 2 * a + c] = x
            ops.wait_loads()
            cuda.syncthreads()  # V_j is in shared memory
            ops.accumulate(tile, s, acc, lane, uint64(V))
        cuda.syncthreads()  # every warp is done with V_j: O_i's stage takes its place
        mk.give_o(buf, acc, one)
        cuda.syncthreads()  # O_i is complete in the float32 stage
        # O_i: written to HBM once (whole rows, coalesced)
        moved = mk.store_o(buf, o, bh, row0, n_rows)
        if COUNT:
            cnt[O_W] += moved
            flush_counts(cnt, counts)

    return dense_pv_tc


@register
class Dense(Schedule):
    name = "dense"
    BACKWARD = "dense"
    TENSOR_CORES = True
    summary = "standard attention: S and P materialised in HBM by three kernels"
    EXPECTED_SLOPES = {"n": 2}
    TRAFFIC_CLASS = "standard"
    # The seed explainer's example: Q 12, K and V each read by Tr = 3 query blocks (36 + 36),
    # O 12, S and P each written and read once (36 + 36 each way).
    WORKED_EXAMPLE = ({"n_q": 6, "d": 2, "block_q": 2, "block_k": 2}, 240)
    LOOP_NEST = """
        # kernel 1: scores
        for (b, h, i) in parallel:            # one CTA per query block, Br threads
            load Q_i                          # HBM -> registers
            for j in range(Tc):
                load K_j                      # HBM -> shared, per query block
                write S_ij = Q_i K_j^T * scale   # shared -> HBM, masked entries as -inf
        # kernel 2: softmax
        for (b, h, r) in parallel:            # one CTA per query row
            load S_r                          # HBM -> shared, once
            write P_r = softmax(S_r)          # HBM
        # kernel 3: output
        for (b, h, i) in parallel:            # one CTA per query block, Br threads
            for j in range(Tc):
                load V_j                      # HBM -> shared, per query block
                load P_ij                     # HBM -> shared, once
                acc_i += P_ij V_j
            write O_i = acc_i                 # HBM
    """

    def model(self, p: Problem) -> Ledger:
        scores = p.n_q * p.n_k
        per_head = {
            "q": {"read": p.n_q * p.d},
            "k": {"read": p.tr * p.n_k * p.d},
            "v": {"read": p.tr * p.n_k * p.dv},
            "o": {"write": p.n_q * p.dv},
            "s": {"read": scores, "write": scores},
            "p": {"read": scores, "write": scores},
            "lse": {"write": p.n_q if p.save_lse else 0},
        }
        return self.ledger(per_head, p.bh)

    def walk(self, p: Problem) -> Counter:
        c = Counter()
        for i in range(0, p.n_q, p.block_q):  # kernel 1
            queries = rows(i, p.block_q, p.n_q)
            c["q", "read"] += len(queries) * p.d
            for j in range(0, p.n_k, p.block_k):
                keys = rows(j, p.block_k, p.n_k)
                c["k", "read"] += len(keys) * p.d
                c["s", "write"] += len(queries) * len(keys)
        for _r in range(p.n_q):  # kernel 2
            for _col in range(p.n_k):
                c["s", "read"] += 1
                c["p", "write"] += 1
            if p.save_lse:
                c["lse", "write"] += 1
        for i in range(0, p.n_q, p.block_q):  # kernel 3
            queries = rows(i, p.block_q, p.n_q)
            for j in range(0, p.n_k, p.block_k):
                keys = rows(j, p.block_k, p.n_k)
                c["v", "read"] += len(keys) * p.dv
                c["p", "read"] += len(queries) * len(keys)
            c["o", "write"] += len(queries) * p.dv
        return c

    def workspace_bytes(self, p: Problem) -> int:
        # S and P: N_q x N_k float32 scores per (batch, head), each materialised in HBM.
        return 2 * p.bh * p.n_q * p.n_k * 4

    def tiles_for_sram(self, m: int, d: int) -> tuple[int, int]:
        # Same tile shapes as q_outer: a query block of M/(4d) rows against K/V tiles.
        big = ceil_div(m, 4 * d)
        return big, min(big, d)

    def check(self, p: Problem) -> None:
        softmax = softmax_shared_bytes(p.n_k)
        if softmax > SHARED_BYTES_LIMIT:
            most = (SHARED_BYTES_LIMIT - 4 * (SOFTMAX_MAX_THREADS + 2)) // 4
            raise ValueError(
                f"n_k: dense keeps one row of S in shared memory ({softmax} bytes for "
                f"n_k={p.n_k}); the limit is {SHARED_BYTES_LIMIT} bytes, so n_k <= {most}")

    def allocate_workspace(self, p: Problem, empty=device_empty) -> tuple:
        shape = (p.bh, p.n_q, p.n_k)
        return empty(shape, np.float32), empty(shape, np.float32)

    def layout(self, p: Problem) -> TensorCores | None:
        """Tensor cores for kernels 1 and 3 on 16-bit inputs (and TF32, opted in), on wgmma
        where the device and the tiles have it (`uses_wgmma`), else None (CUDA cores)."""
        kind = tensor_core_kind(self, p)
        return None if kind is None else TensorCores(kind, wgmma=uses_wgmma(kind, p))

    def threads(self, p: Problem) -> int:
        lay = self.layout(p)
        return p.block_q if lay is None else lay.threads(p.block_q, p.block_k)

    def output_roundings(self, p: Problem) -> int:
        # on tensor cores P_ij is rounded (16 bits, or TF32) before P_ij V_j
        return 1 + (self.layout(p) is not None)

    def warp_exchanges(self, p: Problem) -> int:
        lay = self.layout(p)
        if lay is None:
            return 0
        per_pair = (warp_exchanges_per_tile(lay, p.block_k, p.d, 0)
                    + warp_exchanges_per_tile(lay, p.block_k, 0, p.dv))
        return p.bh * p.tr * p.tc * lay.warps(p.block_q) * per_pair

    def tc_shared_bytes(self, p: Problem) -> tuple[int, int]:
        """The dynamic buffers of the tensor-core kernels 1 and 3 (each builds its operands
        only: Q_i and K_j, or V_j and the O_i stage)."""
        lay = self.layout(p)
        return tuple(tc_shared_layout(p.block_q, p.block_k, d, dv, False, lay).bytes
                     for d, dv in ((p.d, 0), (0, p.dv)))

    def kernels(self, p: Problem, count: bool) -> list[Kernel]:
        counters = 8 * counter_slots(True) if count else 0
        lay = self.layout(p)
        if lay is None:
            chunk = p.block_q * (score_chunk(p.block_k) + 1)
            fns = [(make_scores_kernel(p.block_q, p.block_k, p.d, p.mask, count, p.group),
                    4 * (p.block_k * p.d + chunk), SHARED_BYTES_LIMIT),
                   (make_pv_kernel(p.block_q, p.block_k, p.dv, p.mask, count, p.group),
                    4 * (p.block_k * p.dv + chunk), SHARED_BYTES_LIMIT)]
        else:
            scores_bytes, pv_bytes = self.tc_shared_bytes(p)
            fns = [(make_tc_scores_kernel(p.block_q, p.block_k, p.d, lay, p.mask, count,
                                          p.group),
                    scores_bytes, dynamic_shared_limit()),
                   (make_tc_pv_kernel(p.block_q, p.block_k, p.dv, lay, count, p.group),
                    pv_bytes, dynamic_shared_limit())]
        # (a third argument only under a mask: the unmasked kernel keeps its key)
        masked = (True,) if p.mask.bounded else ()
        fns.insert(1, (make_softmax_kernel(softmax_threads(p.n_k), p.save_lse, count, *masked),
                       softmax_shared_bytes(p.n_k), SHARED_BYTES_LIMIT))
        return [Kernel(fn.py_func.__name__, fn, b + counters, limit) for fn, b, limit in fns]

    def launch(self, p, q, k, v, out, lse, counts, *, scale, count, workspace=None):
        s_hbm, p_hbm = workspace or self.allocate_workspace(p)
        scores, softmax, pv = (kernel.fn for kernel in self.kernels(p, count))
        shared = (0, 0)  # CUDA cores: static shared memory
        lay = self.layout(p)
        if lay is not None:  # tensor cores: dynamic buffers of cp.async'd tiles
            if not SIMULATOR and lay.copies_rows(p.d):  # kernel 1's Q_i, K_j
                check_aligned(q=q, k=k)
            if not SIMULATOR and lay.copies_rows(p.dv):  # kernel 3's V_j
                check_aligned(v=v)
            shared = self.tc_shared_bytes(p)
        threads = self.threads(p)
        launch(scores, (p.tr, p.bh), threads, shared[0], q, k, s_hbm, counts, np.float32(scale))
        launch(softmax, (p.n_q, p.bh), softmax_threads(p.n_k), 4 * p.n_k, s_hbm, p_hbm, lse,
               counts)
        launch(pv, (p.tr, p.bh), threads, shared[1], p_hbm, v, out, counts)
