"""dense's backward matmuls on tensor cores (16-bit inputs, and float32 at a TF32 precision):
the loop nests of `backward` (the same kernels 1 to 4, the same traffic) over the operands the
flash orders use, so the standard-attention baseline is not slowed by CUDA cores.

    kernel 1, per query block i:     load dO_i                  # cp.async, once
                                     for j: load V_j; dP_ij = dO_i V_j^T    # as S = Q K^T
                                            write dP_ij from the accumulator fragments
    kernel 3, per K/V block j:       for i: load Q_i, dO_i      # cp.async, per (j, i)
                                            P_ij^T, dS_ij^T from HBM into A fragments
                                            dV_j += P_ij^T dO_i;  dK_j += dS_ij^T Q_i
                                     write dK_j = tau dK_j, dV_j from the fragments
    kernel 4, per query block i:     for j: load K_j; dS_ij from HBM into the A fragment
                                            dQ_i += dS_ij K_j   # as P V
                                     write dQ_i = tau dQ_i      # through the O_i stage

Kernel 2 (dS = P o (dP - rowsum(dP o P)), row by row) has no matmul and stays as it is. P, dP
and dS stay float32 in HBM; a product that reads P or dS rounds it to the operand type on the
way into its A fragment, as the flash orders round theirs (`grad_tensor_cores.TC_ROUNDINGS`).
A warp owns 16 query rows (kernels 1 and 4) or 16 keys (kernel 3).
"""

from __future__ import annotations

from numba import float32, int64, uint32, uint64

from ...core.ledger import slot
from ...core.mask import NO_MASK
from ...device.intrinsics import widen
from ...device.runtime import (
    SHARED_ALIGN,
    SHARED_F32,
    cuda,
    inlined,
    kernel_factory,
    kernel_options,
)
from ...microkernel.grad_tensor_cores import (
    make_reg_product,
    make_tc_grad_io,
    tc_grad_layout,
    tc_grad_warps,
)
from ...microkernel.tensor_cores import (
    WARP_ROWS,
    TensorCores,
    _up,
    make_tc_micro_kernel,
    make_tc_operands,
    tc_shared_layout,
)
from ...microkernel.tiles import counter_slots, counts_flusher, make_kv_head, zero_counts

(DO_R, V_R, P_R, Q_R, K_R, DQ_W, DK_W, DV_W) = (
    slot("do", "read"), slot("v", "read"), slot("p", "read"), slot("q", "read"),
    slot("k", "read"), slot("dq", "write"), slot("dk", "write"), slot("dv", "write"))
# dP's and dS's slots come from the schedule's declared tensors, known once it is registered:
# each kernel factory asks for them when it builds


def tc_shared_bytes(block_q: int, block_k: int, d: int, dv: int,
                    spec: TensorCores) -> tuple[int, int, int]:
    """The dynamic buffers of kernels 1, 3 and 4: dO_i and V_j; Q_i and dO_i (the backward
    micro-kernel's buffer); K_j and the dQ_i stage."""
    return (tc_shared_layout(block_q, block_k, dv, 0, False, spec).bytes,
            tc_grad_layout(block_q, block_k, d, dv, False, 1, spec.tf32).bytes,
            tc_shared_layout(block_q, block_k, 0, d, False, spec).bytes)


def tc_threads(block_q: int, block_k: int) -> tuple[int, int, int]:
    """Threads of kernels 1, 3 and 4: a warp per 16 query rows, keys, query rows."""
    return (32 * tc_grad_warps(block_q), 32 * tc_grad_warps(block_k),
            32 * tc_grad_warps(block_q))


@kernel_factory
def make_tc_dp_kernel(BR, BC, DV, SPEC, COUNT, GROUP):
    """Kernel 1 on tensor cores: dP_ij = dO_i V_j^T, the forward's S = Q K^T on dO and V."""
    NCNT = counter_slots(COUNT)
    flush_counts = counts_flusher()
    ops = make_tc_operands(BR, BC, DV, 0, SPEC)  # dO_i in Q_i's tile, V_j in K_j's
    V_AT = tc_shared_layout(BR, BC, DV, 0, False, SPEC).k
    NKT = -(-BC // 16) * 2  # 8-key n-tiles of dP_ij
    NS = 4 * NKT  # a thread's entries of dP_ij
    kv_head = make_kv_head(GROUP)
    DP_W = slot("dp", "write")

    @cuda.jit
    def dense_bwd_dp_tc(do, v, dp_hbm, counts):
        i = cuda.blockIdx.x
        bh = cuda.blockIdx.y
        kv = kv_head(bh)  # query head bh's K/V head (grouped-query attention)
        n_k = v.shape[1]
        row0 = i * BR
        n_rows = min(BR, do.shape[1] - row0)
        buf = cuda.shared.array(0, SHARED_F32)
        tile = ops.tiles()
        w, lane = ops.coords()
        t2 = 2 * (lane & uint32(3))
        dp = cuda.local.array(NS, float32)
        cnt = cuda.local.array(NCNT, int64)
        if COUNT:
            zero_counts(cnt)
        ops.clear(buf)
        cuda.syncthreads()  # the tiles' padding is zero before any copy lands
        # dO_i: read from HBM once, stays in shared memory for every K/V block
        moved = ops.load_q(do, bh, row0, n_rows)
        if COUNT:
            cnt[DO_R] += moved
        for j in range((n_k + BC - 1) // BC):
            key0 = j * BC
            bc = min(BC, n_k - key0)
            cuda.syncthreads()  # every warp is done with the previous V_j
            # V_j: every query block reads all of V
            moved = ops.load_k(v, kv, key0, bc, 0)
            if COUNT:
                cnt[V_R] += moved
            ops.wait_loads()
            cuda.syncthreads()  # dO_i and V_j are in shared memory
            ops.scores(tile, dp, w, lane, uint64(V_AT))
            for a in range(2):
                r = int(ops.local_row(w, lane, a))
                for n in range(NKT):
                    for c in range(2):
                        col = int(uint32(8 * n + c) + t2)
                        if r < n_rows and col < bc:
                            # dP_ij: a quadratic intermediate, written to HBM from the
                            # accumulator fragment
                            dp_hbm[bh, row0 + r, key0 + col] = dp[4 * n + 2 * a + c]
                            if COUNT:
                                cnt[DP_W] += 1
        if COUNT:
            flush_counts(cnt, counts)

    return dense_bwd_dp_tc


def _make_transposed_fragment(BR, BC, D, DV, SPEC):
    """transposed(src, s, bh, row0, n_rows, key0, n_keys, w, lane) -> elements read: s = a
    float32 tile of src[bh, queries, keys] (P_ij or dS_ij in HBM) transposed, as warp w's
    accumulator-layout fragment of its 16 keys (rows 16 w + g + 8 a) by the block's queries
    (columns 8 n + 2 t + c), 0 outside the tile: the A fragment of P_ij^T dO_i or dS_ij^T Q_i
    (`grad_tensor_cores.make_reg_product` rounds it to the operand type)."""
    QT = tc_grad_layout(BR, BC, D, DV, False, 1, SPEC.tf32).rows // 8  # 8-query n-tiles

    @inlined
    def transposed(src, s, bh, row0, n_rows, key0, n_keys, w, lane):
        g, t2 = lane >> uint32(2), uint32(2) * (lane & uint32(3))
        moved = 0
        for n in range(QT):
            for c in range(2):
                r = int(uint32(8 * n + c) + t2)  # the query of this column
                for a in range(2):
                    key = int(w * uint32(WARP_ROWS) + g) + 8 * a
                    x = float32(0.0)
                    if r < n_rows and key < n_keys:
                        x = src[bh, row0 + r, key0 + key]
                        moved += 1
                    s[4 * n + 2 * a + c] = x
        return moved

    return transposed


@kernel_factory
def make_tc_dkdv_kernel(BR, BC, D, DV, SPEC, COUNT):
    """Kernel 3 on tensor cores: dV_j += P_ij^T dO_i and dK_j += dS_ij^T Q_i, a warp per 16
    keys of K/V block j, Q_i and dO_i through the backward micro-kernel's buffer."""
    NT = 32 * tc_grad_warps(BC)
    sm = tc_grad_layout(BR, BC, D, DV, False, 1, SPEC.tf32)
    io = make_tc_grad_io(BR, BC, D, DV, False, SPEC, NT)
    QT = sm.rows // 8  # 8-query n-tiles of a warp's P_ij^T, dS_ij^T
    NSQ = 4 * QT  # a thread's entries of them
    NDK, NDV = 4 * (_up(D, 16) // 8), 4 * (_up(DV, 16) // 8)  # a thread's accumulators
    acc_dv = make_reg_product(QT // 2, _up(DV, 16) // 8, sm.vs, SPEC)  # += P^T dO_i
    acc_dk = make_reg_product(QT // 2, _up(D, 16) // 8, sm.ks, SPEC)  # += dS^T Q_i
    transposed = _make_transposed_fragment(BR, BC, D, DV, SPEC)
    DS_R = slot("ds", "read")
    NCNT = counter_slots(COUNT)
    flush_counts = counts_flusher()

    @cuda.jit(**kernel_options(NT, 255))
    def dense_bwd_dkdv_tc(p_hbm, ds_hbm, q, do, dk, dv, counts, scale):
        j = cuda.blockIdx.x
        bh = cuda.blockIdx.y
        n_q = q.shape[1]
        key0 = j * BC
        bc = min(BC, dk.shape[1] - key0)
        buf = cuda.shared.array(0, SHARED_F32, alignment=SHARED_ALIGN)
        tile = io.tiles()
        w, lane = io.coords()
        s = cuda.local.array(NSQ, float32)
        dk_j = cuda.local.array(NDK, float32)
        dv_j = cuda.local.array(NDV, float32)
        cnt = cuda.local.array(NCNT, int64)
        if COUNT:
            zero_counts(cnt)
        for e in range(NDK):
            dk_j[e] = float32(0.0)
        for e in range(NDV):
            dv_j[e] = float32(0.0)
        io.clear(buf)
        for i in range((n_q + BR - 1) // BR):
            row0 = i * BR
            n_rows = min(BR, n_q - row0)
            cuda.syncthreads()  # the padding is zero; every warp is done with the last tiles
            # Q_i, dO_i: read from HBM per K/V block
            moved_q = io.load_q(q, bh, row0, n_rows, 0)
            moved_do = io.load_do(do, bh, row0, n_rows, 0)
            if COUNT:
                cnt[Q_R] += moved_q
                cnt[DO_R] += moved_do
            io.wait_loads()
            cuda.syncthreads()  # Q_i and dO_i are in shared memory
            # P_ij: read back from HBM once per element, into P_ij^T's A fragment
            moved = transposed(p_hbm, s, bh, row0, n_rows, key0, bc, w, lane)
            if COUNT:
                cnt[P_R] += moved
            acc_dv(tile, dv_j, s, uint64(sm.do), lane)
            # dS_ij: read back from HBM once per element, into dS_ij^T's A fragment
            moved = transposed(ds_hbm, s, bh, row0, n_rows, key0, bc, w, lane)
            if COUNT:
                cnt[DS_R] += moved
            acc_dk(tile, dk_j, s, uint64(sm.q), lane)
        # dK_j = tau dK_j, dV_j: written to HBM once, from the warps' fragments
        moved_k = io.store_dk(dk, bh, key0, bc, dk_j, scale, w, lane)
        moved_v = io.store_dv(dv, bh, key0, bc, dv_j, float32(1.0), w, lane)
        if COUNT:
            cnt[DK_W] += moved_k
            cnt[DV_W] += moved_v
            flush_counts(cnt, counts)

    return dense_bwd_dkdv_tc


@kernel_factory
def make_tc_dq_kernel(BR, BC, D, SPEC, COUNT, GROUP):
    """Kernel 4 on tensor cores: dQ_i = tau dS_i K, the forward's P V on dS and K (dS from
    HBM straight into the A fragment), through the O_i stage."""
    NCNT = counter_slots(COUNT)
    flush_counts = counts_flusher()
    ops = make_tc_operands(BR, BC, 0, D, SPEC)  # K_j in V_j's tile
    mk = make_tc_micro_kernel(BR, BC, 0, D, SPEC, NO_MASK, False)  # dQ_i's stage
    K_AT = tc_shared_layout(BR, BC, 0, D, False, SPEC).v
    NKT = -(-BC // 16) * 2  # 8-key n-tiles of dS_ij
    NS = 4 * NKT  # a thread's entries of dS_ij
    NACC = mk.NACC
    kv_head = make_kv_head(GROUP)
    DS_R = slot("ds", "read")

    @cuda.jit
    def dense_bwd_dq_tc(ds_hbm, k, dq, counts, scale):
        i = cuda.blockIdx.x
        bh = cuda.blockIdx.y
        kv = kv_head(bh)  # query head bh's K/V head (grouped-query attention)
        n_k = k.shape[1]
        row0 = i * BR
        n_rows = min(BR, dq.shape[1] - row0)
        buf = cuda.shared.array(0, SHARED_F32)
        tile = ops.tiles()
        w, lane = ops.coords()
        t2 = 2 * (lane & uint32(3))
        ds = cuda.local.array(NS, float32)
        acc = cuda.local.array(NACC, float32)
        tau = cuda.local.array(2, float32)
        cnt = cuda.local.array(NCNT, int64)
        if COUNT:
            zero_counts(cnt)
        for x in range(NACC):
            acc[x] = float32(0.0)
        tau[0] = scale
        tau[1] = scale
        ops.clear(buf)
        for j in range((n_k + BC - 1) // BC):
            key0 = j * BC
            bc = min(BC, n_k - key0)
            cuda.syncthreads()  # the padding is zero; every warp is done with the last K_j
            # K_j: every query block reads all of K
            moved = ops.load_v(k, kv, key0, bc, 0)
            if COUNT:
                cnt[K_R] += moved
            for a in range(2):
                r = int(ops.local_row(w, lane, a))
                for n in range(NKT):
                    for c in range(2):
                        col = int(uint32(8 * n + c) + t2)
                        x = float32(0.0)
                        if r < n_rows and col < bc:
                            # dS_ij: read back from HBM once per element, straight into
                            # the A fragment of dS_ij K_j
                            x = widen(ds_hbm[bh, row0 + r, key0 + col])
                            if COUNT:
                                cnt[DS_R] += 1
                        ds[4 * n + 2 * a + c] = x
            ops.wait_loads()
            cuda.syncthreads()  # K_j is in shared memory
            ops.accumulate(tile, ds, acc, lane, uint64(K_AT))
        cuda.syncthreads()  # every warp is done with K_j: dQ_i's stage takes its place
        mk.give_o(buf, acc, tau)  # tau dQ_i
        cuda.syncthreads()  # dQ_i is complete in the float32 stage
        # dQ_i: written to HBM once (whole rows, coalesced)
        moved = mk.store_o(buf, dq, bh, row0, n_rows)
        if COUNT:
            cnt[DQ_W] += moved
            flush_counts(cnt, counts)

    return dense_bwd_dq_tc
