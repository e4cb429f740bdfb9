"""ring: ring attention, the K/V-outer order one level up.

Each device keeps its query rows resident (Q-outer at the device level) while the K/V
shards travel around a ring of P devices (K/V-outer across devices); every step is an
online-softmax update of the device's (O_i, lse_i), combined exactly as split_kv's partials:

    device r of P, holding Q_r, K_r, V_r (N/P rows each; zig-zag chunks r, 2P-1-r if causal)
    K, V = K_r, V_r
    for s in 0 .. P-1:                              # K/V-outer across devices
        j = (r - s) mod P                           # K, V are device j's shard
        if s < P-1:
            issue send K, V -> r+1; recv K', V' <- r-1    # before the compute: overlapped
        O_s, lse_s = attention(Q_r, K, V)           # our kernels (lo.attention), Q-outer
        lse_i = logaddexp(lse_i, lse_s)             # the combine (local.Accumulator)
        O_i = exp(lse_i_old - lse_i) O_i + exp(lse_s - lse_i) O_s
        if s < P-1: wait; K, V = K', V'
    O_r = O_i (and lse_r = lse_i)

Causal, zig-zag layout (C = N / (2P)): at s = 0 the device's own chunks r, 2P-1-r form one
causal call on its 2C rows (layout.py). At s > 0, from device j: if j < r, both local query
chunks see chunk j whole and not chunk 2P-1-j (a 2C x C call); if j > r, only query chunk
2P-1-r sees anything, and it sees both of j's chunks whole (a C x 2C call). Every device
computes the same 2P + 1 C x C half-blocks, and every K/V shard still travels whole (the
devices after this one need both chunks). `overlap=False` waits for each transfer before
the compute (same bytes; it times the transfers alone).

Interconnect, per device (B batch, H heads, b bytes per element), counted in
`transport.Link.shift` and modelled by `transfers`: P - 1 steps s = 0 .. P-2, each sending
and receiving one shard of K and one of V,

    k: B H (N/P) d b,   v: B H (N/P) dv b       per step, each way
    total sent = total received = (P - 1) B H (N/P) (d + dv) b

causal or not. The device holds two K/V shards at a time (the one in use and the one
arriving): 2 B H (N/P) (d + dv) b, against all-gather's B H N (d + dv) b.

HBM (our kernels' counters, `local_shapes`): P calls of N/P queries x N/P keys, or causal one
causal 2C x 2C call, r calls of 2C x C and P-1-r calls of C x 2C; each call's traffic is the
local schedule's exact model (q_outer: Q_i once per call, K_j, V_j once per query block).
Every call writes lse (the combine needs it) when P > 1; at P = 1 the single call is
lo.attention itself.
"""

from __future__ import annotations

from typing import NamedTuple

from .layout import CPProblem
from .local import Accumulator, Device, LocalShape, Part
from .transport import Transfer


class Block(NamedTuple):
    """The local rows of one step's call: query rows q, rows of the K/V shard k."""

    q: slice
    k: slice
    causal: bool


def step_block(p: CPProblem, rank: int, s: int) -> Block:
    """What device `rank` computes at step s with device j = rank - s's K/V shard."""
    whole = slice(0, p.n_local)
    if not p.causal:
        return Block(whole, whole, False)
    j = (rank - s) % p.world
    c = p.chunk
    if j == rank:
        return Block(whole, whole, True)  # own chunks: the diagonal, one causal call
    if j < rank:
        return Block(whole, slice(0, c), False)  # chunk j only; 2P-1-j comes after both
    return Block(slice(c, 2 * c), whole, False)  # query chunk 2P-1-r sees both of j's


def run(dev: Device, q, k, v) -> Part:
    p, tl = dev.problem, dev.timeline
    with_lse = p.world > 1 or p.save_lse
    acc = Accumulator()
    kv = {"k": k, "v": v}  # device j's K_j, V_j, j = rank - s
    for s in range(p.world):
        step_start = tl.mark()
        # K_j, V_j go on to the next device while we compute with them
        pending = dev.link.shift(s, kv) if s < p.world - 1 else None
        if pending is not None and not dev.overlap:
            arrived = pending.wait()
            tl.add(s, "transfer", step_start, tl.mark())
        compute_start = tl.mark()
        block = step_block(p, dev.rank, s)
        acc.add(dev.attend(q[..., block.q, :], kv["k"][..., block.k, :],
                           kv["v"][..., block.k, :], block.causal, with_lse), block.q)
        compute_end = tl.mark()
        tl.add(s, "compute", compute_start, compute_end)
        if pending is not None and dev.overlap:
            arrived = pending.wait()
            tl.add(s, "wait", compute_end, tl.mark())
        tl.add(s, "step", step_start, tl.mark())
        if pending is not None:
            kv = arrived
    return acc.result(q.dtype)


def transfers(p: CPProblem) -> tuple[Transfer, ...]:
    """The exact interconnect model per device: one K and one V shard each way per step."""
    shard = p.bh * p.n_local * p.itemsize
    return tuple(Transfer(s, name, shard * width, shard * width)
                 for s in range(p.world - 1) for name, width in (("k", p.d), ("v", p.dv)))


def local_shapes(p: CPProblem, rank: int) -> tuple[LocalShape, ...]:
    """Device `rank`'s local calls in closed form (the HBM model's terms)."""
    with_lse = p.world > 1 or p.save_lse
    if not p.causal:
        return (LocalShape(p.n_local, p.n_local, False, with_lse, p.heads),) * p.world
    c = p.chunk
    return ((LocalShape(2 * c, 2 * c, True, with_lse, p.heads),)
            + (LocalShape(2 * c, c, False, with_lse, p.heads),) * rank
            + (LocalShape(c, 2 * c, False, with_lse, p.heads),) * (p.world - 1 - rank))
