"""The tensor-core micro-kernel for 16-bit inputs (and TF32), shared by kv_outer and q_outer.

The same device functions as the CUDA-core micro-kernel (`cuda_cores.MicroKernel`), so the
two loop nests run either unchanged; this one multiplies on tensor cores, FlashAttention-2
style (mma.sync m16n8k16, float32 accumulators; `intrinsics`):

    warp w of W = ceil(Br / 16) owns query rows 16 w .. 16 w + 15 of the block;
    lane 4 g + t holds rows 16 w + g and 16 w + g + 8 (a = 0, 1) of every fragment
    S = Q_i K_j^T:  per 16 head dims: Q_i's A fragment by ldmatrix, then per 16 keys one
                    ldmatrix of K_j (B of two 8-key n-tiles) and two mma
    row max, sum:   the 4 lanes of a row (t = 0..3) by two xor shuffles
    P:              2^(S scale log2 e - m) rounded to 16 bits in registers, where the S
                    accumulator fragment already is P's A fragment for P V_j (no shared round)
    acc += P V_j:   per 16 keys and 16 dims of V: one ldmatrix.trans (B of two n-tiles), two mma

K_j, V_j can be double-buffered (`TensorCores.stages` = 2, q_outer's loop nest): the copies
of the next pair land under this pair's arithmetic. Tiles arrive in shared memory as 16-bit
rows through `cp.async` (16 bytes a copy, rows past
the tile's valid ones zero-filled; a head dim that is not a multiple of 8 takes plain loads),
padded to whole 16s of head dims and keys (zero, cleared once per CTA) with each row stride
8 elements over that, so the 8 rows one ldmatrix reads fall in different banks. The 16-bit
tiles come first in the dynamic buffer; the float32 O_i stage (O_i leaves, and for kv_outer
comes back, through it with the same row copies as the CUDA-core path) takes their place
after the last tile, or for kv_outer lies after them, with kv_outer's l_i, m_i rows.

Masked keys (past N_k, past Bc, or outside the row's span under a mask, `core.mask`) get
weight exactly 0, and V_j's
rows past the tile are zero, so 0 x V adds nothing; a NaN or inf in a *visible-but-masked* V row
would still reach the output through 0 x NaN, unlike the CUDA-core path, which skips masked
keys (float16 inputs only carry what float16 holds; the NaN tests run in float32).

P is rounded to 16 bits before P V_j (l_i sums the unrounded weights, as FlashAttention-2
does): one more rounding of 2^-11 (float16) or 2^-8 (bfloat16) of max|V| in the output.

TF32 (`TensorCores("tf32")`, float32 inputs at precision "tf32"): the same loop on mma.sync
m16n8k8 over float32 tiles (cp.async 4 floats a copy), fragments by plain shared loads
(ldmatrix moves 16-bit rows), the strides padded for them (`tc_shared_layout`). P V_j takes
P's A fragment straight from the S accumulators by reading its 8 keys in the order the lanes
hold them (`make_tc_operands`, accumulate_tf32). The hardware reads each float32 operand's
top 19 bits: Q, K, P and V each lose up to 2^-10 of themselves (`reference.tf32_tolerance`).

3xTF32 (`TensorCores("tf32x3")`, precision "tf32x3", what SDPA's efficient backend does with
float32 inputs): the same loop, each operand x split in registers into a TF32 head
h = round(x) and tail x - h (exact), and each product taken as three, tail x head +
head x tail + head x head; only tail x tail (2^-22 of the product) and the tails' own TF32
truncation (2^-21 each) are lost, about float32's accuracy for three times the mma.

Hopper (`TensorCores(dtype, stages, wgmma=True)`, 16-bit inputs on sm_90a where `hopper.supports`
the tiles): the same loop with its two products on wgmma, a warpgroup of four warps taking
64 rows, the operands read by the tensor cores from shared memory in swizzled tiles
(`hopper`); the fragments, and so all the rest, are the same. Pipelined (q_outer's stream),
K/V come through a ring of buffers with mbarriers and the warpgroups take turns at the
tensor cores (`hopper.make_stage_ring`).
"""

from __future__ import annotations

import math
from functools import cache, partial
from typing import NamedTuple

import numpy as np
from numba import float32, uint16, uint32, uint64

from ..core.mask import Mask
from ..device import tensor_map
from ..device.intrinsics import (
    cp_async_wait_all,
    exp2,
    ldmatrix_x4,
    ldmatrix_x4_trans,
    mma_bf16,
    mma_f16,
    mma_tf32,
    narrow,
    pack_bf16x2,
    pack_f16x2,
    shfl_xor,
    tf32_round,
)
from ..device.runtime import SIMULATOR, cuda, data_pointer, inlined
from . import hopper
from .persistent import persistent_grid, tickets
from .spec import DATA_REGISTERS, MicroKernel
from .tiles import (
    make_lse_of,
    make_reciprocal,
    make_row_copier,
    make_tile_loader,
    make_tile_storer,
    make_visible,
    unrolled,
)

NEG_INF = float32(-math.inf)
WARP_ROWS = 16  # query rows of one warp: the m of m16n8k16


class TensorCores(NamedTuple):
    """The tensor-core micro-kernel for one operand type with `stages` K/V buffers: 'float16'
    or 'bfloat16' inputs (m16n8k16), or float32 inputs on m16n8k8 TF32: 'tf32' (each operand
    as TF32, the opt-in `precision="tf32"`) or 'tf32x3' (each operand split into a TF32 head
    and tail, three products: about float32's accuracy, `precision="tf32x3"`): the
    counterpart of `cuda_cores.Layout` (which picks the CUDA-core one)."""

    dtype: str
    stages: int = 1
    wgmma: bool = False  # the products on Hopper's wgmma (`hopper`), else on mma.sync
    # wgmma with two K/V buffers: P V_j issued a tile behind, under the next softmax
    # (`MicroKernel.PIPELINED`)
    pipelined: bool = False
    # pipelined, the ring filled by a producer warpgroup's TMA copies (`hopper.
    # make_tma_producer`) instead of every computing thread's cp.async
    producer: bool = False
    # a causal grid's heads taken this many at a time, heaviest blocks first within each
    # group (`tiles.grouped_block`; 0: first over every head), where the loop nest reads it
    causal_heads: int = 0
    # with a producer: a CTA an SM, folding query blocks in turn (`persistent`), the producer
    # copying the next block's Q_i and first K/V tiles under the last block's end
    persistent: bool = False

    @property
    def tf32(self) -> bool:
        """float32 tiles multiplied on m16n8k8 TF32 (one product or three)."""
        return self.dtype in ("tf32", "tf32x3")

    @property
    def split(self) -> bool:
        """Each float32 operand as a TF32 head and tail, three products (3xTF32)."""
        return self.dtype == "tf32x3"

    @property
    def k_buffers(self) -> int:
        """K_j buffers in shared memory: the pipelined ring's (`hopper.make_stage_ring`), or
        `stages`."""
        return hopper.K_BUFFERS if self.pipelined else self.stages

    @property
    def v_buffers(self) -> int:
        """V_j buffers: the pipelined ring's, or `stages`."""
        return hopper.V_BUFFERS if self.pipelined else self.stages

    @property
    def itemsize(self) -> int:
        """Bytes of a tile element in shared memory (the inputs' own)."""
        return 4 if self.tf32 else 2

    @property
    def per_copy(self) -> int:
        """Elements one 16-byte cp.async copies."""
        return 16 // self.itemsize

    ALIGNED = "qkv"  # the arrays moved 16 bytes at a time where `copies_rows` (`Layout`)
    falls_back = False  # inputs cp.async cannot copy are refused (`check_aligned`)

    def buffer_bytes(self, block_q: int, block_k: int, d: int, dv: int, reload: bool,
                     transpose_q: bool) -> int:
        """Bytes of a CTA's dynamic shared buffer (`tc_shared_layout`; Q_i is never
        transposed here)."""
        return tc_shared_layout(block_q, block_k, d, dv, reload, self).bytes

    def work_grid(self, grid: tuple, args: tuple, p=None) -> tuple[tuple, tuple]:
        """The launch's grid and kernel arguments: a CTA per work item, as given; with a
        producer, the tensor maps of q, k, v (args' first three) after them."""
        if not self.producer:
            return grid, args
        boxes = hopper.tma_boxes(p.block_q, p.block_k, p.d, p.dv)
        maps = tensor_map.maps_for(zip(args[:3], boxes, strict=True))
        if self.persistent:  # a CTA an SM, drawing the work items from a counter in HBM
            return persistent_grid(grid), (*args, maps, tickets())
        return grid, (*args, maps)

    def copies_rows(self, *widths: int) -> bool:
        """Whether rows of these widths arrive by cp.async (whole 16-byte copies; the source
        must then be 16-byte aligned, `check_aligned`), else by plain loads."""
        return all(w % self.per_copy == 0 for w in widths)

    def warps(self, block_q: int) -> int:
        return -(-block_q // WARP_ROWS)

    def threads(self, block_q: int, block_k: int) -> int:
        """The computing warps' threads, and a producer's warpgroup."""
        return 32 * self.warps(block_q) + (hopper.WARPGROUP if self.producer else 0)

    def registers(self, block_k: int, dv: int, reload: bool = False) -> int:
        """The register cap to compile with: 128 (two CTAs of 256 threads per SM) while a
        thread's S (Bc/2) and O (dv/2) accumulators take at most DATA_REGISTERS, else 255.
        Uncapped, q_outer float16 at d = 64 takes 130 registers and one CTA an SM
        (measured: results/tuning_history/micro_kernel.md). TF32's
        scalar fragment loads need more (kv_outer spills under 128); 3xTF32's fit in a loop
        nest that writes O_i once (q_outer at d = 64: 128 registers and 4 bytes spilled, by
        ptxas) but not in one that reloads it (`reload`: kv_outer spills 56 bytes)."""
        data = _up(block_k, 16) // 2 + _up(dv, 16) // 2
        fits = not self.tf32 or (self.split and not reload)
        return 128 if data <= DATA_REGISTERS and fits else 255

    def __str__(self) -> str:
        kind = {"float16": "f16", "bfloat16": "bf16"}.get(self.dtype, self.dtype)
        return ("wgmma." if self.wgmma else "mma.") + kind + (
            "" if self.stages == 1 else f"x{self.stages}") + (
                ".pipelined" if self.pipelined else "") + (".tma" if self.producer else "") + (
                    ".persistent" if self.persistent else "") + (
                        f".heads{self.causal_heads}" if self.causal_heads else "")


def warp_exchanges_per_tile(spec: TensorCores, block_k: int, d: int, dv: int) -> int:
    """Warp-collective calls (ldmatrix, mma, shuffles) one warp makes per K/V tile: what the
    simulator's emulation costs (`api.simulated_seconds`)."""
    kp = _up(block_k, 16)
    nkt, dvt = kp // 8, _up(dv, 16) // 8
    if spec.wgmma:  # two warpgroup products (a warpgroup exchange: four warps'), 4 shuffles
        return 2 * 4 + 4
    if spec.tf32:  # plain shared loads; an mma (three split) per 8 head dims and 8 keys, 8
        # keys and 8 dims
        products = 3 if spec.split else 1
        return products * (_up(d, 8) // 8 * nkt + nkt * dvt) + 4
    dk = _up(d, 16) // 16
    return dk + dk * nkt // 2 * 3 + 4 + kp // 16 * dvt // 2 * 3


def check_aligned(**arrays) -> None:
    """Refuse an array the tensor-core kernels cannot copy with cp.async, which moves
    16-byte rows from 16-byte aligned addresses (where `TensorCores.copies_rows`)."""
    for name, a in arrays.items():
        if data_pointer(a) % 16:
            raise ValueError(f"{name}: the tensor-core kernels need its data 16-byte aligned, "
                             f"it starts at {data_pointer(a):#x}; copy it")


def _up(n: int, to: int) -> int:
    return -(-n // to) * to


class TcSharedLayout(NamedTuple):
    """The dynamic buffer of one CTA: the input tiles at element offsets (q, k, v, row strides
    qs, ks, vs; 16-bit, or float32 for TF32), then float32 regions at float offsets (o: the
    O_i stage, stride os; stats: kv_outer's l_i, m_i rows)."""

    q: int
    qs: int
    k: int
    ks: int
    v: int
    vs: int
    o: int
    os: int
    stats: int
    size: int  # floats in all
    bars: int  # the pipelined ring's mbarriers (floats), where TensorCores.pipelined

    @property
    def bytes(self) -> int:
        return 4 * self.size


@cache
def tc_shared_layout(BR: int, BC: int, D: int, DV: int, reload: bool,
                     spec: TensorCores) -> TcSharedLayout:
    """Row strides padded so that the lanes of a warp reading their fragments hit 32
    different banks: 16-bit rows 8 elements over whole 16s (ldmatrix's 8 rows); TF32 rows of
    Q and K 4 floats over whole 32s (lane 4 g + t reads row g, column t), V's 4 over whole
    16s (lane 4 g + t reads rows 2 t, 2 t + 1, column g)."""
    rows, keys = _up(BR, WARP_ROWS), _up(BC, 16)
    if spec.wgmma:  # swizzled tiles (`hopper`): no padding, whole 16s of head dims
        qs, ks, vs = D, D, DV
    elif spec.tf32:
        qs, ks, vs = _up(D, 32) + 4, _up(D, 32) + 4, _up(DV, 16) + 4
    else:
        qs, ks, vs = _up(D, 16) + 8, _up(D, 16) + 8, _up(DV, 16) + 8
    k = rows * qs
    v = k + spec.k_buffers * keys * ks
    if spec.wgmma:  # a swizzled tile starts where the pattern does (`hopper.ALIGN` bytes)
        v = _up(v, hopper.ALIGN // spec.itemsize)
    elements = v + spec.v_buffers * keys * vs
    tiles = _up(-(-elements * spec.itemsize // 4), 4)  # floats, 16-byte aligned
    os = _up(DV, 4)
    # kv_outer's O_i comes back at every visit, beside the tiles; a loop nest that writes O_i
    # once, after its last tile, stages it where the tiles were
    o = tiles if reload else 0
    stats = o + rows * os
    size = max(tiles, stats) + (2 * rows if reload else 0)
    # the pipelined ring's mbarriers (8 bytes each), past all else
    bars = _up(size, 2)
    if spec.pipelined:
        size = bars + 2 * (hopper.RING_BARRIERS
                           + (hopper.QUEUE_BARRIERS if spec.persistent else 0))
    return TcSharedLayout(0, qs, k, ks, v, vs, o, os, stats, size, bars)


class TcOperands(NamedTuple):
    """The matmul half of the tensor-core micro-kernel, which dense's kernels use too: the
    dynamic buffer's 16-bit view, a thread's coordinates, the tile loads into shared memory
    and the two products on fragments (see `make_tc_operands`)."""

    clear: object  # clear(buf): the whole buffer zero (the tiles' padding stays so)
    tiles: object  # tiles() -> the buffer in the tiles' element type
    coords: object  # coords() -> (warp, lane), unsigned
    local_row: object  # local_row(w, lane, a) -> the block row of a lane's half a
    load_q: object  # load_q(src, bh, row0, n_rows): Q_i, or with rows past n_rows zero
    load_k: object  # load_k(src, bh, key0, n_keys, stage)
    load_v: object  # load_v(src, bh, key0, n_keys, stage)
    wait_loads: object  # wait_loads(): this thread's cp.async copies have landed
    scores: object  # scores(tile, s, w, lane, k_at): s = Q_i K_j^T of the warp's rows
    accumulate: object  # accumulate(tile, s, acc, lane, v_at): acc += P V_j, P from s


class TcBasics(NamedTuple):
    """The buffer and a thread's place (`make_tc_basics`): the `TcOperands` fields of the
    same names."""

    clear: object
    tiles: object
    coords: object
    local_row: object


@cache
def make_tc_basics(BR: int, BC: int, D: int, DV: int, SPEC: TensorCores,
                   RELOAD: bool = False) -> TcBasics:
    """The buffer `tc_shared_layout(BR, BC, D, DV, RELOAD, SPEC)` cleared and viewed in the
    tiles' element type, and a thread's (warp, lane) and rows, for W = ceil(Br / 16) warps."""
    NT = 32 * -(-BR // WARP_ROWS)
    sm = tc_shared_layout(BR, BC, D, DV, RELOAD, SPEC)
    ELEMENT = _tile_type("float32" if SPEC.tf32 else SPEC.dtype)
    ALIGN = hopper.buffer_align(SPEC)  # as the kernel's own view of the buffer

    @cuda.jit(device=True)
    def clear(buf):
        for e in range(cuda.threadIdx.x, sm.size, NT):
            buf[e] = float32(0.0)

    @cuda.jit(device=True, inline="always")
    def tiles():
        """The buffer in the tiles' element type (dynamic shared arrays alias)."""
        if SPEC.wgmma:  # swizzled tiles from a pattern's start
            return cuda.shared.array(0, ELEMENT, alignment=ALIGN)
        return cuda.shared.array(0, ELEMENT)

    @inlined
    def coords():
        """(warp, lane) of this thread, unsigned."""
        t = uint32(cuda.threadIdx.x)
        return t // uint32(32), t % uint32(32)

    @inlined
    def local_row(w, lane, a):
        return w * uint32(WARP_ROWS) + (lane >> uint32(2)) + uint32(8 * a)

    return TcBasics(clear, tiles, coords, local_row)


class TcLoads(NamedTuple):
    """The tiles' loads into shared memory (`make_tc_loads`): the `TcOperands` fields of the
    same names."""

    load_q: object
    load_k: object
    load_v: object
    wait_loads: object


@cache
def make_tc_tile_loader(R: int, C: int, AT: int, S: int, STAGE: int, NT: int, PER: int,
                        VEC: bool, tiles):
    """load(src, bh, row0, n_rows, stage): rows row0 .. row0 + R - 1 of src[bh] (columns
    < C) into the tile at AT + stage STAGE of the buffer `tiles()`, stride S, by NT threads;
    rows past n_rows become zero. VEC: by cp.async, PER elements a 16-byte copy (every tile
    of the kernel in whole copies: `TensorCores.copies_rows`), else by plain loads. Returns
    the elements this thread counts (thread 0 counts the tile)."""
    if VEC:
        copy_rows = make_row_copier(R, C, S, NT, PER)

        @inlined
        def load(src, bh, row0, n_rows, stage):
            at = uint64(AT) + uint64(stage) * uint64(STAGE)
            return copy_rows(tiles(), at, src, bh, row0, n_rows)  # HBM -> shared, 16 B a copy

        return load

    @inlined
    def load_plain(src, bh, row0, n_rows, stage):
        tile = tiles()
        t = uint32(cuda.threadIdx.x)
        at = uint64(AT) + uint64(stage) * uint64(STAGE)
        for e in range(t, R * C, NT):
            r, c = uint32(e) // uint32(C), uint32(e) % uint32(C)
            x = src[bh, row0 + r, c] if r < uint32(n_rows) else 0
            tile[at + uint64(r) * uint64(S) + uint64(c)] = x
        return n_rows * C if t == 0 else 0

    return load_plain


@cache
def make_wgmma_tile_loader(R: int, C: int, AT: int, STAGE: int, NT: int, tiles):
    """load(src, bh, row0, n_rows, stage): as `make_tc_tile_loader`'s, into a swizzled tile
    (`hopper.make_swizzled_copier`) for the wgmma products."""
    copy_rows = hopper.make_swizzled_copier(R, C, NT)

    @inlined
    def load(src, bh, row0, n_rows, stage):
        at = uint64(AT) + uint64(stage) * uint64(STAGE)
        return copy_rows(tiles(), at, src, bh, row0, n_rows)  # HBM -> shared, 16 B a copy

    return load


@cache
def make_tc_loads(BR: int, BC: int, D: int, DV: int, SPEC: TensorCores,
                  RELOAD: bool = False) -> TcLoads:
    """Q_i, K_j and V_j from HBM into their tiles (`make_tc_tile_loader`)."""
    NT = 32 * -(-BR // WARP_ROWS)
    KP = _up(BC, 16)  # keys of a tile, padded
    VEC = SPEC.copies_rows(D, DV)  # rows in whole 16-byte copies
    sm = tc_shared_layout(BR, BC, D, DV, RELOAD, SPEC)
    tiles = make_tc_basics(BR, BC, D, DV, SPEC, RELOAD).tiles

    def make_loader(R: int, C: int, AT: int, S: int, STAGE: int):
        if C == 0:
            return None  # a kernel of one product (dense's) has no such tile
        if SPEC.wgmma:
            return make_wgmma_tile_loader(R, C, AT, STAGE, NT, tiles)
        return make_tc_tile_loader(R, C, AT, S, STAGE, NT, SPEC.per_copy, VEC, tiles)

    load_q_tile = make_loader(BR, D, sm.q, sm.qs, 0)

    @inlined
    def load_q(src, bh, row0, n_rows):
        return load_q_tile(src, bh, row0, n_rows, 0)

    @inlined
    def wait_loads():
        if SPEC.wgmma:
            hopper.wait_loads()  # landed, and seen by wgmma once the barrier shares them
        elif VEC:
            cp_async_wait_all()  # this thread's copies have landed (the barrier then shares)

    # K_STAGE, V_STAGE: elements between K/V buffers
    return TcLoads(load_q, make_loader(BC, D, sm.k, sm.ks, KP * sm.ks),
                   make_loader(BC, DV, sm.v, sm.vs, KP * sm.vs), wait_loads)


class TcProducts(NamedTuple):
    """The two products on fragments (`make_tc_mma16`, `make_tf32_scores` and
    `make_tf32_accumulate`): the `TcOperands` fields of the same names."""

    scores: object
    accumulate: object


@cache
def make_tc_mma16(BR: int, BC: int, D: int, DV: int, SPEC: TensorCores,
                  RELOAD: bool = False) -> TcProducts:
    """S = Q_i K_j^T and acc += P V_j on m16n8k16 (float16 or bfloat16), operands by
    ldmatrix."""
    KP = _up(BC, 16)  # keys of a tile, padded
    DK = _up(D, 16) // 16  # k-steps of S = Q K^T (16 head dims)
    NKT = KP // 8  # 8-key n-tiles of S
    DVT = _up(DV, 16) // 8  # 8-dim n-tiles of O
    NS = 4 * NKT  # a thread's scores
    sm = tc_shared_layout(BR, BC, D, DV, RELOAD, SPEC)
    Q, QS, KS, VS = sm.q, sm.qs, sm.ks, sm.vs
    BF16 = SPEC.dtype == "bfloat16"
    mma = mma_bf16 if BF16 else mma_f16
    pack = pack_bf16x2 if BF16 else pack_f16x2

    @inlined
    def scores(tile, s, w, lane, k_at):
        """s = Q_i K_j^T of the warp's 16 rows: n-tile n of 8 keys in s[4 n .. 4 n + 3]."""
        for e in range(NS):
            s[e] = float32(0.0)
        q_row = uint64(Q) + uint64(w * uint32(WARP_ROWS) + (lane & uint32(15))) * uint64(QS)
        q_col = uint64(8) * uint64(lane >> uint32(4))
        k_row = uint64(8 * (lane >> uint32(4)) + (lane & uint32(7)))
        k_col = uint64(8) * uint64((lane >> uint32(3)) & uint32(1))
        for kk in range(DK):
            a0, a1, a2, a3 = ldmatrix_x4(tile, q_row + q_col + uint64(16 * kk))
            for n2 in range(NKT // 2):
                b = ldmatrix_x4(tile, k_at + (k_row + uint64(16 * n2)) * uint64(KS)
                                + k_col + uint64(16 * kk))
                for h in range(2):
                    n = 2 * n2 + h
                    s[4 * n], s[4 * n + 1], s[4 * n + 2], s[4 * n + 3] = mma(
                        a0, a1, a2, a3, b[2 * h], b[2 * h + 1],
                        s[4 * n], s[4 * n + 1], s[4 * n + 2], s[4 * n + 3])

    @inlined
    def accumulate(tile, s, acc, lane, v_at):
        """acc += P V_j, P's A fragment packed from the weights in s."""
        v_row = uint64((lane & uint32(7)) + uint32(8) * ((lane >> uint32(3)) & uint32(1)))
        v_col = uint64(8) * uint64(lane >> uint32(4))
        for kk in range(KP // 16):
            p0 = pack(s[8 * kk], s[8 * kk + 1])
            p1 = pack(s[8 * kk + 2], s[8 * kk + 3])
            p2 = pack(s[8 * kk + 4], s[8 * kk + 5])
            p3 = pack(s[8 * kk + 6], s[8 * kk + 7])
            for n2 in range(DVT // 2):
                b = ldmatrix_x4_trans(tile, v_at + (v_row + uint64(16 * kk)) * uint64(VS)
                                      + v_col + uint64(16 * n2))
                for h in range(2):
                    n = 2 * n2 + h
                    acc[4 * n], acc[4 * n + 1], acc[4 * n + 2], acc[4 * n + 3] = mma(
                        p0, p1, p2, p3, b[2 * h], b[2 * h + 1],
                        acc[4 * n], acc[4 * n + 1], acc[4 * n + 2], acc[4 * n + 3])

    return TcProducts(scores, accumulate)


class Tf32Mma(NamedTuple):
    """TF32 operands and their product (`make_tf32_mma`)."""

    tf32_operand: object  # tf32_operand(x) -> (head, tail)
    mma_f32: object  # mma_f32(a0 .. a3, b0, b1, c0 .. c3): C + A B from (head, tail) operands


@cache
def make_tf32_mma(SPLIT: bool) -> Tf32Mma:
    """The m16n8k8 TF32 product, one (TF32) or three (SPLIT: 3xTF32) a step."""

    @inlined
    def tf32_operand(x):
        """A float32 operand as (head, tail): split (tf32x3) into its TF32 head and the tail
        x - head (exact; the hardware keeps the tail's top 19 bits), else x itself, whose
        top 19 bits the hardware reads as TF32, with no tail."""
        if SPLIT:
            head = tf32_round(x)
            return head, x - head
        return x, float32(0.0)

    @inlined
    def mma_f32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """C + A B on m16n8k8 TF32 from (head, tail) operands (`tf32_operand`; fragments as
        mma_tf32's): split, three products, the two small cross terms first (tail x head,
        head x tail; only tail x tail is dropped, 2^-22 of the product), then head x head."""
        if SPLIT:
            c0, c1, c2, c3 = mma_tf32(a0[1], a1[1], a2[1], a3[1], b0[0], b1[0], c0, c1, c2, c3)
            c0, c1, c2, c3 = mma_tf32(a0[0], a1[0], a2[0], a3[0], b0[1], b1[1], c0, c1, c2, c3)
        return mma_tf32(a0[0], a1[0], a2[0], a3[0], b0[0], b1[0], c0, c1, c2, c3)

    return Tf32Mma(tf32_operand, mma_f32)


@cache
def make_tf32_scores(BR: int, BC: int, D: int, DV: int, SPEC: TensorCores,
                     RELOAD: bool = False):
    """scores(tile, s, w, lane, k_at): s = Q_i K_j^T on m16n8k8 TF32 (`TcOperands.scores`)."""
    D8 = _up(D, 8) // 8  # TF32's k-steps (8 head dims)
    NKT = _up(BC, 16) // 8  # 8-key n-tiles of S
    NS = 4 * NKT  # a thread's scores
    sm = tc_shared_layout(BR, BC, D, DV, RELOAD, SPEC)
    Q, QS, KS = sm.q, sm.qs, sm.ks
    tm = make_tf32_mma(SPEC.split)
    tf32_operand, mma_f32 = tm.tf32_operand, tm.mma_f32

    @inlined
    def scores_ntile(n, a0, a1, a2, a3, tile, s, k_at):
        """s's n-tile n (keys 8 n .. 8 n + 7) += Q_i's A fragment a0 .. a3 times K_j's B
        fragment at the same 8 head dims (k_at: lane's key g, head dim t of those)."""
        kb = k_at + uint64(8 * n) * uint64(KS)
        s[4 * n], s[4 * n + 1], s[4 * n + 2], s[4 * n + 3] = mma_f32(
            a0, a1, a2, a3, tf32_operand(tile[kb]), tf32_operand(tile[kb + uint64(4)]),
            s[4 * n], s[4 * n + 1], s[4 * n + 2], s[4 * n + 3])

    # the n-tiles in straight-line code (s is indexed by n: a loop LLVM left rolled, as it
    # does once 3xTF32's three products pass its unroll threshold, sends s to local memory)
    scores_ntiles = unrolled(scores_ntile, NKT, 7, NKT)

    @inlined
    def scores_tf32(tile, s, w, lane, k_at):
        """s = Q_i K_j^T on m16n8k8 TF32: lane 4 g + t gives Q's rows g, g + 8 and K's key g
        at head dims t and t + 4 of each 8 (plain shared loads; each operand split once)."""
        for e in range(NS):
            s[e] = float32(0.0)
        g, t = lane >> uint32(2), lane & uint32(3)
        q_at = uint64(Q) + uint64(w * uint32(WARP_ROWS) + g) * uint64(QS) + uint64(t)
        k_row = k_at + uint64(g) * uint64(KS) + uint64(t)
        for kk in range(D8):
            qa = q_at + uint64(8 * kk)
            a0, a2 = tf32_operand(tile[qa]), tf32_operand(tile[qa + uint64(4)])
            a1 = tf32_operand(tile[qa + uint64(8 * QS)])
            a3 = tf32_operand(tile[qa + uint64(8 * QS + 4)])
            scores_ntiles(a0, a1, a2, a3, tile, s, k_row + uint64(8 * kk))

    return scores_tf32


@cache
def make_tf32_accumulate(BR: int, BC: int, D: int, DV: int, SPEC: TensorCores,
                         RELOAD: bool = False):
    """accumulate(tile, s, acc, lane, v_at): acc += P V_j on m16n8k8 TF32
    (`TcOperands.accumulate`)."""
    NKT = _up(BC, 16) // 8  # 8-key n-tiles of S
    DVT = _up(DV, 16) // 8  # 8-dim n-tiles of O
    NACC = 4 * DVT  # a thread's accumulators of O
    VS = tc_shared_layout(BR, BC, D, DV, RELOAD, SPEC).vs
    SPLIT = SPEC.split
    tm = make_tf32_mma(SPLIT)
    tf32_operand, mma_f32 = tm.tf32_operand, tm.mma_f32

    @inlined
    def accumulate_mtile(m, p0, p1, p2, p3, tile, acc, v_at):
        """acc's n-tile m (dims 8 m .. 8 m + 7) += P's A fragment p0 .. p3 times V_j's B
        fragment of the same 8 keys (v_at: lane's key 2 t, dim g of those)."""
        vb = v_at + uint64(8 * m)
        acc[4 * m], acc[4 * m + 1], acc[4 * m + 2], acc[4 * m + 3] = mma_f32(
            p0, p1, p2, p3, tf32_operand(tile[vb]), tf32_operand(tile[vb + uint64(VS)]),
            acc[4 * m], acc[4 * m + 1], acc[4 * m + 2], acc[4 * m + 3])

    accumulate_mtiles = unrolled(accumulate_mtile, DVT, 7, DVT)  # acc is indexed by m

    @inlined
    def accumulate_ntile(n, tile, s, acc, v_row):
        """acc += P's keys 8 n .. 8 n + 7 times V_j's rows of them: the lane holds keys
        2 t, 2 t + 1 of each 8, so k-index t is key 2 t and t + 4 is key 2 t + 1 (a sum over
        keys in any order), and V's B fragment follows: rows 2 t, 2 t + 1, column g."""
        p0, p1 = tf32_operand(s[4 * n]), tf32_operand(s[4 * n + 2])
        p2, p3 = tf32_operand(s[4 * n + 1]), tf32_operand(s[4 * n + 3])
        accumulate_mtiles(p0, p1, p2, p3, tile, acc, v_row + uint64(8 * n) * uint64(VS))

    accumulate_ntiles = unrolled(accumulate_ntile, NKT, 4, NKT)  # s is indexed by n

    @cuda.jit(device=True, inline="always")
    def accumulate_tf32(tile, s, acc, lane, v_at):
        """acc += P V_j on m16n8k8 TF32, P's A fragment straight from s
        (`accumulate_ntile`). 3xTF32 sums the tile's products apart, from zero, and adds them
        to acc in float32: carried through every tile's mma, acc drifted with the keys (the
        mma's own float32 sums are not float32 adds; in TF32 alone its operand rounding hides
        that; measured: results/tuning_history/micro_kernel.md)."""
        g, t = lane >> uint32(2), lane & uint32(3)
        v_row = v_at + uint64(2 * t) * uint64(VS) + uint64(g)
        if SPLIT:
            acc_j = cuda.local.array(NACC, float32)  # P_ij V_j of this tile alone
            for e in range(NACC):
                acc_j[e] = float32(0.0)
            accumulate_ntiles(tile, s, acc_j, v_row)
            for e in range(NACC):
                acc[e] += acc_j[e]
        else:
            accumulate_ntiles(tile, s, acc, v_row)

    return accumulate_tf32


@cache
def make_tc_operands(BR: int, BC: int, D: int, DV: int, SPEC: TensorCores,
                     RELOAD: bool = False) -> TcOperands:
    """`TcOperands` for a CTA of W = ceil(Br / 16) warps over the buffer
    `tc_shared_layout(BR, BC, D, DV, RELOAD, SPEC)`, from its parts: `make_tc_basics`,
    `make_tc_loads`, and the products of `make_tc_mma16` (16-bit) or `make_tf32_scores` and
    `make_tf32_accumulate` (TF32). A kernel that multiplies only one pair of operands
    (dense's scores, its P V) builds with the other head dim 0."""
    sizes = (BR, BC, D, DV, SPEC, RELOAD)
    base, io = make_tc_basics(*sizes), make_tc_loads(*sizes)
    if SPEC.wgmma:
        sm = tc_shared_layout(BR, BC, D, DV, RELOAD, SPEC)
        wg = hopper.make_wgmma_products(SPEC.dtype, BR, _up(BC, 16), D, DV, sm.q)
        products = TcProducts(wg.scores, wg.accumulate)
    elif SPEC.tf32:
        products = TcProducts(make_tf32_scores(*sizes), make_tf32_accumulate(*sizes))
    else:
        products = make_tc_mma16(*sizes)
    return TcOperands(base.clear, base.tiles, base.coords, base.local_row, io.load_q,
                      io.load_k, io.load_v, io.wait_loads, products.scores, products.accumulate)


class TcTileIO(NamedTuple):
    """The tiles between HBM and shared memory (`make_tc_tile_io`): the
    `cuda_cores.MicroKernel` fields of the same names."""

    load_q: object
    load_k: object
    load_v: object
    load_o: object
    store_o: object


@cache
def make_tc_tile_io(BR: int, BC: int, D: int, DV: int, SPEC: TensorCores,
                    RELOAD: bool) -> TcTileIO:
    """The micro-kernel's tile loads (`make_tc_loads`' with its signatures) and O_i's
    between HBM and the float32 O_i stage."""
    NT = 32 * -(-BR // WARP_ROWS)
    sm = tc_shared_layout(BR, BC, D, DV, RELOAD, SPEC)
    O, OS = sm.o, sm.os  # noqa: E741
    io = make_tc_loads(BR, BC, D, DV, SPEC, RELOAD)
    load_q_tile, load_k_tile, load_v_tile = io.load_q, io.load_k, io.load_v
    load_o_stage = make_tile_loader(BR, DV, NT, (O, OS))
    store_o_stage = make_tile_storer(BR, DV, NT, (O, OS))

    @inlined
    def load_q(buf, q, bh, row0, n_rows, scale_log2):
        return load_q_tile(q, bh, row0, n_rows)

    @inlined
    def load_k(buf, k, bh, key0, n_keys, stage):
        return load_k_tile(k, bh, key0, n_keys, stage)

    @inlined
    def load_v(buf, v, bh, key0, n_keys, stage):
        return load_v_tile(v, bh, key0, n_keys, stage)

    @inlined
    def load_o(buf, o, bh, row0, n_rows):
        return load_o_stage(buf, o, bh, row0, n_rows, 0, DV)

    @inlined
    def store_o(buf, o, bh, row0, n_rows):
        return store_o_stage(buf, o, bh, row0, n_rows, 0, DV)

    return TcTileIO(load_q, load_k, load_v, load_o, store_o)


class TcScaling(NamedTuple):
    """A row half's scores scaled and its max (`make_tc_scaling`)."""

    row_max4: object  # row_max4(x): max over the 4 lanes of a row
    scale_row: object  # scale_row(s, a, scale_log2) -> the row half's max
    scale_row_masked: object  # scale_row_masked(s, a, scale_log2, vis, t2): masked too


@cache
def make_tc_scaling(NKT: int, LEFT: bool = False) -> TcScaling:
    """The scaling of a thread's NKT n-tiles of scores, row half by row half. LEFT: a row's
    span of keys may start after the tile's first key (a mask bounded on the left)."""

    @inlined
    def row_max4(x):
        """Max over the 4 lanes of a row."""
        x = max(x, shfl_xor(x, 1))
        return max(x, shfl_xor(x, 2))

    @inlined
    def scale_row(s, a, scale_log2):
        """Row half a of the warp's scores times scale log2(e), in place; their max."""
        part = NEG_INF
        for n in range(NKT):
            for c in range(2):
                x = s[4 * n + 2 * a + c] * scale_log2
                s[4 * n + 2 * a + c] = x
                part = max(part, x)
        return part

    @inlined
    def scale_row_masked(s, a, scale_log2, first, end, t2):
        """scale_row, with -inf (weight 0) for the keys outside [first, end) in the tile
        (past N_k, padding, or outside the row's span under a mask; their scores may be
        garbage)."""
        part = NEG_INF
        for n in range(NKT):
            for c in range(2):
                x = s[4 * n + 2 * a + c] * scale_log2
                col = int(uint32(8 * n + c) + t2)
                if col >= end or (LEFT and col < first):
                    x = NEG_INF
                s[4 * n + 2 * a + c] = x
                part = max(part, x)
        return part

    return TcScaling(row_max4, scale_row, scale_row_masked)


@cache
def make_whole_tile(KP: int, MASK: Mask):
    """whole_tile(n_keys, key0, diag): whether the warp's 16 rows (the first's diagonal key
    diag) all see every key of a tile of KP keys (no tail or padding keys, none outside a
    row's span): most tiles, most of the instructions, then need no per-key test."""
    visible = make_visible(MASK)
    BOUNDED = MASK.bounded

    @inlined
    def whole_tile(n_keys, key0, diag):
        if not BOUNDED:
            return n_keys == KP
        return (n_keys == KP and visible(diag, key0, n_keys)[1] == KP
                and visible(diag + WARP_ROWS - 1, key0, n_keys)[0] == 0)

    return whole_tile


@cache
def make_tc_online_update(BR: int, BC: int, D: int, DV: int, SPEC: TensorCores,
                          MASK: Mask, RELOAD: bool):
    """online_update(buf, n_keys, key0, diag0, m, l, acc, scale_log2, stage): K_j, V_j
    folded into the warp's rows (`cuda_cores.MicroKernel.online_update`; diag0 the diagonal
    key of the block's first row, the keys a row sees from `tiles.make_visible`)."""
    KP = _up(BC, 16)  # keys of a tile, padded
    NKT = KP // 8  # 8-key n-tiles of S
    DVT = _up(DV, 16) // 8  # 8-dim n-tiles of O
    NS = 4 * NKT  # a thread's scores
    sm = tc_shared_layout(BR, BC, D, DV, RELOAD, SPEC)
    K, V = sm.k, sm.v
    K_STAGE, V_STAGE = KP * sm.ks, KP * sm.vs  # elements between K/V buffers
    ops = make_tc_operands(BR, BC, D, DV, SPEC, RELOAD)
    tiles, coords, local_row = ops.tiles, ops.coords, ops.local_row
    scores, accumulate = ops.scores, ops.accumulate
    sc = make_tc_scaling(NKT, MASK.left >= 0)
    row_max4, scale_row, scale_row_masked = sc.row_max4, sc.scale_row, sc.scale_row_masked
    visible = make_visible(MASK)
    whole_tile = make_whole_tile(KP, MASK)

    @cuda.jit(device=True)
    def online_update(buf, n_keys, key0, diag0, m, l, acc, scale_log2, stage):  # noqa: E741
        tile = tiles()
        w, lane = coords()
        t2 = 2 * (lane & uint32(3))
        s = cuda.local.array(NS, float32)
        scores(tile, s, w, lane, uint64(K) + uint64(stage) * uint64(K_STAGE))
        whole = whole_tile(n_keys, key0, diag0 + int(w) * WARP_ROWS)
        for a in range(2):
            if whole:
                part = scale_row(s, a, scale_log2)
            else:
                first, end = visible(diag0 + int(local_row(w, lane, a)), key0, n_keys)
                part = scale_row_masked(s, a, scale_log2, first, end, t2)
            new_max = max(m[a], row_max4(part))
            shift = new_max if new_max > NEG_INF else float32(0.0)  # no key seen: 2^-inf = 0
            alpha = exp2(m[a] - shift)
            m[a] = new_max
            l[a] *= alpha
            for n in range(DVT):
                acc[4 * n + 2 * a] *= alpha
                acc[4 * n + 2 * a + 1] *= alpha
            for n in range(NKT):
                for c in range(2):
                    p = exp2(s[4 * n + 2 * a + c] - shift)
                    l[a] += p
                    s[4 * n + 2 * a + c] = p
        accumulate(tile, s, acc, lane, uint64(V) + uint64(stage) * uint64(V_STAGE))

    return online_update


class TcPipelined(NamedTuple):
    """online_update with P V_j a tile behind (`make_tc_pipelined_update`): the
    `MicroKernel` fields of the same names."""

    weigh_first: object
    weigh_ahead: object
    fold_last: object
    ring: object  # the K/V loop's buffers and turns (`hopper.StageRing`)
    # producer(COUNT): the producer's copies into the ring (`hopper.make_tma_producer`),
    # where SPEC.producer, else None; persistent, producer(COUNT, items, kv_blocks, kv_head)
    # (`hopper.make_tma_persistent_producer`)
    producer: object


@cache
def make_tc_pipelined_update(BR: int, BC: int, D: int, DV: int, SPEC: TensorCores,
                             MASK: Mask) -> TcPipelined:
    """weigh_ahead and fold_last (`MicroKernel.PIPELINED`) on Hopper's wgmma: on the
    warpgroup's turn, S_ij issued, then P_i,j-1 V_j-1 behind it; S_ij's softmax while that
    product runs; acc rescaled once it has landed; K_j and V_j-1 released as their products
    land (`hopper.make_stage_ring`)."""
    KP = _up(BC, 16)  # keys of a tile, padded
    NKT = KP // 8  # 8-key n-tiles of S
    DVT = _up(DV, 16) // 8  # 8-dim n-tiles of O
    NS = 4 * NKT  # a thread's scores
    sm = tc_shared_layout(BR, BC, D, DV, False, SPEC)
    K, V = sm.k, sm.v
    K_STAGE, V_STAGE = KP * sm.ks, KP * sm.vs  # elements between K/V buffers
    base = make_tc_basics(BR, BC, D, DV, SPEC)
    tiles, coords, local_row = base.tiles, base.coords, base.local_row
    wg = hopper.make_wgmma_products(SPEC.dtype, BR, KP, D, DV, sm.q)
    ring = hopper.make_stage_ring(sm.bars, 32 * -(-BR // WARP_ROWS), SPEC.producer,
                                  SPEC.persistent)
    take_turn, pass_turn, k_free, v_free = ring.take_turn, ring.pass_turn, ring.k.free, \
        ring.v.free
    scores_ahead, accumulate_ahead = wg.scores_ahead, wg.accumulate_ahead
    wait_scores, wait_accumulate, accumulate = wg.wait_scores, wg.wait_accumulate, wg.accumulate
    sc = make_tc_scaling(NKT, MASK.left >= 0)
    row_max4, scale_row, scale_row_masked = sc.row_max4, sc.scale_row, sc.scale_row_masked
    visible = make_visible(MASK)
    whole_tile = make_whole_tile(KP, MASK)

    @inlined
    def weights(s, n_keys, key0, diag0, m, l, alpha, scale_log2, w, lane):  # noqa: E741
        """The scores in s to weights, the thread's rows' m, l updated, alpha[a] the factor
        their acc takes."""
        t2 = 2 * (lane & uint32(3))
        whole = whole_tile(n_keys, key0, diag0 + int(w) * WARP_ROWS)
        for a in range(2):
            if whole:
                part = scale_row(s, a, scale_log2)
            else:
                first_key, end = visible(diag0 + int(local_row(w, lane, a)), key0, n_keys)
                part = scale_row_masked(s, a, scale_log2, first_key, end, t2)
            new_max = max(m[a], row_max4(part))
            shift = new_max if new_max > NEG_INF else float32(0.0)  # no key seen: 2^-inf = 0
            alpha[a] = exp2(m[a] - shift)
            m[a] = new_max
            l[a] *= alpha[a]
            for n in range(NKT):
                for c in range(2):
                    x = exp2(s[4 * n + 2 * a + c] - shift)
                    l[a] += x
                    s[4 * n + 2 * a + c] = x

    def make_weigh(FIRST: bool):
        """weigh_ahead with a P V_j-1 behind S_ij (FIRST: none, the block's first tile): a
        function each, so that no branch lies between a product's issue and its wait (ptxas
        then serialises every wgmma of the kernel)."""

        @cuda.jit(device=True)
        def weigh(buf, n_keys, key0, diag0, m, l, acc, p, scale_log2,  # noqa: E741
                  k_stage, v_stage):
            tile = tiles()
            w, lane = coords()
            s = cuda.local.array(NS, float32)
            alpha = cuda.local.array(2, float32)
            take_turn()
            scores_ahead(tile, s, w, uint64(K) + uint64(k_stage) * uint64(K_STAGE))
            if not FIRST:  # P_i,j-1 V_j-1, under this tile's softmax
                accumulate_ahead(tile, p, acc, uint64(V) + uint64(v_stage) * uint64(V_STAGE))
            pass_turn()
            wait_scores(s, not FIRST)
            k_free(buf, k_stage)
            weights(s, n_keys, key0, diag0, m, l, alpha, scale_log2, w, lane)
            if not FIRST:
                wait_accumulate(acc)  # P_i,j-1 V_j-1 has landed: acc may be rescaled
                v_free(buf, v_stage)
            for a in range(2):
                for n in range(DVT):
                    acc[4 * n + 2 * a] *= alpha[a]
                    acc[4 * n + 2 * a + 1] *= alpha[a]
            for e in range(NS):
                p[e] = s[e]

        return weigh

    @inlined
    def fold_last(buf, acc, p, v_stage):
        w, lane = coords()
        accumulate(tiles(), p, acc, lane, uint64(V) + uint64(v_stage) * uint64(V_STAGE))

    make_producer = hopper.make_tma_persistent_producer if SPEC.persistent else \
        hopper.make_tma_producer
    producer = partial(make_producer, BR, BC, D, DV, sm.q, K, V, K_STAGE, V_STAGE, ring,
                       tiles) if SPEC.producer else None
    return TcPipelined(make_weigh(True), make_weigh(False), fold_last, ring, producer)


class TcOStage(NamedTuple):
    """O_i and the row statistics through the float32 stage (`make_tc_o_stage`): the
    `cuda_cores.MicroKernel` fields of the same names."""

    give_o: object
    take_o: object
    keep_stats: object


@cache
def make_tc_o_stage(BR: int, BC: int, D: int, DV: int, SPEC: TensorCores,
                    RELOAD: bool) -> TcOStage:
    """O_i into and out of its stage from the accumulator fragments, and kv_outer's l_i,
    m_i rows."""
    ROWS = -(-BR // WARP_ROWS) * WARP_ROWS
    DVT = _up(DV, 16) // 8  # 8-dim n-tiles of O
    sm = tc_shared_layout(BR, BC, D, DV, RELOAD, SPEC)
    O, OS, STATS = sm.o, sm.os, sm.stats  # noqa: E741
    base = make_tc_basics(BR, BC, D, DV, SPEC, RELOAD)
    coords, local_row = base.coords, base.local_row

    @inlined
    def give_o(buf, acc, factor):
        w, lane = coords()
        t2 = 2 * (lane & uint32(3))
        for a in range(2):
            at = uint64(O) + uint64(local_row(w, lane, a)) * uint64(OS)
            for n in range(DVT):
                for c in range(2):
                    x = uint32(8 * n + c) + t2
                    if x < uint32(DV):
                        buf[at + uint64(x)] = acc[4 * n + 2 * a + c] * factor[a]

    @inlined
    def take_o(buf, acc, l, l_row, m):  # noqa: E741
        w, lane = coords()
        t2 = 2 * (lane & uint32(3))
        for a in range(2):
            r = uint64(local_row(w, lane, a))
            l_row[a] = buf[uint64(STATS) + r]
            m[a] = buf[uint64(STATS + ROWS) + r]
            l[a] = l_row[a] if (lane & uint32(3)) == 0 else float32(0.0)  # one partial per row
            for n in range(DVT):
                for c in range(2):
                    x = uint32(8 * n + c) + t2
                    o = buf[uint64(O) + r * uint64(OS) + uint64(x)] if x < uint32(DV) else \
                        float32(0.0)
                    acc[4 * n + 2 * a + c] = o * l_row[a]

    @inlined
    def keep_stats(buf, l_row, m):
        w, lane = coords()
        if (lane & uint32(3)) == 0:
            for a in range(2):
                r = uint64(local_row(w, lane, a))
                buf[uint64(STATS) + r] = l_row[a]
                buf[uint64(STATS + ROWS) + r] = m[a]

    return TcOStage(give_o, take_o, keep_stats)


@cache
def make_tc_o_direct(BR: int, BC: int, D: int, DV: int, SPEC: TensorCores):
    """put_o(buf, o, bh, row0, n_rows, acc, factor) -> elements written: O_i = acc factor straight
    from the accumulator fragments to HBM, no stage (a persistent CTA's: the stage would lie
    under the next block's tiles, which land meanwhile); a thread's two rows, 2 columns of
    each 8 (the lanes of a row fill 16 bytes of it, the L2 gathers a row's sectors)."""
    DVT = _up(DV, 16) // 8  # 8-dim n-tiles of O
    base = make_tc_basics(BR, BC, D, DV, SPEC)
    coords, local_row = base.coords, base.local_row

    @inlined
    def put_o(buf, o, bh, row0, n_rows, acc, factor):
        w, lane = coords()
        t2 = 2 * (lane & uint32(3))
        moved = 0
        for a in range(2):
            r = int(local_row(w, lane, a))
            if r < n_rows:
                for n in range(DVT):
                    for c in range(2):
                        x = uint32(8 * n + c) + t2
                        if x < uint32(DV):
                            # O_i: written to HBM once, normalised
                            o[uint64(bh), uint64(row0 + r), uint64(x)] = narrow(
                                acc[4 * n + 2 * a + c] * factor[a], o)
                            moved += 1
        return moved

    return put_o


class TcRowStats(NamedTuple):
    """A row's statistics over its 4 lanes (`make_tc_row_stats`): the
    `cuda_cores.MicroKernel` fields of the same names."""

    row_sums: object
    store_lse: object


@cache
def make_tc_row_stats(BR: int, BC: int, D: int, DV: int, SPEC: TensorCores,
                      RELOAD: bool, MASKED: bool = False) -> TcRowStats:
    """The full l_i of a thread's two rows, and lse_i to HBM (their reciprocals:
    `tiles.make_reciprocal`; MASKED: lse -inf for a row that saw no key, `tiles.make_lse_of`)."""
    lse_of = make_lse_of(MASKED)
    base = make_tc_basics(BR, BC, D, DV, SPEC, RELOAD)
    coords, local_row = base.coords, base.local_row

    @cuda.jit(device=True)
    def row_sums(buf, l, l_row):  # noqa: E741
        for a in range(2):
            x = l[a] + shfl_xor(l[a], 1)
            l_row[a] = x + shfl_xor(x, 2)

    @inlined
    def store_lse(lse, bh, row0, n_rows, m, l_row):
        w, lane = coords()
        moved = 0
        if (lane & uint32(3)) == 0:
            for a in range(2):
                r = int(local_row(w, lane, a))
                if r < n_rows:
                    # lse_i: the row statistic the backward pass needs, written once
                    lse[bh, row0 + r] = lse_of(m[a], l_row[a])
                    moved += 1
        return moved

    return TcRowStats(row_sums, store_lse)


@cache
def make_tc_micro_kernel(BR: int, BC: int, D: int, DV: int, SPEC: TensorCores,
                         MASK: Mask, RELOAD: bool):
    """The tensor-core micro-kernel's device functions (`cuda_cores.MicroKernel`); `stage`
    arguments pick the K/V buffer (0 .. SPEC.stages - 1). Its parts: `make_tc_operands`,
    `make_tc_tile_io`, `make_tc_online_update`, `make_tc_o_stage` and `make_tc_row_stats`."""
    W = -(-BR // WARP_ROWS)  # warps
    NACC = 4 * (_up(DV, 16) // 8)  # a thread's accumulators (4 per 8-dim n-tile of O)
    sizes = (BR, BC, D, DV, SPEC, RELOAD)
    ops, io = make_tc_operands(*sizes), make_tc_tile_io(*sizes)
    ost, st = make_tc_o_stage(*sizes), make_tc_row_stats(*sizes, MASK.bounded)
    online_update = make_tc_online_update(BR, BC, D, DV, SPEC, MASK, RELOAD)
    ahead = make_tc_pipelined_update(BR, BC, D, DV, SPEC, MASK) if SPEC.pipelined else None
    return MicroKernel(ops.clear, online_update, st.row_sums, ost.give_o,
                       make_reciprocal(2, MASK.bounded),
                       ost.take_o, ost.keep_stats, ops.coords, io.load_q, io.load_k, io.load_v,
                       ops.wait_loads, io.load_o, io.store_o, st.store_lse, 32 * W, 2, NACC,
                       W * WARP_ROWS, tc_shared_layout(*sizes[:4], RELOAD, SPEC).stats,
                       SPEC.stages, PIPELINED=SPEC.pipelined,
                       weigh_first=ahead and ahead.weigh_first,
                       weigh_ahead=ahead and ahead.weigh_ahead,
                       fold_last=ahead and ahead.fold_last, ring=ahead and ahead.ring,
                       producer=ahead and ahead.producer,
                       NS=4 * (_up(BC, 16) // 8))


def _tile_type(dtype: str):
    """The element type of the shared tiles: the inputs' own (bfloat16 as its uint16 bits),
    as a NumPy dtype on the simulator and a Numba type on the GPU."""
    if SIMULATOR:
        return {"float16": np.dtype(np.float16), "bfloat16": np.dtype(np.uint16),
                "float32": np.dtype(np.float32)}[dtype]
    from numba.core import types

    return {"float16": types.float16, "bfloat16": uint16, "float32": float32}[dtype]

