"""Brute-force walks of each schedule's loop nest, written independently of the models.

Each walk replays the loop nest of DESIGN.md section 3 element by element in plain Python and
counts every transfer. The property tests compare them with the closed-form models over many
shapes. A new schedule needs a walk here: the registry test fails until it has one.
"""

from __future__ import annotations

from collections import Counter


def _rows(start, block, n):
    return range(start, min(start + block, n))


def _walk_dense(p):
    c = Counter()
    for i in range(0, p.n_q, p.block_q):
        rows = _rows(i, p.block_q, p.n_q)
        c["q", "read"] += len(rows) * p.d
        for j in range(0, p.n_k, p.block_k):
            keys = _rows(j, p.block_k, p.n_k)
            c["k", "read"] += len(keys) * p.d
            c["s", "write"] += len(rows) * len(keys)
    for _r in range(p.n_q):
        for _col in range(p.n_k):
            c["s", "read"] += 1
            c["p", "write"] += 1
        if p.save_lse:
            c["lse", "write"] += 1
    for i in range(0, p.n_q, p.block_q):
        rows = _rows(i, p.block_q, p.n_q)
        for j in range(0, p.n_k, p.block_k):
            keys = _rows(j, p.block_k, p.n_k)
            c["v", "read"] += len(keys) * p.dv
            c["p", "read"] += len(rows) * len(keys)
        c["o", "write"] += len(rows) * p.dv
    return c


def _visible(p, rows, keys):
    """Does any query in `rows` see any key in `keys`?"""
    return not p.causal or keys[0] <= rows[-1]


def _walk_kv_outer(p):
    c = Counter()
    c["o", "write"] += p.n_q * p.dv
    c["l", "write"] += p.n_q
    c["m", "write"] += p.n_q
    for j in range(0, p.n_k, p.block_k):
        keys = _rows(j, p.block_k, p.n_k)
        c["k", "read"] += len(keys) * p.d
        c["v", "read"] += len(keys) * p.dv
        for i in range(0, p.n_q, p.block_q):
            rows = _rows(i, p.block_q, p.n_q)
            if not _visible(p, rows, keys):
                continue
            for tensor, width in (("q", p.d), ("o", p.dv), ("l", 1), ("m", 1)):
                c[tensor, "read"] += len(rows) * width
            for tensor, width in (("o", p.dv), ("l", 1), ("m", 1)):
                c[tensor, "write"] += len(rows) * width
    if p.save_lse:
        c["lse", "write"] += p.n_q
    return c


def _walk_q_outer(p):
    c = Counter()
    for i in range(0, p.n_q, p.block_q):
        rows = _rows(i, p.block_q, p.n_q)
        c["q", "read"] += len(rows) * p.d
        for j in range(0, p.n_k, p.block_k):
            keys = _rows(j, p.block_k, p.n_k)
            if _visible(p, rows, keys):
                c["k", "read"] += len(keys) * p.d
                c["v", "read"] += len(keys) * p.dv
        c["o", "write"] += len(rows) * p.dv
        if p.save_lse:
            c["lse", "write"] += len(rows)
    return c


WALKS = {"dense": _walk_dense, "kv_outer": _walk_kv_outer, "q_outer": _walk_q_outer}


def walk(name, p):
    """Counts of schedule `name` on problem `p`, as {tensor: {direction: n}} for all heads."""
    per_head = WALKS[name](p)
    out = {}
    for (tensor, direction), n in per_head.items():
        out.setdefault(tensor, {})[direction] = n * p.bh
    return out
