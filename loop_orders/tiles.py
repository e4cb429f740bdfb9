"""Device functions shared by the schedules: the algorithm, independent of loop order.

Every schedule moves tiles between HBM and the SM with `load_tile` / `load_row` and runs the
same online-softmax micro-kernel `make_online_update` on a (query row, K/V tile) pair. What
differs between schedules is only the loop nest around these calls, so measured differences
come from the loop order.

Counting: each HBM load/store site returns or knows the number of elements it moved; a thread
adds them to a private counter array (slots from `ledger.slot`), and `flush_counts` adds the
CTA's totals to the global int64 counter array once per CTA. Kernels only touch counters under
`if COUNT:` with COUNT a compile-time constant, so the uncounted build contains no counter code.

Scores are kept pre-scaled by log2(e) (`scale_log2 = scale * log2(e)`) so the update uses exp2.
"""

from __future__ import annotations

import math
from functools import cache

from numba import float32, int64

from .ledger import N_SLOTS
from .runtime import cuda

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


@cuda.jit(device=True)
def load_tile(dst, src, bh, row0, n_rows, n_cols):
    """All threads of the CTA copy rows [row0, row0+n_rows) of src[bh] into dst (float32).

    Consecutive threads take consecutive elements of a row, so global loads coalesce.
    Returns how many elements this thread loaded.
    """
    moved = 0
    for e in range(cuda.threadIdx.x, n_rows * n_cols, cuda.blockDim.x):
        r = e // n_cols
        c = e - r * n_cols
        dst[r, c] = float32(src[bh, row0 + r, c])
        moved += 1
    return moved


@cuda.jit(device=True)
def load_row(dst, src, bh, row, n_cols):
    """One thread copies row `row` of src[bh] into its registers/local array `dst`."""
    for c in range(n_cols):
        dst[c] = float32(src[bh, row, c])
    return n_cols


@cuda.jit(device=True)
def zero_counts(cnt):
    for s in range(cnt.shape[0]):
        cnt[s] = 0


@cuda.jit(device=True)
def flush_counts(cnt, counts):
    """Sum every thread's counters in shared memory, then add them to HBM once per CTA.

    Must be reached by every thread of the CTA (it has barriers).
    """
    cta = cuda.shared.array(N_SLOTS, int64)
    for s in range(cuda.threadIdx.x, N_SLOTS, cuda.blockDim.x):
        cta[s] = 0
    cuda.syncthreads()  # the CTA totals are zero before any thread adds to them
    for s in range(N_SLOTS):
        if cnt[s] != 0:
            cuda.atomic.add(cta, s, cnt[s])
    cuda.syncthreads()  # every thread has added its counts
    for s in range(cuda.threadIdx.x, N_SLOTS, cuda.blockDim.x):
        if cta[s] != 0:
            cuda.atomic.add(counts, s, cta[s])


def counter_slots(count: bool) -> int:
    """Size of a thread's private counter array (1 when counting is compiled out)."""
    return N_SLOTS if count else 1


@cache
def make_online_update(D: int, DV: int, BC: int, CAUSAL: bool):  # noqa: N803 - paper's names
    """The micro-kernel: fold one K/V tile into one query row's online-softmax state.

    State of row `row`: running max m2 (log2 units), denominator l, unnormalised numerator
    acc[DV]. For the tile's scores t (first key `key0`, `n_keys` valid keys):
    m' = max(m2, max t); alpha = 2^(m2 - m'); l' = alpha l + sum 2^(t - m');
    acc' = alpha acc + 2^(t - m') V_j. Returns (m', l'). `s` is scratch of BC scores.
    """

    @cuda.jit(device=True)
    def online_update(q_row, k_tile, v_tile, n_keys, key0, row, scale_log2, m2, l, acc, s):  # noqa: E741
        n_vis = n_keys
        if CAUSAL:
            # Keys after the query are masked: never scored and never multiplied into acc, so
            # a NaN in a masked row of V cannot leak into this row (0 * NaN = NaN).
            n_vis = min(n_keys, row - key0 + 1)
        if n_vis <= 0:
            return m2, l  # the row sees no key of this tile (causal diagonal)
        tile_max = float32(-math.inf)
        for c in range(n_vis):
            dot = float32(0.0)
            for x in range(D):
                dot += q_row[x] * k_tile[c, x]
            s[c] = dot * scale_log2
            tile_max = max(tile_max, s[c])  # skips a NaN score (Python's max; Numba's too)
        if tile_max == -math.inf:
            # Every visible score is -inf (weight 0) or NaN. A NaN must reach the output, not
            # be skipped like a masked tile: return m = l = NaN, which poisons this row.
            for c in range(n_vis):
                if s[c] != s[c]:
                    return s[c], s[c]
            return m2, l
        m_new = max(m2, tile_max)
        alpha = math.exp2(m2 - m_new)  # 0 before the first key (m2 = -inf)
        l = alpha * l  # noqa: E741
        for x in range(DV):
            acc[x] *= alpha
        for c in range(n_vis):
            p = math.exp2(s[c] - m_new)
            l += p  # noqa: E741
            for x in range(DV):
                acc[x] += p * v_tile[c, x]
        return m_new, l

    return online_update
