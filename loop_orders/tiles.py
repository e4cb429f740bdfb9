"""Device functions shared by the schedules: the algorithm, independent of loop order.

Every schedule moves tiles between HBM and shared memory with `make_tile_loader` and rows
into registers with `load_row`; the flash orders also share the online-softmax micro-kernel
in `microkernel.py`. What differs between schedules is only the loop nest around these calls,
so measured differences come from the loop order.

Counting: each HBM load/store site returns or knows the number of elements it moved; a thread
adds them to a private counter array (slots from `ledger.slot`), and `flush_counts` adds the
CTA's totals to the global int64 counter array once per CTA. Kernels only touch counters under
`if COUNT:` with COUNT a compile-time constant, so the uncounted build contains no counter code.
"""

from __future__ import annotations

import math
from functools import cache

from numba import float32, int64

from .ledger import N_SLOTS
from .runtime import cuda

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


@cache
def make_tile_loader(ROWS: int, COLS: int, THREADS: int):  # noqa: N803 - compile-time sizes
    """Device function: the CTA's THREADS threads copy rows [row0, row0 + n_rows) of src[bh]
    (n_rows <= ROWS, COLS columns) into the shared tile dst as float32.

    Consecutive threads take consecutive elements of a row, so global loads coalesce.
    Returns how many elements the calling thread loaded.
    """

    @cuda.jit(device=True)
    def load_tile(dst, src, bh, row0, n_rows):
        moved = 0
        for e in range(cuda.threadIdx.x, n_rows * COLS, THREADS):
            r = e // COLS
            c = e - r * COLS
            dst[r, c] = float32(src[bh, row0 + r, c])
            moved += 1
        return moved

    return load_tile


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
