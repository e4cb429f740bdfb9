"""split_kv: the split-KV forward (flash-decoding). Each query block's K/V blocks are cut into
S contiguous ranges, one CTA each; a second kernel combines the partial results exactly.

    kernel 1, per (batch, head), query block i, split s in parallel:  # one CTA each
        j0, j1 = [s P, (s + 1) P) cut to [first_i, end_i)   # P = ceil(Tc / S) blocks a split
        if j0 >= j1: done                          # (i, s) not visited: i sees none of them
        load Q_i                                   # once per visited (i, s)
        m_is, l_is, acc_is = -inf, 0, 0
        for j in j0 .. j1 - 1:
            load K_j, V_j
            online-softmax update of (m_is, l_is, acc_is)
        write O_is = acc_is / l_is, lse_is = m_is + log l_is     # float32 o_part, lse_part
    kernel 2, per (batch, head), query block i in parallel:       # one CTA each
        load lse_is of every visited split s
        lse_i = log sum_s exp(lse_is)              # (shifted by the largest lse_is)
        load O_is of every visited split s; O_i = sum_s exp(lse_is - lse_i) O_is
        write O_i;  write lse_i                    # lse only with save_lse

Traffic (elements, per batch x head). A query block of r_i rows that sees the K/V blocks
first_i .. end_i - 1 (all Tc without a mask) visits the S_i splits that hold one of them,
floor(first_i / P) .. ceil(end_i / P) - 1. Q: sum_i S_i r_i d read. K, V: as q_outer, every
visible block once per query block, sum_i (the keys of its blocks) (d + dv). o_part:
sum_i S_i r_i dv written and read back; lse_part: sum_i S_i r_i each way. O: N_q dv written;
lse: N_q with save_lse. So split_kv moves (S_i - 1) r_i d more Q than q_outer plus the
partials' round trip, and buys B H Tr S CTAs instead of B H Tr: at decode (N_q = 1) q_outer
has one CTA per head.

A row that sees no key of a visited split (a mask) gets O_is = 0 and lse_is = -inf there, so
its weight in the combine is exp(-inf) = 0; a row that sees no key at all gets O_i = 0 and
lse_i = -inf. The weights are exp(lse_is - max) over their sum,
so they sum to 1 in float32 too and O_i stays a convex combination of V's rows. lse_is is a
float32 (as in FlashAttention-2's split kernels), so the weights carry a relative error of
about |score| 2^-23: the order of the scores' own rounding, but where |score| reaches ~10^7
(float16 inputs near their largest) log l_is drops below lse_is's resolution and the splits'
shares with it (`COMBINES_BY_LSE`). Option `splits`: an integer S, or "auto":
`auto_splits`, FlashAttention-2's heuristic on this GPU's SMs (the simulator stands in for an
H100/H200, 132 SMs).

Worked example (`WORKED_EXAMPLE`, the seed's N = 6, d = dv = 2, Br = Bc = 2, S = 2): P = 2, so
split 0 holds K/V blocks 0 and 1 and split 1 block 2, and all 3 query blocks visit both: Q 24,
K 36, V 36, o_part 24 + 24, lse_part 12 + 12, O 12, in all 180.
"""

from __future__ import annotations

import functools
import math
from collections import Counter

import numpy as np
from numba import float32, int64

from ..core.ledger import Ledger, slot
from ..core.schedule import Kernel, Option, Problem, ceil_div, int_option, register, rows, sees
from ..device.intrinsics import narrow
from ..device.runtime import (
    SHARED_F32,
    cuda,
    device_empty,
    dynamic_shared_limit,
    kernel_factory,
    kernel_options,
    launch,
    multiprocessor_count,
    resident_ctas,
)
from ..microkernel.cuda_cores import MicroKernelSchedule, Unroll, micro_kernel
from ..microkernel.hopper import buffer_align
from ..microkernel.stream import make_counted_loads, make_fold_tiles
from ..microkernel.tiles import (
    counter_slots,
    counts_flusher,
    make_kv_blocks,
    make_kv_head,
    make_online_start,
    zero_counts,
)

# As q_outer: two chunks per trip of the micro-kernel's hot loops.
UNROLL = Unroll.by(2)
COMBINE_THREADS = 128
# "auto" (FlashAttention-2's num_splits_heuristic): one split when the query blocks alone
# fill 80% of the GPU's CTA slots; else the smallest eligible S whose wave efficiency is
# within 85% of the best, S <= MAX_SPLITS.
MAX_SPLITS = 128
FILLED, WITHIN = 0.8, 0.85


@kernel_factory
def make_kernel(BR, BC, D, DV, MK, MASK, SAVE_LSE, COUNT, GROUP):
    mk = micro_kernel(BR, BC, D, DV, MK, MASK, False, UNROLL)  # CUDA or tensor cores
    ALIGN = buffer_align(MK)  # as the micro-kernel's views of the buffer
    # the staggered K/V loop needs K_j0 loaded by the caller; split_kv (KV_STAGES 1) has none
    assert not mk.STAGGERED, "split_kv: a staggered K/V loop needs K_j0 loaded first"
    MASKED = MASK.bounded
    NT, RM, NACC = mk.NT, mk.RM, mk.NACC  # threads; a thread's rows, accumulators
    # Numba compiles closure variables as constants: take the device functions by name
    row_sums, reciprocal, give_o = mk.row_sums, mk.reciprocal, mk.give_o
    store_O_is, store_lse_is = mk.store_o, mk.store_lse
    start = make_online_start(NACC, RM, COUNT, mk.clear)
    loads = make_counted_loads(BC, COUNT, mk)
    load_Q_i_counted = loads.q
    fold_tiles = make_fold_tiles(BC, mk, loads)  # q_outer's K/V loop, over the split's blocks
    flush_counts = counts_flusher()
    kv_blocks = make_kv_blocks(BC, MASK)  # [first_i, end_i)
    NCNT = counter_slots(COUNT)
    OP_W, LP_W = slot("o_part", "write"), slot("lse_part", "write")
    kv_head = make_kv_head(GROUP)

    @cuda.jit(**kernel_options(NT, MK.registers(BC, DV)))
    def split_kv(q, k, v, o_part, lse_part, counts, n_splits, per, scale_log2):
        i = cuda.blockIdx.x
        s = cuda.blockIdx.y
        bh = cuda.blockIdx.z
        kv = kv_head(bh)  # query head bh's K/V head (grouped-query attention)
        n_q = q.shape[1]
        n_k = k.shape[1]
        row0 = i * BR
        n_rows = min(BR, n_q - row0)
        first, end = kv_blocks(row0, n_rows, n_q, n_k)
        j0 = s * per
        j1 = min(j0 + per, end)
        if MASKED:
            j0 = max(j0, first)
        if j0 >= j1:
            return  # split s holds no K/V block that query block i sees (the whole CTA)
        part = s * cuda.gridDim.z + bh  # (split, head) row of o_part and lse_part

        buf = cuda.shared.array(0, SHARED_F32, alignment=ALIGN)  # Q_i, K_j, V_j, ...
        acc = cuda.local.array(NACC, float32)
        m_i = cuda.local.array(RM, float32)
        l_i = cuda.local.array(RM, float32)  # this thread's partial sums of its rows
        l_row = cuda.local.array(RM, float32)
        inv_l = cuda.local.array(RM, float32)
        cnt = cuda.local.array(NCNT, int64)
        start(buf, acc, m_i, l_i, cnt)  # zeros, -inf; the buffer cleared
        # Q_i: read from HBM once per visited split
        load_Q_i_counted(buf, q, bh, row0, n_rows, scale_log2, cnt)
        # K_j, V_j: the split's own blocks, each read once per query block; row0 + N_k - N_q
        # is the first row's diagonal key (bottom-right aligned)
        fold_tiles(buf, k, v, kv, n_k, j0, j1, row0 + n_k - n_q, m_i, l_i, acc, scale_log2,
                   cnt)

        row_sums(buf, l_i, l_row)
        reciprocal(l_row, inv_l)  # a row that saw no key of the split keeps O_is = 0
        cuda.syncthreads()  # every thread is done with the tiles: O_is may take their place
        give_o(buf, acc, inv_l)  # normalised, into its stage
        cuda.syncthreads()  # O_is is complete in shared memory
        # O_is: the split's partial output, written to HBM in float32 for the combine
        moved = store_O_is(buf, o_part, part, row0, n_rows)
        if COUNT:
            cnt[OP_W] += moved
        # lse_is: the split's log-sum-exp (-inf for a row that saw no key of the split), for
        # the combine's weights
        moved = store_lse_is(lse_part, part, row0, n_rows, m_i, l_row)
        if COUNT:
            cnt[LP_W] += moved
            flush_counts(cnt, counts)

    return split_kv


@kernel_factory
def make_combine_kernel(BR, BC, NT, MASK, SAVE_LSE, COUNT):
    flush_counts = counts_flusher()
    kv_blocks = make_kv_blocks(BC, MASK)  # [first_i, end_i)
    MASKED = MASK.bounded
    NCNT = counter_slots(COUNT)
    O_W, LSE_W = slot("o", "write"), slot("lse", "write")
    OP_R, LP_R = slot("o_part", "read"), slot("lse_part", "read")

    @cuda.jit
    def split_kv_combine(o_part, lse_part, o, lse, counts, n_k, n_splits, per):
        i = cuda.blockIdx.x
        bh = cuda.blockIdx.y
        heads = cuda.gridDim.y
        t = cuda.threadIdx.x
        n_q = o.shape[1]
        dv = o.shape[2]
        row0 = i * BR
        n_rows = min(BR, n_q - row0)
        first, end = kv_blocks(row0, n_rows, n_q, n_k)
        s0, s1 = 0, min(n_splits, (end + per - 1) // per)  # the splits kernel 1 visited
        if MASKED:
            s0 = first // per
            if end <= first:
                s1 = s0
        # w[s BR + r]: split s's weight for row r, then lse_i of the block's rows from
        # w[n_splits BR] on
        w = cuda.shared.array(0, SHARED_F32)
        cnt = cuda.local.array(NCNT, int64)
        if COUNT:
            zero_counts(cnt)
        for r in range(t, n_rows, NT):
            top = float32(-math.inf)
            for s in range(s0, s1):
                # lse_is: read back from HBM once per visited split
                x = lse_part[s * heads + bh, row0 + r]
                w[s * BR + r] = x
                top = max(top, x)
                if COUNT:
                    cnt[LP_R] += 1
            total = float32(0.0)
            if MASKED and top == float32(-math.inf):
                top = float32(0.0)  # the row saw no key: every weight exp(-inf) = 0
            for s in range(s0, s1):
                e = math.exp(w[s * BR + r] - top)  # exp(-inf) = 0; NaN stays NaN
                w[s * BR + r] = e
                total += e
            if MASKED and total == float32(0.0):
                w[n_splits * BR + r] = float32(-math.inf)  # lse_i of a row that saw no key
                total = float32(math.inf)  # and its weights 0 / inf = 0
            else:
                w[n_splits * BR + r] = top + math.log(total)  # lse_i
            for s in range(s0, s1):  # exp(lse_is - lse_i), summing to 1 in float32 too
                w[s * BR + r] = w[s * BR + r] / total
        cuda.syncthreads()  # every row's weights and lse_i are in shared memory
        for e in range(t, n_rows * dv, NT):
            r = e // dv
            x = e % dv
            out = float32(0.0)
            for s in range(s0, s1):
                # O_is: read back from HBM once per visited split (0 where the row saw no
                # key of the split, with weight 0)
                out += w[s * BR + r] * o_part[s * heads + bh, row0 + r, x]
                if COUNT:
                    cnt[OP_R] += 1
            # O_i: written to HBM once (coalesced: consecutive threads, consecutive columns)
            o[bh, row0 + r, x] = narrow(out, o)
            if COUNT:
                cnt[O_W] += 1
        if SAVE_LSE:
            for r in range(t, n_rows, NT):
                # lse_i: the row statistic the backward pass needs, written once
                lse[bh, row0 + r] = w[n_splits * BR + r]
                if COUNT:
                    cnt[LSE_W] += 1
        if COUNT:
            flush_counts(cnt, counts)

    return split_kv_combine


@register
class SplitKV(MicroKernelSchedule):
    name = "split_kv"
    RELOAD = False
    TENSOR_CORES = True
    make_kernel = staticmethod(make_kernel)
    summary = ("split-KV (flash-decoding): each query block's K/V range split over S CTAs, "
               "then combined")
    TENSORS = {"o_part": "float32", "lse_part": "float32"}
    OPTIONS = {"splits": Option(
        default="auto", help="K/V splits per query block (auto: FlashAttention-2's heuristic)",
        allowed="an integer 1 <= splits <= 1024, or 'auto'",
        check=int_option(1, 1024, also=("auto",)), examples=(1, 2, 3, 5, 16, "auto"))}
    TRAFFIC_CLASS = "flash"
    COMBINES_BY_LSE = True
    WORKED_EXAMPLE = ({"n_q": 6, "d": 2, "block_q": 2, "block_k": 2,
                       "options": {"splits": 2}}, 180)
    BACKWARD = "q_outer"  # O and lse are q_outer's, so is the gradient
    LOOP_NEST = """
        for (b, h, i, s) in parallel:         # one CTA per query block and split
            j0, j1 = max(s * P, first_i), min((s + 1) * P, end_i)   # P = ceil(Tc / S)
            if j0 >= j1: continue             # the split holds nothing block i sees
            load Q_i                          # HBM -> shared, once per (i, s)
            m, l, acc = -inf, 0, 0
            for j in range(j0, j1):
                load K_j, V_j                 # HBM -> shared
                online-softmax update of (m, l, acc) with S_ij = Q_i K_j^T
            write O_is = acc / l, lse_is = m + log(l)   # float32 partials -> HBM
        for (b, h, i) in parallel:            # combine: one CTA per query block
            load lse_is for the visited splits         # HBM -> shared
            lse_i = log(sum_s exp(lse_is))
            load O_is; O_i = sum_s exp(lse_is - lse_i) O_is
            write O_i                         # -> HBM, once
            write lse_i                       # only with save_lse
    """

    @functools.lru_cache(maxsize=4096)  # noqa: B019 - the registry keeps one instance
    def splits(self, p: Problem) -> int:
        """S for p: the option's integer, or `auto_splits`."""
        chosen = p.option("splits")
        return self.auto_splits(p) if chosen == "auto" else chosen

    def auto_splits(self, p: Problem) -> int:
        """FlashAttention-2's heuristic: the query blocks B H Tr against the CTA slots of the
        GPU (SMs x the CTAs of kernel 1 one SM holds); 1 split if they fill FILLED of the
        slots, else the smallest eligible S (S = 1, or ceil(Tc / S) < ceil(Tc / (S - 1)))
        whose wave efficiency (B H Tr S / slots over its ceiling) is within WITHIN of the
        best eligible S <= min(MAX_SPLITS, slots, Tc). (FlashAttention-2 takes the best over
        every S, eligible or not, and falls back to 1 when no eligible S comes within 85% of
        it; with our many small CTAs that fell back at Tc = 64: 2.31 ms instead of split.)"""
        lay = self.layout(p)
        slots = multiprocessor_count() * resident_ctas(
            lay.threads(p.block_q, p.block_k), self.dynamic_shared_bytes(p, lay),
            lay.registers(p.block_k, p.dv))
        work = p.bh * p.tr
        if work >= FILLED * slots:
            return 1
        most = min(MAX_SPLITS, slots, p.tc)
        eligible = [s for s in range(1, most + 1)
                    if s == 1 or ceil_div(p.tc, s) != ceil_div(p.tc, s - 1)]
        efficiency = {s: work * s / slots / math.ceil(work * s / slots) for s in eligible}
        best = max(efficiency.values())
        return next(s for s in eligible if efficiency[s] >= WITHIN * best)

    def ctas(self, p: Problem) -> int:
        return p.bh * p.tr * self.splits(p)

    def resolved_options(self, p: Problem) -> dict:
        return {"splits": self.splits(p)}

    def model(self, p: Problem) -> Ledger:
        n_splits = self.splits(p)
        per = ceil_div(p.tc, n_splits)
        first, end = p.kv_block_ranges()
        visited = np.where(end > first, np.minimum(n_splits, -(-end // per)) - first // per, 0)
        query_rows = p.query_block_rows()
        keys_read = int(p.visited_keys().sum())
        partial_rows = int((visited * query_rows).sum())
        per_head = {
            "q": {"read": partial_rows * p.d},
            "k": {"read": keys_read * p.d},
            "v": {"read": keys_read * p.dv},
            "o_part": {"read": partial_rows * p.dv, "write": partial_rows * p.dv},
            "lse_part": {"read": partial_rows, "write": partial_rows},
            "o": {"write": p.n_q * p.dv},
            "lse": {"write": p.n_q if p.save_lse else 0},
        }
        return self.ledger(per_head, p.bh)

    def walk(self, p: Problem) -> Counter:
        n_splits = self.splits(p)
        per = ceil_div(p.tc, n_splits)
        c = Counter()
        for i in range(0, p.n_q, p.block_q):
            queries = rows(i, p.block_q, p.n_q)
            visited = 0
            for s in range(n_splits):
                seen = [j for j in range(s * per, min((s + 1) * per, p.tc))
                        if sees(p, queries, rows(j * p.block_k, p.block_k, p.n_k))]
                if not seen:
                    continue
                visited += 1
                c["q", "read"] += len(queries) * p.d
                for j in seen:
                    keys = rows(j * p.block_k, p.block_k, p.n_k)
                    c["k", "read"] += len(keys) * p.d
                    c["v", "read"] += len(keys) * p.dv
                c["o_part", "write"] += len(queries) * p.dv
                c["lse_part", "write"] += len(queries)
            c["lse_part", "read"] += visited * len(queries)
            c["o_part", "read"] += visited * len(queries) * p.dv
            c["o", "write"] += len(queries) * p.dv
            if p.save_lse:
                c["lse", "write"] += len(queries)
        return c

    def workspace_bytes(self, p: Problem) -> int:
        # o_part and lse_part: float32 partials of every split of every query row
        return 4 * self.splits(p) * p.bh * p.n_q * (p.dv + 1)

    def allocate_workspace(self, p: Problem, empty=device_empty) -> tuple:
        parts = self.splits(p) * p.bh
        return empty((parts, p.n_q, p.dv), np.float32), empty((parts, p.n_q), np.float32)

    def tiles_for_sram(self, m: int, d: int) -> tuple[int, int]:
        # As q_outer: the resident query block is the large one.
        big = ceil_div(m, 4 * d)
        return big, min(big, d)

    def combine_shared_bytes(self, p: Problem) -> int:
        """The combine's weights (S Br floats) and lse_i of the block's rows (Br floats)."""
        return 4 * (self.splits(p) + 1) * p.block_q

    def kernels(self, p: Problem, count: bool) -> list[Kernel]:
        fn = make_combine_kernel(p.block_q, p.block_k, COMBINE_THREADS, p.mask, p.save_lse,
                                 count)
        counters = 8 * counter_slots(True) if count else 0
        combine = Kernel(fn.py_func.__name__, fn, self.combine_shared_bytes(p) + counters,
                         dynamic_shared_limit())
        return [self.micro_kernel(p, count), combine]

    def launch(self, p, q, k, v, out, lse, counts, *, scale, count, workspace=None):
        o_part, lse_part = workspace or self.allocate_workspace(p)
        n_splits = self.splits(p)
        per = ceil_div(p.tc, n_splits)
        self.launch_kernel(p, (p.tr, n_splits, p.bh), count, scale, q, k, v, o_part, lse_part,
                           counts, n_splits, per)
        combine = self.kernels(p, count)[1]
        launch(combine.fn, (p.tr, p.bh), COMBINE_THREADS, self.combine_shared_bytes(p), o_part,
               lse_part, out, lse, counts, p.n_k, n_splits, per)
