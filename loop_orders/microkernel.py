"""The tile micro-kernel shared by kv_outer and q_outer: one query row against one K/V tile.

Thread layout. A query row is owned by TPR consecutive threads ("parts"); each part holds a
slice of the row's head dims in registers: DP = D / TPR dims of Q_i and DVP = DV / TPR dims
of the accumulator. A score is the sum of the parts' partial dot products, combined with one
`shfl_xor` (TPR = 2). Splitting d halves each thread's registers, which is what lets two or
three CTAs of 128 rows share an SM. Under the simulator (no warp shuffles) TPR is 1.

Which dims a part owns (`part_dim`): with D a multiple of 4 TPR, part p owns the 4-wide chunks
p, p + TPR, p + 2 TPR, ... so its shared-memory reads are 16-byte vectors and the parts of a
warp hit different banks; otherwise part p owns dims p, p + TPR, ...

The update, per group of keys c (scores pre-scaled by log2 e, so exp is exp2):
    s = Q_i K_c^T;  m' = max(m, max s);  if m' > m: l, acc *= 2^(m - m')   (skipped otherwise)
    l += sum 2^(s - m');  acc += 2^(s - m') V_c
Keys after the query (causal) get weight 0 and are never multiplied into acc, so a NaN in a
masked row of K or V cannot reach the output; a NaN score does reach it (2^NaN = NaN).
The loops over D and DV have compile-time trip counts and unroll, keeping q and acc in
registers; scores are plain scalars.
"""

from __future__ import annotations

import math
from functools import cache

from numba import float32, uint32, uint64

from .runtime import SIMULATOR, cuda


def threads_per_row(d: int, dv: int, block_q: int) -> int:
    """TPR: 2 on the GPU when both head dims split evenly and the CTA is whole warps, else 1.

    Whole warps keep every row's two lanes in one warp. Always 1 on the simulator, which has no
    shuffles.
    """
    if SIMULATOR or d % 2 or dv % 2 or (2 * block_q) % 32:
        return 1
    return 2


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
def make_row_io(D: int, DV: int, TPR: int):  # noqa: N803 - the paper's names
    """Per-thread loads and stores of a row's slice: Q_i in, O_i in and out."""
    q_dim = make_part_dim(D, TPR)
    v_dim = make_part_dim(DV, TPR)
    DP, DVP = D // TPR, DV // TPR  # noqa: N806

    @cuda.jit(device=True)
    def load_q(q_part, q, bh, row, part):
        for y in range(DP):
            q_part[y] = float32(q[bh, row, q_dim(part, y)])
        return DP

    @cuda.jit(device=True)
    def load_o(acc, o, bh, row, part, factor):
        for y in range(DVP):
            acc[y] = float32(o[bh, row, v_dim(part, y)]) * factor
        return DVP

    @cuda.jit(device=True)
    def store_o(o, acc, bh, row, part, factor):
        for y in range(DVP):
            o[bh, row, v_dim(part, y)] = acc[y] * factor
        return DVP

    return load_q, load_o, store_o


@cuda.jit(device=True, inline="always")
def pair_mask():
    """The two lanes that own one row: shuffles name only them, so rows of a warp may
    diverge (causal masks differ per row) without a shuffle waiting on another row's lanes."""
    return uint32(3) << uint32(cuda.laneid & 30)


@cuda.jit(device=True, inline="always")
def sum_parts(x, tpr):
    """Sum a value over the TPR threads that own one row."""
    if tpr == 2:
        x += cuda.shfl_xor_sync(pair_mask(), x, 1)
    return x


@cuda.jit(device=True, inline="always")
def share_from_part0(x, tpr):
    """Part 0's value of x, for every part of the row (part 0 alone loads row statistics)."""
    if tpr == 2:
        x = cuda.shfl_sync(pair_mask(), x, cuda.laneid & 30)
    return x


@cache
def make_online_update(D: int, DV: int, TPR: int, CAUSAL: bool):  # noqa: N803
    """Fold one K/V tile into one row's (m, l, acc); returns the new (m, l).

    Keys go four at a time: the four dot products share each q element (four independent FMA
    chains), one max check covers four keys, and acc takes four rank-1 updates per element.
    The n_keys % 4 leftover keys go one at a time. Loop bounds depend only on n_keys, the same
    for all threads, so every shuffle is reached by both parts of a row.
    """
    q_dim = make_part_dim(D, TPR)
    v_dim = make_part_dim(DV, TPR)
    DP, DVP = D // TPR, DV // TPR  # noqa: N806

    @cuda.jit(device=True, inline="always")
    def rescale(m, new_max, l, acc):  # noqa: E741
        """Raise the running max to new_max: scale l and acc by 2^(m - new_max)."""
        if new_max > m:  # skipped whenever the max is unchanged (most keys)
            alpha = math.exp2(m - new_max)  # 0 before the first key
            l *= alpha  # noqa: E741
            for y in range(DVP):
                acc[y] *= alpha
            m = new_max
        return m, l

    @cuda.jit(device=True)
    def online_update(q_part, K_j, V_j, n_keys, key0, row, part, scale_log2, m, l, acc):  # noqa: N803, E741
        n_vis = n_keys
        if CAUSAL:
            n_vis = max(0, min(n_keys, row - key0 + 1))  # keys after the query are masked
        neg_inf = float32(-math.inf)
        c = 0
        while c + 4 <= n_keys:
            cu = uint64(c)
            d0 = float32(0.0)
            d1 = float32(0.0)
            d2 = float32(0.0)
            d3 = float32(0.0)
            for y in range(DP):
                x = q_dim(part, y)
                qy = q_part[y]
                d0 += qy * K_j[cu, x]
                d1 += qy * K_j[cu + 1, x]
                d2 += qy * K_j[cu + 2, x]
                d3 += qy * K_j[cu + 3, x]
            # Both lanes of the row reach the four shuffles (outside the n_vis conditionals);
            # then a masked key gets score -inf: weight 0, and it never touches V below.
            d0 = sum_parts(d0, TPR)
            d1 = sum_parts(d1, TPR)
            d2 = sum_parts(d2, TPR)
            d3 = sum_parts(d3, TPR)
            s0 = d0 * scale_log2 if c < n_vis else neg_inf
            s1 = d1 * scale_log2 if c + 1 < n_vis else neg_inf
            s2 = d2 * scale_log2 if c + 2 < n_vis else neg_inf
            s3 = d3 * scale_log2 if c + 3 < n_vis else neg_inf
            m, l = rescale(m, max(max(s0, s1), max(s2, s3)), l, acc)  # noqa: E741
            m_ref = m if m > neg_inf else float32(0.0)  # no finite score yet: 2^s itself
            p0 = math.exp2(s0 - m_ref)
            p1 = math.exp2(s1 - m_ref)
            p2 = math.exp2(s2 - m_ref)
            p3 = math.exp2(s3 - m_ref)
            l += (p0 + p1) + (p2 + p3)  # noqa: E741
            if c + 4 <= n_vis:
                for y in range(DVP):
                    x = v_dim(part, y)
                    acc[y] += (p0 * V_j[cu, x] + p1 * V_j[cu + 1, x]
                               + p2 * V_j[cu + 2, x] + p3 * V_j[cu + 3, x])
            else:  # the causal diagonal: only the visible keys
                for u in range(4):
                    if c + u < n_vis:
                        p = p0 if u == 0 else p1 if u == 1 else p2 if u == 2 else p3
                        for y in range(DVP):
                            acc[y] += p * V_j[c + u, v_dim(part, y)]
            c += 4
        while c < n_keys:
            dot = float32(0.0)
            for y in range(DP):
                dot += q_part[y] * K_j[c, q_dim(part, y)]
            score = sum_parts(dot, TPR) * scale_log2
            if c < n_vis:
                m, l = rescale(m, score, l, acc)  # noqa: E741
                p = math.exp2(score - (m if m > neg_inf else float32(0.0)))
                l += p  # noqa: E741
                for y in range(DVP):
                    acc[y] += p * V_j[c, v_dim(part, y)]
            c += 1
        return m, l

    return online_update
