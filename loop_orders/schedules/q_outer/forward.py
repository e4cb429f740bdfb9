"""q_outer: the FlashAttention-2 forward order. A query block and its accumulator stay on chip.

    for each (batch, head), query block i in parallel       # one CTA each
        load Q_i                                             # once
        m_i = -inf, l_i = 0, acc_i = 0                       # registers
        for j in first_i .. end_i - 1:                       # all Tc, or those the mask shows
            load K_j, V_j                                    # every query block reloads them
            online-softmax update of (m_i, l_i, acc_i) with S_ij = Q_i K_j^T
        write O_i = acc_i / l_i                              # once
        write lse_i = m_i + log l_i                          # only with save_lse

When K_j, V_j land (the counts are the same either way): on tensor cores K_j+1, V_j+1 go to a
second buffer while K_j, V_j are folded in; on CUDA cores, with one K and one V buffer, V_j
is copied while S_ij is computed and K_j+1 while P_ij V_j is (`stream_kv_staggered`; K_0
while Q_i loads), by cp.async where rows are whole 16-byte copies. Float32 at d = 128 on
128 x 64 tiles, causal or not, runs a kernel of its own, the same loop nest with its warps
specialised (`warp_specialised`: S warps and P V warps). Causal query blocks start heaviest
first, over every (batch, head). On Hopper, 16-bit, K/V may come from a producer warpgroup's
TMA copies (`make_produced_kernel`), and that kernel may run on persistent CTAs, one an SM
folding query blocks in turn (`make_persistent_produced_kernel`): the "in parallel" below is
then the SMs', each taking the next (b, h, i) from a counter as it finishes one.

Traffic (elements, per batch x head): Q is read once (N_q d) and O written once (N_q dv).
Each query block reads the K/V rows it visits: sum_i min(c_i Bc, N_k) (d + dv), which is
Tr N_k (d + dv) without a mask. With Br = M/(4d) rows resident this is Theta(N^2 d^2 / M).
"""

from __future__ import annotations

from collections import Counter

from numba import float32, int32, int64

from ...core.ledger import Ledger, slot
from ...core.schedule import Problem, ceil_div, register, rows, sees
from ...device.intrinsics import named_barrier, set_max_registers
from ...device.runtime import (
    SHARED_F32,
    cuda,
    inlined,
    kernel_factory,
    kernel_options,
)
from ...microkernel import hopper, tuning
from ...microkernel.cuda_cores import MicroKernelSchedule, Unroll, micro_kernel
from ...microkernel.hopper import buffer_align
from ...microkernel.persistent import make_items
from ...microkernel.stream import (
    make_counted_loads,
    make_fold_tiles,
    make_stream_kv_pipelined,
)
from ...microkernel.tensor_cores import make_tc_o_direct
from ...microkernel.tiles import (
    block_grid,
    counter_slots,
    counts_flusher,
    make_block_of,
    make_kv_blocks,
    make_kv_head,
    make_online_reset,
    make_online_start,
)
from .warp_specialised import SQUARE_MASKS, Specialised, make_specialised_kernel

# Compile-time choices per head dim, each measured (results/tuning_history/q_outer.md):
# hot-loop steps per trip (else Unroll.by(2): 2 chunks of S_ij's dims, 8 keys of P_ij V_j),
UNROLL = {128: Unroll(chunks=10, keys=32)}
# S_ij's first 4-dim chunk setting the scores instead of adding to zeroed ones (`PEEL`),
PEEL = {128}
# and Q_i kept a row per query row rather than transposed (the micro-kernel's TRANSPOSE_Q).
ROW_MAJOR_Q = {128}


def transposes_q(d: int) -> bool:
    """Whether q_outer keeps Q_i transposed at head dim d (`ROW_MAJOR_Q`)."""
    return d not in ROW_MAJOR_Q


Q_R, K_R, V_R, O_W, LSE_W = (slot("q", "read"), slot("k", "read"), slot("v", "read"),
                             slot("o", "write"), slot("lse", "write"))


@kernel_factory
def make_kernel(BR, BC, D, DV, MK, MASK, SAVE_LSE, COUNT, GROUP):
    if isinstance(MK, Specialised):  # S warps and P V warps (`warp_specialised`; GROUP 1)
        return make_specialised_kernel(BR, BC, D, DV, MK, MASK, SAVE_LSE, COUNT,
                                       (Q_R, K_R, V_R, O_W, LSE_W))
    if getattr(MK, "persistent", False):  # ... on a CTA an SM, folding blocks in turn
        return make_persistent_produced_kernel(BR, BC, D, DV, MK, MASK, SAVE_LSE, COUNT, GROUP)
    if getattr(MK, "producer", False):  # a producer warpgroup's TMA copies (Hopper)
        return make_produced_kernel(BR, BC, D, DV, MK, MASK, SAVE_LSE, COUNT, GROUP)
    mk = micro_kernel(BR, BC, D, DV, MK, MASK, False, UNROLL.get(D, Unroll.by(2)), D in PEEL,
                      transposes_q(D))
    ALIGN = buffer_align(MK)  # as the micro-kernel's views of the buffer
    NT, RM, NACC = mk.NT, mk.RM, mk.NACC  # threads; a thread's rows, accumulators
    # staggered or pipelined K/V loads: K_j0 first, under Q_i's
    STAGGERED = mk.STAGGERED or mk.PIPELINED
    # Numba compiles closure variables as constants: take the device functions by name
    wait_loads = mk.wait_loads
    write_block = make_write_block(mk, SAVE_LSE, COUNT, cta_sync)
    start = make_online_start(NACC, RM, COUNT, mk.clear)
    loads = make_counted_loads(BC, COUNT, mk)
    load_K_j_counted, load_Q_i_counted = loads.k, loads.q
    fold_tiles = make_fold_tiles(BC, mk, loads)
    flush_counts = counts_flusher()
    block_of = make_block_of(MASK.bounded, HEAVY_LAST=True,
                             GROUP_HEADS=getattr(MK, "causal_heads", 0))
    kv_blocks = make_kv_blocks(BC, MASK)  # [j0, j1): the K/V blocks query block i sees
    NCNT = counter_slots(COUNT)
    kv_head = make_kv_head(GROUP)

    @cuda.jit(**kernel_options(NT, MK.registers(BC, DV)))
    def q_outer(q, k, v, o, lse, counts, scale_log2):
        # masked: the query blocks that see the most K/V blocks start first (`block_grid`)
        i, bh = block_of(q.shape[0])
        kv = kv_head(bh)  # query head bh's K/V head (grouped-query attention)
        n_q = q.shape[1]
        n_k = k.shape[1]
        row0 = i * BR
        n_rows = min(BR, n_q - row0)
        diag0 = row0 + n_k - n_q  # the first row's diagonal key (bottom-right aligned)

        buf = cuda.shared.array(0, SHARED_F32, alignment=ALIGN)  # Q_i, K_j, V_j, ...
        acc = cuda.local.array(NACC, float32)
        m_i = cuda.local.array(RM, float32)
        l_i = cuda.local.array(RM, float32)  # this thread's partial sums of its rows
        l_row = cuda.local.array(RM, float32)
        inv_l = cuda.local.array(RM, float32)
        cnt = cuda.local.array(NCNT, int64)
        start(buf, acc, m_i, l_i, cnt)  # zeros, -inf; the buffer cleared
        if STAGGERED:
            # K_j0 is copied while Q_i loads (results/tuning_history/q_outer.md)
            j0, j1 = kv_blocks(row0, n_rows, n_q, n_k)
            if j0 < j1:
                load_K_j_counted(buf, k, kv, j0 * BC, n_k, 0, cnt)
            load_Q_i_counted(buf, q, bh, row0, n_rows, scale_log2, cnt)
        else:
            # Q_i first (K_0 and V_0 ahead of it lost on tensor cores:
            # results/tuning_history/q_outer.md); stream_kv copies them
            load_Q_i_counted(buf, q, bh, row0, n_rows, scale_log2, cnt)
            j0, j1 = kv_blocks(row0, n_rows, n_q, n_k)
        fold_tiles(buf, k, v, kv, n_k, j0, j1, diag0, m_i, l_i, acc, scale_log2, cnt)
        if j0 >= j1:
            # a query block that sees no key: no K/V tile waited for Q_i's copies, which
            # must land before O_i's stage takes their place
            wait_loads()

        write_block(buf, o, lse, bh, row0, n_rows, m_i, l_i, l_row, inv_l, acc, cnt)
        if COUNT:
            flush_counts(cnt, counts)

    return q_outer


@inlined
def cta_sync():
    cuda.syncthreads()


def make_write_block(mk, SAVE_LSE: bool, COUNT: bool, sync, write_o=None):
    """write_block(buf, o, lse, bh, row0, n_rows, m_i, l_i, l_row, inv_l, acc, cnt): a query
    block's end: l_i summed over the lanes, O_i = acc / l_i to HBM, and lse_i, each counted.
    O_i goes through its stage (`sync()` the barrier of the threads holding the block's
    rows), or by write_o(buf, o, bh, row0, n_rows, acc, inv_l) -> elements written where
    given (a persistent CTA's, `tensor_cores.make_tc_o_direct`)."""
    row_sums, reciprocal, store_lse = mk.row_sums, mk.reciprocal, mk.store_lse
    write_O_i = write_o or make_staged_o(mk, sync)

    @inlined
    def write_block(buf, o, lse, bh, row0, n_rows, m_i, l_i, l_row, inv_l, acc, cnt):
        row_sums(buf, l_i, l_row)
        reciprocal(l_row, inv_l)
        moved = write_O_i(buf, o, bh, row0, n_rows, acc, inv_l)
        if COUNT:
            cnt[O_W] += moved
        if SAVE_LSE:
            moved = store_lse(lse, bh, row0, n_rows, m_i, l_row)
            if COUNT:
                cnt[LSE_W] += moved

    return write_block


def make_staged_o(mk, sync):
    """write_o(buf, o, bh, row0, n_rows, acc, inv_l) -> elements written: O_i = acc inv_l
    through its stage in shared memory (where the tiles were) to HBM; `sync()` the barrier of
    the threads holding the block's rows."""
    give_o, store_O_i = mk.give_o, mk.store_o

    @inlined
    def write_o(buf, o, bh, row0, n_rows, acc, inv_l):
        sync()  # every thread is done with the tiles: O_i may take their place
        give_o(buf, acc, inv_l)  # normalised, into its stage
        sync()  # O_i is complete in shared memory
        # O_i: written to HBM once, normalised
        return store_O_i(buf, o, bh, row0, n_rows)

    return write_o


def make_produced_kernel(BR, BC, D, DV, MK, MASK, SAVE_LSE, COUNT, GROUP):
    """The same loop nest on Hopper with a producer warpgroup (`TensorCores.producer`,
    FlashAttention-3's warp specialisation): past the computing warpgroups, one more whose
    first thread copies Q_i and every K_j, V_j into the ring by TMA (`hopper.
    make_tma_producer`) on registers the computing ones take (setmaxnreg); the computing
    threads only wait for fills and release buffers, and meet at a barrier of their own."""
    mk = micro_kernel(BR, BC, D, DV, MK, MASK, False, UNROLL.get(D, Unroll.by(2)), D in PEEL,
                      transposes_q(D))
    ALIGN = buffer_align(MK)  # as the micro-kernel's views of the buffer
    NT, RM, NACC = mk.NT, mk.RM, mk.NACC  # computing threads; a thread's rows, accumulators
    begin, end, q_landed = mk.ring.begin, mk.ring.end, mk.ring.k.landed
    produce = mk.producer(COUNT)
    fewer = set_max_registers(hopper.PRODUCER_REGISTERS, False)
    more = set_max_registers(hopper.CONSUMER_REGISTERS, True)
    computing_sync, _ = named_barrier(hopper.COMPUTING_BARRIER, NT)
    write_block = make_write_block(mk, SAVE_LSE, COUNT, computing_sync)
    start = make_online_start(NACC, RM, COUNT, mk.clear)
    fold_tiles = make_fold_tiles(BC, mk, make_counted_loads(BC, COUNT, mk))
    flush_counts = counts_flusher()
    block_of = make_block_of(MASK.bounded, HEAVY_LAST=True,
                             GROUP_HEADS=getattr(MK, "causal_heads", 0))
    kv_blocks = make_kv_blocks(BC, MASK)  # [j0, j1): the K/V blocks query block i sees
    NCNT = counter_slots(COUNT)
    kv_head = make_kv_head(GROUP)

    @cuda.jit(**kernel_options(NT + hopper.WARPGROUP, hopper.LAUNCH_REGISTERS))
    def q_outer_tma(q, k, v, o, lse, counts, maps, scale_log2):
        # masked: the query blocks that see the most K/V blocks start first (`block_grid`)
        i, bh = block_of(q.shape[0])
        kv = kv_head(bh)  # query head bh's K/V head (grouped-query attention)
        n_q = q.shape[1]
        n_k = k.shape[1]
        row0 = i * BR
        n_rows = min(BR, n_q - row0)
        diag0 = row0 + n_k - n_q  # the first row's diagonal key (bottom-right aligned)

        buf = cuda.shared.array(0, SHARED_F32, alignment=ALIGN)  # Q_i, K_j, V_j, ...
        acc = cuda.local.array(NACC, float32)
        m_i = cuda.local.array(RM, float32)
        l_i = cuda.local.array(RM, float32)  # this thread's partial sums of its rows
        l_row = cuda.local.array(RM, float32)
        inv_l = cuda.local.array(RM, float32)
        cnt = cuda.local.array(NCNT, int64)
        start(buf, acc, m_i, l_i, cnt)  # zeros, -inf; the buffer cleared
        j0, j1 = kv_blocks(row0, n_rows, n_q, n_k)
        begin(buf)  # the ring's mbarriers, for the producer and the computing threads
        if cuda.threadIdx.x >= NT:  # the producer warpgroup: one thread copies
            fewer()
            if cuda.threadIdx.x == NT:
                produce(buf, maps, q, k, v, bh, kv, row0, n_rows, n_k, j0, j1, cnt)
        else:
            more()
            fold_tiles(buf, k, v, kv, n_k, j0, j1, diag0, m_i, l_i, acc, scale_log2, cnt)
            if j0 >= j1:
                # a query block that sees no key: Q_i's copy lands before O_i's stage takes
                # its place, and the warpgroups' first turn is taken
                q_landed(buf, 0, 0)
                end()
            write_block(buf, o, lse, bh, row0, n_rows, m_i, l_i, l_row, inv_l, acc, cnt)
        if COUNT:
            flush_counts(cnt, counts)

    return q_outer_tma


def make_persistent_produced_kernel(BR, BC, D, DV, MK, MASK, SAVE_LSE, COUNT, GROUP):
    """`make_produced_kernel`'s loop nest on persistent CTAs (`TensorCores.persistent`,
    FlashAttention-3's persistent kernel; `microkernel.persistent`): a CTA an SM, the
    producer thread handing the computing threads one work item after another with its Q_i
    (`hopper.make_tma_persistent_producer`), so that the next block's Q_i and first K/V tiles
    land under this block's last products and O_i. The ring's positions, its mbarriers' phases
    and the warpgroups' turns run on from block to block; O_i goes from the accumulators
    straight to HBM (`tensor_cores.make_tc_o_direct`: a stage would lie under tiles landing)."""
    mk = micro_kernel(BR, BC, D, DV, MK, MASK, False, UNROLL.get(D, Unroll.by(2)), D in PEEL,
                      transposes_q(D))
    ALIGN = buffer_align(MK)  # as the micro-kernel's views of the buffer
    NT, RM, NACC = mk.NT, mk.RM, mk.NACC  # computing threads; a thread's rows, accumulators
    begin, end, q_landed = mk.ring.begin, mk.ring.end, mk.ring.q.landed
    kv_blocks = make_kv_blocks(BC, MASK)  # [j0, j1): the K/V blocks query block i sees
    kv_head = make_kv_head(GROUP)
    items = make_items(BR, MASK.bounded, getattr(MK, "causal_heads", 0))
    produce_items = mk.producer(COUNT, items, kv_blocks, kv_head)
    fewer = set_max_registers(hopper.PRODUCER_REGISTERS, False)
    more = set_max_registers(hopper.CONSUMER_REGISTERS, True)
    put_o = make_tc_o_direct(BR, BC, D, DV, MK)  # no stage: O_i from the accumulators
    write_block = make_write_block(mk, SAVE_LSE, COUNT, None, put_o)
    start = make_online_start(NACC, RM, COUNT, mk.clear)
    reset = make_online_reset(NACC, RM)
    fold_from = make_stream_kv_pipelined(BC, mk, make_counted_loads(BC, COUNT, mk), True)
    flush_counts = counts_flusher()
    NCNT = counter_slots(COUNT)

    @cuda.jit(**kernel_options(NT + hopper.WARPGROUP, hopper.LAUNCH_REGISTERS))
    def q_outer_tma_persistent(q, k, v, o, lse, counts, maps, tickets, scale_log2):
        buf = cuda.shared.array(0, SHARED_F32, alignment=ALIGN)  # Q_i, K_j, V_j, ...
        item = cuda.shared.array(2, int32)  # the work item handed over with its Q_i
        acc = cuda.local.array(NACC, float32)
        m_i = cuda.local.array(RM, float32)
        l_i = cuda.local.array(RM, float32)  # this thread's partial sums of its rows
        l_row = cuda.local.array(RM, float32)
        inv_l = cuda.local.array(RM, float32)
        cnt = cuda.local.array(NCNT, int64)
        start(buf, acc, m_i, l_i, cnt)  # the buffer cleared, once
        begin(buf)  # the ring's mbarriers and Q_i's, for the producer and the computing threads
        if cuda.threadIdx.x >= NT:  # the producer warpgroup: one thread copies
            fewer()
            if cuda.threadIdx.x == NT:
                produce_items(buf, maps, q, k, v, tickets, item, cnt)
        else:
            more()
            n_q, n_k = q.shape[1], k.shape[1]
            handed = int32(0)  # items the producer handed over
            t0 = int64(0)  # K/V tiles the CTA folded before this block
            while True:
                q_landed(buf, 0, handed)  # Q_i in shared memory, its item beside it
                i, bh = item[0], item[1]
                if i < 0:
                    break
                row0 = int64(i) * BR
                n_rows = min(BR, n_q - row0)
                diag0 = row0 + n_k - n_q  # the first row's diagonal key (bottom-right aligned)
                j0, j1 = kv_blocks(row0, n_rows, n_q, n_k)
                reset(acc, m_i, l_i)
                fold_from(buf, k, v, kv_head(bh), n_k, j0, j1, t0, diag0, m_i, l_i, acc,
                          scale_log2, cnt)
                write_block(buf, o, lse, bh, row0, n_rows, m_i, l_i, l_row, inv_l, acc, cnt)
                t0 += j1 - j0
                handed += 1
            end()  # the last warpgroup passed the turn once more than it took it
        if COUNT:
            flush_counts(cnt, counts)

    return q_outer_tma_persistent


@register
class QOuter(MicroKernelSchedule):
    name = "q_outer"
    BACKWARD = "q_outer"
    RELOAD = False
    TENSOR_CORES = True
    # Which kernel this loop nest runs (`MicroKernelSchedule.layout`): each table says one
    # measured choice; what was measured, with its logs, is results/tuning_history/q_outer.md.
    KV_STAGES = 2  # K/V loads under the arithmetic: double-buffered (tensor cores), staggered
    # thread tiles measured fastest here: 8 x 8 at d = 64, 8 x 4 at 128; at 64 x 64 and d = 128,
    # P_ij^T in K_j's place (two CTAs an SM)
    TUNED_LAYOUTS = {(128, 64, 64): (8, 8), (128, 64, 128): (8, 4),
                     (64, 64, 128): (8, 4, 1, True)}
    # causal d = 64 at N_q <= 512: 64-row blocks beat 128 x 64
    SHORT_TILES = {(64, True): ((512, (64, 64)),)}
    # TF32 / 3xTF32 at d = 128 on 64 x 64: one K/V buffer lets two CTAs share an SM
    TC_KV_STAGES = {("tf32x3", 64, 64, 128, 128): 1, ("tf32", 64, 64, 128, 128): 1}
    # float32 d = 128 on 128 x 64: S warps and P V warps, unrolled (chunks, keys) per mask
    SPECIALISED = {(128, 64, 128, 128, False): (3, 4), (128, 64, 128, 128, True): (3, 8)}
    # causal, up to N_q = 2048: persistent CTAs, unrolled (chunks, keys, peel)
    PERSISTENT = {(128, 64, 128, 128, True): (2048, (3, 8, False))}
    # causal 3xTF32 at d = 128 up to N_q = 2048: 64 x 64 tiles on one K/V buffer
    TC_SHORT_TILES = {("tf32x3", 128, True): ((2048, (64, 64)),)}
    PRODUCED_KERNEL = True  # `make_produced_kernel`
    GROUPS_HEADS = True  # its tensor-core kernels' causal grid, by groups of heads
    # Hopper, 16-bit, causal, d = 128 on 128 x 128: eight heads a group (the K/V of the heads
    # on the GPU at once stay in L2)
    HOPPER_CAUSAL_HEADS = {(128, 128, 128): 8}
    # Hopper, 16-bit: the K/V loop measured fastest on each tile (results/bench_hopper_builds
    # .csv, N = 1024 and 4096; bench_hopper_n1024.csv for 64 x 64): each product waited at
    # d = 64 on 128 x 64 and 64 x 64 (one warpgroup: no producer), the TMA producer elsewhere
    HOPPER_BUILDS = {(128, 64, 64): "sync", (64, 64, 64): "sync", (128, 128, 64): "tma",
                     (128, 64, 128): "tma", (128, 128, 128): "tma"}
    # ... the TMA build on persistent CTAs at d = 128 on 128 x 128 up to N_q = 4096, where it
    # was measured faster (at 16384 not: results/bench_hopper_persistent.csv)
    HOPPER_PERSISTENT = {(128, 128, 128): 4096}
    # ... and the tiles (the fastest build on them) a call naming none takes, per (d, causal):
    # ((from N_q, tiles), ...), the last that N_q reaches
    HOPPER_TILES = {(64, False): ((0, (128, 64)), (4096, (128, 128))),
                    (64, True): ((0, (64, 64)), (2048, (128, 64))),
                    (128, False): ((0, (128, 128)),), (128, True): ((0, (128, 128)),)}
    make_kernel = staticmethod(make_kernel)
    summary = "FlashAttention-2 order: Q block resident, K/V streamed; one CTA per query block"
    EXPECTED_SLOPES = {"m": -1, "n": 2, "d": 2}
    TRAFFIC_CLASS = "flash"
    # The seed explainer's example: Q once (12), K and V three times (36 + 36), O once (12).
    WORKED_EXAMPLE = ({"n_q": 6, "d": 2, "block_q": 2, "block_k": 2}, 96)
    LOOP_NEST = """
        for (b, h, i) in parallel:            # one CTA per query block
            load Q_i                          # HBM -> shared memory, once
            m_i, l_i, acc_i = -inf, 0, 0
            for j in range(first_i, end_i):   # all Tc, or the blocks the mask shows i
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
        keys_read = int(p.visited_keys().sum())
        per_head = {
            "q": {"read": p.n_q * p.d},
            "k": {"read": keys_read * p.d},
            "v": {"read": keys_read * p.dv},
            "o": {"write": p.n_q * p.dv},
            "lse": {"write": p.n_q if p.save_lse else 0},
        }
        return self.ledger(per_head, p.bh)

    def walk(self, p: Problem) -> Counter:
        c = Counter()
        for i in range(0, p.n_q, p.block_q):
            queries = rows(i, p.block_q, p.n_q)
            c["q", "read"] += len(queries) * p.d
            for j in range(0, p.n_k, p.block_k):
                keys = rows(j, p.block_k, p.n_k)
                if sees(p, queries, keys):
                    c["k", "read"] += len(keys) * p.d
                    c["v", "read"] += len(keys) * p.dv
            c["o", "write"] += len(queries) * p.dv
            if p.save_lse:
                c["lse", "write"] += len(queries)
        return c

    def workspace_bytes(self, p: Problem) -> int:
        return 0  # m_i, l_i and the accumulator live in registers only

    def specialised(self, p: Problem, stages: int) -> Specialised | None:
        """The warp-specialised kernel, unrolled as SPECIALISED says (on persistent CTAs up to
        the N_q PERSISTENT gives), where p's tiles and mask are in it (and K/V loads run under
        the arithmetic, `stages` 2), or where LOOP_ORDERS_LAYOUT=ws (or
        ws,CHUNKS,KEYS[,PEEL[,PERSISTENT]]: its unrolling and CTAs, `Specialised`) forces it
        (for tuning and tests: a ValueError where the tiles do not fit it); else None. Any
        other LOOP_ORDERS_LAYOUT names a thread tile of the shared micro-kernel."""
        forced = tuning.current()
        tiles = (p.block_q, p.block_k, p.d, p.dv)
        # its roles implement no mask or causal with N_q = N_k (`SQUARE_MASKS`), one K/V head
        # per query head
        square = (p.mask in SQUARE_MASKS and (p.n_q == p.n_k or not p.mask.bounded)
                  and p.group == 1)
        if forced.forces_own_kernel():
            if not Specialised.fits(*tiles) or not square:
                return super().specialised(p, stages)  # refused, with the reason
            chosen = Specialised.parse(forced.layout, p.dv)
        elif (not forced.layout and stages > 1 and square
              and (*tiles, p.causal) in self.SPECIALISED):
            largest_n, steps = self.PERSISTENT.get((*tiles, p.causal), (0, ()))
            if p.n_q <= largest_n:
                chosen = Specialised(p.dv, *steps, persistent=True)
            else:
                chosen = Specialised(p.dv, *self.SPECIALISED[(*tiles, p.causal)])
        else:
            return None
        return chosen.for_problem(p.n_q, p.n_k, p.block_q, p.block_k)

    def transposes_q(self, p: Problem) -> bool:
        return transposes_q(p.d)

    def tiles_for_sram(self, m: int, d: int) -> tuple[int, int]:
        # Algorithm 1's sizes with the roles swapped: the resident query block is the large one.
        big = ceil_div(m, 4 * d)
        return big, min(big, d)

    def launch(self, p, q, k, v, out, lse, counts, *, scale, count, workspace=None):
        self.launch_kernel(p, block_grid(p.tr, p.bh, p.mask.bounded), count, scale, q, k, v, out,
                           lse, counts)
