"""dK and dV of grouped-query attention: the sum over a K/V head's query heads.

In the per-head order a backward loop order runs each query head h against K/V head
h // G (G = H_q / H_kv) and writes dK_h, dV_h as if that K/V head were its own, into
(B H_q, N_k, width) buffers, as FlashAttention-2's GQA backward writes its dk_expanded. The
gradient of a K/V head is the sum over its G query heads:

    for (kv head, element e) in parallel:          # one thread per element of dK (dV)
        dK[kv, e] = sum_g dK_h[kv G + g, e]        # G reads, summed in float32; one write

so the model adds, per K/V head, G N_k d reads and N_k d writes of dk (and dv alike) to the
backward's own traffic (`group_sum_traffic`). Packed GQA (`api.packed_rows`) runs a group's
query rows against its K/V head in one loop nest and needs no sum.
"""

from __future__ import annotations

from numba import float32, int64

from ..core.ledger import Ledger, slot
from ..core.schedule import Problem
from ..device.intrinsics import narrow, widen
from ..device.runtime import cuda, kernel_factory, launch
from .tiles import counter_slots, counts_flusher
from .tiles import zero_counts as zero

THREADS = 256


@kernel_factory
def make_group_sum_kernel(G, TENSOR, COUNT):
    """out[kv] = sum of parts[kv G + g] over g < G, element by element; counted as reads and
    writes of TENSOR ("dk" or "dv")."""
    NCNT = counter_slots(COUNT)
    flush_counts = counts_flusher()
    READ, WRITE = slot(TENSOR, "read"), slot(TENSOR, "write")

    @cuda.jit
    def group_sum(parts, out, counts):
        kv = cuda.blockIdx.y
        n, width = out.shape[1], out.shape[2]
        cnt = cuda.local.array(NCNT, int64)
        if COUNT:
            zero(cnt)
        e = cuda.blockIdx.x * THREADS + cuda.threadIdx.x
        if e < n * width:
            r, c = e // width, e % width
            total = float32(0.0)
            for g in range(G):
                # the G query heads' parts: each read once
                total += widen(parts[kv * G + g, r, c])
            # the K/V head's gradient: written once, in the input dtype
            out[kv, r, c] = narrow(total, out)
            if COUNT:
                cnt[READ] += G
                cnt[WRITE] += 1
        if COUNT:
            flush_counts(cnt, counts)

    return group_sum


def launch_group_sums(p: Problem, parts_k, parts_v, dk, dv, counts, count: bool) -> None:
    """dk, dv (B H_kv, N_k, width) from the per-query-head parts (B H_q, N_k, width)."""
    for tensor, parts, out, width in (("dk", parts_k, dk, p.d), ("dv", parts_v, dv, p.dv)):
        blocks = -(-p.n_k * width // THREADS)
        launch(make_group_sum_kernel(p.group, tensor, count), (blocks, p.bh_kv), THREADS, 0,
               parts, out, counts)


def group_sum_traffic(p: Problem) -> Ledger:
    """The sums' traffic (zero without grouping): dk and dv parts read, the sums written."""
    if p.group == 1:
        return Ledger({})
    per_kv_head = {"dk": {"read": p.group * p.n_k * p.d, "write": p.n_k * p.d},
                   "dv": {"read": p.group * p.n_k * p.dv, "write": p.n_k * p.dv}}
    return Ledger(per_kv_head).scaled(p.bh_kv)
