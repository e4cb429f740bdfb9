"""Helpers shared by the GPU experiments (runtime benchmark, Nsight Compute traffic).

Inputs are made once per configuration as device arrays; every configuration is checked
against the float64 reference on sampled rows before it is timed or profiled.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np

import loop_orders as lo
from loop_orders.core.schedule import backward_of
from loop_orders.device import runtime
from loop_orders.device.arrays import bfloat16_bits, host_values
from loop_orders.reference import (
    attention_grad_reference,
    grad_tolerance,
    relative_error,
    tf32_grad_tolerance,
    tf32_tolerance,
    tolerance,
)
from loop_orders.results import atomic_write_text, provenance
from loop_orders.warm import Job, warm_cache

CHECK_ROWS = 128  # query rows per checked head
# The pseudo-dtypes of the experiments' dtype lists and results, for the schedules with
# TENSOR_CORES: float32 inputs multiplied on TF32 tensor cores at that precision ("tf32", or
# "tf32x3": 3xTF32)
TC_PRECISIONS = ("tf32", "tf32x3")


def input_kind(label: str) -> dict:
    """make_problem's dtype (and precision) for a dtype label of the experiments."""
    return {"dtype": "float32", "precision": label} if label in TC_PRECISIONS else \
        {"dtype": label}


def runs(sched, label: str) -> bool:
    """Whether `sched` runs inputs of this dtype label (a TF32 precision needs its
    tensor cores)."""
    return label not in TC_PRECISIONS or sched.TENSOR_CORES


def flops(p: lo.Problem) -> float:
    """Forward attention FLOPs: 2 N_q N_k (d + dv) per head, halved when causal."""
    work = 2.0 * p.bh * p.n_q * p.n_k * (p.d + p.dv)
    return work / 2 if p.causal else work


def random_inputs(p: lo.Problem, rng):
    """Host q of shape (bh, n_q, d), k and v (bh_kv, n_k, .) with unit-variance entries
    (never zeros)."""
    return tuple(host_array(rng.standard_normal((heads, n, w), dtype=np.float32), p)
                 for heads, n, w in ((p.bh, p.n_q, p.d), (p.bh_kv, p.n_k, p.d),
                                     (p.bh_kv, p.n_k, p.dv)))


def host_array(x, p: lo.Problem) -> np.ndarray:
    """float32 values in p's kernel dtype (bfloat16 as its uint16 bits)."""
    return bfloat16_bits(x) if p.dtype == "bfloat16" else x.astype(p.dtype)


def reference_rows(q, k, v, heads, rows, causal, group: int = 1):
    """Float64 reference output for the given (head, rows): rows are independent. Query
    head h reads K/V head h // group; causal is bottom-right aligned (query i sees keys
    j <= i + n_k - n_q)."""
    q, k, v = (host_values(x) for x in (q, k, v))
    out = []
    for h in heads:
        qh = q[h, rows].astype(np.float64)
        s = qh @ k[h // group].astype(np.float64).T / math.sqrt(q.shape[-1])
        if causal:
            diagonal = np.asarray(rows)[:, None] + k.shape[1] - q.shape[1]
            s = np.where(np.arange(k.shape[1])[None, :] <= diagonal, s, -np.inf)
        s = np.exp(s - s.max(axis=1, keepdims=True))
        out.append((s / s.sum(axis=1, keepdims=True)) @ v[h // group].astype(np.float64))
    return np.stack(out)


def check_output(sched, p, q, k, v, out_host, rng) -> float:
    """Relative error on sampled rows of the first and last head; raises if out of tolerance
    or if any output element (all heads) is not finite."""
    out_host = host_values(out_host)
    if not np.isfinite(out_host).all():
        raise AssertionError(f"{sched.name}: non-finite output for {p.describe()}")
    rows = np.sort(rng.choice(p.n_q, size=min(CHECK_ROWS, p.n_q), replace=False))
    heads = sorted({0, p.bh - 1})
    ref = reference_rows(q, k, v, heads, rows, p.causal, p.group)
    got = np.stack([out_host[h, rows] for h in heads])
    err = relative_error(got, ref)
    if p.precision != "ieee":
        tol = tf32_tolerance(host_values(q)[heads][:, rows], host_values(k)[heads],
                             host_values(v)[heads], ref, causal=False, precision=p.precision)
    else:
        tol = tolerance(p.dtype, sched.output_roundings(p), host_values(v), ref)
    if not err <= tol:
        raise AssertionError(f"{sched.name}: error {err:.2e} > {tol:.2e} for {p.describe()}")
    return err


class Buffers:
    """Device inputs (several sets, rotated so L2 does not flatter), output and workspace."""

    def __init__(self, sched, p, rng, sets=1):
        self.host = [random_inputs(p, rng) for _ in range(sets)]
        self.dev = [tuple(runtime.to_device(x) for x in s) for s in self.host]
        self.out = runtime.device_empty((p.bh, p.n_q, p.dv), p.kernel_dtype)
        self.lse = runtime.device_empty((p.bh, p.n_q) if p.save_lse else (1, 1), np.float32)
        self.counts = runtime.device_zeros(lo.core.ledger.n_slots(), np.int64)
        self.workspace = sched.allocate_workspace(p)
        self.sched, self.p = sched, p

    def launch(self, i=0, count=False):
        q, k, v = self.dev[i % len(self.dev)]
        self.sched.launch(self.p, q, k, v, self.out, self.lse, self.counts,
                          scale=1.0 / math.sqrt(self.p.d), count=count,
                          workspace=self.workspace)


class GradBuffers(Buffers):
    """Buffers for forward + backward: do, the forward's saved workspace, the gradients and
    the backward's workspace too (allocated once; the kernels alone are timed). The backward
    runs `Problem.for_backward`."""

    def __init__(self, sched, p, rng, sets=1):
        super().__init__(sched, p, rng, sets)
        self.bwd, self.pb = backward_of(sched), p.for_backward()
        self.do_host = host_array(rng.standard_normal((p.bh, p.n_q, p.dv), dtype=np.float32), p)
        self.do = runtime.to_device(self.do_host)
        self.grads = [runtime.device_empty((p.bh, n, w), p.kernel_dtype)
                      for n, w in ((p.n_q, p.d), (p.n_k, p.d), (p.n_k, p.dv))]
        self.bwd_workspace = self.bwd.allocate_workspace(self.pb)

    def launch_backward(self, i=0, count=False):
        q, k, v = self.dev[i % len(self.dev)]
        self.bwd.launch(self.pb, q, k, v, self.out, self.do, self.lse, *self.grads, self.counts,
                        scale=1.0 / math.sqrt(self.p.d), count=count,
                        forward_workspace=self.workspace, workspace=self.bwd_workspace)

    def launch_both(self, i=0, count=False):
        self.launch(i, count)
        self.launch_backward(i, count)


class CountedLaunch(NamedTuple):
    """A schedule's forward on fixed device arrays: `launch(i, count=False)` for the timer,
    and the ledger its counted build measured on the first launch (== `model`)."""

    launch: Callable
    counted: lo.Ledger
    model: lo.Ledger


def counted_launch(sched, p: lo.Problem, q, k, v, out) -> CountedLaunch:
    """The forward of p on the kernel views q, k, v -> out (no lse kept), run once counted;
    raises if the counters differ from the model."""
    lse = runtime.device_empty((1, 1), np.float32)
    counts = runtime.device_zeros(lo.core.ledger.n_slots(), np.int64)
    workspace = sched.allocate_workspace(p)

    def launch(_i, count=False):
        sched.launch(p, q, k, v, out, lse, counts, scale=1 / math.sqrt(p.d), count=count,
                     workspace=workspace)

    launch(0, count=True)
    counted = lo.Ledger.from_array(runtime.to_host(counts), sched.ledger_tensors())
    model = sched.model(p)
    if counted != model:
        raise AssertionError(f"{sched.name}: counted {counted} != model {model} for "
                             f"{p.describe()}")
    return CountedLaunch(launch, counted, model)


def check_gradients(sched, p, q, k, v, do, grads_host, rng) -> float:
    """Largest relative error of dQ, dK, dV on the first and last head against float64
    (whole heads: a gradient row depends on every row); raises if out of tolerance."""
    heads = sorted({0, p.bh - 1})
    sub = (slice(None),) if p.bh == 1 else (heads,)
    q, k, v, do = (host_values(x) for x in (q, k, v, do))
    grads_host = [host_values(g) for g in grads_host]
    refs = attention_grad_reference(q[sub], k[sub], v[sub], do[sub], causal=p.causal)
    bwd = backward_of(sched)
    # a TF32 forward's rounding reaches every backward (through lse and O), on any cores
    tol = (tf32_grad_tolerance(q[sub], k[sub], precision=p.precision, causal=p.causal)
           if p.precision != "ieee" else grad_tolerance(p.dtype,
                                                        bwd.output_roundings(p.for_backward())))
    errs = [relative_error(g[sub], r) for g, r in zip(grads_host, refs, strict=True)]
    if not all(np.isfinite(g).all() for g in grads_host) or max(errs) > tol:
        raise AssertionError(f"{sched.name} backward: errors {errs} > {tol:.2e} for "
                             f"{p.describe()}")
    return max(errs)


def warm(problems, counted=(False, True), workers: int = 12) -> None:
    """On a GPU, compile the kernels of [(schedule name, Problem, backward[, tuning
    override])] (each counted and not, as `counted` says; the override as `Job.tuned`)
    into the disk cache in parallel first; prints what it did."""
    import time

    if runtime.SIMULATOR:
        return
    jobs = [Job(name, p, count, backward, *tuned) for name, p, backward, *tuned in problems
            for count in counted]
    t0 = time.time()
    done = warm_cache(jobs, workers)
    print(f"warm: {done} kernel builds for {len(jobs)} problems in {time.time() - t0:.0f} s",
          flush=True)


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
