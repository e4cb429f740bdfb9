"""Helpers shared by the GPU experiments (runtime benchmark, Nsight Compute traffic).

Inputs are made once per configuration as device arrays; every configuration is checked
against the float64 reference on sampled rows before it is timed or profiled.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import numpy as np

import loop_orders as lo
from loop_orders import runtime
from loop_orders.reference import relative_error, tolerance
from loop_orders.results import atomic_write_text, provenance

CHECK_ROWS = 128  # query rows per checked head


def flops(p: lo.Problem) -> float:
    """Forward attention FLOPs: 2 N_q N_k (d + dv) per head, halved when causal."""
    work = 2.0 * p.bh * p.n_q * p.n_k * (p.d + p.dv)
    return work / 2 if p.causal else work


def random_inputs(p: lo.Problem, rng):
    """Host q, k, v of shape (bh, n, d) with unit-variance entries (never zeros)."""
    q = rng.standard_normal((p.bh, p.n_q, p.d), dtype=np.float32).astype(p.dtype)
    k = rng.standard_normal((p.bh, p.n_k, p.d), dtype=np.float32).astype(p.dtype)
    v = rng.standard_normal((p.bh, p.n_k, p.dv), dtype=np.float32).astype(p.dtype)
    return q, k, v


def reference_rows(q, k, v, heads, rows, causal):
    """Float64 reference output for the given (head, rows): rows are independent."""
    out = []
    for h in heads:
        qh = q[h, rows].astype(np.float64)
        s = qh @ k[h].astype(np.float64).T / math.sqrt(q.shape[-1])
        if causal:
            s = np.where(np.arange(k.shape[1])[None, :] <= rows[:, None], s, -np.inf)
        s = np.exp(s - s.max(axis=1, keepdims=True))
        out.append((s / s.sum(axis=1, keepdims=True)) @ v[h].astype(np.float64))
    return np.stack(out)


def check_output(sched, p, q, k, v, out_host, rng) -> float:
    """Relative error on sampled rows of the first and last head; raises if out of tolerance
    or if any output element (all heads) is not finite."""
    if not np.isfinite(out_host).all():
        raise AssertionError(f"{sched.name}: non-finite output for {p.describe()}")
    rows = np.sort(rng.choice(p.n_q, size=min(CHECK_ROWS, p.n_q), replace=False))
    heads = sorted({0, p.bh - 1})
    ref = reference_rows(q, k, v, heads, rows, p.causal)
    got = np.stack([out_host[h, rows] for h in heads])
    err = relative_error(got, ref)
    tol = tolerance(p.dtype, sched.output_roundings(p), v, ref)
    if not err <= tol:
        raise AssertionError(f"{sched.name}: error {err:.2e} > {tol:.2e} for {p.describe()}")
    return err


class Buffers:
    """Device inputs (several sets, rotated so L2 does not flatter), output and workspace."""

    def __init__(self, sched, p, rng, sets=1):
        self.host = [random_inputs(p, rng) for _ in range(sets)]
        self.dev = [tuple(runtime.to_device(x) for x in s) for s in self.host]
        self.out = runtime.device_empty((p.bh, p.n_q, p.dv), np.dtype(p.dtype))
        self.lse = runtime.device_empty((p.bh, p.n_q) if p.save_lse else (1, 1), np.float32)
        self.counts = runtime.device_zeros(lo.ledger.n_slots(), np.int64)
        self.workspace = sched.allocate_workspace(p)
        self.sched, self.p = sched, p

    def launch(self, i=0, count=False):
        q, k, v = self.dev[i % len(self.dev)]
        self.sched.launch(self.p, q, k, v, self.out, self.lse, self.counts,
                          scale=1.0 / math.sqrt(self.p.d), count=count,
                          workspace=self.workspace)


def write_csv(path: Path, rows: list[dict], prov: dict | None = None) -> None:
    """Atomically write rows (dicts with the same keys) plus provenance columns."""
    prov = prov or provenance()
    extra = {"git_sha": prov["git_sha"], "device": prov.get("device", ""),
             "versions": json.dumps(prov.get("versions", {}), sort_keys=True),
             "date": prov.get("date", "")}
    buf = io.StringIO()
    fields = list(rows[0]) + list(extra) if rows else list(extra)
    writer = csv.DictWriter(buf, fieldnames=fields)
    writer.writeheader()
    for row in rows:
        writer.writerow({**extra, **row})  # a resumed row keeps its own provenance
    atomic_write_text(path, buf.getvalue())
