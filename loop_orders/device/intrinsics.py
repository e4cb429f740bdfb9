"""Hardware instructions the kernels want and Numba does not offer as such: the one module
of inline PTX (each an `@intrinsic` emitting `llvmlite.ir.InlineAsm`), so a move to another
compiler front end is this module's work.

`exp2(x)`: 2^x in float32 as the single MUFU.EX2 instruction (PTX `ex2.approx.ftz.f32`).
Numba lowers `math.exp2` to `ex2.approx.f32`, which flushes no subnormals and so takes three
more instructions around the MUFU (a compare and two multiplies that rescale subnormal
inputs). The online softmax only ever exponentiates differences s - m <= 0 of a row's scores
and its running max, where a weight below 2^-126 is as good as 0, so the flushing version is
exact enough; both give 2^-inf = 0 and propagate NaN. The simulator runs `math.exp2`.

Tensor cores (the 16-bit micro-kernel, `tensor_cores`), warp-collective: all 32 lanes of a
warp call them together. Fragments are 32-bit registers holding two 16-bit values, the lower
column (or key) in the low half; lane = 4 g + t.

    mma_f16(a0..a3, b0, b1, c0..c3) -> (d0..d3)   mma.sync m16n8k16, float16 in, float32 acc
    mma_bf16(...)                                 the same for bfloat16
        A (16 x 16, row major): a0 = A[g, 2t:2t+2], a1 = A[g+8, 2t:2t+2], a2 = A[g, 8+2t:..],
        a3 = A[g+8, 8+2t:..];  B (16 x 8, k x n): b0 = B[2t:2t+2, g], b1 = B[8+2t:.., g];
        C, D (16 x 8): c0, c1 = C[g, 2t], C[g, 2t+1]; c2, c3 = C[g+8, 2t], C[g+8, 2t+1]
    mma_tf32(a0..a3, b0, b1, c0..c3)              mma.sync m16n8k8 on TF32 (float32 values,
                                                  or their bits as uint32):
        a0 = A[g, t], a1 = A[g+8, t], a2 = A[g, t+4], a3 = A[g+8, t+4]; b0 = B[t, g],
        b1 = B[t+4, g]; C, D as above
    tf32_round(x)                                 float32 x rounded to TF32's 10 mantissa bits
                                                  (nearest, ties away: cvt.rna.tf32.f32), as a
                                                  float32 whose last 13 bits are zero: the head
                                                  of x, whose tail x - head is exact (3xTF32)
    pack_f16x2(lo, hi), pack_bf16x2(lo, hi)       two float32 -> one register (round to nearest)
    ldmatrix_x4(tile, e), ldmatrix_x4_trans(tile, e)
                                                  four 8x8 16-bit matrices from shared memory:
        lane l gives the address tile[e] of row l % 8 of matrix l // 8; lane 4g + t receives
        row g, columns 2t, 2t+1 of each matrix (transposed: rows 2t, 2t+1 of column g)
    cp_async16(tile, e, src, bh, row, col, n_bytes, width)
                                                  16 bytes src[bh, row, col:] -> tile[e:],
        asynchronously, the bytes past n_bytes (0 or 16) zero-filled; col may run past the
        row's end (`width` columns, a compile-time constant) into the next rows, so a copier
        can step rows by a constant column offset: a C-contiguous src folds it into the
        address as it is; a strided one (one sequence of a packed varlen batch, whose rows
        lie heads x d apart) splits it into rows and a column first; then
    cp_async_commit(), cp_async_wait_all()        close a group; wait for all of a thread's
                                                  groups
    cp_async_wait_one()                           wait for all of a thread's groups but the
                                                  last one it closed
    st_global_v4(dst, bh, row, col, x0, x1, x2, x3)
                                                  dst[bh, row, col:col + 4] = x0 .. x3 as one
        16-byte store (st.global.v4.f32; that address 16-byte aligned): a warp whose lanes
        hold consecutive 16-byte pieces of a row fills whole 32-byte sectors, where four
        scalar stores 16 bytes apart would each touch the same sectors partly
    shfl_xor(x, lanes)                            x of lane (lane ^ lanes), float32
    vote_any(x)                                   whether x holds on any lane of the warp

Named barriers, for warps that split a CTA's work (`warp_specialised`): barrier `ident` (1 ..
15; 0 is __syncthreads') of `count` threads (a multiple of 32, whole warps):

    named_barrier(ident, count) -> (sync, arrive)  sync(): arrive and wait until `count`
        threads have arrived (bar.sync); arrive(): arrive and go on (bar.arrive). Memory
        writes before either are seen by the threads that sync on the same barrier after.
    turn_barrier(count) -> (sync, arrive)         the same with the id a value of the
        kernel's (sync(ident), arrive(ident)): warpgroups that take turns each name theirs

Memory barriers (mbarrier) in shared memory, 8 bytes at an element offset of a shared array
that is a multiple of 8 bytes: a phase completes when `count` arrivals have come, and the
next begins; waiting names the parity of the phase it waits for (0, 1, 0, ...):

    mbarrier_init(tile, at, count)                one thread, before any other uses it (a
                                                  __syncthreads between)
    mbarrier_arrive(tile, at)                     this thread arrives (release: its writes
                                                  before are seen by whoever waits after)
    cp_async_arrive(tile, at)                     this thread arrives once every cp.async it
                                                  issued before has landed (.noinc: one of
                                                  the `count`)
    mbarrier_wait(tile, at, parity)               wait until the phase of that parity has
                                                  completed (acquire)

Hopper's tensor memory accelerator (TMA), one thread issuing a whole tile's copy:

    tma_load(ROWS, WIDTH)(tile, e, bars, at, maps, m, src, col, row, bh)
        the box src[bh, row:row + ROWS, col:col + WIDTH] (16-bit elements; zeros past src's
        ends) into tile[e:], rows of WIDTH swizzled as `WgmmaOperand` lays them out (e where
        a pattern starts), its bytes counted at the mbarrier bars[at]
        (cp.async.bulk.tensor.3d ... mbarrier::complete_tx::bytes); maps[16 m:16 m + 16] is
        src's tensor map (`tensor_map`), in global memory; src itself is read only by the
        simulator's emulation
    mbarrier_expect_tx(bars, at, n_bytes)         this thread arrives, and the phase waits
                                                  also for n_bytes of copies to land
    fence_tensor_map(maps, m)                     the map the host wrote, seen by the copies
                                                  (fence.proxy.tensormap acquire)
    set_max_registers(COUNT, MORE)()              setmaxnreg: this warpgroup's registers per
                                                  thread raised (MORE) or lowered to COUNT

Hopper's warpgroup products (sm_90a; `hopper`, the Hopper micro-kernel), warpgroup-collective:
the 128 threads of warps 4 h .. 4 h + 3 call them together. A shared operand is a matrix in
rows of 32, 64 or 128 bytes, swizzled (`WgmmaOperand`), whose address the instruction reads
through a 64-bit descriptor (start, leading and stride byte offsets, swizzle mode).
The accumulator fragments are mma.sync's C, warp 4 h + u holding rows 16 u .. 16 u + 15 of
the warpgroup's 64: d[4 n + 2 a + c] = D[16 u + g + 8 a, 8 n + 2 t + c].

    wgmma_scores(KIND, N, KSTEPS, A, B)(d, tile, a_at, b_at)
        d = A B^T: A the 64 x 16 KSTEPS operand at tile[a_at:], B the N x 16 KSTEPS one at
        tile[b_at:] (wgmma.mma_async m64nNk16 from shared memory, KSTEPS of them, then
        commit and wait: the products are done when it returns)
    wgmma_accumulate(KIND, N, KSTEPS, B)(d, p, tile, b_at)
        d += P B^T, P's A fragment of k-step kk packed from p[8 kk .. 8 kk + 7] as mma.sync's
        (p[8 kk + 2 r + h] is row g + 8 (r % 2), column 16 kk + 8 (r // 2) + 2 t + h): the
        weights as the score fragments hold them, rounded to KIND
    wgmma_scores(..., wait=False), wgmma_accumulate(..., wait=False)
        the same, committed as a group and not waited for: d holds the result only after
    wgmma_wait(PENDING, COUNT)(d)                 wait until at most PENDING of the
        warpgroup's committed groups run on (wgmma.wait_group), d[:COUNT] passing through it
        so that nothing reads them before (groups complete in the order committed)
    fence_async_shared()                          this thread's writes to shared memory (its
        stores and cp.async copies) are seen by later asynchronous-proxy reads (wgmma), once
        a barrier has ordered them

bfloat16 has no NumPy dtype, so its arrays reach the kernels as uint16 arrays of its bits
(`schedule.KERNEL_DTYPES`); every conversion between an HBM element and float32 goes through

    widen(x)                                      float32 of x: a float cast, or uint16 taken
                                                  as bfloat16 bits (exact: a 16-bit shift)
    narrow(x, dst)                                float32 x as dst's element type: a float
                                                  cast, or for uint16 the nearest bfloat16
                                                  (cvt.rn.bf16.f32, ties to even)

On the simulator, which has no warps, each is emulated in Python: the lanes of a warp (a
warpgroup) swap their operands through the block (`_group_gather`, two barriers), so the
kernels' fragment logic runs in CI exactly as on the GPU, only the arithmetic is NumPy's. The
emulation needs every lane of a warp at each of its warp-collective calls, which the kernels'
warp-uniform control flow gives. Named barriers are emulated per CTA, counting threads (a GPU
counts whole warps: the counts are multiples of 32); cp.async and TMA copy at once (a TMA
copy then counts its bytes at its mbarrier), so cp.async's waits and the fences do nothing.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import NamedTuple

import numpy as np

from .runtime import SIMULATOR, cuda, inlined

FULL_MASK = 0xFFFFFFFF
WARPGROUP = 128  # threads of a warpgroup: the wgmma products' collective


SWIZZLE_MODES = {64: 1, 32: 2, 16: 3}  # a swizzled row's elements -> the descriptor's mode


class WgmmaOperand(NamedTuple):
    """A wgmma operand in shared memory, swizzled (TMA's and CUTLASS's canonical layouts):
    rows of `width` 16-bit elements (64, 32 or 16: the 128-, 64- and 32-byte swizzles) one
    after another, the 16-byte chunks of each permuted by the address bits above them
    (`swizzled`); a matrix wider than `width` in column blocks `block` elements apart.
    K-major (`mn_major` False): a row is one index of M (N), its columns run along K; MN-major:
    a row is one index of K, its columns run along M (N). The pattern repeats every 8 rows,
    from addresses that are multiples of 8 rows' bytes (1024 at the 128-byte swizzle): a
    block must start at one."""

    width: int
    block: int
    mn_major: bool = False

    def element(self, mn, k):
        """Element (mn, k)'s offset from the operand's first, before the swizzle."""
        row, col = (k, mn) if self.mn_major else (mn, k)
        return (col // self.width) * self.block + row * self.width + col % self.width

    def k_step(self, kk: int) -> int:
        """Where k-step kk's 16 columns of K start, in elements from the operand's first."""
        return int(self.element(0, 16 * kk))

    def addresses(self, at: int, mn: int, k: int) -> np.ndarray:
        """The elements that hold the operand's (mn x k) values when it starts at element
        `at` of a 1024-byte-aligned shared buffer."""
        r, c = np.meshgrid(np.arange(mn), np.arange(k), indexing="ij")
        return swizzled(at + self.element(r, c), self.width)

    def descriptor_fields(self) -> int:
        """The descriptor's bits other than the start address: the leading byte offset (an
        MN-major operand's column blocks; unused K-major, 16), the stride byte offset (8
        rows), the swizzle mode."""
        lbo = 2 * self.block if self.mn_major else 16
        return ((lbo >> 4) << 16 | (16 * self.width >> 4) << 32
                | SWIZZLE_MODES[self.width] << 62)


def swizzled(e, width: int):
    """Where element e (from a 1024-byte-aligned base) of a tile in rows of `width` 16-bit
    elements lies: the 16-byte chunk bits of its address XOR the row bits above them (a
    row's chunks land in different banks, as TMA and wgmma swizzle them)."""
    return e ^ (((e >> 6) & (width // 8 - 1)) << 3)


def _check_wgmma(kind: str, n: int, ksteps: int) -> None:
    if kind not in ("f16", "bf16") or not (8 <= n <= 256 and n % 8 == 0) or ksteps < 1:
        raise ValueError(f"wgmma m64n{n}k16 .{kind} x {ksteps}: N is 8 .. 256 in steps of 8, "
                         "operands f16 or bf16")


def _check_barrier(ident: int, count: int) -> None:
    """A named barrier's id and thread count as PTX takes them."""
    if not 1 <= ident <= 15 or count <= 0 or count % 32 or count > 1024:
        raise ValueError(f"named barrier {ident} of {count} threads: ids are 1 .. 15 (0 is "
                         "__syncthreads'), counts whole warps up to 1024 threads")


def _check_tma(rows: int, width: int) -> None:
    """A box TMA copies into a swizzled tile: 1 .. 256 rows of a swizzled row's 16-bit
    elements."""
    if not 1 <= rows <= 256 or width not in SWIZZLE_MODES:
        raise ValueError(f"TMA box of {rows} rows x {width} elements: rows 1 .. 256, rows of "
                         f"{sorted(SWIZZLE_MODES)} elements (the 32/64/128-byte swizzles)")


def _check_registers(count: int) -> None:
    if not 24 <= count <= 256 or count % 8:
        raise ValueError(f"setmaxnreg {count}: a multiple of 8 from 24 to 256")


if SIMULATOR:
    from .arrays import bfloat16_bits

    def exp2(x):
        """2^x as the GPU's instruction gives it: inf past float's range, where math.exp2
        raises."""
        try:
            return math.exp2(x)
        except OverflowError:
            return math.inf

    _CREATING = threading.Lock()

    class _WarpExchange:
        """The lanes of one warp swapping values, call after call: each lane writes its value
        into the call's slot; the last to arrive takes the slot's values and opens every other
        lane's own gate (a lock per lane, so the lanes wake independently; a Condition wakes
        them one after another). Two slots in turn: a lane can only reach a slot again two
        calls later, once every lane has left the call that used it before."""

        def __init__(self, lanes: int):
            self.lanes, self.lock = lanes, threading.Lock()
            self.slots = [{"values": [None] * lanes, "arrived": 0, "result": None}
                          for _ in range(2)]
            self.gates = [threading.Lock() for _ in range(lanes)]
            for gate in self.gates:
                gate.acquire()  # closed
            self.turns = [0] * lanes

        def gather(self, lane: int, value, combine):
            slot = self.slots[self.turns[lane] % 2]
            self.turns[lane] += 1
            slot["values"][lane] = value
            with self.lock:
                slot["arrived"] += 1
                last = slot["arrived"] == self.lanes
            if last:
                slot["arrived"], slot["result"] = 0, combine(list(slot["values"]))
                for other, gate in enumerate(self.gates):
                    if other != lane:
                        gate.release()  # open
            elif not self.gates[lane].acquire(timeout=_GATHER_TIMEOUT_S):
                raise RuntimeError("warp exchange: a lane never arrived (its kernel raised?)")
            return slot["result"]

    _GATHER_TIMEOUT_S = 300  # a lane that never arrives (its kernel raised): fail, not hang

    def _group_gather(value, combine, size: int):
        """combine(the values of `value` from the threads of the calling thread's group of
        `size` (a warp, a warpgroup)), worked out once per group and call (by its last
        thread) and returned to every thread."""
        thread = threading.current_thread()
        block = thread._manager.__dict__
        group, lane = divmod(thread.thread_id, size)
        exchange = block.get(("group", size, group))
        if exchange is None:
            with _CREATING:
                lanes = min(size, int(np.prod(thread._manager._block_dim)) - size * group)
                exchange = block.setdefault(("group", size, group), _WarpExchange(lanes))
        return exchange.gather(lane, value, combine)

    def _warp_gather(value, combine=list):
        """combine(the values of `value` from the lanes of the calling thread's warp)."""
        return _group_gather(value, combine, 32)

    def _lane():
        return threading.current_thread().thread_id % 32

    def _halves(words, kind):
        """uint32 words -> float64 pairs (low half first) of float16 or bfloat16."""
        w = np.asarray(words, dtype=np.uint32)
        if kind == "f16":
            return w.view(np.float16).astype(np.float64).reshape(*w.shape, 2)
        lo, hi = (w << 16).view(np.float32), (w & 0xFFFF0000).view(np.float32)
        return np.stack([lo, hi], axis=-1).astype(np.float64)

    def _fragment_index(regs: int, row, col, halves: int = 2):
        """(rows, cols) of every lane's registers' elements: row(g, t, r, h), col(...)."""
        g, t, r, h = np.meshgrid(np.arange(8), np.arange(4), np.arange(regs),
                                 np.arange(halves), indexing="ij")
        return row(g, t, r, h).ravel(), col(g, t, r, h).ravel()

    # m16n8k16: A (16 x 16) in 4 registers of 2 halves, B (16 x 8) in 2, C (16 x 8) 4 floats
    _A16 = _fragment_index(4, lambda g, t, r, h: g + 8 * (r % 2),
                           lambda g, t, r, h: 2 * t + h + 8 * (r // 2))
    _B16 = _fragment_index(2, lambda g, t, r, h: 2 * t + h + 8 * r, lambda g, t, r, h: g)
    _C = _fragment_index(2, lambda g, t, r, h: g + 8 * r, lambda g, t, r, h: 2 * t + h)
    # m16n8k8 TF32: A (16 x 8) in 4 registers of one value, B (8 x 8) in 2
    _A8 = _fragment_index(4, lambda g, t, r, h: g + 8 * (r % 2),
                          lambda g, t, r, h: t + 4 * (r // 2), halves=1)
    _B8 = _fragment_index(2, lambda g, t, r, h: t + 4 * r, lambda g, t, r, h: g, halves=1)

    def _product(lanes, values_a, values_b, a_index, b_index, shape_a, shape_b):
        """D = A B + C of the warp, from every lane's fragments."""
        A, B, C = np.zeros(shape_a), np.zeros(shape_b), np.zeros((16, 8))
        A[a_index] = values_a(lanes).ravel()
        B[b_index] = values_b(lanes).ravel()
        C[_C] = np.array([x[2] for x in lanes], dtype=np.float64).ravel()
        return (A @ B + C).astype(np.float32)

    def _lane_of(D):
        g, t = divmod(_lane(), 4)
        return D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]

    def _mma_m16n8k16(kind, a, b, c):
        def product(lanes):
            return _product(lanes, lambda ls: _halves([x[0] for x in ls], kind),
                            lambda ls: _halves([x[1] for x in ls], kind), _A16, _B16,
                            (16, 16), (16, 8))

        return _lane_of(_warp_gather((a, b, c), product))

    def mma_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        return _mma_m16n8k16("f16", (a0, a1, a2, a3), (b0, b1), (c0, c1, c2, c3))

    def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        return _mma_m16n8k16("bf16", (a0, a1, a2, a3), (b0, b1), (c0, c1, c2, c3))

    def _tf32(words):
        """TF32 keeps float32's top 19 bits (the hardware ignores the rest); operands are
        float32 values or their bits."""
        bits = np.array([np.float32(w).view(np.uint32) if isinstance(w, (float, np.floating))
                         else w for w in np.ravel(words)], dtype=np.uint32).reshape(
            np.shape(words))
        return (bits & 0xFFFFE000).view(np.float32).astype(np.float64)

    def mma_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        def product(lanes):
            return _product(lanes, lambda ls: _tf32([x[0] for x in ls]),
                            lambda ls: _tf32([x[1] for x in ls]), _A8, _B8, (16, 8), (8, 8))

        return _lane_of(_warp_gather(((a0, a1, a2, a3), (b0, b1), (c0, c1, c2, c3)), product))

    def tf32_round(x):
        x = np.float32(x)
        if not np.isfinite(x):
            return x  # inf stays inf, NaN stays NaN
        bits = (int(x.view(np.uint32)) + 0x1000) & 0xFFFFE000  # half of the dropped bits' ulp
        return np.uint32(bits).view(np.float32)

    def pack_f16x2(lo, hi):
        return int(np.array([lo, hi], dtype=np.float16).view(np.uint32)[0])

    def _bf16_bits(x):
        return int(bfloat16_bits(x)[0])  # nearest, ties to even

    def pack_bf16x2(lo, hi):
        return _bf16_bits(lo) | _bf16_bits(hi) << 16

    def widen(x):
        if isinstance(x, np.uint16):
            return np.uint32(int(x) << 16).view(np.float32)
        return np.float32(x)

    def narrow(x, dst):
        return np.uint16(_bf16_bits(x)) if dst.dtype == np.uint16 else x

    def _ldmatrix(tile, e, trans):
        rows = _warp_gather(int(e))
        bits = tile.view(np.uint16)
        g, t = divmod(_lane(), 4)
        out = []
        for mat in range(4):
            at = rows[8 * mat:8 * mat + 8]
            if trans:
                lo, hi = bits[at[2 * t] + g], bits[at[2 * t + 1] + g]
            else:
                lo, hi = bits[at[g] + 2 * t], bits[at[g] + 2 * t + 1]
            out.append(int(lo) | int(hi) << 16)
        return tuple(out)

    def ldmatrix_x4(tile, e):
        return _ldmatrix(tile, e, False)

    def ldmatrix_x4_trans(tile, e):
        return _ldmatrix(tile, e, True)

    def cp_async16(tile, e, src, bh, row, col, n_bytes, width):
        per = 16 // tile.itemsize
        for u in range(per):
            r, c = divmod(int(col) + u, width)  # a column past the row's end: the next rows
            tile[e + u] = src[bh, row + r, c] if u * tile.itemsize < n_bytes else 0

    def st_global_v4(dst, bh, row, col, x0, x1, x2, x3):
        for u, x in enumerate((x0, x1, x2, x3)):
            dst[bh, row, col + u] = x

    def cp_async_commit():
        pass

    def cp_async_wait_all():
        pass

    def cp_async_wait_one():
        pass

    def shfl_xor(x, lanes):
        return _warp_gather(x)[_lane() ^ lanes]

    def vote_any(x):
        return _warp_gather(bool(x), any)

    class _NamedBarrier:
        """One named barrier of one CTA: each generation completes when `count` threads
        have reached it; a sync waits for that, an arrive does not."""

        def __init__(self, count: int):
            self.count, self.cond = count, threading.Condition()
            self.arrived = self.generation = 0

        def reach(self, wait: bool):
            with self.cond:
                generation = self.generation
                self.arrived += 1
                if self.arrived == self.count:
                    self.arrived, self.generation = 0, generation + 1
                    self.cond.notify_all()
                elif wait and not self.cond.wait_for(lambda: self.generation != generation,
                                                     timeout=_GATHER_TIMEOUT_S):
                    raise RuntimeError("named barrier: threads never arrived")

    def _barrier_of_block(ident: int, count: int) -> _NamedBarrier:
        block = threading.current_thread()._manager.__dict__
        bar = block.get(("bar", ident))
        if bar is None:
            with _CREATING:
                bar = block.setdefault(("bar", ident), _NamedBarrier(count))
        if bar.count != count:  # on a GPU: undefined (a hang, at best)
            raise RuntimeError(f"named barrier {ident}: reached with {count} threads and with "
                               f"{bar.count}")
        return bar

    def named_barrier(ident: int, count: int):
        _check_barrier(ident, count)

        def sync():
            _barrier_of_block(ident, count).reach(True)

        def arrive():
            _barrier_of_block(ident, count).reach(False)

        return sync, arrive

    def turn_barrier(count: int):
        def sync(ident):
            _barrier_of_block(int(ident), count).reach(True)

        def arrive(ident):
            _barrier_of_block(int(ident), count).reach(False)

        return sync, arrive

    class _MemoryBarrier:
        """One mbarrier: a phase completes when `count` arrivals have come."""

        def __init__(self, count: int):
            self.count, self.pending, self.phase = count, count, 0
            self.tx = 0  # bytes expected and not yet landed (it may run below 0 for a while)
            self.cond = threading.Condition()

        def _settle(self):
            """The phase completes once every arrival has come and every byte landed."""
            if self.pending == 0 and self.tx == 0:
                self.pending, self.phase = self.count, self.phase + 1
                self.cond.notify_all()

        def arrive(self, expect: int = 0):
            with self.cond:
                self.tx += expect
                self.pending -= 1
                self._settle()

        def complete(self, landed: int):
            with self.cond:
                self.tx -= landed
                self._settle()

        def wait(self, parity: int):
            """Until the phase of this parity has completed: the current one is the other's
            (or a later one of its own, which a correct kernel never lets happen)."""
            with self.cond:
                if not self.cond.wait_for(lambda: self.phase % 2 != parity,
                                          timeout=_GATHER_TIMEOUT_S):
                    raise RuntimeError("mbarrier: its arrivals never came")

    def _memory_barrier(at) -> _MemoryBarrier:
        bar = threading.current_thread()._manager.__dict__.get(("mbarrier", int(at)))
        if bar is None:
            raise RuntimeError(f"mbarrier at {int(at)}: used before mbarrier_init")
        return bar

    def mbarrier_init(tile, at, count):
        block = threading.current_thread()._manager.__dict__
        block[("mbarrier", int(at))] = _MemoryBarrier(int(count))

    def mbarrier_arrive(tile, at):
        _memory_barrier(at).arrive()

    def cp_async_arrive(tile, at):
        _memory_barrier(at).arrive()  # the emulated copies have landed already

    def mbarrier_wait(tile, at, parity):
        _memory_barrier(at).wait(int(parity))

    def mbarrier_expect_tx(tile, at, n_bytes):
        _memory_barrier(at).arrive(int(n_bytes))

    @functools.cache
    def tma_load(rows: int, width: int):
        _check_tma(rows, width)

        def load(tile, e, bars, at, maps, m, src, col, row, bh):
            """The box's rows of src[bh] (zeros past its end) into tile[e:], swizzled as the
            hardware does, then its bytes counted at the mbarrier."""
            n_rows, n_cols = src.shape[1], src.shape[2]
            for r in range(rows):
                for c in range(width):
                    y, x = int(row) + r, int(col) + c
                    inside = y < n_rows and x < n_cols
                    tile[swizzled(int(e) + r * width + c, width)] = src[bh, y, x] if inside \
                        else 0
            _memory_barrier(at).complete(2 * rows * width)

        return load

    def fence_tensor_map(maps, m):
        pass

    @functools.cache
    def set_max_registers(count: int, more: bool):
        _check_registers(count)

        def setmaxnreg():
            pass

        return setmaxnreg

    def _as_kind(x, kind):
        """float values rounded to KIND (nearest, ties to even), as float64."""
        x = np.asarray(x, np.float32)
        if kind == "f16":
            return x.astype(np.float16).astype(np.float64)
        return (bfloat16_bits(x).astype(np.uint32) << 16).view(np.float32).astype(np.float64)

    def _tile_values(tile, index, kind):
        """A shared tile's 16-bit elements at `index` as float64 (bfloat16 as its bits)."""
        x = tile[index]
        if kind == "bf16":
            return (x.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return x.astype(np.float64)

    def _fragment_of(D, n: int):
        """This thread's accumulator fragment of the warpgroup's 64 x n D."""
        u, lane = divmod(threading.current_thread().thread_id % WARPGROUP, 32)
        g, t = divmod(lane, 4)
        return [D[16 * u + g + 8 * a, 8 * j + 2 * t + c]
                for j in range(n // 8) for a in range(2) for c in range(2)]

    def wgmma_scores(kind: str, n: int, ksteps: int, a: WgmmaOperand, b: WgmmaOperand,
                     wait: bool = True):
        _check_wgmma(kind, n, ksteps)  # the emulation is done when it returns, waited or not

        def scores(d, tile, a_at, b_at):
            def product(ats):
                a0, b0 = ats[0]
                return (_tile_values(tile, a.addresses(a0, 64, 16 * ksteps), kind)
                        @ _tile_values(tile, b.addresses(b0, n, 16 * ksteps), kind).T
                        ).astype(np.float32)

            for e, x in enumerate(_fragment_of(_group_gather((int(a_at), int(b_at)), product,
                                                              WARPGROUP), n)):
                d[e] = x

        return scores

    def wgmma_accumulate(kind: str, n: int, ksteps: int, b: WgmmaOperand, wait: bool = True):
        _check_wgmma(kind, n, ksteps)

        def accumulate(d, p, tile, b_at):
            def product(parts):
                A, C = np.zeros((64, 16 * ksteps)), np.zeros((64, n))
                for thread, ps, ds, _ in parts:
                    u, lane = divmod(thread, 32)
                    g, t = divmod(lane, 4)
                    for e, x in enumerate(_as_kind(ps, kind)):
                        kk, r, h = e // 8, (e % 8) // 2, e % 2
                        A[16 * u + g + 8 * (r % 2), 16 * kk + 8 * (r // 2) + 2 * t + h] = x
                    for e, x in enumerate(ds):
                        j, a, c = e // 4, (e % 4) // 2, e % 2
                        C[16 * u + g + 8 * a, 8 * j + 2 * t + c] = x
                B = _tile_values(tile, b.addresses(parts[0][3], n, 16 * ksteps), kind)
                return (A @ B.T + C).astype(np.float32)

            thread = threading.current_thread().thread_id % WARPGROUP
            mine = (thread, [p[e] for e in range(8 * ksteps)], [d[e] for e in range(n // 2)],
                    int(b_at))
            for e, x in enumerate(_fragment_of(_group_gather(mine, product, WARPGROUP), n)):
                d[e] = x

        return accumulate

    def wgmma_wait(pending: int, count: int):
        def wait(d):
            pass

        return wait

    def fence_async_shared():
        pass

else:
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.cuda.extending import intrinsic

    _F32, _I32 = ir.FloatType(), ir.IntType(32)

    def _float_asm(text: str, out: str = "f"):
        """An intrinsic f(x) -> float32 of one PTX instruction on float32 x, whose result is a
        float register (`out` 'f') or the bits of one ('r': a .b32, such as a TF32 value)."""

        @intrinsic
        def op(typingctx, x):
            if not isinstance(x, types.Float):
                return None

            def codegen(context, builder, sig, args):
                value = context.cast(builder, args[0], sig.args[0], types.float32)
                fnty = ir.FunctionType(_F32 if out == "f" else _I32, [_F32])
                result = builder.call(ir.InlineAsm(fnty, text, f"={out},f"), [value])
                return result if out == "f" else builder.bitcast(result, _F32)

            return types.float32(x), codegen

        return op

    _ex2_approx_ftz = _float_asm("ex2.approx.ftz.f32 $0, $1;")

    @inlined
    def exp2(x):
        return _ex2_approx_ftz(x)

    def _as_b32(context, builder, x, ty):
        """A 32-bit operand register: a float's bits (TF32), or an integer's value."""
        if isinstance(ty, types.Float):
            return builder.bitcast(context.cast(builder, x, ty, types.float32), _I32)
        return context.cast(builder, x, ty, types.uint32)

    def _mma_intrinsic(asm_text: str, a_regs: str):
        """An mma.sync intrinsic of four 32-bit A registers, two B and four float32 C; A and
        B go in as `a_regs` ('r': packed 16-bit pairs; TF32 is float32 bits, also 'r')."""

        @intrinsic
        def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            def codegen(context, builder, sig, args):
                ins = [_as_b32(context, builder, x, t)
                       for x, t in zip(args[:6], sig.args[:6], strict=True)]
                ins += [context.cast(builder, x, t, types.float32)
                        for x, t in zip(args[6:], sig.args[6:], strict=True)]
                out = ir.LiteralStructType([_F32] * 4)
                fnty = ir.FunctionType(out, [_I32] * 6 + [_F32] * 4)
                cons = "=f,=f,=f,=f," + f"{a_regs}," * 6 + "f,f,f,f"
                res = builder.call(ir.InlineAsm(fnty, asm_text, cons), ins)
                vals = [builder.extract_value(res, n) for n in range(4)]
                return context.make_tuple(builder, sig.return_type, vals)

            return types.UniTuple(types.float32, 4)(a0, a1, a2, a3, b0, b1, c0, c1, c2,
                                                    c3), codegen

        return mma

    _OPERANDS = "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};"
    mma_f16 = _mma_intrinsic("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 " + _OPERANDS,
                             "r")
    mma_bf16 = _mma_intrinsic(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 " + _OPERANDS, "r")
    mma_tf32 = _mma_intrinsic("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 " + _OPERANDS,
                              "r")

    tf32_round = _float_asm("cvt.rna.tf32.f32 $0, $1;", out="r")

    def _pack_intrinsic(kind: str):
        @intrinsic
        def pack(typingctx, lo, hi):
            def codegen(context, builder, sig, args):
                vals = [context.cast(builder, x, t, types.float32)
                        for x, t in zip(args, sig.args, strict=True)]
                # cvt puts its first source in the upper half
                asm = ir.InlineAsm(ir.FunctionType(_I32, [_F32, _F32]),
                                   f"cvt.rn.{kind}x2.f32 $0, $2, $1;", "=r,f,f")
                return builder.call(asm, vals)

            return types.uint32(lo, hi), codegen

        return pack

    pack_f16x2 = _pack_intrinsic("f16")
    pack_bf16x2 = _pack_intrinsic("bf16")

    @intrinsic
    def widen(typingctx, x):
        if x == types.uint16:
            def codegen(context, builder, sig, args):
                bits = builder.shl(builder.zext(args[0], _I32), ir.Constant(_I32, 16))
                return builder.bitcast(bits, _F32)
        elif isinstance(x, (types.Float, types.Integer)):
            def codegen(context, builder, sig, args):
                return context.cast(builder, args[0], sig.args[0], types.float32)
        else:
            return None
        return types.float32(x), codegen

    @intrinsic
    def narrow(typingctx, x, dst):
        if not isinstance(dst, types.Array):
            return None
        to = dst.dtype
        if to == types.uint16:
            def codegen(context, builder, sig, args):
                value = context.cast(builder, args[0], sig.args[0], types.float32)
                asm = ir.InlineAsm(ir.FunctionType(ir.IntType(16), [_F32]),
                                   "cvt.rn.bf16.f32 $0, $1;", "=h,f")
                return builder.call(asm, [value])
        else:
            def codegen(context, builder, sig, args):
                return context.cast(builder, args[0], sig.args[0], to)
        return to(x, dst), codegen

    def _element_pointer(context, builder, aryty, ary, indices, index_types):
        """Generic address of ary[indices] as a 64-bit integer."""
        arr = context.make_array(aryty)(context, builder, ary)
        idx = [context.cast(builder, i, t, types.intp)
               for i, t in zip(indices, index_types, strict=True)]
        ptr = cgutils.get_item_pointer(context, builder, aryty, arr, idx, wraparound=False)
        return builder.ptrtoint(ptr, ir.IntType(64))

    def _shared_address(context, builder, aryty, ary, e, ety):
        """The 32-bit shared-window address of ary[e] (ary in shared memory): the array's
        base converted once (an address-space cast, which the compiler shares between calls)
        plus e elements in 32-bit arithmetic, so that constant steps of e become immediate
        offsets of the instruction instead of 64-bit adds and a conversion per call."""
        arr = context.make_array(aryty)(context, builder, ary)
        base = builder.addrspacecast(arr.data, ir.PointerType(arr.data.type.pointee, 3))
        item = context.get_abi_sizeof(context.get_data_type(aryty.dtype))
        offset = builder.mul(builder.trunc(context.cast(builder, e, ety, types.uint64), _I32),
                             ir.Constant(_I32, item))
        return builder.add(builder.ptrtoint(base, _I32), offset)

    def _ldmatrix_intrinsic(trans: bool):
        suffix = ".trans" if trans else ""

        @intrinsic
        def ldmatrix(typingctx, tile, e):
            def codegen(context, builder, sig, args):
                addr = _shared_address(context, builder, sig.args[0], args[0], args[1],
                                       sig.args[1])
                out = ir.LiteralStructType([_I32] * 4)
                text = (f"ldmatrix.sync.aligned.m8n8.x4{suffix}.shared.b16 "
                        "{$0,$1,$2,$3}, [$4];")
                asm = ir.InlineAsm(ir.FunctionType(out, [_I32]), text,
                                   "=r,=r,=r,=r,r,~{memory}", side_effect=True)
                res = builder.call(asm, [addr])
                vals = [builder.extract_value(res, n) for n in range(4)]
                return context.make_tuple(builder, sig.return_type, vals)

            return types.UniTuple(types.uint32, 4)(tile, e), codegen

        return ldmatrix

    ldmatrix_x4 = _ldmatrix_intrinsic(False)
    ldmatrix_x4_trans = _ldmatrix_intrinsic(True)

    @intrinsic
    def cp_async16(typingctx, tile, e, src, bh, row, col, n_bytes, width):
        def codegen(context, builder, sig, args):
            dst = _shared_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            row, row_type = args[4], sig.args[4]
            col = context.cast(builder, args[5], sig.args[5], types.uint64)
            if sig.args[2].layout != "C":
                # rows apart by a stride of their own: col's whole rows go to the row index
                # (width is a constant: the division compiles to a multiply and shifts)
                w = context.cast(builder, args[7], sig.args[7], types.uint64)
                row = builder.add(context.cast(builder, row, row_type, types.intp),
                                  builder.udiv(col, w))
                row_type, col = types.intp, builder.urem(col, w)
            # src[bh, row, 0], then col elements on (C-contiguous: into the next rows where
            # col passes the row's end): col stays an offset the compiler can fold into the
            # copy
            row_start = _element_pointer(context, builder, sig.args[2], args[2],
                                         [args[3], row, context.get_constant(types.intp, 0)],
                                         [sig.args[3], row_type, types.intp])
            item = context.get_abi_sizeof(context.get_data_type(sig.args[2].dtype))
            srcp = builder.add(row_start, builder.mul(col, ir.Constant(ir.IntType(64), item)))
            nb = context.cast(builder, args[6], sig.args[6], types.uint32)
            i64 = ir.IntType(64)
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_I32, i64, _I32]),
                               "cp.async.cg.shared.global [$0], [$1], 16, $2;",
                               "r,l,r,~{memory}", side_effect=True)
            builder.call(asm, [dst, srcp, nb])
            return context.get_dummy_value()

        return types.void(tile, e, src, bh, row, col, n_bytes, width), codegen

    @intrinsic
    def st_global_v4(typingctx, dst, bh, row, col, x0, x1, x2, x3):
        def codegen(context, builder, sig, args):
            addr = _element_pointer(context, builder, sig.args[0], args[0], args[1:4],
                                    sig.args[1:4])
            values = [context.cast(builder, x, ty, types.float32)
                      for x, ty in zip(args[4:], sig.args[4:], strict=True)]
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [ir.IntType(64), *[_F32] * 4]),
                               "st.global.v4.f32 [$0], {$1, $2, $3, $4};",
                               "l,f,f,f,f,~{memory}", side_effect=True)
            builder.call(asm, [addr, *values])
            return context.get_dummy_value()

        return types.void(dst, bh, row, col, x0, x1, x2, x3), codegen

    def _void_asm(text: str):
        @intrinsic
        def op(typingctx):
            def codegen(context, builder, sig, args):
                asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, "~{memory}",
                                   side_effect=True)
                builder.call(asm, [])
                return context.get_dummy_value()

            return types.void(), codegen

        return op

    cp_async_commit = _void_asm("cp.async.commit_group;")
    cp_async_wait_all = _void_asm("cp.async.wait_all;")
    cp_async_wait_one = _void_asm("cp.async.wait_group 1;")

    def named_barrier(ident: int, count: int):
        _check_barrier(ident, count)
        return (_void_asm(f"bar.sync {ident}, {count};"),
                _void_asm(f"bar.arrive {ident}, {count};"))

    def _id_barrier(op: str, count: int):
        @intrinsic
        def barrier(typingctx, ident):
            def codegen(context, builder, sig, args):
                asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_I32]),
                                   f"bar.{op} $0, {count};", "r,~{memory}", side_effect=True)
                builder.call(asm, [context.cast(builder, args[0], sig.args[0], types.uint32)])
                return context.get_dummy_value()

            return types.void(ident), codegen

        return barrier

    @functools.cache
    def turn_barrier(count: int):
        if count <= 0 or count % 32 or count > 1024:
            raise ValueError(f"turn barrier of {count} threads: whole warps up to 1024")
        return _id_barrier("sync", count), _id_barrier("arrive", count)

    def _shared_asm(text: str, with_value: bool = False):
        """An instruction on the shared address of tile[at] ($0), and with_value a 32-bit
        value ($1)."""
        def emit(context, builder, sig, args):
            addr = _shared_address(context, builder, sig.args[0], args[0], args[1],
                                   sig.args[1])
            vals = [context.cast(builder, x, t, types.uint32)
                    for x, t in zip(args[2:], sig.args[2:], strict=True)]
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_I32] * (1 + len(vals))),
                               text, "r," + "r," * len(vals) + "~{memory}", side_effect=True)
            builder.call(asm, [addr, *vals])
            return context.get_dummy_value()

        if with_value:
            @intrinsic
            def op_value(typingctx, tile, at, value):
                return types.void(tile, at, value), emit

            return op_value

        @intrinsic
        def op(typingctx, tile, at):
            return types.void(tile, at), emit

        return op

    mbarrier_init = _shared_asm("mbarrier.init.shared.b64 [$0], $1;", True)
    mbarrier_arrive = _shared_asm(
        "{ .reg .b64 state; mbarrier.arrive.shared.b64 state, [$0]; }")
    cp_async_arrive = _shared_asm("cp.async.mbarrier.arrive.noinc.shared.b64 [$0];")
    # a loop, in a block of its own so that each copy's labels are its own
    mbarrier_wait = _shared_asm(
        "{ .reg .pred done; WAIT: mbarrier.try_wait.parity.shared.b64 done, [$0], $1; "
        "@!done bra WAIT; }", True)

    @inlined
    def vote_any(x):
        return cuda.any_sync(FULL_MASK, x)

    @inlined
    def shfl_xor(x, lanes):
        return cuda.shfl_xor_sync(FULL_MASK, x, lanes)

    def _descriptor(builder, address, op: WgmmaOperand):
        """The 64-bit matrix descriptor of an operand at a 32-bit shared address: bits 0-13
        the address / 16, 16-29 the leading byte offset / 16, 32-45 the stride byte offset
        / 16, 62-63 the swizzle (`WgmmaOperand.descriptor_fields`)."""
        i64 = ir.IntType(64)
        start = builder.and_(builder.lshr(builder.zext(address, i64), ir.Constant(i64, 4)),
                             ir.Constant(i64, 0x3FFF))
        return builder.or_(start, ir.Constant(i64, op.descriptor_fields()))

    def _k_step_descriptors(builder, desc, op: WgmmaOperand, ksteps: int):
        """The descriptors of k-steps 0 .. ksteps - 1: the start moved to each step's 16
        columns of K (`WgmmaOperand.k_step`; the swizzle applies to the address read)."""
        i64 = ir.IntType(64)
        return [builder.add(desc, ir.Constant(i64, (2 * op.k_step(kk)) >> 4))
                for kk in range(ksteps)]

    def _local_pointers(context, builder, aryty, ary, count: int):
        """Pointers to elements 0 .. count - 1 of a (local) array."""
        data = context.make_array(aryty)(context, builder, ary).data
        return [builder.gep(data, [ir.Constant(ir.IntType(32), e)]) for e in range(count)]

    def _wgmma_text(kind: str, n: int, ksteps: int, a_text, b_operand, trans: str,
                    first_scale: str, wait: bool) -> str:
        """fence; KSTEPS wgmma.mma_async into $0 .. $(n/2 - 1); commit; wait for them (or
        not: `wgmma_wait` does)."""
        outs = "{" + ",".join(f"${e}" for e in range(n // 2)) + "}"
        lines = ["{", ".reg .pred zero, one;", "setp.ne.b32 zero, $__Z, 0;",
                 "setp.eq.b32 one, $__Z, 0;", "wgmma.fence.sync.aligned;"]
        for kk in range(ksteps):
            scale = first_scale if kk == 0 else "one"
            lines.append(f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{kind}.{kind} {outs}, "
                         f"{a_text(kk)}, {b_operand(kk)}, {scale}, 1, 1, {trans};")
        lines += ["wgmma.commit_group.sync.aligned;"]
        lines += ["wgmma.wait_group.sync.aligned 0;", "}"] if wait else ["}"]
        return "\n".join(lines)

    @functools.cache
    def wgmma_scores(kind: str, n: int, ksteps: int, a: WgmmaOperand, b: WgmmaOperand,
                     wait: bool = True):
        _check_wgmma(kind, n, ksteps)
        outs = n // 2
        # operands: the outputs, A's descriptors, B's, a zero
        text = _wgmma_text(kind, n, ksteps, lambda kk: f"${outs + kk}",
                           lambda kk: f"${outs + ksteps + kk}",
                           f"{int(a.mn_major)}, {int(b.mn_major)}", "zero", wait)
        text = text.replace("$__Z", f"${outs + 2 * ksteps}")
        cons = "=f," * outs + "l," * (2 * ksteps) + "r,~{memory}"

        @intrinsic
        def scores(typingctx, d, tile, a_at, b_at):
            def codegen(context, builder, sig, args):
                i64 = ir.IntType(64)
                descs = []
                for op, at, at_type in ((a, args[2], sig.args[2]), (b, args[3], sig.args[3])):
                    address = _shared_address(context, builder, sig.args[1], args[1], at,
                                              at_type)
                    descs += _k_step_descriptors(builder, _descriptor(builder, address, op),
                                                 op, ksteps)
                fnty = ir.FunctionType(ir.LiteralStructType([_F32] * outs),
                                       [i64] * (2 * ksteps) + [_I32])
                res = builder.call(ir.InlineAsm(fnty, text, cons, side_effect=True),
                                   descs + [ir.Constant(_I32, 0)])
                for e, ptr in enumerate(_local_pointers(context, builder, sig.args[0], args[0],
                                                        outs)):
                    builder.store(builder.extract_value(res, e), ptr)
                return context.get_dummy_value()

            return types.void(d, tile, a_at, b_at), codegen

        return scores

    @functools.cache
    def wgmma_accumulate(kind: str, n: int, ksteps: int, b: WgmmaOperand, wait: bool = True):
        _check_wgmma(kind, n, ksteps)
        outs = n // 2
        # operands: the outputs, the accumulators in (tied to them), A's registers, B's
        # descriptors, a zero
        a_at, b_at = 2 * outs, 2 * outs + 4 * ksteps
        text = _wgmma_text(kind, n, ksteps,
                           lambda kk: "{" + ",".join(f"${a_at + 4 * kk + r}" for r in range(4))
                           + "}", lambda kk: f"${b_at + kk}", str(int(b.mn_major)), "one",
                           wait)
        text = text.replace("$__Z", f"${b_at + ksteps}")
        cons = ("=f," * outs + ",".join(str(e) for e in range(outs)) + ","
                + "r," * (4 * ksteps) + "l," * ksteps + "r,~{memory}")
        pack = f"cvt.rn.{kind}x2.f32 $0, $2, $1;"  # cvt puts its first source in the upper half

        @intrinsic
        def accumulate(typingctx, d, p, tile, b_at):
            def codegen(context, builder, sig, args):
                i64 = ir.IntType(64)
                acc_ptrs = _local_pointers(context, builder, sig.args[0], args[0], outs)
                p_ptrs = _local_pointers(context, builder, sig.args[1], args[1], 8 * ksteps)
                packer = ir.InlineAsm(ir.FunctionType(_I32, [_F32, _F32]), pack, "=r,f,f")
                regs = [builder.call(packer, [builder.load(p_ptrs[2 * e]),
                                              builder.load(p_ptrs[2 * e + 1])])
                        for e in range(4 * ksteps)]
                address = _shared_address(context, builder, sig.args[2], args[2], args[3],
                                          sig.args[3])
                descs = _k_step_descriptors(builder, _descriptor(builder, address, b), b,
                                            ksteps)
                fnty = ir.FunctionType(ir.LiteralStructType([_F32] * outs),
                                       [_F32] * outs + [_I32] * (4 * ksteps)
                                       + [i64] * ksteps + [_I32])
                res = builder.call(ir.InlineAsm(fnty, text, cons, side_effect=True),
                                   [builder.load(ptr) for ptr in acc_ptrs] + regs + descs
                                   + [ir.Constant(_I32, 0)])
                for e, ptr in enumerate(acc_ptrs):
                    builder.store(builder.extract_value(res, e), ptr)
                return context.get_dummy_value()

            return types.void(d, p, tile, b_at), codegen

        return accumulate

    @functools.cache
    def wgmma_wait(pending: int, count: int):
        text = f"wgmma.wait_group.sync.aligned {pending};"
        cons = "=f," * count + ",".join(str(e) for e in range(count)) + ",~{memory}"

        @intrinsic
        def wait(typingctx, d):
            def codegen(context, builder, sig, args):
                ptrs = _local_pointers(context, builder, sig.args[0], args[0], count)
                fnty = ir.FunctionType(ir.LiteralStructType([_F32] * count), [_F32] * count)
                res = builder.call(ir.InlineAsm(fnty, text, cons, side_effect=True),
                                   [builder.load(ptr) for ptr in ptrs])
                for e, ptr in enumerate(ptrs):
                    builder.store(builder.extract_value(res, e), ptr)
                return context.get_dummy_value()

            return types.void(d), codegen

        return wait

    fence_async_shared = _void_asm("fence.proxy.async.shared::cta;")

    mbarrier_expect_tx = _shared_asm(
        "{ .reg .b64 state; mbarrier.arrive.expect_tx.shared::cta.b64 state, [$0], $1; }", True)

    def _map_address(context, builder, arg_types, args):
        """The generic address of tensor map m: maps[16 m] (the arguments (maps, m); maps a
        uint64 array in global memory, 16 words a map)."""
        at = builder.mul(context.cast(builder, args[1], arg_types[1], types.intp),
                         ir.Constant(ir.IntType(64), 16))
        return _element_pointer(context, builder, arg_types[0], args[0], [at], [types.intp])

    @functools.cache
    def tma_load(rows: int, width: int):
        _check_tma(rows, width)
        text = ("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx"
                "::bytes [$0], [$1, {$2, $3, $4}], [$5];")

        @intrinsic
        def load(typingctx, tile, e, bars, at, maps, m, src, col, row, bh):
            def codegen(context, builder, sig, args):
                dst = _shared_address(context, builder, sig.args[0], args[0], args[1],
                                      sig.args[1])
                bar = _shared_address(context, builder, sig.args[2], args[2], args[3],
                                      sig.args[3])
                tmap = _map_address(context, builder, sig.args[4:6], args[4:6])
                coords = [builder.trunc(context.cast(builder, x, t, types.uint64), _I32)
                          for x, t in zip(args[7:], sig.args[7:], strict=True)]
                asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_I32, ir.IntType(64)]
                                                   + [_I32] * 4),
                                   text, "r,l,r,r,r,r,~{memory}", side_effect=True)
                builder.call(asm, [dst, tmap, *coords, bar])
                return context.get_dummy_value()

            return types.void(tile, e, bars, at, maps, m, src, col, row, bh), codegen

        return load

    @intrinsic
    def fence_tensor_map(typingctx, maps, m):
        def codegen(context, builder, sig, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [ir.IntType(64)]),
                               "fence.proxy.tensormap::generic.acquire.gpu [$0], 128;",
                               "l,~{memory}", side_effect=True)
            builder.call(asm, [_map_address(context, builder, sig.args, args)])
            return context.get_dummy_value()

        return types.void(maps, m), codegen

    @functools.cache
    def set_max_registers(count: int, more: bool):
        _check_registers(count)
        return _void_asm(f"setmaxnreg.{'inc' if more else 'dec'}.sync.aligned.u32 {count};")
