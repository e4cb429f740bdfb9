"""The Hopper half of the tensor-core micro-kernel: its two products on wgmma (sm_90a).

`TensorCores(dtype, stages, wgmma=True)` runs the same loop nests, online softmax and
fragments as the mma.sync build (`tensor_cores`); what changes is who multiplies and where the
operands lie:

    warpgroup h (warps 4 h .. 4 h + 3) owns query rows 64 h .. 64 h + 63 of the block;
    S = Q_i K_j^T:  one wgmma m64nBck16 per 16 head dims, Q_i and K_j both read from shared
                    memory by the tensor cores (no ldmatrix), into the same accumulator
                    fragments as mma.sync's (warp 4 h + u holds rows 16 u .. of the 64)
    acc += P V_j:   one wgmma m64nDvk16 per 16 keys, P's A fragment from registers (the
                    score fragments rounded to 16 bits, as on mma.sync), V_j from shared
                    memory read MN-major (its rows are the product's K)

Each product is issued, committed and waited for in one call (`intrinsics.wgmma_scores`,
`wgmma_accumulate`): the warpgroup's tensor cores run its whole k-loop while the warps wait.
Pipelined (`TensorCores.pipelined`, q_outer's K/V stream: `stream.make_fold_tiles`), the
product P_i,j-1 V_j-1 is issued beside S_ij and left to run under S_ij's softmax
(FlashAttention-3's intra-warpgroup overlap), waited for only before acc is rescaled:

    issue S_ij = Q_i K_j^T; issue acc += P_i,j-1 V_j-1     # two groups, in that order
    wait for S_ij (one group may run on); m, l, P_ij from it
    wait for P_i,j-1 V_j-1; acc *= 2^(m_old - m_new)

There K/V come through a ring of buffers (`make_stage_ring`: K_BUFFERS for K, V_BUFFERS for
V) instead of a CTA barrier a tile: each fill's landing and each buffer's release are
mbarriers, and the warpgroups take turns issuing their two products, so one warpgroup's
softmax runs under the other's products (FlashAttention-3's ping-pong):

    warpgroup g, tile j:  K_j+1, V_j copied (each into a buffer every thread has released)
                          K_j, V_j-1 landed?  [take the turn]  issue S_ij, P_i,j-1 V_j-1
                          [pass the turn to g + 1]  S_ij landed: release K_j; softmax;
                          P_i,j-1 V_j-1 landed: release V_j-1; rescale acc

The tiles lie in shared memory swizzled, as TMA writes them and as FlashAttention-3's
and CUTLASS's layouts do: rows of W = 64 elements (128 bytes; 32 or 16 where the columns do
not come in 64s), one after another, in column blocks of W; the 16-byte chunk c of row r of
a block at chunk c XOR (r mod 8) (at the 128-byte swizzle: `intrinsics.swizzled`). One
layout serves all three tiles: Q_i and K_j as K-major operands, V_j as an MN-major one (its
rows are the keys, the K of P V_j). Rows arrive by cp.async, 16 bytes a copy: consecutive
threads take consecutive chunks of a row, so a warp reads whole 128-byte lines of HBM and,
the chunks of a row swizzled apart, writes all 32 banks at once. A pattern repeats every 8
rows from multiples of 1024 bytes (`ALIGN`): the buffer and every tile start at one.

With a producer warpgroup (`make_tma_producer`) one thread fills the ring by TMA while the
two computing warpgroups only wait for fills and release buffers; on persistent CTAs
(`make_tma_persistent_producer`, `microkernel.persistent`) it goes on from one query block
into the next, handing the computing warpgroups each block with its Q_i:

    producer:   for each work item: K_j0 into the ring; Q_i's buffer free?  item, Q_i
                copied; K_j, V_j for the rest of the block (ring positions running on)
    computing:  Q_i landed?  read the item; fold its tiles; release Q_i's buffer after the
                last S_ij; O_i from the accumulators to HBM

Whole 16s of head dims, rows in 64s and keys in 16s (`supports`): other tiles run on mma.sync.
"""

from __future__ import annotations

from functools import cache
from typing import NamedTuple

from numba import int32, int64, uint32, uint64

from ..core.ledger import slot
from ..device.intrinsics import (
    WgmmaOperand,
    cp_async16,
    cp_async_arrive,
    cp_async_commit,
    cp_async_wait_all,
    fence_async_shared,
    fence_tensor_map,
    mbarrier_arrive,
    mbarrier_expect_tx,
    mbarrier_init,
    mbarrier_wait,
    tma_load,
    turn_barrier,
    wgmma_accumulate,
    wgmma_scores,
    wgmma_wait,
)
from ..device.runtime import SHARED_ALIGN, SIMULATOR, cuda, inlined

WARPGROUP_ROWS = 64  # query rows of one warpgroup: the m of wgmma m64nNk16
WARPGROUP = 128  # threads of a warpgroup
CORE = 8  # a core matrix is 8 x 8 elements
ALIGN = 1024  # bytes: the 128-byte swizzle's pattern (8 rows) repeats from multiples of it
K_BUFFERS, V_BUFFERS = 2, 3  # the pipelined K/V loop's ring (`make_stage_ring`)
RING_BARRIERS = 2 * (K_BUFFERS + V_BUFFERS)  # a landed and a free mbarrier a buffer
QUEUE_BARRIERS = 2  # persistent CTAs: Q_i's buffer's landed and free mbarriers, past the ring's
OPERAND_KINDS = {"float16": "f16", "bfloat16": "bf16"}


def supports(dtype: str, block_q: int, block_k: int, d: int, dv: int) -> bool:
    """Whether the wgmma build takes these tiles: 16-bit inputs, whole warpgroups of query
    rows, keys in whole 16s (the k of P V_j) and head dims in whole 16s (S's k; O's n),
    at most 256 keys or dims (wgmma's largest n)."""
    return (dtype in OPERAND_KINDS and block_q % WARPGROUP_ROWS == 0
            and block_k % 16 == 0 and block_k <= 256
            and d % 16 == 0 and dv % 16 == 0 and d <= 256 and dv <= 256)


def buffer_align(layout) -> int | None:
    """The alignment a kernel declares its dynamic shared buffer with, the same as its tiles'
    view's (`tensor_cores.make_tc_basics`): ALIGN where the layout's tiles are swizzled for
    wgmma, so that every view of the buffer starts at one address; None on the simulator."""
    if SIMULATOR:
        return None
    return ALIGN if getattr(layout, "wgmma", False) else SHARED_ALIGN


def swizzle_width(cols: int) -> int:
    """Elements in a swizzled row of a tile of `cols` columns (a whole 16): 64 (128-byte
    swizzle) where they come in whole 64s, else 32, else 16."""
    return next(w for w in (64, 32, 16) if cols % w == 0)


def k_major(rows: int, cols: int) -> WgmmaOperand:
    """A tile of `rows` x `cols` read as a K-major operand (its columns are the K)."""
    width = swizzle_width(cols)
    return WgmmaOperand(width, rows * width)


def mn_major(rows: int, cols: int) -> WgmmaOperand:
    """A tile of `rows` x `cols` read as an MN-major operand: its rows are the K."""
    width = swizzle_width(cols)
    return WgmmaOperand(width, rows * width, mn_major=True)


@cache
def make_swizzled_copier(ROWS: int, COLS: int, THREADS: int):
    """copy_rows(tile, at, src, bh, row0, n_rows): rows row0 .. row0 + ROWS - 1 of src[bh]
    (COLS columns, a whole 16; ROWS a whole 8) into the swizzled tile at `at` (`k_major`'s
    and `mn_major`'s layout, `at` where a pattern starts), by cp.async (16 bytes a copy; rows
    past n_rows zero), as one commit group; returns the elements this thread counts (thread 0
    counts n_rows COLS). Copy e takes chunk e % CH of row e // CH: a warp reads whole rows
    (full 128-byte lines of HBM) and, the chunks of a row swizzled apart, writes 32 banks."""
    CH = COLS // CORE  # 16-byte chunks of a row
    W = swizzle_width(COLS)
    PER_ROW = W // CORE  # chunks of a swizzled row
    SHIFT = {64: 0, 32: 1, 16: 2}[W]  # row >> SHIFT: the bits a row's chunks XOR
    BLOCK = ROWS * W  # elements between column blocks
    TRIPS = -(-ROWS * CH // THREADS)
    # every trip copies the same chunk of rows a whole number of patterns (8 rows) on:
    # addresses are the first trip's plus constants
    RSTEP = THREADS // CH  # rows a trip steps, where STEADY
    STEADY = THREADS % CH == 0 and RSTEP % CORE == 0 and ROWS % RSTEP == 0

    @inlined
    def slot(r, c):
        """Where chunk c of row r lies from the tile's start."""
        q = (c % uint32(PER_ROW)) ^ ((r >> uint32(SHIFT)) % uint32(PER_ROW))
        return (uint64(c // uint32(PER_ROW)) * uint64(BLOCK) + uint64(r) * uint64(W)
                + uint64(CORE) * uint64(q))

    @inlined
    def copy_rows(tile, at, src, bh, row0, n_rows):
        t = uint32(cuda.threadIdx.x)
        if STEADY and n_rows == ROWS:  # a full tile
            r, c = t // uint32(CH), t % uint32(CH)
            dst = at + slot(r, c)
            col = uint64(r) * uint64(COLS) + uint64(CORE) * uint64(c)
            for u in range(TRIPS):
                cp_async16(tile, dst + uint64(u * RSTEP * W), src, bh, row0,
                           col + uint64(u * RSTEP * COLS), 16, COLS)
        else:  # a tail tile, or rows the CTA does not cover evenly
            for u in range(TRIPS):
                e = t + uint32(u * THREADS)
                if e < uint32(ROWS * CH):
                    r, c = e // uint32(CH), e % uint32(CH)
                    inside = r < uint32(n_rows)
                    src_row = row0 + (r if inside else uint32(0))  # a row that exists
                    cp_async16(tile, at + slot(r, c), src, bh, src_row, uint32(CORE) * c,
                               16 if inside else 0, COLS)
        cp_async_commit()
        return n_rows * COLS if t == 0 else 0

    return copy_rows


@inlined
def wait_loads():
    """This thread's cp.async copies have landed and, once a barrier orders them, are seen
    by wgmma's reads (the asynchronous proxy)."""
    cp_async_wait_all()
    fence_async_shared()


class WgmmaProducts(NamedTuple):
    """The two products on wgmma: `scores` and `accumulate` as the `tensor_cores.TcOperands`
    fields of the same names (each done when it returns), and for the pipelined update the
    same issued without waiting, and the waits."""

    scores: object
    accumulate: object
    scores_ahead: object  # scores_ahead(tile, s, w, k_at): s = Q_i K_j^T, issued
    accumulate_ahead: object  # accumulate_ahead(tile, p, acc, v_at): acc += P V_j, issued
    wait_scores: object  # wait_scores(s, behind): S landed, `behind` (a P V) may run on
    wait_accumulate: object  # wait_accumulate(acc): every product issued has landed


@cache
def make_wgmma_products(DTYPE: str, BR: int, KP: int, QC: int, VC: int,
                        Q: int) -> WgmmaProducts:
    """S = Q_i K_j^T and acc += P V_j for tiles of BR query rows, KP keys, QC head dims of Q
    and K, VC of V (each a whole 16, or 0 where a kernel makes only the other product), Q_i
    at element Q of the tiles."""
    kind = OPERAND_KINDS[DTYPE]
    q_op, k_op, v_op = k_major(BR, QC), k_major(KP, QC), mn_major(KP, VC)
    product_s = issue_s = product_pv = issue_pv = None  # a kernel of one product (dense's)
    if QC:
        product_s = wgmma_scores(kind, KP, QC // 16, q_op, k_op)
        issue_s = wgmma_scores(kind, KP, QC // 16, q_op, k_op, wait=False)
    if VC:
        product_pv = wgmma_accumulate(kind, VC, KP // 16, v_op)
        issue_pv = wgmma_accumulate(kind, VC, KP // 16, v_op, wait=False)
    s_landed, s_landed_behind = wgmma_wait(0, KP // 2), wgmma_wait(1, KP // 2)
    acc_landed = wgmma_wait(0, VC // 2)
    Q_ROWS = WARPGROUP_ROWS * q_op.width  # where a warpgroup's rows start in each block

    @inlined
    def q_of(w):
        """Where the warpgroup's 64 rows of Q_i start in the tiles."""
        return uint64(Q) + uint64(w // uint32(4)) * uint64(Q_ROWS)

    @inlined
    def scores(tile, s, w, lane, k_at):
        """s = Q_i K_j^T of the warpgroup's 64 rows (every warp of it calls)."""
        product_s(s, tile, q_of(w), k_at)

    @inlined
    def accumulate(tile, s, acc, lane, v_at):
        """acc += P V_j, P's A fragment packed from the weights in s."""
        product_pv(acc, s, tile, v_at)

    @inlined
    def scores_ahead(tile, s, w, k_at):
        issue_s(s, tile, q_of(w), k_at)

    @inlined
    def accumulate_ahead(tile, p, acc, v_at):
        issue_pv(acc, p, tile, v_at)

    @inlined
    def wait_scores(s, behind):
        if behind:
            s_landed_behind(s)  # the P V issued after S may run on
        else:
            s_landed(s)

    @inlined
    def wait_accumulate(acc):
        acc_landed(acc)

    return WgmmaProducts(scores, accumulate, scores_ahead, accumulate_ahead, wait_scores,
                         wait_accumulate)


class BufferBarriers(NamedTuple):
    """One kind of buffer's mbarriers in the ring (`make_stage_ring`), each taking the float32
    buffer first; `use` counts a buffer's fills from 0."""

    copied: object  # copied(buf, s): this thread's copies into buffer s count once landed
    landed: object  # landed(buf, s, use): every thread's copies of that fill landed
    free: object  # free(buf, s): this thread is done reading buffer s's latest fill
    freed: object  # freed(buf, s, use): every thread is done with that fill
    # expect(buf, s, n_bytes): the producer's arrival, the fill's TMA copies to count n_bytes
    expect: object
    landing: object  # landing(s): the float offset of buffer s's landed mbarrier


class StageRing(NamedTuple):
    """The pipelined K/V loop's buffers and turns (`make_stage_ring`); a warpgroup's calls
    come in the loop's order."""

    # begin(buf): barriers set up; the kernel's copies (K_j0, Q_i) K buffer 0's first fill
    # (PERSISTENT: Q_i's own)
    begin: object
    k: object  # the K buffers' `BufferBarriers`
    v: object  # the V buffers'
    take_turn: object  # take_turn(): this warpgroup's turn at the tensor cores
    pass_turn: object  # pass_turn(): the next warpgroup's turn
    end: object  # end(): the turns balanced (every bar.arrive met by a bar.sync)
    # persistent CTAs (`make_stage_ring` PERSISTENT): Q_i's buffer as one more of the ring,
    # its fills counted by the CTA's query blocks (None elsewhere: Q_i lands with K_j0)
    q: object = None


@cache
def make_buffer_barriers(LANDED: int, FREE: int) -> BufferBarriers:
    """The landed mbarriers of a kind of buffer from float LANDED of the buffer, its free ones
    from FREE, 8 bytes (2 floats) each."""

    @inlined
    def at(first, s):
        return uint32(first) + uint32(2) * uint32(s)

    @inlined
    def copied(buf, s):
        cp_async_arrive(buf, at(LANDED, s))

    @inlined
    def landed(buf, s, use):
        mbarrier_wait(buf, at(LANDED, s), use & 1)
        fence_async_shared()  # the copies seen by wgmma's reads (the asynchronous proxy)

    @inlined
    def free(buf, s):
        mbarrier_arrive(buf, at(FREE, s))

    @inlined
    def freed(buf, s, use):
        mbarrier_wait(buf, at(FREE, s), use & 1)

    @inlined
    def expect(buf, s, n_bytes):
        mbarrier_expect_tx(buf, at(LANDED, s), n_bytes)

    @inlined
    def landing(s):
        return at(LANDED, s)

    return BufferBarriers(copied, landed, free, freed, expect, landing)


@cache
def make_stage_ring(AT: int, NT: int, PRODUCED: bool = False,
                    PERSISTENT: bool = False) -> StageRing:
    """The mbarriers (at float AT of the buffer, 8 bytes each: the K buffers' landed, the V
    buffers' landed, the K buffers' free, the V buffers' free) and the warpgroups' turns of
    NT computing threads. No CTA-wide barrier in the K/V loop: a fill is waited for by whoever
    reads it and a buffer refilled once all have released it, so the warpgroups run apart,
    each issuing its products on its turn (FlashAttention-3's ping-pong: one warpgroup's
    softmax under the other's products; bar.sync / bar.arrive 1 + warpgroup). The fills are
    every computing thread's cp.async copies, or (PRODUCED) a producer warpgroup's TMA copies
    (`make_tma_producer`): then a fill lands on one arrival and its bytes, and `begin` is
    the whole CTA's, producer included, before it splits. PERSISTENT (a CTA folding query
    blocks in turn, `make_tma_persistent_producer`): Q_i's buffer has its landed and free
    mbarriers too, after the ring's (`QUEUE_BARRIERS`), and the turns run on from one block
    into the next (`begin` and `end` once a kernel)."""
    NWG = NT // 128  # computing warpgroups
    turn_sync, turn_arrive = turn_barrier(256)  # the one taking its turn, the one passing it
    K_LANDED, V_LANDED = AT, AT + 2 * K_BUFFERS
    K_FREE, V_FREE = V_LANDED + 2 * V_BUFFERS, V_LANDED + 2 * (V_BUFFERS + K_BUFFERS)
    FILLERS = 1 if PRODUCED else NT  # arrivals that land a fill
    Q_LANDED = AT + 2 * RING_BARRIERS  # persistent: Q_i's buffer's landed and free mbarriers

    @inlined
    def warpgroup():
        return uint32(cuda.threadIdx.x) // uint32(128)

    @inlined
    def begin(buf):
        if cuda.threadIdx.x == 0:
            for e in range(RING_BARRIERS):
                landed = e < K_BUFFERS + V_BUFFERS
                mbarrier_init(buf, uint32(AT + 2 * e), FILLERS if landed else NT)
            if PERSISTENT:
                mbarrier_init(buf, uint32(Q_LANDED), FILLERS)
                mbarrier_init(buf, uint32(Q_LANDED + 2), NT)
        cuda.syncthreads()  # the barriers are set up before any thread arrives at them
        if not PRODUCED:
            cp_async_arrive(buf, uint32(K_LANDED))
        if NWG > 1 and warpgroup() == uint32(NWG - 1):
            turn_arrive(1)  # the first warpgroup's first turn

    @inlined
    def take_turn():
        if NWG > 1:
            turn_sync(uint32(1) + warpgroup())

    @inlined
    def pass_turn():
        if NWG > 1:
            turn_arrive(uint32(1) + (warpgroup() + uint32(1)) % uint32(NWG))

    @inlined
    def end():
        if NWG > 1 and warpgroup() == uint32(0):
            turn_sync(1)  # the last warpgroup passed the turn once more than it took it

    return StageRing(begin, make_buffer_barriers(K_LANDED, K_FREE),
                     make_buffer_barriers(V_LANDED, V_FREE), take_turn, pass_turn, end,
                     make_buffer_barriers(Q_LANDED, Q_LANDED + 2) if PERSISTENT else None)


Q_R, K_R, V_R = slot("q", "read"), slot("k", "read"), slot("v", "read")
# a producer warpgroup beside two computing ones: 168 registers a thread at launch (384
# threads, the whole file), 24 for the producer and 240 for the others after setmaxnreg
LAUNCH_REGISTERS, PRODUCER_REGISTERS, CONSUMER_REGISTERS = 168, 24, 240
COMPUTING_BARRIER = 5  # the computing threads' own barrier (the turns take 1 + warpgroup)
MAP_Q, MAP_K, MAP_V = 0, 1, 2  # the kernel's tensor maps (`tensor_map`): of q, k, v


class TmaBoxes(NamedTuple):
    """The TMA boxes of a CTA's tiles (rows, swizzled row width): Q_i's and K_j's (width of
    the head dims), V_j's (of dv); what a producer copies and the host encodes maps for."""

    q: tuple
    k: tuple
    v: tuple


def tma_boxes(block_q: int, block_k: int, d: int, dv: int) -> TmaBoxes:
    keys = -(-block_k // 16) * 16  # a tile's keys, padded (zeros past N_k: TMA's fill)
    return TmaBoxes((block_q, swizzle_width(d)), (keys, swizzle_width(d)),
                    (keys, swizzle_width(dv)))


@cache
def make_tma_tile(ROWS: int, W: int, COLS: int, MAP: int):
    """copy_tile(tile, at, buf, landing, maps, src, row0, head): rows row0 .. row0 + ROWS - 1
    of src[head] (COLS columns) into the swizzled tile at element `at`, a TMA box per column
    block of W (map MAP of `maps`), counted at the mbarrier at float `landing` of buf."""
    copy = tma_load(ROWS, W)

    @inlined
    def copy_tile(tile, at, buf, landing, maps, src, row0, head):
        for c in range(COLS // W):
            copy(tile, uint64(at + c * ROWS * W), buf, landing, maps, MAP, src, c * W, row0,
                 head)

    return copy_tile


class RingFills(NamedTuple):
    """The producer thread's TMA copies into the ring (`make_ring_fills`), each counted at its
    buffer's landed mbarrier and, counted (COUNT), its elements at their counter slots (the
    valid rows: TMA reads none past N_q, N_k)."""

    q: object  # q(buf, tile, maps, q, bh, row0, n_rows, landing, cnt): Q_i, at mbarrier landing
    take_k: object  # take_k(buf, t): K's buffer of ring position t once released, its bytes
    k: object  # k(buf, tile, maps, k, kv, key0, n_k, t, cnt): K_j into that buffer
    take_v: object  # take_v(buf, t), v(buf, tile, maps, v, kv, key0, n_k, t, cnt): V_j's
    v: object
    q_bytes: int  # a Q_i box's bytes (whole boxes: TMA writes zeros past N_q, N_k)
    k_bytes: int


@cache
def make_ring_fills(BR: int, BC: int, D: int, DV: int, Q: int, K: int, V: int, K_STAGE: int,
                    V_STAGE: int, ring: StageRing, COUNT: bool) -> RingFills:
    """The copies of `RingFills`: tiles at element offsets Q, K, V of the tiles' view, K_STAGE,
    V_STAGE apart; K_j at ring position t into K buffer t % K_BUFFERS, V_j into V buffer
    t % V_BUFFERS, each once every computing thread has released the buffer's previous fill;
    maps MAP_Q, MAP_K, MAP_V of `maps`."""
    boxes = tma_boxes(BR, BC, D, DV)
    (QR, _), (KR, _), _ = boxes
    copy_q = make_tma_tile(*boxes.q, D, MAP_Q)
    Q_BYTES, K_BYTES = 2 * QR * D, 2 * KR * D
    take_k, fill_k = make_kv_fill(BC, D, boxes.k, MAP_K, K_BUFFERS, ring.k, K, K_STAGE, K_R,
                                  COUNT)
    take_v, fill_v = make_kv_fill(BC, DV, boxes.v, MAP_V, V_BUFFERS, ring.v, V, V_STAGE, V_R,
                                  COUNT)

    @inlined
    def fill_q(buf, tile, maps, q, bh, row0, n_rows, landing, cnt):
        # Q_i: read from HBM once
        copy_q(tile, Q, buf, landing, maps, q, row0, bh)
        if COUNT:
            cnt[Q_R] += n_rows * D

    return RingFills(fill_q, take_k, fill_k, take_v, fill_v, Q_BYTES, K_BYTES)


@cache
def make_kv_fill(BC: int, COLS: int, BOX: tuple, MAP: int, BUFFERS: int, bars: BufferBarriers,
                 AT: int, STAGE: int, SLOT: int, COUNT: bool) -> tuple:
    """(take, fill) for K_j or V_j (COLS columns, boxes BOX of map MAP) in a ring of BUFFERS
    buffers from element AT of the tiles' view, STAGE apart, with mbarriers `bars`:
    take(buf, t) waits until every computing thread has released the buffer of ring position
    t's previous fill and expects a box's bytes there; fill(buf, tile, maps, src, kv, key0,
    n_k, t, cnt) copies the tile into it, counted at counter slot SLOT (COUNT)."""
    copy = make_tma_tile(*BOX, COLS, MAP)
    BYTES = 2 * BOX[0] * COLS

    @inlined
    def take(buf, t):
        if t >= BUFFERS:  # the tile where the one BUFFERS back was, once every thread is done
            bars.freed(buf, t % BUFFERS, (t - BUFFERS) // BUFFERS)
        bars.expect(buf, t % BUFFERS, BYTES)

    @inlined
    def fill(buf, tile, maps, src, kv, key0, n_k, t, cnt):
        # K_j or V_j: reloaded from HBM by every query block
        copy(tile, AT + (t % BUFFERS) * STAGE, buf, bars.landing(t % BUFFERS), maps, src,
             key0, kv)
        if COUNT:
            cnt[SLOT] += min(BC, n_k - key0) * COLS

    return take, fill


@inlined
def fence_maps(maps):
    for m in range(3):
        fence_tensor_map(maps, m)  # the maps the host wrote, seen by the copies


@cache
def make_tma_producer(BR: int, BC: int, D: int, DV: int, Q: int, K: int, V: int, K_STAGE: int,
                      V_STAGE: int, ring: StageRing, tiles, COUNT: bool):
    """produce(buf, maps, q, k, v, bh, kv, row0, n_rows, n_k, j0, j1, cnt): the one producer
    thread's TMA copies of a query block's tiles into the ring
    (`make_stage_ring` PRODUCED, `make_ring_fills`): Q_i with K_j0 (K buffer 0's first
    fill), then K_j and V_j at ring position t = j - j0."""
    fills = make_ring_fills(BR, BC, D, DV, Q, K, V, K_STAGE, V_STAGE, ring, COUNT)
    fill_q, take_k, fill_k, take_v, fill_v = fills.q, fills.take_k, fills.k, fills.take_v, \
        fills.v
    Q_BYTES, K_BYTES = fills.q_bytes, fills.k_bytes
    k_bars = ring.k

    @inlined
    def produce(buf, maps, q, k, v, bh, kv, row0, n_rows, n_k, j0, j1, cnt):
        tile = tiles()
        fence_maps(maps)
        # Q_i with K_j0 on K buffer 0's first fill (or alone)
        k_bars.expect(buf, 0, Q_BYTES + (K_BYTES if j0 < j1 else 0))
        fill_q(buf, tile, maps, q, bh, row0, n_rows, k_bars.landing(0), cnt)
        for j in range(j0, j1):
            t = j - j0
            if t > 0:
                take_k(buf, t)
            fill_k(buf, tile, maps, k, kv, j * BC, n_k, t, cnt)
            take_v(buf, t)
            fill_v(buf, tile, maps, v, kv, j * BC, n_k, t, cnt)

    return produce


@cache
def make_tma_persistent_producer(BR: int, BC: int, D: int, DV: int, Q: int, K: int, V: int,
                                 K_STAGE: int, V_STAGE: int, ring: StageRing, tiles,
                                 COUNT: bool, items, kv_blocks, kv_head):
    """produce_items(buf, maps, q, k, v, tickets, item, cnt): a persistent CTA's producer
    thread (`make_stage_ring` PERSISTENT): for each work item in turn (`items`, a
    `persistent.Items`; the next drawn from `tickets` once the last one's copies are out),
    K_j0 into the ring, then, once every computing thread is done with the last Q_i, the
    item into `item` (query block, batch x head; block -1: none left) and Q_i into its
    buffer, counted at its landed mbarrier (the computing threads read the item once it has
    landed), then every other K_j and V_j, their ring positions running on from the last
    block's. K/V head of a query head: `kv_head`; the K/V blocks a query block visits:
    `kv_blocks`."""
    fills = make_ring_fills(BR, BC, D, DV, Q, K, V, K_STAGE, V_STAGE, ring, COUNT)
    fill_q, take_k, fill_k, take_v, fill_v = fills.q, fills.take_k, fills.k, fills.take_v, \
        fills.v
    Q_BYTES = fills.q_bytes
    q_bars = ring.q
    item_of, draw = items.item_of, items.draw

    @inlined
    def produce_items(buf, maps, q, k, v, tickets, item, cnt):
        tile = tiles()
        fence_maps(maps)
        n_q, n_k = q.shape[1], k.shape[1]
        i, bh = item_of(int32(cuda.blockIdx.x), q)  # (every CTA has a first item)
        handed = int32(0)  # items handed to the computing threads
        t0 = int64(0)  # K/V tiles copied into the ring before this item's
        while True:
            row0 = int64(i) * BR
            j0, j1 = int64(0), int64(0)
            if i >= 0:
                j0, j1 = kv_blocks(row0, min(BR, n_q - row0), n_q, n_k)
            kv = kv_head(bh)
            if j0 < j1:  # K_j0 first: its buffer is released before Q_i's
                take_k(buf, t0)
                fill_k(buf, tile, maps, k, kv, j0 * BC, n_k, t0, cnt)
            if handed > 0:  # every computing thread is done with the last Q_i and its item
                q_bars.freed(buf, 0, handed - 1)
            item[0] = i
            item[1] = bh
            if i < 0:
                # none left: the item handed over on Q_i's landed mbarrier, no copy behind it
                mbarrier_arrive(buf, q_bars.landing(0))
                break
            # the item handed over once Q_i's bytes land (the arrival releases its stores)
            q_bars.expect(buf, 0, Q_BYTES)
            fill_q(buf, tile, maps, q, bh, row0, min(BR, n_q - row0), q_bars.landing(0), cnt)
            for j in range(j0, j1):
                t = t0 + (j - j0)
                if j > j0:
                    take_k(buf, t)
                    fill_k(buf, tile, maps, k, kv, j * BC, n_k, t, cnt)
                take_v(buf, t)
                fill_v(buf, tile, maps, v, kv, j * BC, n_k, t, cnt)
            t0 += j1 - j0
            handed += 1
            i, bh = draw(tickets, q)

    return produce_items
