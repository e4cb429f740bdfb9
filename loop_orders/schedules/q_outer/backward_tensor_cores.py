"""q_outer's backward kernels on tensor cores (16-bit inputs, float32 at a TF32 precision):
the loop nests of `backward` (the same preprocess and convert kernels, the same traffic) over
the tensor-core tile steps of `microkernel.grad_tensor_cores`.

    K/V-outer, per (batch, head), K/V block j in parallel:   # W = ceil(Bc / 16) warps
        load K_j, V_j                                         # once, cp.async
        for i in i0_j .. i1_j - 1:                            # the query blocks that see j
            load Q_i, dO_i, lse_i, delta_i                    # per (j, i)
            kv_step: S^T, dP^T, P^T, dS^T; dV_j += P^T dO_i; dK_j += dS^T Q_i;  dS^T -> shared
            atomic: dq_acc_i += tau dS K_j                    # warps over 16-row slices
        write dK_j, dV_j                                      # from the fragments
    separate, Q-outer, query block i in parallel:             # W = ceil(Br / 16) warps
        load Q_i, dO_i, lse_i, delta_i
        for j in j0_i .. j1_i - 1:                            # the K/V blocks i sees
            load K_j, V_j;  q_step: dQ_i += dS K_j
        write tau dQ_i
"""

from __future__ import annotations

from numba import float32, int64, uint32

from ...core.ledger import slot
from ...device.runtime import (
    SHARED_ALIGN,
    SHARED_F32,
    cuda,
    inlined,
    kernel_factory,
    kernel_options,
)
from ...microkernel.grad_tensor_cores import (
    make_tc_grad_io,
    make_tc_grad_steps,
    tc_grad_layout,
    tc_grad_warps,
)
from ...microkernel.tensor_cores import WARP_ROWS, _up
from ...microkernel.tiles import (
    counter_slots,
    counts_flusher,
    make_block_of,
    make_kv_blocks,
    make_kv_head,
    make_q_blocks,
)
from ...microkernel.tiles import zero_counts as zero


def tc_kv_threads(block_k: int) -> int:
    """Threads of the K/V-outer kernel: a warp per 16 keys."""
    return 32 * tc_grad_warps(block_k)


def tc_q_threads(block_q: int) -> int:
    """Threads of the Q-outer dQ kernel: a warp per 16 query rows."""
    return 32 * tc_grad_warps(block_q)


def tc_shared_bytes(block_q: int, block_k: int, d: int, dv: int, stages: int,
                    tf32: bool = False) -> int:
    return tc_grad_layout(block_q, block_k, d, dv, False, stages, tf32).bytes


def _make_block_loads(BR, BC, D, DV, SPEC, NT, STAGES, COUNT):
    """load_block(q, do, lse, delta, bh, row0, n_rows, stage, buf, cnt): Q_i, dO_i (cp.async)
    and lse_i, delta_i (the stats rows) of a query block into buffer `stage`, counted."""
    io = make_tc_grad_io(BR, BC, D, DV, False, SPEC, NT, STAGES)
    load_q, load_do, lse_stats = io.load_q, io.load_do, io.lse_stats
    Q_R, DO_R = slot("q", "read"), slot("do", "read")
    LSE_R, DELTA_R = slot("lse", "read"), slot("delta", "read")

    @inlined
    def load_block(q, do, lse, delta, bh, row0, n_rows, stage, buf, cnt):
        # Q_i, dO_i, lse_i, delta_i: read per visited (j, i)
        moved_q = load_q(q, bh, row0, n_rows, stage)
        moved_do = load_do(do, bh, row0, n_rows, stage)
        rows_in = lse_stats(buf, lse, delta, bh, row0, n_rows, stage)
        if COUNT:
            cnt[Q_R] += moved_q
            cnt[DO_R] += moved_do
            cnt[LSE_R] += rows_in
            cnt[DELTA_R] += rows_in

    return load_block


@kernel_factory
def make_tc_kv_kernel(BR, BC, D, DV, MASK, ATOMIC, SPEC, STAGES, COUNT, GROUP):
    NT = tc_kv_threads(BC)
    W = NT // 32
    RT = _up(BR, WARP_ROWS) // WARP_ROWS  # 16-row slices of Q_i (dQ_i's product)
    DT, DVT = _up(D, 16) // 8, _up(DV, 16) // 8  # 8-wide n-tiles of dK_j (dQ_i), dV_j
    NDK, NDV = 4 * DT, 4 * DVT  # a thread's accumulators
    io = make_tc_grad_io(BR, BC, D, DV, False, SPEC, NT, STAGES)
    st = make_tc_grad_steps(BR, BC, D, DV, MASK, False, SPEC, NT, STAGES)
    clear, coords, wait_loads = io.clear, io.coords, io.wait_loads
    load_k, load_v, store_dk, store_dv = io.load_k, io.load_v, io.store_dk, io.store_dv
    kv_step, dq_partial = st.kv_step, st.dq_partial
    load_block = _make_block_loads(BR, BC, D, DV, SPEC, NT, STAGES, COUNT)
    NCNT = counter_slots(COUNT)
    flush_counts = counts_flusher()
    MASKED = MASK.bounded
    block_of = make_block_of(MASKED, HEAVY_LAST=False)
    q_blocks = make_q_blocks(BR, MASK)  # [first_j, end_j): the query blocks that see j
    K_R, V_R = slot("k", "read"), slot("v", "read")
    ACC_R, ACC_W = slot("dq_acc", "read"), slot("dq_acc", "write")
    DK_W, DV_W = slot("dk", "write"), slot("dv", "write")

    @inlined
    def add_dq(dq_acc, bh, row0, n_rows, acc, scale, m, lane):
        """dq_acc rows 16 m + g + 8 a of the block += tau acc, float32 atomics (each a read
        and a write of one element in HBM); returns how many elements it added."""
        g, t2 = lane >> uint32(2), uint32(2) * (lane & uint32(3))
        added = 0
        for a in range(2):
            r = 16 * m + int(g) + 8 * a
            if r < n_rows:
                for n in range(DT):
                    for c in range(2):
                        x = int(uint32(8 * n + c) + t2)
                        if x < D:
                            cuda.atomic.add(dq_acc, (bh, row0 + r, x),
                                            acc[4 * n + 2 * a + c] * scale)
                            added += 1
        return added

    kv_head = make_kv_head(GROUP)

    @cuda.jit(**kernel_options(NT, 255))
    def q_outer_bwd_tc(q, k, v, do, lse, delta, dq_acc, dk, dv, counts, scale, scale_log2):
        # masked: the K/V blocks the most query blocks see start first (`block_grid`)
        j, bh = block_of(q.shape[0])
        kv = kv_head(bh)  # query head bh's K/V head (grouped-query attention)
        n_q = q.shape[1]
        n_k = k.shape[1]
        T_r = (n_q + BR - 1) // BR
        key0 = j * BC
        bc = min(BC, n_k - key0)
        buf = cuda.shared.array(0, SHARED_F32, alignment=SHARED_ALIGN)
        w, lane = coords()
        dk_j = cuda.local.array(NDK, float32)
        dv_j = cuda.local.array(NDV, float32)
        dq_i = cuda.local.array(NDK, float32)
        cnt = cuda.local.array(NCNT, int64)
        if COUNT:
            zero(cnt)
        for e in range(NDK):
            dk_j[e] = float32(0.0)
        for e in range(NDV):
            dv_j[e] = float32(0.0)
        clear(buf)
        cuda.syncthreads()  # the buffer is clear (the tiles' padding) before any copy lands
        # K_j, V_j: read from HBM once, stay in shared memory for every query block
        moved_k = load_k(k, kv, key0, bc)
        moved_v = load_v(v, kv, key0, bc)
        if COUNT:
            cnt[K_R] += moved_k
            cnt[V_R] += moved_v
        i0, i1 = 0, T_r  # no mask: every query block sees block j
        if MASKED:
            i0, i1 = q_blocks(key0, bc, n_q, n_k)  # the query blocks that see block j
        if i0 < i1:
            load_block(q, do, lse, delta, bh, i0 * BR, min(BR, n_q - i0 * BR), 0, buf, cnt)
        if MASKED and i0 >= i1:
            wait_loads()  # no query block sees block j: K_j, V_j's copies land before exit
        for i in range(i0, i1):
            row0 = i * BR
            n_rows = min(BR, n_q - row0)
            stage = (i - i0) % STAGES
            if STAGES == 1 and i > i0:
                cuda.syncthreads()  # every warp is done with the last Q_i, dO_i, dS^T, stats
                load_block(q, do, lse, delta, bh, row0, n_rows, 0, buf, cnt)
            wait_loads()
            # Q_i, dO_i (K_j, V_j the first time) and the stats are in shared memory, and
            # (two buffers) every warp is done with the other buffer and dS^T
            cuda.syncthreads()
            if STAGES == 2 and i + 1 < i1:  # the next block lands under this one's products
                load_block(q, do, lse, delta, bh, row0 + BR, min(BR, n_q - row0 - BR),
                           1 - stage, buf, cnt)
            # row0 + N_k - N_q: the first row's diagonal key (bottom-right aligned)
            kv_step(buf, dk_j, dv_j, row0 + n_k - n_q, key0, n_rows, bc, scale_log2, stage,
                    ATOMIC)
            if ATOMIC:
                cuda.syncthreads()  # dS^T is complete in shared memory
                for m in range(int(w), RT, W):
                    dq_partial(buf, dq_i, m)
                    # dq_acc_i: float32 atomic adds of tau dS K_j (each a read and a write)
                    added = add_dq(dq_acc, bh, row0, n_rows, dq_i, scale, m, lane)
                    if COUNT:
                        cnt[ACC_R] += added
                        cnt[ACC_W] += added
        # dK_j, dV_j: written to HBM once, from the warps' fragments
        moved_k = store_dk(dk, bh, key0, bc, dk_j, scale, w, lane)
        moved_v = store_dv(dv, bh, key0, bc, dv_j, float32(1.0), w, lane)
        if COUNT:
            cnt[DK_W] += moved_k
            cnt[DV_W] += moved_v
            flush_counts(cnt, counts)

    return q_outer_bwd_tc


@kernel_factory
def make_tc_q_kernel(BR, BC, D, DV, MASK, SPEC, COUNT, GROUP):
    NT = tc_q_threads(BR)
    NDQ = 4 * (_up(D, 16) // 8)  # a thread's accumulators of dQ_i (8-wide n-tiles)
    io = make_tc_grad_io(BR, BC, D, DV, False, SPEC, NT)
    st = make_tc_grad_steps(BR, BC, D, DV, MASK, False, SPEC, NT)
    clear, coords, wait_loads, lse_stats = io.clear, io.coords, io.wait_loads, io.lse_stats
    load_k, load_v, load_q, load_do = io.load_k, io.load_v, io.load_q, io.load_do
    store_dq, q_step = io.store_dk, st.q_step  # dQ_i's rows are d wide, as dK_j's
    NCNT = counter_slots(COUNT)
    flush_counts = counts_flusher()
    MASKED = MASK.bounded
    block_of = make_block_of(MASKED, HEAVY_LAST=True)
    kv_blocks = make_kv_blocks(BC, MASK)  # [first_i, end_i): the K/V blocks i sees
    Q_R, K_R, V_R, DO_R = (slot("q", "read"), slot("k", "read"), slot("v", "read"),
                           slot("do", "read"))
    LSE_R, DELTA_R, DQ_W = slot("lse", "read"), slot("delta", "read"), slot("dq", "write")
    kv_head = make_kv_head(GROUP)

    @cuda.jit(**kernel_options(NT, 255))
    def q_outer_bwd_dq_tc(q, k, v, do, lse, delta, dq, counts, scale, scale_log2):
        # masked: the query blocks that see the most K/V blocks start first (`block_grid`)
        i, bh = block_of(q.shape[0])
        kv = kv_head(bh)  # query head bh's K/V head (grouped-query attention)
        n_q = q.shape[1]
        n_k = k.shape[1]
        row0 = i * BR
        n_rows = min(BR, n_q - row0)
        buf = cuda.shared.array(0, SHARED_F32, alignment=SHARED_ALIGN)
        w, lane = coords()
        dq_i = cuda.local.array(NDQ, float32)
        cnt = cuda.local.array(NCNT, int64)
        if COUNT:
            zero(cnt)
        for e in range(NDQ):
            dq_i[e] = float32(0.0)
        clear(buf)
        cuda.syncthreads()  # the buffer is clear (the tiles' padding) before any copy lands
        # Q_i, dO_i, lse_i, delta_i: read from HBM once, stay on chip for every K/V block
        moved_q = load_q(q, bh, row0, n_rows, 0)
        moved_do = load_do(do, bh, row0, n_rows, 0)
        rows_in = lse_stats(buf, lse, delta, bh, row0, n_rows, 0)
        if COUNT:
            cnt[Q_R] += moved_q
            cnt[DO_R] += moved_do
            cnt[LSE_R] += rows_in
            cnt[DELTA_R] += rows_in
        j0, j1 = 0, (n_k + BC - 1) // BC  # no mask: block i sees every K/V block
        if MASKED:
            j0, j1 = kv_blocks(row0, n_rows, n_q, n_k)  # the K/V blocks block i sees
            if j0 >= j1:
                wait_loads()  # block i sees no key: Q_i, dO_i's copies land before exit
        for j in range(j0, j1):
            key0 = j * BC
            bc = min(BC, n_k - key0)
            cuda.syncthreads()  # every warp is done with the previous K_j, V_j
            # K_j, V_j: reloaded from HBM by every query block
            moved_k = load_k(k, kv, key0, bc)
            moved_v = load_v(v, kv, key0, bc)
            if COUNT:
                cnt[K_R] += moved_k
                cnt[V_R] += moved_v
            wait_loads()
            cuda.syncthreads()  # K_j, V_j (and Q_i, dO_i, stats the first time) are shared
            # row0 + N_k - N_q: the first row's diagonal key (bottom-right aligned)
            q_step(buf, dq_i, row0 + n_k - n_q, key0, n_rows, bc, scale_log2)
        # dQ_i: written to HBM once, from the warps' fragments
        moved = store_dq(dq, bh, row0, n_rows, dq_i, scale, w, lane)
        if COUNT:
            cnt[DQ_W] += moved
            flush_counts(cnt, counts)

    return q_outer_bwd_dq_tc
