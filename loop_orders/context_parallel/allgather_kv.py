"""allgather_kv: gather every device's K and V first, then one local pass.

The same split of the work as ring (each device's query rows against every key they see),
but K/V arrive all at once before any compute instead of shard by shard behind it:

    device r of P, holding Q_r, K_r, V_r (N/P rows each; zig-zag chunks r, 2P-1-r if causal)
    K = all_gather(K_r); V = all_gather(V_r)       # every shard, in rank order
    K, V = global order                             # a local permutation (layout.unshard)
    O_r = attention(Q_r, K, V)                      # our kernels: one call
    causal (C = N / (2P)), three calls combined as split_kv's partials (local.Accumulator):
        O_a  = attention(Q_r, K_r, V_r, causal)     # own chunks r, 2P-1-r: the diagonal
        O_b  = attention(Q_r, K[0 : rC])            # chunks 0 .. r-1: seen by both
        O_c  = attention(Q_{2P-1-r}, K[(r+1)C : (2P-1-r)C])   # seen by the late chunk only
        O_r  = combine(O_a, O_b, O_c)

Interconnect, per device (B batch, H heads, b bytes per element), counted in
`transport.Link.all_gather` and modelled by `transfers`: one step, K and V of the P - 1
other devices,

    k: (P - 1) B H (N/P) d b,   v: (P - 1) B H (N/P) dv b       each way

which is ring's total in one step, with nothing to overlap it with, and every device
holds all of K and V: B H N (d + dv) b (ring: 2 B H (N/P) (d + dv) b).

HBM (our kernels' counters, `local_shapes`): one call of N/P queries x N keys; causal, one
causal 2C x 2C call, one of 2C x rC (r > 0) and one of C x (2P - 2 - 2r) C (r < P - 1),
the same query-key pairs ring computes in at most three calls instead of P.
"""

from __future__ import annotations

from .layout import CPProblem, unshard
from .local import Accumulator, Device, LocalShape, Part
from .transport import Transfer


def run(dev: Device, q, k, v) -> Part:
    p, tl, rank = dev.problem, dev.timeline, dev.rank
    start = tl.mark()
    # K, V: every device's shard, in one step before any compute
    keys = unshard(dev.link.all_gather(0, "k", k), p.causal)
    values = unshard(dev.link.all_gather(0, "v", v), p.causal)
    gathered = tl.mark()
    tl.add(0, "transfer", start, gathered)
    if not p.causal:
        part = dev.attend(q, keys, values, False, p.save_lse)
    else:
        c, with_lse = p.chunk, p.world > 1 or p.save_lse
        acc = Accumulator()
        acc.add(dev.attend(q, k, v, True, with_lse))  # own chunks: the diagonal
        if rank > 0:  # chunks 0 .. r-1, before both of ours
            acc.add(dev.attend(q, keys[..., :rank * c, :], values[..., :rank * c, :],
                               False, with_lse))
        between = slice((rank + 1) * c, (2 * p.world - 1 - rank) * c)
        if rank < p.world - 1:  # chunks r+1 .. 2P-2-r: after chunk r, before 2P-1-r
            acc.add(dev.attend(q[..., c:, :], keys[..., between, :], values[..., between, :],
                               False, with_lse), slice(c, 2 * c))
        part = acc.result(q.dtype)
    done = tl.mark()
    tl.add(0, "compute", gathered, done)
    tl.add(0, "step", start, done)
    return part


def transfers(p: CPProblem) -> tuple[Transfer, ...]:
    """The exact interconnect model per device: the other P - 1 shards of K and V."""
    if p.world == 1:
        return ()
    others = (p.world - 1) * p.bh * p.n_local * p.itemsize
    return (Transfer(0, "k", others * p.d, others * p.d),
            Transfer(0, "v", others * p.dv, others * p.dv))


def local_shapes(p: CPProblem, rank: int) -> tuple[LocalShape, ...]:
    """Device `rank`'s local calls in closed form (the HBM model's terms)."""
    if not p.causal:
        return (LocalShape(p.n_local, p.n, False, p.save_lse, p.heads),)
    c, with_lse = p.chunk, p.world > 1 or p.save_lse
    shapes = [LocalShape(2 * c, 2 * c, True, with_lse, p.heads)]
    if rank > 0:
        shapes.append(LocalShape(2 * c, rank * c, False, with_lse, p.heads))
    if rank < p.world - 1:
        shapes.append(LocalShape(c, (2 * p.world - 2 - 2 * rank) * c, False, with_lse,
                                 p.heads))
    return tuple(shapes)
