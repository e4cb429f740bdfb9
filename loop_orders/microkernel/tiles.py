"""Device functions shared by the schedules: the algorithm, independent of loop order.

Every schedule moves data between HBM and shared memory as tiles of whole rows, with
`make_tile_loader` and `make_tile_storer`, so every HBM access is coalesced (the flash orders'
tiles are rows of one shared buffer; dense passes a thread's own rows through a shared tile);
the flash orders also share the online-softmax micro-kernel in `microkernel.py`. What
differs between schedules is only the loop nest around these calls, so measured differences
come from the loop order.

Counting: each HBM load/store site returns or knows the number of elements it moved; a thread
adds them to a private counter array (slots from `ledger.slot`), and `counts_flusher()` adds the
CTA's totals to the global int64 counter array once per CTA. Kernels only touch counters under
`if COUNT:` with COUNT a compile-time constant, so the uncounted build contains no counter code.
"""

from __future__ import annotations

import math
import types
from functools import cache
from typing import NamedTuple

from numba import float32, int64, uint32, uint64

from ..core.ledger import n_slots
from ..core.mask import Mask, key_span, kv_block_range, q_block_range
from ..device.intrinsics import cp_async16, cp_async_commit, narrow, widen
from ..device.runtime import cuda, inlined

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


class _Rounds(NamedTuple):
    """How a CTA of THREADS covers a ROWS x COLS tile, an element a thread a round."""

    per_thread: int  # full rounds of the CTA over the tile
    whole_rows: bool  # each round covers whole rows, and the rounds cover the tile exactly


def _rounds(ROWS: int, COLS: int, THREADS: int) -> _Rounds:
    return _Rounds(ROWS * COLS // THREADS,
                   THREADS % COLS == 0 and ROWS % (THREADS // COLS) == 0)


def _flat_index(AT):
    """at(r, c): the index of tile element (r, c) in a 1-D shared buffer laid out as AT =
    (offset, stride[, col_stride]) (see _tile_copy)."""
    OFFSET, STRIDE, COL_STRIDE = (*AT, 1)[:3]

    @inlined
    def at(r, c):
        return uint64(OFFSET) + uint64(r) * uint64(STRIDE) + uint64(c) * uint64(COL_STRIDE)

    return at


def _tile_copy(ROWS: int, COLS: int, THREADS: int, TO_HBM: bool, AT):
    """Device function copying between a shared tile and rows [row0, row0 + n_rows),
    columns [col0, col0 + n_cols) of hbm[bh] (n_rows <= ROWS, n_cols <= COLS): into the
    tile as float32 times `factor`, or out of it in hbm's dtype (`intrinsics.widen`, `narrow`:
    bfloat16 arrives as uint16 bits). Returns the elements this
    thread moved. The tile is a 2-D shared array, or with AT = (offset, stride) the rows of a
    1-D shared buffer from `offset` on, `stride` floats apart; AT = (offset, stride,
    col_stride) spaces a row's elements col_stride floats apart (AT = (offset, 1, stride)
    stores the tile transposed).

    Consecutive threads take consecutive elements of a row, so HBM accesses coalesce: a
    warp's accesses fill whole 32-byte sectors. A full tile takes a loop of compile-time trip
    count with constant offsets, which LLVM unrolls 8 copies a trip: a thread waits for HBM
    once per 8 elements (`_tile_load_in_flight` waits once a tile).
    """
    PER_THREAD, WHOLE_ROWS = _rounds(ROWS, COLS, THREADS)
    FLAT = AT is not None
    flat_at = _flat_index(AT) if FLAT else None

    @inlined
    def copy(tile, hbm, bh, row0, col0, r, c, factor):
        # unsigned indices: Numba then skips its negative-index fix-up on every access
        h = (uint64(bh), uint64(row0) + r, uint64(col0) + c)
        if FLAT:
            at = flat_at(r, c)
            if TO_HBM:
                hbm[h] = narrow(tile[at], hbm)
            else:
                tile[at] = widen(hbm[h]) * factor
        elif TO_HBM:
            hbm[h] = narrow(tile[r, c], hbm)
        else:
            tile[r, c] = widen(hbm[h]) * factor

    @cuda.jit(device=True)
    def copy_tile(tile, hbm, bh, row0, n_rows, col0, n_cols, factor):
        t = uint32(cuda.threadIdx.x)
        moved = 0
        if n_rows == ROWS and n_cols == COLS and WHOLE_ROWS:
            # a full tile: thread t owns column t % COLS of rows t // COLS + u THREADS/COLS
            cols = uint32(COLS)
            for u in range(PER_THREAD):
                copy(tile, hbm, bh, row0, col0, t // cols + uint32(u * (THREADS // COLS)),
                     t % cols, factor)
            moved = PER_THREAD
        else:  # a tail tile, or a width the CTA does not cover in whole rows
            width = uint32(n_cols)
            for e in range(t, n_rows * n_cols, THREADS):
                copy(tile, hbm, bh, row0, col0, uint32(e) // width, uint32(e) % width, factor)
                moved += 1
        return moved

    return copy_tile


def _tile_load_in_flight(ROWS: int, COLS: int, THREADS: int, AT):
    """_tile_copy's load into a flat tile (AT), with a full tile's loads all in flight: they
    go out first, in straight-line code, into as many registers, then the stores, so a thread
    waits for HBM once, where _tile_copy's loop (which LLVM unrolls 8 copies a trip) waits
    once per 8 elements. For a tile loaded where nothing else runs, as q_outer's Q_i before
    its first K/V block. A tail tile takes _tile_copy's path."""
    PER_THREAD, WHOLE_ROWS = _rounds(ROWS, COLS, THREADS)
    flat_at = _flat_index(AT)
    HELD = max(PER_THREAD, 1)
    copy_tail = _tile_copy(ROWS, COLS, THREADS, False, AT)

    @inlined
    def fetch(u, held, hbm, bh, row0, col0, t):
        """held[u] = the thread's u-th element of a full tile: row t // COLS + u THREADS/COLS,
        column t % COLS (as _tile_copy's)."""
        r = t // uint32(COLS) + u * uint32(THREADS // COLS)
        held[u] = widen(hbm[uint64(bh), uint64(row0) + r, uint64(col0) + t % uint32(COLS)])

    @inlined
    def put(u, held, tile, t, factor):
        """The thread's u-th element of a full tile into it, times factor."""
        r = t // uint32(COLS) + u * uint32(THREADS // COLS)
        tile[flat_at(r, t % uint32(COLS))] = held[u] * factor

    fetch_all = unrolled(fetch, PER_THREAD, 6, PER_THREAD)  # straight-line code
    put_all = unrolled(put, PER_THREAD, 4, PER_THREAD)

    @cuda.jit(device=True)
    def copy_tile(tile, hbm, bh, row0, n_rows, col0, n_cols, factor):
        if n_rows == ROWS and n_cols == COLS and WHOLE_ROWS:
            t = uint32(cuda.threadIdx.x)
            held = cuda.local.array(HELD, float32)
            fetch_all(held, hbm, bh, row0, col0, t)
            put_all(held, tile, t, factor)
            return PER_THREAD
        return copy_tail(tile, hbm, bh, row0, n_rows, col0, n_cols, factor)

    return copy_tile


def odd_stride(width: int) -> int:
    """A shared-memory row stride for `width` floats: whole 16-byte chunks, an odd number of
    them, so that 16-byte loads of the same column of 8 consecutive rows hit different banks."""
    s = -(-width // 4) * 4
    return s if (s // 4) % 2 else s + 4


@cache
def make_tile_loader(ROWS: int, COLS: int, THREADS: int, at=None, scaled=False,
                     in_flight=False):
    """load_tile(tile, src, bh, row0, n_rows, col0, n_cols): HBM -> shared (see _tile_copy;
    sizes are compile-time). With `scaled`, load_tile takes a last argument `factor` that
    every element is multiplied by on its way in (the flash orders fold the softmax scale
    into Q_i so); `in_flight`: a full tile's loads all go out before its stores
    (`_tile_load_in_flight`; a flat tile, `at`). Every thread of the CTA must call it; the
    caller puts the barriers around it."""
    copy_tile = (_tile_load_in_flight(ROWS, COLS, THREADS, at) if in_flight
                 else _tile_copy(ROWS, COLS, THREADS, False, at))
    if scaled:
        return copy_tile

    @inlined
    def load_tile(tile, src, bh, row0, n_rows, col0, n_cols):
        return copy_tile(tile, src, bh, row0, n_rows, col0, n_cols, float32(1.0))

    return load_tile


@cache
def make_tile_storer(ROWS: int, COLS: int, THREADS: int, at=None):
    """store_tile(tile, dst, bh, row0, n_rows, col0, n_cols): shared -> HBM (see _tile_copy).
    Every thread of the CTA must call it; the caller puts the barriers around it."""
    copy_tile = _tile_copy(ROWS, COLS, THREADS, True, at)

    @inlined
    def store_tile(tile, dst, bh, row0, n_rows, col0, n_cols):
        return copy_tile(tile, dst, bh, row0, n_rows, col0, n_cols, float32(1.0))

    return store_tile


@cache
def make_row_copier(ROWS: int, COLS: int, STRIDE: int, THREADS: int, PER: int,
                    FIRST: int = 0, WHOLE: bool = False):
    """copy_rows(tile, at, src, bh, row0, n_rows): rows row0 .. row0 + ROWS - 1 of src[bh]
    (COLS columns, COLS a multiple of PER, the elements of one 16-byte copy) into tile[at +
    r STRIDE + c] by cp.async, HBM -> shared without passing through registers; rows past
    n_rows are filled with zeros. The copies run asynchronously, as one commit group: the
    caller waits for them (`intrinsics.cp_async_wait_all`, or `cp_async_wait_one` with one
    later group in flight) before its barrier. src must be
    16-byte aligned (`tensor_cores.check_aligned`). The THREADS threads from FIRST on (all
    of the CTA's, or one group of warps) call it; returns the elements this thread counts
    (the first thread counts the tile's n_rows COLS). WHOLE: the caller copies whole tiles
    only (n_rows == ROWS, where STEADY), so the tail's code is left out."""
    CH = COLS // PER
    TRIPS = -(-ROWS * CH // THREADS)
    # Whether every trip of the CTA copies whole rows, the same column for each thread: then
    # a full tile's trips differ only by constant offsets (row steps of RSTEP)
    STEADY = CH > 0 and THREADS % CH == 0 and ROWS * CH % THREADS == 0
    RSTEP = THREADS // max(CH, 1)

    @inlined
    def copy_rows(tile, at, src, bh, row0, n_rows):
        # the thread's place among the copiers (a uint32 difference: Numba widens it)
        t = uint32(cuda.threadIdx.x) if FIRST == 0 else uint32(uint32(cuda.threadIdx.x)
                                                               - uint32(FIRST))
        if STEADY and (WHOLE or n_rows == ROWS):  # a full tile
            r0, c = uint64(t // uint32(CH)), uint64(t % uint32(CH))
            dst = at + r0 * uint64(STRIDE) + uint64(PER) * c
            col = r0 * uint64(COLS) + uint64(PER) * c
            for u in range(TRIPS):
                # row r0 + u RSTEP as columns past row0's (`cp_async16` takes them so): the
                # addresses are the first trip's plus constants, no arithmetic per copy
                cp_async16(tile, dst + uint64(u * RSTEP * STRIDE), src, bh, row0,
                           col + uint64(u * RSTEP * COLS), 16, COLS)
        else:  # a tail tile, or rows the CTA does not cover a whole number of times a trip
            for u in range(TRIPS):
                e = t + uint32(u * THREADS)
                if e < uint32(ROWS * CH):
                    r, c = e // uint32(CH), e % uint32(CH)
                    inside = r < uint32(n_rows)
                    src_row = row0 + (r if inside else uint32(0))  # a row that exists
                    cp_async16(tile, at + uint64(r) * uint64(STRIDE) + uint64(PER * c),
                               src, bh, src_row, PER * c, 16 if inside else 0, COLS)
        cp_async_commit()
        return n_rows * COLS if t == 0 else 0

    return copy_rows


@cache
def make_clear(SIZE: int, THREADS: int):
    """Device function zeroing a CTA's shared buffer of SIZE floats, once per CTA, so the
    tiles' padding and rows past N stay zero. The threads take 16-byte chunks in turn, one
    st.shared.v4 each, the CTA's whole rounds in straight-line code, then the chunks and
    floats left over. A Numba range over single floats took about 14 instructions a float:
    3,000 a thread per CTA at q_outer's 128 x 64 tiles (d = 64). (The tensor-core
    micro-kernel keeps that range: under its 128-register cap at d = 64 these straight-line
    rounds made ptxas spill 116 B in the causal 3xTF32 kernel's hot loop, against 4 B.)"""
    CHUNKS, REST = divmod(SIZE, 4)
    ROUNDS, LAST = divmod(CHUNKS, THREADS)

    @inlined
    def zero_chunk(c, buf):
        for w in range(4):
            buf[uint64(4) * uint64(c) + uint64(w)] = float32(0.0)

    @inlined
    def zero_round(k, buf):
        zero_chunk(uint32(cuda.threadIdx.x) + k * uint32(THREADS), buf)

    rounds = unrolled(zero_round, ROUNDS, 1, ROUNDS)  # straight-line code

    @inlined
    def clear(buf):
        rounds(buf)
        t = uint32(cuda.threadIdx.x)
        if t < uint32(LAST):
            zero_chunk(t + uint32(ROUNDS * THREADS), buf)
        for r in range(REST):  # the floats past the last whole chunk
            if t == uint32(r % THREADS):
                buf[uint64(4 * CHUNKS + r)] = float32(0.0)

    return clear


def block_grid(n_blocks: int, n_bh: int, causal: bool) -> tuple:
    """The grid of one CTA per (block, batch x head) that `make_block_of` reads: (blocks, B H),
    or under a mask (`causal`: any `core.mask.Mask.bounded`), where blocks differ in work, one
    dimension of blocks x B H CTAs ordered heaviest first over every (batch, head).

    The GPU starts CTAs in grid order. On a (blocks, B H) grid each head's long blocks start
    after the previous head's short ones, the last head's long blocks near the end, and the SMs
    finish apart: for q_outer's query blocks at N = 4096, B H = 64 on 128 x 64 tiles (one CTA
    an SM), a greedy schedule of the blocks' K/V tiles ends 7 % after the mean SM's share in
    that order, and 0.4 % after it heaviest first (26 % and 3 % at N = 1024)."""
    return (n_blocks * n_bh,) if causal else (n_blocks, n_bh)


@cache
def make_kv_head(GROUP: int):
    """kv_head(bh): the K/V head query head bh reads under grouped-query attention, GROUP
    query heads to a K/V head (SDPA's and FlashAttention's grouping); bh itself, with no
    arithmetic and no change of type, when GROUP is 1."""
    if GROUP == 1:
        @inlined
        def kv_head(bh):
            return bh
    else:
        @inlined
        def kv_head(bh):
            return bh // GROUP
    return kv_head


def grouped_block(c, n_blocks, n_bh, group):
    """(block, bh) of CTA c of a causal grid of n_blocks x n_bh that takes its heads `group`
    at a time (the last group the rest), each group's heaviest (last) query blocks first: the
    CTAs on the GPU at once then read the K/V of a few heads, which the L2 can keep, instead
    of one query block of every head. The host's and the device's rule (`make_block_of`)."""
    span = n_blocks * group
    g = c // span
    heads = min(group, n_bh - g * group)
    w = c - g * span
    return n_blocks - 1 - w // heads, g * group + w % heads


grouped_block_device = cuda.jit(device=True, inline="always")(grouped_block)


@cache
def make_block_of(CAUSAL: bool, HEAVY_LAST: bool, GROUP_HEADS: int = 0):
    """Device function block_of(n_bh) -> (block, bh) of this CTA on `block_grid`'s grid, with
    n_bh = B H. The causal grid starts with the heaviest blocks: the last (HEAVY_LAST: query
    blocks, which see more keys the later they are) or the first (K/V blocks, which more
    queries see the earlier they are); with GROUP_HEADS, the last first within each group of
    that many heads (`grouped_block`)."""
    if CAUSAL and HEAVY_LAST and GROUP_HEADS:
        @inlined
        def block_of(n_bh):
            n_blocks = int64(cuda.gridDim.x // uint32(n_bh))
            return grouped_block_device(int64(cuda.blockIdx.x), n_blocks, int64(n_bh),
                                        int64(GROUP_HEADS))
        return block_of
    if not CAUSAL:
        @inlined
        def block_of(n_bh):
            return cuda.blockIdx.x, cuda.blockIdx.y
    elif HEAVY_LAST:
        @inlined
        def block_of(n_bh):
            first = cuda.gridDim.x - 1 - cuda.blockIdx.x  # CTAs counted from the grid's end
            return int64(first // uint32(n_bh)), cuda.blockIdx.x % uint32(n_bh)
    else:
        @inlined
        def block_of(n_bh):
            return int64(cuda.blockIdx.x // uint32(n_bh)), cuda.blockIdx.x % uint32(n_bh)
    return block_of


# The mask's one rule (`core.mask`) and the block ranges that follow from it, as device
# functions: the same Python functions the host calls, jitted.
key_span_device = cuda.jit(device=True, inline="always")(key_span)


def _calling_device_rule(fn):
    """fn with its calls of `key_span` bound to the device function (a kernel can call
    only device functions; the host keeps calling the plain one)."""
    names = {**fn.__globals__, "key_span": key_span_device}
    return types.FunctionType(fn.__code__, names, fn.__name__, fn.__defaults__, fn.__closure__)


kv_block_range_device = cuda.jit(device=True, inline="always")(
    _calling_device_rule(kv_block_range))
q_block_range_device = cuda.jit(device=True, inline="always")(q_block_range)


@cache
def make_visible(MASK: Mask):
    """Device function visible(diag, key0, n_keys) -> (first, end): the keys of the tile
    key0 .. key0 + n_keys - 1 (counted from key0) that a query row sees, where diag is the
    row's diagonal key, row + N_k - N_q (`core.mask.key_span`; empty when end <= first).
    Without a mask: (0, n_keys)."""
    LEFT, RIGHT = MASK
    if not MASK.bounded:
        @inlined
        def visible(diag, key0, n_keys):
            return 0, n_keys
    else:
        @inlined
        def visible(diag, key0, n_keys):
            return key_span_device(diag, key0, n_keys, LEFT, RIGHT)

    return visible


@cache
def make_kv_blocks(BC: int, MASK: Mask):
    """Device function kv_blocks(row0, n_rows, n_q, n_k) -> (first, end): the K/V blocks of
    BC keys that the query block of rows row0 .. row0 + n_rows - 1 visits: all
    ceil(N_k / BC), or under a mask those holding a key some row sees
    (`core.mask.kv_block_range`)."""
    LEFT, RIGHT = MASK
    if not MASK.bounded:
        @inlined
        def kv_blocks(row0, n_rows, n_q, n_k):
            return 0, (n_k + BC - 1) // BC
    else:
        @inlined
        def kv_blocks(row0, n_rows, n_q, n_k):
            return kv_block_range_device(row0, n_rows, n_q, n_k, BC, LEFT, RIGHT)

    return kv_blocks


@cache
def make_q_blocks(BR: int, MASK: Mask):
    """Device function q_blocks(key0, n_keys, n_q, n_k) -> (first, end): the query blocks of
    BR rows that visit the K/V block of keys key0 .. key0 + n_keys - 1: all ceil(N_q / BR),
    or under a mask those with a row that sees one of its keys (`core.mask.q_block_range`)."""
    LEFT, RIGHT = MASK
    if not MASK.bounded:
        @inlined
        def q_blocks(key0, n_keys, n_q, n_k):
            return 0, (n_q + BR - 1) // BR
    else:
        @inlined
        def q_blocks(key0, n_keys, n_q, n_k):
            return q_block_range_device(key0, n_keys, n_q, n_k, BR, LEFT, RIGHT)

    return q_blocks


@cache
def make_lse_of(MASKED: bool):
    """lse_of(m, l) -> lse = (m + log2 l) ln 2, from a row's running max m (log2 units) and
    sum l; MASKED: -inf where l = 0, a row that saw no key (log2 0 is -inf on a GPU but an
    error on the simulator)."""

    @inlined
    def lse_of(m, l):  # noqa: E741
        if MASKED and l == float32(0.0):
            return float32(-math.inf)
        return (m + math.log2(l)) * float32(LN2)

    return lse_of


@cache
def make_reciprocal(RM: int, MASKED: bool):
    """reciprocal(x, out): out[a] = 1 / x[a] for a thread's RM row sums; MASKED: 0 where
    x[a] = 0, a row that has seen no key (so its O_i stays 0 rather than 0 / 0)."""

    @inlined
    def reciprocal(x, out):
        for a in range(RM):
            if MASKED:
                out[a] = float32(0.0) if x[a] == float32(0.0) else float32(1.0) / x[a]
            else:
                out[a] = float32(1.0) / x[a]

    return reciprocal


@cuda.jit(device=True)
def zero_counts(cnt):
    for s in range(cnt.shape[0]):
        cnt[s] = 0


@cache
def make_online_reset(NACC: int, RM: int):
    """reset(acc, m_i, l_i): a query block's online softmax before its first tile: acc = 0,
    m_i = -inf, l_i = 0 for the thread's NACC accumulators and RM rows."""

    @inlined
    def reset(acc, m_i, l_i):
        for y in range(NACC):
            acc[y] = float32(0.0)
        for a in range(RM):
            m_i[a] = float32(-math.inf)
            l_i[a] = float32(0.0)

    return reset


@cache
def make_online_start(NACC: int, RM: int, COUNT: bool, clear):
    """start(buf, acc, m_i, l_i, cnt): a flash forward CTA's first step (q_outer's, split_kv's
    kernel): the counters zeroed, the online softmax reset (`make_online_reset`), and the
    shared buffer cleared (`clear`), then a barrier. Every thread calls it."""
    reset = make_online_reset(NACC, RM)

    @inlined
    def start(buf, acc, m_i, l_i, cnt):
        if COUNT:
            zero_counts(cnt)
        reset(acc, m_i, l_i)
        clear(buf)  # padding and rows past N_q stay zero
        cuda.syncthreads()  # the buffer is clear before any tile lands in it

    return start


@cache
def _flusher(slots: int):
    @cuda.jit(device=True)
    def flush_counts(cnt, counts):
        cta = cuda.shared.array(slots, int64)
        for s in range(cuda.threadIdx.x, slots, cuda.blockDim.x):
            cta[s] = 0
        cuda.syncthreads()  # the CTA totals are zero before any thread adds to them
        for s in range(slots):
            if cnt[s] != 0:
                cuda.atomic.add(cta, s, cnt[s])
        cuda.syncthreads()  # every thread has added its counts
        for s in range(cuda.threadIdx.x, slots, cuda.blockDim.x):
            if cta[s] != 0:
                cuda.atomic.add(counts, s, cta[s])

    return flush_counts


def counts_flusher():
    """flush_counts(cnt, counts): sum every thread's counters in shared memory, then add them
    to HBM once per CTA. Must be reached by every thread of the CTA (it has barriers). Built
    for the counter slots of the tensors declared now (`ledger.n_slots`)."""
    return _flusher(n_slots())


def counter_slots(count: bool) -> int:
    """Size of a thread's private counter array (1 when counting is compiled out)."""
    return n_slots() if count else 1


@cache
def unrolled(step, n: int, arity: int, by: int, first: int = 0):
    """A device function run(a_1 .. a_arity) that calls step(i, a_1 .. a_arity) for
    i = first .. first + n - 1, `by` calls per trip of a loop with a 32-bit counter (by = n:
    no loop).

    Numba lowers `for i in range(n)` to a 64-bit counter with a compare, two selects and a
    64-bit add per trip, 14 instructions per trip of a hot loop; a `while` over a uint32
    counter takes a compare and an add (the sum cast back to uint32: Numba widens uint32 +
    uint32 to 64 bits, which cost 4 to 6 instructions more a trip), and unrolling `by` calls
    in straight-line code lets the compiler give the loads of one call constant offsets from
    the previous call's."""
    args = ", ".join(f"a{k}" for k in range(arity))
    by = max(1, min(by, n))
    trips = n // by
    lines = [f"def run({args}):"]
    if trips > 1:
        lines += [f"    i = uint32({first})", f"    while i < uint32({first + trips * by}):"]
        lines += [f"        step(i + uint32({k}), {args})" for k in range(by)]
        lines += [f"        i = uint32(i + uint32({by}))"]
    elif trips == 1:
        lines += [f"    step(uint32({first + k}), {args})" for k in range(by)]
    lines += [f"    step(uint32({first + i}), {args})" for i in range(trips * by, n)]
    lines += ["    return"]
    scope = {"step": step, "uint32": uint32}
    exec("\n".join(lines) + "\n", scope)
    return inlined(scope["run"])


def make_scores(RM: int, KN: int, DX4: int, CHUNKS: int, PEEL: bool,
                q_chunk, k_chunk):
    """scores(s, buf, k_at, tr, tc): s[a KN + b] = Q_i[row a] . K_j[key b] for a thread's RM
    rows and KN keys, over DX4 4-wide chunks of the head dim: the register blocking ("outer
    product") both CUDA-core kernels compute S_ij with. For each chunk the thread's operands
    are loaded first, q_chunk(x4, buf, tr, qq) -> qq[a 4 + u] and k_chunk(x4, buf, k_at, tc,
    kk) -> kk[b 4 + u] (K_j's tile at k_at), then one dim at a time over every (row, key),
    one Q operand in KN FMAs in a row, which the register reuse cache then reads once; CHUNKS
    chunks a trip (`unrolled`). PEEL: the first chunk sets the scores (its first dim by
    multiplies), else they start at zero."""
    RN, KN4, NS = 4 * RM, 4 * KN, RM * KN

    @inlined
    def scores_row(a, u, s, qq, kk):
        for b in range(KN):
            s[a * KN + b] += qq[a * 4 + u] * kk[b * 4 + u]

    @inlined
    def scores_row_set(a, u, s, qq, kk):
        for b in range(KN):
            s[a * KN + b] = qq[a * 4 + u] * kk[b * 4 + u]

    # the rows (and dims) in straight-line code: a loop over them (which LLVM leaves rolled
    # once the nest passes its unroll threshold) indexes s by a variable, sending it to local
    # memory
    scores_dim = unrolled(scores_row, RM, 4, RM)
    scores_dims = unrolled(scores_dim, 4, 3, 4)
    scores_dim_set = unrolled(scores_row_set, RM, 4, RM)
    scores_dims_after = unrolled(scores_dim, 3, 3, 3, first=1)

    @inlined
    def scores_chunk(x4, s, buf, k_at, tr, tc):
        qq = cuda.local.array(RN, float32)
        kk = cuda.local.array(KN4, float32)
        q_chunk(x4, buf, tr, qq)
        k_chunk(x4, buf, k_at, tc, kk)
        scores_dims(s, qq, kk)

    scores_all = unrolled(scores_chunk, DX4, 5, CHUNKS)
    scores_rest = unrolled(scores_chunk, DX4 - 1, 5, CHUNKS, first=1)

    @inlined
    def scores(s, buf, k_at, tr, tc):
        if PEEL:
            qq = cuda.local.array(RN, float32)
            kk = cuda.local.array(KN4, float32)
            q_chunk(uint32(0), buf, tr, qq)
            k_chunk(uint32(0), buf, k_at, tc, kk)
            scores_dim_set(uint32(0), s, qq, kk)
            scores_dims_after(s, qq, kk)
            scores_rest(s, buf, k_at, tr, tc)
        else:
            for e in range(NS):
                s[e] = float32(0.0)
            scores_all(s, buf, k_at, tr, tc)

    return scores
