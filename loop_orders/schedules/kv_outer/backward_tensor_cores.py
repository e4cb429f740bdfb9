"""kv_outer's backward on tensor cores (16-bit inputs, float32 at a TF32 precision):
Algorithm 4's loop nest of `backward` (the same traffic) over the tensor-core tile steps of
`microkernel.grad_tensor_cores`.

    for each (batch, head):                                   # one CTA, W = ceil(Bc / 16) warps
        write dQ = 0, dK = 0, dV = 0                          # line 4, in HBM
        for j in 0 .. Tc - 1:                                 # under a mask, those some
            load K_j, V_j                                     # query sees; cp.async, once
            for i in i0_j .. i1_j - 1:                        # the query blocks that see j
                load Q_i, O_i, dO_i, l_i, m_i;  D_i = rowsum(dO_i o O_i)
                kv_step: dV_j += P^T dO_i;  dK_j += dS^T Q_i;  dS^T -> shared
                dQ_i += tau dS K_j                            # read, added, written in HBM,
                                                              # from each warp's fragments
            write dK_j, dV_j                                  # from the fragments
"""

from __future__ import annotations

from numba import float32, int64, uint32

from ...core.ledger import slot
from ...device.intrinsics import narrow, widen
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
from ...microkernel.tiles import counter_slots, counts_flusher, make_kv_head, make_q_blocks
from ...microkernel.tiles import zero_counts as zero


def tc_threads(block_k: int) -> int:
    """Threads of the kernel: a warp per 16 keys of K_j."""
    return 32 * tc_grad_warps(block_k)


def tc_shared_bytes(block_q: int, block_k: int, d: int, dv: int, tf32: bool = False) -> int:
    return tc_grad_layout(block_q, block_k, d, dv, True, 1, tf32).bytes


def _make_zero_grads(D, DV, NT, COUNT):
    """zero_grads(dq, dk, dv, bh, n_q, n_k, cnt): Algorithm 4 line 4, dQ = dK = dV = 0 in HBM,
    element by element (consecutive threads, consecutive elements); every thread calls it."""
    DQ_W, DK_W, DV_W = slot("dq", "write"), slot("dk", "write"), slot("dv", "write")

    @inlined
    def zero_rows(dst, bh, n_rows, width):
        moved = 0
        for e in range(cuda.threadIdx.x, n_rows * width, NT):
            dst[bh, e // width, e % width] = narrow(float32(0.0), dst)
            moved += 1
        return moved

    @inlined
    def zero_grads(dq, dk, dv, bh, n_q, n_k, cnt):
        # dQ, dK, dV: initialised to zero in HBM (line 4)
        moved_q = zero_rows(dq, bh, n_q, D)
        moved_k = zero_rows(dk, bh, n_k, D)
        moved_v = zero_rows(dv, bh, n_k, DV)
        if COUNT:
            cnt[DQ_W] += moved_q
            cnt[DK_W] += moved_k
            cnt[DV_W] += moved_v

    return zero_grads


def _make_stats(BR, BC, D, DV, NT, COUNT, TF32):
    """visit_stats(buf, l_hbm, m_hbm, bh, row0, n_rows, cnt): base = m_i, inv = 1 / l_i of the
    visited query block into the stats rows, counted (line 8)."""
    sm = tc_grad_layout(BR, BC, D, DV, True, 1, TF32)
    BASE, INV = sm.stats, sm.stats + sm.rows
    L_R, M_R = slot("l", "read"), slot("m", "read")

    @inlined
    def visit_stats(buf, l_hbm, m_hbm, bh, row0, n_rows, cnt):
        for r in range(cuda.threadIdx.x, n_rows, NT):
            buf[BASE + r] = m_hbm[bh, row0 + r]  # log2 units, as the forward keeps it
            buf[INV + r] = float32(1.0) / l_hbm[bh, row0 + r]
            if COUNT:
                cnt[L_R] += 1
                cnt[M_R] += 1

    return visit_stats


def _make_dq_update(D):
    """update_dq(dq, bh, row0, n_rows, acc, scale, m, lane): dQ_i's rows 16 m + g + 8 a +=
    tau acc, read from HBM and written back in dQ's type; returns the elements moved each
    way."""
    DT = _up(D, 16) // 8  # 8-wide n-tiles

    @inlined
    def update_dq(dq, bh, row0, n_rows, acc, scale, m, lane):
        g, t2 = lane >> uint32(2), uint32(2) * (lane & uint32(3))
        moved = 0
        for a in range(2):
            r = 16 * m + int(g) + 8 * a
            if r < n_rows:
                for n in range(DT):
                    for c in range(2):
                        x = int(uint32(8 * n + c) + t2)
                        if x < D:
                            total = widen(dq[bh, row0 + r, x]) + acc[4 * n + 2 * a + c] * scale
                            dq[bh, row0 + r, x] = narrow(total, dq)
                            moved += 1
        return moved

    return update_dq


@kernel_factory
def make_tc_kernel(BR, BC, D, DV, MASK, SPEC, COUNT, GROUP):
    NT = tc_threads(BC)
    W = NT // 32
    RT = _up(BR, WARP_ROWS) // WARP_ROWS  # 16-row slices of Q_i (dQ_i's product)
    NDK, NDV = 4 * (_up(D, 16) // 8), 4 * (_up(DV, 16) // 8)  # a thread's accumulators
    io = make_tc_grad_io(BR, BC, D, DV, True, SPEC, NT)
    st = make_tc_grad_steps(BR, BC, D, DV, MASK, True, SPEC, NT)
    clear, coords, wait_loads = io.clear, io.coords, io.wait_loads
    load_k, load_v, load_q, load_do, load_o = io.load_k, io.load_v, io.load_q, io.load_do, \
        io.load_o
    store_dk, store_dv = io.store_dk, io.store_dv
    kv_step, dq_partial, row_dot = st.kv_step, st.dq_partial, st.row_dot
    zero_grads = _make_zero_grads(D, DV, NT, COUNT)
    visit_stats = _make_stats(BR, BC, D, DV, NT, COUNT, SPEC.tf32)
    update_dq = _make_dq_update(D)
    NCNT = counter_slots(COUNT)
    flush_counts = counts_flusher()
    Q_R, K_R, V_R, O_R, DO_R = (slot("q", "read"), slot("k", "read"), slot("v", "read"),
                                slot("o", "read"), slot("do", "read"))
    DQ_R, DQ_W = slot("dq", "read"), slot("dq", "write")
    DK_W, DV_W = slot("dk", "write"), slot("dv", "write")
    kv_head = make_kv_head(GROUP)
    q_blocks = make_q_blocks(BR, MASK)  # [first_j, end_j): the query blocks that see j
    MASKED = MASK.bounded

    @cuda.jit(**kernel_options(NT, 255))
    def kv_outer_bwd_tc(q, k, v, o, do, l_hbm, m_hbm, dq, dk, dv, counts, scale, scale_log2):
        bh = cuda.blockIdx.x
        kv = kv_head(bh)  # query head bh's K/V head (grouped-query attention)
        n_q = q.shape[1]
        n_k = k.shape[1]
        buf = cuda.shared.array(0, SHARED_F32, alignment=SHARED_ALIGN)
        w, lane = coords()
        dk_j = cuda.local.array(NDK, float32)
        dv_j = cuda.local.array(NDV, float32)
        dq_i = cuda.local.array(NDK, float32)
        cnt = cuda.local.array(NCNT, int64)
        if COUNT:
            zero(cnt)
        clear(buf)
        zero_grads(dq, dk, dv, bh, n_q, n_k, cnt)  # dQ = dK = dV = 0 in HBM (line 4)
        for j in range((n_k + BC - 1) // BC):
            key0 = j * BC
            bc = min(BC, n_k - key0)
            i0, i1 = 0, (n_q + BR - 1) // BR  # no mask: every query block sees block j
            if MASKED:
                i0, i1 = q_blocks(key0, bc, n_q, n_k)  # the query blocks that see block j
                if i0 >= i1:
                    continue  # no query sees block j: its dK_j = dV_j = 0 are in HBM already
            for e in range(NDK):
                dk_j[e] = float32(0.0)
            for e in range(NDV):
                dv_j[e] = float32(0.0)
            cuda.syncthreads()  # every warp is done with the previous K_j, V_j
            # K_j, V_j: read from HBM once, stay in shared memory for all i (lines 5-6)
            moved_k = load_k(k, kv, key0, bc)
            moved_v = load_v(v, kv, key0, bc)
            if COUNT:
                cnt[K_R] += moved_k
                cnt[V_R] += moved_v
            for i in range(i0, i1):
                row0 = i * BR
                n_rows = min(BR, n_q - row0)
                cuda.syncthreads()  # every warp is done with the last step's tiles
                # Q_i, O_i, dO_i, l_i, m_i: reloaded from HBM per K/V block (line 8)
                moved_q = load_q(q, bh, row0, n_rows, 0)
                moved_o = load_o(o, bh, row0, n_rows)
                moved_do = load_do(do, bh, row0, n_rows, 0)
                visit_stats(buf, l_hbm, m_hbm, bh, row0, n_rows, cnt)
                if COUNT:
                    cnt[Q_R] += moved_q
                    cnt[O_R] += moved_o
                    cnt[DO_R] += moved_do
                wait_loads()
                cuda.syncthreads()  # Q_i, O_i, dO_i, l_i, m_i are in shared memory
                row_dot(buf, n_rows)  # D_i = rowsum(dO_i o O_i)
                cuda.syncthreads()  # D_i is in the stats rows
                # row0 + N_k - N_q: the first row's diagonal key (bottom-right aligned)
                kv_step(buf, dk_j, dv_j, row0 + n_k - n_q, key0, n_rows, bc, scale_log2, 0,
                        True)
                cuda.syncthreads()  # dS^T is complete in shared memory
                for m in range(int(w), RT, W):
                    dq_partial(buf, dq_i, m)
                    # dQ_i: read, updated and written back in HBM per visited (j, i)
                    # (lines 21-22); this thread alone touches these elements
                    moved = update_dq(dq, bh, row0, n_rows, dq_i, scale, m, lane)
                    if COUNT:
                        cnt[DQ_R] += moved
                        cnt[DQ_W] += moved
            # dK_j, dV_j: written to HBM once per j (line 24), from the warps' fragments
            moved_k = store_dk(dk, bh, key0, bc, dk_j, scale, w, lane)
            moved_v = store_dv(dv, bh, key0, bc, dv_j, float32(1.0), w, lane)
            if COUNT:
                cnt[DK_W] += moved_k
                cnt[DV_W] += moved_v
        if COUNT:
            flush_counts(cnt, counts)

    return kv_outer_bwd_tc
