"""ulysses: all-to-all from sequence-sharded to head-sharded, attention, and back.

DeepSpeed-Ulysses' order: instead of moving K/V past resident queries, re-shard all three
so that each device holds every row of H/P heads, run single-device attention there, and
re-shard the output back:

    device r of P, holding Q_r, K_r, V_r: every head, N/P rows (zig-zag if causal)
    step 0: for X in Q, K, V:                        # heads g r .. g (r+1) - 1, g = H/P
                X^r = all_to_all(X_r split by heads)   # piece j -> device j
                X^r = global order                   # a local permutation (layout.unshard)
            O^r, lse^r = attention(Q^r, K^r, V^r)    # our kernels: one call, N x N, g heads
    step 1: O_r = all_to_all(O^r split by rows)      # device j's rows -> device j
            lse_r likewise, only with save_lse

Interconnect, per device (B batch, H heads, b bytes per element), counted in
`transport.Link.all_to_all` and modelled by `transfers`: each device keeps 1/P of what it
re-shards and exchanges the rest, P - 1 pieces of B (H/P) (N/P) rows each way:

    step 0:  q: (P - 1) B H N d b / P^2,  k: the same,  v: (P - 1) B H N dv b / P^2
    step 1:  o: (P - 1) B H N dv b / P^2,  lse: (P - 1) B H N 4 / P^2 with save_lse
    total sent = total received = (P - 1) B H N (2d + 2dv) b / P^2  (+ lse)

against ring's (P - 1) B H N (d + dv) b / P: 2/P of ring's bytes (equal at P = 2, half at
P = 4), causal or not. The head count bounds it: P must divide H.

HBM (our kernels' counters, `local_shapes`): one call of N queries x N keys for H/P heads,
the single-device traffic of 1/P of the heads; causal needs no load balancing here (every
device holds whole sequences).
"""

from __future__ import annotations

import torch

from .layout import LSE_BYTES, CPProblem, shard, unshard
from .local import Device, LocalShape, Part
from .transport import Transfer


def run(dev: Device, q, k, v) -> Part:
    p, tl = dev.problem, dev.timeline
    g = p.heads_local

    def to_heads(name: str, x):
        """(B, H, N/P, .) sequence-sharded -> (B, H/P, N, .) head-sharded, global order."""
        pieces = [x[:, j * g:(j + 1) * g] for j in range(p.world)]
        return unshard(dev.link.all_to_all(0, name, pieces), p.causal)

    def to_rows(name: str, x):
        """(B, H/P, N, .) head-sharded -> (B, H, N/P, .) sequence-sharded."""
        pieces = [shard(x, j, p.world, p.causal) for j in range(p.world)]
        return torch.cat(dev.link.all_to_all(1, name, pieces), dim=1)

    start = tl.mark()
    heads_q, heads_k, heads_v = (to_heads(name, x) for name, x in (("q", q), ("k", k),
                                                                    ("v", v)))
    scattered = tl.mark()
    tl.add(0, "transfer", start, scattered)
    part = dev.attend(heads_q, heads_k, heads_v, p.causal, p.save_lse)
    computed = tl.mark()
    tl.add(0, "compute", scattered, computed)
    tl.add(0, "step", start, computed)
    out = to_rows("o", part.out)
    lse = to_rows("lse", part.lse[..., None])[..., 0] if p.save_lse else None
    done = tl.mark()
    tl.add(1, "transfer", computed, done)
    tl.add(1, "step", computed, done)
    return Part(out, lse)


def transfers(p: CPProblem) -> tuple[Transfer, ...]:
    """The exact interconnect model per device: P - 1 pieces of B (H/P) (N/P) rows of each
    tensor, each way."""
    if p.world == 1:
        return ()
    rows = (p.world - 1) * p.batch * p.heads_local * p.n_local
    sizes = [(0, "q", p.d * p.itemsize), (0, "k", p.d * p.itemsize),
             (0, "v", p.dv * p.itemsize), (1, "o", p.dv * p.itemsize)]
    if p.save_lse:
        sizes.append((1, "lse", LSE_BYTES))
    return tuple(Transfer(step, name, rows * width, rows * width)
                 for step, name, width in sizes)


def local_shapes(p: CPProblem, rank: int) -> tuple[LocalShape, ...]:
    """Device `rank`'s local call in closed form: the same on every device."""
    return (LocalShape(p.n, p.n, p.causal, p.save_lse, p.heads_local),)
