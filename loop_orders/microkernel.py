"""The tile micro-kernel shared by kv_outer and q_outer: a thread's query rows against one K/V tile.

Thread layout (`Layout`). Each thread serves RPT query rows ("rows per thread"), Br / RPT
apart, and each row is served by TPR consecutive threads ("parts"); a part holds a slice of
its rows' head dims in registers: DP = D / TPR dims of Q_i and DVP = DV / TPR dims of the
accumulator, per row. A score is the sum of the parts' partial dot products, combined with
`shfl_xor` between the row's TPR lanes. The two knobs trade the same registers differently:
  * RPT = 2 makes every K/V element read from shared memory feed two rows' FMAs instead of
    one, halving shared-memory loads per FMA (register blocking);
  * TPR = 2 or 4 splits d, so RPT rows of Q_i and of the accumulator still fit in registers.
Under the simulator (no warp shuffles) TPR is 1.

Which dims a part owns (`part_dim`): with D a multiple of 4 TPR, part p owns the 4-wide chunks
p, p + TPR, p + 2 TPR, ... so its shared-memory reads are 16-byte vectors and the parts of a
warp hit different banks; otherwise part p owns dims p, p + TPR, ...

The update, per row and group of keys c (scores pre-scaled by log2 e, so exp is exp2):
    s = Q_i K_c^T;  m' = max(m, max s);  if m' > m: l, acc *= 2^(m - m')   (skipped otherwise)
    l += sum 2^(s - m');  acc += 2^(s - m') V_c
Keys after the query (causal) get weight 0 and are never multiplied into acc, so a NaN in a
masked row of K or V cannot reach the output; a NaN score does reach it (2^NaN = NaN).
The loops over rows, D and DV have compile-time trip counts and unroll, keeping q, acc, m, l
and the scores in registers (their local arrays are only ever indexed by constants).
"""

from __future__ import annotations

import math
import os
from functools import cache
from typing import NamedTuple

from numba import float32, uint32, uint64

from .runtime import SIMULATOR, cuda
from .tiles import make_tile_loader, make_tile_storer


class Layout(NamedTuple):
    """How a CTA's threads cover its Br query rows: RPT rows per thread, TPR threads per row."""

    rpt: int
    tpr: int

    def threads(self, block_q: int) -> int:
        return block_q // self.rpt * self.tpr

    def registers(self, d: int, dv: int) -> int:
        """The register cap to compile with: 128 (two CTAs of 256 threads per SM), or 255 when
        the rows' q and acc slices alone take more than 64 registers."""
        return 255 if self.rpt * (d + dv) // self.tpr > 64 else 128


# Candidates, fastest first as measured on the H200 (results/bench_layouts.csv), each with
# the most registers its rows' q and acc slices may take: (1, 2) at d = 64 (64 registers,
# a 128-register cap); (2, 4) at d = 128, where two rows per thread beat one by 1.5x.
LAYOUT_ORDER = [(Layout(1, 2), 64), (Layout(2, 4), 128), (Layout(2, 2), 128),
                (Layout(1, 4), 64), (Layout(2, 1), 64)]


def thread_layout(d: int, dv: int, block_q: int) -> Layout:
    """The first candidate layout whose rows' q and acc slices fit its register budget,
    whose parts split both head dims into 4-wide chunks, and whose CTA is whole warps (a
    row's lanes then share a warp); else one thread per row. The simulator has no shuffles:
    TPR = 1 there. `LOOP_ORDERS_LAYOUT=RPT,TPR` forces a layout (for tuning; it must still
    be valid, with up to 128 registers of q and acc).
    """
    forced = os.environ.get("LOOP_ORDERS_LAYOUT")
    candidates = [(Layout(*map(int, forced.split(","))), 128)] if forced else LAYOUT_ORDER
    for lay, budget in candidates:
        if lay.tpr > 1 and (SIMULATOR or d % (4 * lay.tpr) or dv % (4 * lay.tpr)
                            or lay.threads(block_q) % 32):
            continue
        if block_q % lay.rpt or lay.rpt * (d + dv) // lay.tpr > budget:
            continue
        return lay
    if forced:
        raise ValueError(f"LOOP_ORDERS_LAYOUT={forced} does not fit d={d}, dv={dv}, "
                         f"block_q={block_q}")
    return Layout(1, 1)


def make_part_dim(width: int, tpr: int):
    """Device function (part, y) -> head dim of the y-th element that `part` owns."""
    vec = width % (4 * tpr) == 0

    @cuda.jit(device=True, inline="always")
    def part_dim(part, y):
        if vec:
            return uint64(((y >> 2) * tpr + part) * 4 + (y & 3))
        return uint64(y * tpr + part)

    return part_dim


@cache
def make_row_io(BR: int, D: int, DV: int, RPT: int, TPR: int, SC: int):  # noqa: N803
    """HBM I/O of a query block's rows (Q_i in; O_i in and out), staged through a shared
    tile of SC rows so that HBM sees whole rows, coalesced, while each thread takes or gives
    only its parts' slices of its RPT rows (row0 + r Br/RPT). Each call is made by every
    thread of the CTA (barriers inside) and returns the elements this thread moved."""
    q_dim = make_part_dim(D, TPR)
    v_dim = make_part_dim(DV, TPR)
    DP, DVP = D // TPR, DV // TPR  # noqa: N806
    RS = BR // RPT  # noqa: N806
    NT = BR // RPT * TPR  # noqa: N806
    load_q_chunk = make_tile_loader(SC, D, NT)
    load_o_chunk = make_tile_loader(SC, DV, NT)
    store_o_chunk = make_tile_storer(SC, DV, NT)

    @cuda.jit(device=True, inline="always")
    def chunk_row(row0, r, chunk0, n):
        """Row r's index in the chunk of n rows from chunk0, or -1 if it is not there."""
        local = row0 + r * RS - chunk0
        return local if 0 <= local < n else -1

    @cuda.jit(device=True, inline="always")
    def take_q(q_rows, r, stage, local, part):
        if local >= 0:
            for y in range(DP):
                q_rows[r * DP + y] = stage[local, q_dim(part, y)]

    @cuda.jit(device=True, inline="always")
    def take_o(acc, r, stage, local, part, factor):
        if local >= 0:
            for y in range(DVP):
                acc[r * DVP + y] = stage[local, v_dim(part, y)] * factor

    @cuda.jit(device=True, inline="always")
    def give_o(stage, acc, r, local, part, l_r):
        if local >= 0:
            factor = float32(1.0) / l_r
            for y in range(DVP):
                stage[local, v_dim(part, y)] = acc[r * DVP + y] * factor

    @cuda.jit(device=True)
    def load_q(q_rows, stage, q, bh, block0, row0, part):
        moved = 0
        end = min(block0 + BR, q.shape[1])
        for chunk0 in range(block0, end, SC):
            n = min(SC, end - chunk0)
            cuda.syncthreads()  # every thread is done with the stage's previous contents
            moved += load_q_chunk(stage, q, bh, chunk0, n, 0, D)
            cuda.syncthreads()  # the chunk of Q_i is in shared memory
            take_q(q_rows, 0, stage, chunk_row(row0, 0, chunk0, n), part)
            if RPT == 2:
                take_q(q_rows, 1, stage, chunk_row(row0, 1, chunk0, n), part)
        return moved

    @cuda.jit(device=True)
    def load_o(acc, stage, o, bh, block0, row0, part, l):  # noqa: E741
        """acc = O_i l_i: the unnormalised accumulator back from the stored O_i."""
        moved = 0
        end = min(block0 + BR, o.shape[1])
        for chunk0 in range(block0, end, SC):
            n = min(SC, end - chunk0)
            cuda.syncthreads()  # every thread is done with the stage's previous contents
            moved += load_o_chunk(stage, o, bh, chunk0, n, 0, DV)
            cuda.syncthreads()  # the chunk of O_i is in shared memory
            take_o(acc, 0, stage, chunk_row(row0, 0, chunk0, n), part, l[0])
            if RPT == 2:
                take_o(acc, 1, stage, chunk_row(row0, 1, chunk0, n), part, l[1])
        return moved

    @cuda.jit(device=True)
    def store_o(o, stage, acc, bh, block0, row0, part, l):  # noqa: E741
        """O_i = acc / l_i."""
        moved = 0
        end = min(block0 + BR, o.shape[1])
        for chunk0 in range(block0, end, SC):
            n = min(SC, end - chunk0)
            cuda.syncthreads()  # every thread is done with the stage's previous contents
            give_o(stage, acc, 0, chunk_row(row0, 0, chunk0, n), part, l[0])
            if RPT == 2:
                give_o(stage, acc, 1, chunk_row(row0, 1, chunk0, n), part, l[1])
            cuda.syncthreads()  # the chunk of O_i is complete in shared memory
            moved += store_o_chunk(stage, o, bh, chunk0, n, 0, DV)
        return moved

    return load_q, load_o, store_o


@cuda.jit(device=True, inline="always")
def lane_mask(tpr):
    """The TPR lanes that own one row: shuffles name only them, so rows of a warp may
    diverge (causal masks differ per row) without a shuffle waiting on another row's lanes."""
    return uint32((1 << tpr) - 1) << uint32(cuda.laneid & (32 - tpr))


@cuda.jit(device=True, inline="always")
def sum_parts(x, tpr):
    """Sum a value over the TPR threads that own one row (a butterfly over their lanes)."""
    if tpr >= 2:
        x += cuda.shfl_xor_sync(lane_mask(tpr), x, 1)
    if tpr == 4:
        x += cuda.shfl_xor_sync(lane_mask(tpr), x, 2)
    return x


@cuda.jit(device=True, inline="always")
def share_from_part0(x, tpr):
    """Part 0's value of x, for every part of the row (part 0 alone loads row statistics)."""
    if tpr >= 2:
        x = cuda.shfl_sync(lane_mask(tpr), x, cuda.laneid & (32 - tpr))
    return x


@cache
def make_online_update(D: int, DV: int, RPT: int, RS: int, TPR: int, CAUSAL: bool):  # noqa: N803
    """Fold one K/V tile into the (m, l, acc) of a thread's RPT rows, row0 + r RS.

    Keys go four at a time: four independent FMA chains per row share each q element, the
    RPT rows share each K and V element loaded from shared memory, one max check covers four
    keys per row, and acc takes four rank-1 updates per element. The n_keys % 4 leftover keys
    go one at a time. Loop bounds depend only on n_keys, the same for all threads, so every
    shuffle is reached by all parts of a row.

    The steps for row 1 are written out after those for row 0 (`if RPT == 2`), not looped:
    a loop over r with shuffles and exp2 inside would not unroll, and a runtime r would put
    acc and the scores in local memory instead of registers.
    """
    assert RPT in (1, 2), "a thread serves one or two query rows"
    q_dim = make_part_dim(D, TPR)
    v_dim = make_part_dim(DV, TPR)
    DP, DVP = D // TPR, DV // TPR  # noqa: N806
    NS = 4 * RPT  # noqa: N806 - scores in flight: four keys for each row
    NEG_INF = float32(-math.inf)  # noqa: N806

    @cuda.jit(device=True, inline="always")
    def visible(row0, r, key0, n_keys):
        """How many of the tile's keys row r sees: all, or (causal) those up to the row."""
        if CAUSAL:
            return max(0, min(n_keys, row0 + r * RS - key0 + 1))
        return n_keys

    @cuda.jit(device=True, inline="always")
    def rescale(m, l, acc, r, new_max):  # noqa: E741
        """Raise row r's running max to new_max: scale l and acc by 2^(m - new_max)."""
        if new_max > m[r]:  # skipped whenever the max is unchanged (most keys)
            alpha = math.exp2(m[r] - new_max)  # 0 before the first key
            l[r] *= alpha
            for y in range(DVP):
                acc[r * DVP + y] *= alpha
            m[r] = new_max

    @cuda.jit(device=True, inline="always")
    def weight(m, r, s):
        """2^(s - m_r): the unnormalised softmax weight of a score (2^s while no key is seen)."""
        return math.exp2(s - (m[r] if m[r] > NEG_INF else float32(0.0)))

    @cuda.jit(device=True, inline="always")
    def dots4(s, r, q_rows, K_j, c, part):  # noqa: N803
        """Row r's partial scores against keys c .. c + 3 (this part's dims only)."""
        d0 = float32(0.0)
        d1 = float32(0.0)
        d2 = float32(0.0)
        d3 = float32(0.0)
        for y in range(DP):
            x = q_dim(part, y)
            qy = q_rows[r * DP + y]
            d0 += qy * K_j[c, x]
            d1 += qy * K_j[c + 1, x]
            d2 += qy * K_j[c + 2, x]
            d3 += qy * K_j[c + 3, x]
        s[4 * r] = d0
        s[4 * r + 1] = d1
        s[4 * r + 2] = d2
        s[4 * r + 3] = d3

    @cuda.jit(device=True, inline="always")
    def softmax4(s, r, n_vis, c, scale_log2, m, l, acc):  # noqa: E741
        """Turn row r's four partial scores into weights, updating m, l (and acc's scale).

        All lanes of the row reach the shuffles (outside the visibility conditionals); then
        a masked key gets score -inf: weight 0, and it never touches V.
        """
        for u in range(4):
            dot = sum_parts(s[4 * r + u], TPR)
            s[4 * r + u] = dot * scale_log2 if c + u < n_vis else NEG_INF
        rescale(m, l, acc, r, max(max(s[4 * r], s[4 * r + 1]), max(s[4 * r + 2], s[4 * r + 3])))
        for u in range(4):
            s[4 * r + u] = weight(m, r, s[4 * r + u])
        l[r] += (s[4 * r] + s[4 * r + 1]) + (s[4 * r + 2] + s[4 * r + 3])

    @cuda.jit(device=True, inline="always")
    def fma4(a, s, r, v0, v1, v2, v3):
        """a + row r's four weights times one element of four V rows, as four FMAs."""
        a += s[4 * r] * v0
        a += s[4 * r + 1] * v1
        a += s[4 * r + 2] * v2
        a += s[4 * r + 3] * v3
        return a

    @cuda.jit(device=True, inline="always")
    def accumulate4(acc, s, V_j, c, part):  # noqa: N803
        """acc_r += the weights of keys c .. c + 3 times their V rows, every row seeing all
        four: the rows share each V element loaded."""
        for y in range(DVP):
            x = v_dim(part, y)
            v0 = V_j[c, x]
            v1 = V_j[c + 1, x]
            v2 = V_j[c + 2, x]
            v3 = V_j[c + 3, x]
            acc[y] = fma4(acc[y], s, 0, v0, v1, v2, v3)
            if RPT == 2:
                acc[DVP + y] = fma4(acc[DVP + y], s, 1, v0, v1, v2, v3)

    @cuda.jit(device=True, inline="always")
    def accumulate_visible(acc, r, s, V_j, c, part, n_vis):  # noqa: N803
        """acc_r += the weights of those of keys c .. c + 3 that row r sees (the diagonal)."""
        for u in range(4):
            if c + u < n_vis:
                for y in range(DVP):
                    acc[r * DVP + y] += s[4 * r + u] * V_j[c + u, v_dim(part, y)]

    @cuda.jit(device=True, inline="always")
    def one_key(q_rows, K_j, V_j, c, r, n_vis, part, scale_log2, m, l, acc):  # noqa: N803, E741
        """Fold the single key c into row r."""
        dot = float32(0.0)
        for y in range(DP):
            dot += q_rows[r * DP + y] * K_j[c, q_dim(part, y)]
        score = sum_parts(dot, TPR) * scale_log2
        if c < n_vis:
            rescale(m, l, acc, r, score)
            p = weight(m, r, score)
            l[r] += p
            for y in range(DVP):
                acc[r * DVP + y] += p * V_j[c, v_dim(part, y)]

    @cuda.jit(device=True)
    def online_update(q_rows, K_j, V_j, n_keys, key0, row0, part, scale_log2, m, l, acc):  # noqa: N803, E741
        s = cuda.local.array(NS, float32)  # row r's scores, then weights, at s[4 r: 4 r + 4]
        vis0 = visible(row0, 0, key0, n_keys)
        vis1 = visible(row0, 1, key0, n_keys)
        c = 0
        while c + 4 <= n_keys:
            cu = uint64(c)  # unsigned: no negative-index fix-up on the shared loads
            # Both rows' scores first, so the K loads they share are issued once.
            dots4(s, 0, q_rows, K_j, cu, part)
            if RPT == 2:
                dots4(s, 1, q_rows, K_j, cu, part)
            softmax4(s, 0, vis0, c, scale_log2, m, l, acc)
            if RPT == 2:
                softmax4(s, 1, vis1, c, scale_log2, m, l, acc)
            if c + 4 <= vis0:  # row 0 sees the fewest keys, so every row sees all four
                accumulate4(acc, s, V_j, cu, part)
            else:  # the causal diagonal
                accumulate_visible(acc, 0, s, V_j, c, part, vis0)
                if RPT == 2:
                    accumulate_visible(acc, 1, s, V_j, c, part, vis1)
            c += 4
        while c < n_keys:
            one_key(q_rows, K_j, V_j, c, 0, vis0, part, scale_log2, m, l, acc)
            if RPT == 2:
                one_key(q_rows, K_j, V_j, c, 1, vis1, part, scale_log2, m, l, acc)
            c += 1

    return online_update
