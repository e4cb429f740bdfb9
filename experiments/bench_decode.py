"""The decode regime on a GPU: few queries against long K/V, where split-KV wins.

    python -m experiments.bench_decode [--out DIR] [--quick]        # needs torch there

N_q in {1, 16, 128} queries against N_k in {4096 ... 131072} keys, B H in {16, 64}, d = 64
and 128, float32 and float16: split_kv (splits = auto) beside q_outer and torch SDPA
(efficient for float32, flash for float16) in the same run; a sweep of the split count S at
one shape. Every point is checked against the float64 reference on sampled rows of the first
and last head before it is timed; our schedules' counted traffic is checked against the model
at every point. Times: the kernels alone (launches queued back to back, as bench_runtime),
and our public call `lo.attention` on torch tensors (allocation and launch included).

Writes bench_decode.csv (provider, shape, splits, ms_kernel, ms_call, model and counted
bytes, achieved GB/s of the model's bytes, relative error, status) with provenance.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import numpy as np

import loop_orders as lo
from experiments.bench_runtime import POINT_BUDGET_S, time_launches
from experiments.gpu_common import counted_launch, write_csv
from loop_orders.device import runtime
from loop_orders.device.arrays import KINDS
from loop_orders.reference import attention_reference, relative_error, tolerance
from loop_orders.results import provenance

SWEEP = {"n_q": [1, 16, 128], "n_k": [4096, 16384, 65536, 131072], "bh": [16, 64],
         "d": [64, 128], "dtype": ["float32", "float16"]}
QUICK = {"n_q": [1], "n_k": [4096, 65536], "bh": [16], "d": [64], "dtype": ["float32"]}
HEADS = 16
BLOCK_Q, BLOCK_K = 64, 64
# The target shape, and the split-count sweep there.
TARGET = {"n_q": 1, "n_k": 65536, "bh": 16, "d": 64, "dtype": "float32"}
SPLITS = [1, 2, 4, 8, 16, 32, 64, 128]
SCHEDULES = ["split_kv", "q_outer"]
SDPA = {"float32": "efficient", "float16": "flash"}
CHECK_ROWS = 16


class Point:
    """One shape's inputs (torch tensors on the GPU) and its float64 reference rows."""

    def __init__(self, shape: dict, rng):
        import torch

        self.shape = shape
        tdt = getattr(torch, shape["dtype"])
        gen = torch.Generator(device="cuda").manual_seed(int(rng.integers(2**31)))
        lead = (shape["bh"] // HEADS, HEADS)
        self.q = torch.randn(*lead, shape["n_q"], shape["d"], device="cuda", dtype=tdt,
                             generator=gen)
        self.k, self.v = (torch.randn(*lead, shape["n_k"], shape["d"], device="cuda",
                                      dtype=tdt, generator=gen) for _ in range(2))
        self.rows = sorted(int(r) for r in rng.choice(shape["n_q"], min(CHECK_ROWS,
                                                                          shape["n_q"]),
                                                      replace=False))
        heads = sorted({0, shape["bh"] - 1})
        flat = [x.reshape(shape["bh"], -1, shape["d"]) for x in (self.q, self.k, self.v)]
        self.host = [x[heads].float().cpu().numpy().astype(shape["dtype"]) for x in flat]
        self.heads = heads
        self.ref, _ = attention_reference(self.host[0][:, self.rows], *self.host[1:])

    def check(self, out, roundings: int) -> float:
        """Relative error of out's sampled rows (first and last head); raises if off."""
        flat = out.reshape(self.shape["bh"], self.shape["n_q"], -1)
        got = flat[self.heads][:, self.rows].float().cpu().numpy()
        if not np.isfinite(got).all():
            raise AssertionError(f"non-finite output at {self.shape}")
        err = relative_error(got, self.ref)
        tol = tolerance(self.shape["dtype"], roundings, self.host[2], self.ref)
        if not err <= tol:
            raise AssertionError(f"error {err:.2e} > {tol:.2e} at {self.shape}")
        return err


def problem(name: str, shape: dict, options=None) -> lo.Problem:
    return lo.make_problem(name, n_q=shape["n_q"], n_k=shape["n_k"], d=shape["d"],
                           batch=shape["bh"] // HEADS, heads=HEADS, block_q=BLOCK_Q,
                           block_k=BLOCK_K, dtype=shape["dtype"], options=options)


def bench_ours(name: str, point: Point, options=None) -> dict:
    """Kernel-only and public-call times of one schedule, its counted traffic and error."""
    import torch

    sched = lo.get_schedule(name)
    p = problem(name, point.shape, options)
    lo.api.check_launch(sched, p, count=True, host_inputs=False)
    kind = KINDS["torch"]
    qv, kv, vv = (kind.view(x).reshape(p.bh, n, p.d) for x, n in
                  ((point.q, p.n_q), (point.k, p.n_k), (point.v, p.n_k)))
    out = torch.empty(*point.q.shape[:-1], p.dv, device="cuda", dtype=point.q.dtype)
    run = counted_launch(sched, p, qv, kv, vv, kind.view(out).reshape(p.bh, p.n_q, p.dv))
    err = point.check(out, sched.output_roundings(p))
    ms_kernel = time_launches(run.launch)
    call_opts = dict(p.options) or None

    def public(_i):
        lo.attention(point.q, point.k, point.v, schedule=name, block_q=BLOCK_Q,
                     block_k=BLOCK_K, options=call_opts)

    ms_call = time_launches(public)
    return {"splits": sched.resolved_options(p).get("splits", ""), "ms_kernel": ms_kernel,
            "ms_call": ms_call, "model_bytes": run.model.bytes(p.itemsize),
            "counted_bytes": run.counted.bytes(p.itemsize), "rel_error": err}


def bench_sdpa(point: Point) -> dict:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = SDPA[point.shape["dtype"]]
    chosen = {"efficient": SDPBackend.EFFICIENT_ATTENTION,
              "flash": SDPBackend.FLASH_ATTENTION}[backend]

    def launch(_i):
        with sdpa_kernel(chosen):
            return torch.nn.functional.scaled_dot_product_attention(point.q, point.k, point.v)

    err = point.check(launch(0), 1)
    ms = time_launches(launch)
    return {"splits": "", "ms_kernel": ms, "ms_call": ms, "model_bytes": "",
            "counted_bytes": "", "rel_error": err, "backend": backend}


def row(provider: str, shape: dict, **values) -> dict:
    base = {"provider": provider, **shape, "batch": shape["bh"] // HEADS, "heads": HEADS,
            "block_q": min(BLOCK_Q, shape["n_q"]), "block_k": BLOCK_K, "splits": "",
            "ms_kernel": "", "ms_call": "", "model_bytes": "", "counted_bytes": "",
            "gbps": "", "rel_error": "", "backend": "", "status": "ok"}
    base.update(values)
    if base["model_bytes"] and base["ms_kernel"]:
        base["gbps"] = round(base["model_bytes"] / base["ms_kernel"] / 1e6, 1)
    for key in ("ms_kernel", "ms_call"):
        if base[key] != "":
            base[key] = round(base[key], 5)
    if base["rel_error"] != "":
        base["rel_error"] = f"{base['rel_error']:.2e}"
    return base


def measure(provider: str, fn, shape: dict, budget: dict) -> dict:
    """Time one provider at one shape unless its predicted time is over budget."""
    trend = (provider, shape["n_q"], shape["bh"], shape["d"], shape["dtype"])
    predicted = 2 * budget.get(trend, 0) / 1e3  # time grows about as N_k
    if predicted > POINT_BUDGET_S:
        return row(provider, shape, status=f"skipped: predicted {predicted:.1f} s per launch")
    try:
        values = fn()
    except (ValueError, RuntimeError, MemoryError) as exc:
        return row(provider, shape, status=f"refused: {str(exc).splitlines()[0][:160]}")
    except AssertionError as exc:  # a wrong answer is recorded, never timed
        print(f"{provider}: FAILED {exc}", flush=True)
        return row(provider, shape, status=f"failed: {str(exc).splitlines()[0][:160]}")
    budget[trend] = values["ms_kernel"]
    out = row(provider, shape, **values)
    print(f"{provider:22s} N_q={shape['n_q']:4d} N_k={shape['n_k']:7d} BH={shape['bh']:3d} "
          f"d={shape['d']:3d} {shape['dtype']}: {out['ms_kernel']:9.4f} ms kernel, "
          f"{out['ms_call']:9.4f} ms call, S={out['splits']!s:>4} {out['gbps']!s:>7} GB/s",
          flush=True)
    return out


def warm(shapes: list[dict]) -> None:
    """Compile every kernel the sweep will launch, in parallel processes, into the disk
    cache (loop_orders.warm)."""
    from loop_orders.warm import Job, warm_cache

    jobs = {}  # the kernels depend on the tiles, head dims and dtype, not on N or B H
    for shape in shapes:
        for name in SCHEDULES:
            for count in (False, True):
                p = problem(name, shape)
                jobs.setdefault((name, p.block_q, p.d, p.dtype, count), Job(name, p, count))
    t0 = time.time()
    compiled = warm_cache(list(jobs.values()))
    print(f"bench_decode: {compiled} kernels compiled into the cache in "
          f"{time.time() - t0:.0f} s", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if runtime.SIMULATOR:
        print("bench_decode: no CUDA GPU here; nothing timed")
        return 0
    import torch

    prov = provenance(torch=torch.__version__)
    rng = np.random.default_rng()
    sweep = QUICK if args.quick else SWEEP
    shapes = [dict(zip(sweep, values, strict=True)) for values in itertools.product(
        *(sweep[k] for k in ("n_q", "n_k", "bh", "d", "dtype")))]
    shapes.sort(key=lambda s: (s["n_q"], s["bh"], s["d"], s["dtype"], s["n_k"]))
    warm(shapes)
    rows, budget, t0 = [], {}, time.time()
    path = args.out / "bench_decode.csv"
    for shape in shapes:
        point = Point(shape, rng)
        for name in SCHEDULES:
            rows.append(measure(name, lambda n=name, pt=point: bench_ours(n, pt), shape,
                                budget))
        rows.append(measure(f"torch_sdpa_{SDPA[shape['dtype']]}",
                            lambda pt=point: bench_sdpa(pt), shape, budget))
        if shape == TARGET:
            for splits in SPLITS:
                rows.append(measure(f"split_kv_s{splits}", lambda s=splits, pt=point: bench_ours(
                    "split_kv", pt, {"splits": s}), shape, {}))
        del point
        torch.cuda.empty_cache()
        write_csv(path, rows, prov)
    print(f"bench_decode: {len(rows)} rows in {time.time() - t0:.0f} s -> {path}")
    target = [r for r in rows if all(r[k] == v for k, v in TARGET.items())]
    print(json.dumps([{k: r[k] for k in ("provider", "splits", "ms_kernel", "ms_call")}
                      for r in target], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
