"""Grouped-query decode on a GPU: packed against per-query-head loop orders, beside SDPA.

    python -m experiments.bench_gqa_decode [--out DIR] [--quick] [--block-k 32,64,128]

One query (n_q = 1, causal: it sees every key) against n_k in {4096 ... 65536} keys, H_q = 32
query heads over H_kv = 8 K/V heads (Llama-3-8B's grouping), d = 128, float16, batch 1 and 4:
split_kv and q_outer per query head (each K/V head read 4 times) and packed (`pack_gqa`: read
once), beside torch SDPA with enable_gqa=True (the flash backend where it takes the call, else
the one torch picks; the row names it) in the same run. Every point is checked against the
float64 reference (K/V repeated over the groups) before it is timed, and its counted traffic
against the model. Times: the kernels alone (launches back to back between CUDA events,
`bench_runtime.time_launches`) and the public call `lo.attention` on torch tensors. The tiles
are 64 x 64 (clamped to the query rows); `--block-k` adds packed split_kv rows at other K/V
block sizes (a split's blocks are fewer and larger, its CTAs' shared memory larger).

Writes bench_gqa_decode.csv (provider, shape, ms_kernel, ms_call, model and counted bytes of K
and V and of everything, achieved GB/s, error, status) with provenance.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path
from typing import NamedTuple

import numpy as np

import loop_orders as lo
from experiments.bench_runtime import time_launches
from experiments.gpu_common import counted_launch, write_csv
from loop_orders.device.arrays import KINDS
from loop_orders.reference import attention_reference, relative_error, tolerance
from loop_orders.warm import Job, warm

H_Q, H_KV, D = 32, 8, 128
SWEEP = {"n_k": [4096, 16384, 65536], "batch": [1, 4]}
QUICK = {"n_k": [4096, 65536], "batch": [1]}
PROVIDERS = [("split_kv", False), ("split_kv", True), ("q_outer", False), ("q_outer", True)]
BLOCK_Q, BLOCK_K = 64, 64


class Provider(NamedTuple):
    """One of our rows: a schedule, per query head or packed, at K/V block size block_k."""

    name: str
    packed: bool
    block_k: int = BLOCK_K

    @property
    def label(self) -> str:
        label = f"{self.name} {'packed' if self.packed else 'per head'}"
        return label if self.block_k == BLOCK_K else f"{label}, block_k {self.block_k}"


def providers(block_ks: list[int]) -> list[Provider]:
    """PROVIDERS at BLOCK_K, then packed split_kv at each other block_k asked for."""
    return [Provider(name, packed) for name, packed in PROVIDERS] + [
        Provider("split_kv", True, bk) for bk in block_ks if bk != BLOCK_K]


class Point:
    """One shape's float16 q, k, v on the GPU and the float64 reference of heads 0 and last."""

    def __init__(self, n_k: int, batch: int, seed: int):
        import torch

        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.n_k, self.batch = n_k, batch
        self.q = torch.randn(batch, H_Q, 1, D, device="cuda", dtype=torch.float16,
                             generator=gen)
        self.k, self.v = (torch.randn(batch, H_KV, n_k, D, device="cuda", dtype=torch.float16,
                                      generator=gen) for _ in range(2))
        group = H_Q // H_KV
        self.heads = [0, H_Q - 1]
        q = self.q[0, self.heads].double().cpu().numpy()
        kv = [x[0, [h // group for h in self.heads]].double().cpu().numpy()
              for x in (self.k, self.v)]
        self.ref, _ = attention_reference(q, *kv)
        self.v_host = kv[1]

    def check(self, out, roundings: int) -> float:
        got = out[0, self.heads].double().cpu().numpy()
        err = relative_error(got, self.ref)
        tol = tolerance("float16", roundings, self.v_host, self.ref)
        if not (np.isfinite(got).all() and err <= tol):
            raise AssertionError(f"error {err:.2e} > {tol:.2e} at n_k={self.n_k}")
        return err


def problem(who: Provider, point: Point) -> lo.Problem:
    return lo.make_problem(who.name, n_q=1, n_k=point.n_k, d=D, batch=point.batch,
                           heads=H_Q, kv_heads=H_KV, block_q=BLOCK_Q, block_k=who.block_k,
                           causal=True, dtype="float16", pack_gqa=who.packed)


def bench_ours(who: Provider, point: Point) -> dict:
    import torch

    sched = lo.get_schedule(who.name)
    p = problem(who, point)
    kind = KINDS["torch"]
    qv = kind.view(point.q).reshape(p.bh, p.n_q, D)
    kv, vv = (kind.view(x).reshape(p.bh_kv, p.n_k, D) for x in (point.k, point.v))
    out = torch.empty_like(point.q)
    run = counted_launch(sched, p, qv, kv, vv, kind.view(out).reshape(p.bh, p.n_q, D))
    err = point.check(out, sched.output_roundings(p))
    ms_kernel = time_launches(run.launch)

    def public(_i):
        lo.attention(point.q, point.k, point.v, schedule=who.name, block_q=BLOCK_Q,
                     block_k=who.block_k, causal=True, pack_gqa=who.packed)

    kv_elems = run.model.read("k") + run.model.read("v")
    return {"ms_kernel": ms_kernel, "ms_call": time_launches(public),
            "kv_bytes": 2 * kv_elems, "model_bytes": run.model.bytes(2),
            "counted_bytes": run.counted.bytes(2), "rel_error": err,
            "splits": sched.resolved_options(p).get("splits", ""), "block_k": p.block_k}


def bench_sdpa(point: Point) -> dict:
    from torch.nn import functional
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def call(backend):
        def launch(_i):
            with sdpa_kernel(backend):
                return functional.scaled_dot_product_attention(point.q, point.k, point.v,
                                                      enable_gqa=True)
        return launch

    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION), ("math", SDPBackend.MATH)):
        try:
            out = call(backend)(0)
        except RuntimeError:
            continue
        err = point.check(out, 1)
        ms = time_launches(call(backend))
        return {"ms_kernel": ms, "ms_call": ms, "rel_error": err, "backend": name,
                "kv_bytes": 2 * 2 * point.batch * H_KV * point.n_k * D}
    raise RuntimeError("no SDPA backend took enable_gqa=True")


def row(provider: str, point: Point, **values) -> dict:
    base = {"provider": provider, "n_q": 1, "n_k": point.n_k, "batch": point.batch,
            "heads": H_Q, "kv_heads": H_KV, "d": D, "dtype": "float16", "splits": "",
            "block_k": "",
            "ms_kernel": "", "ms_call": "", "kv_bytes": "", "model_bytes": "",
            "counted_bytes": "", "gbps": "", "rel_error": "", "backend": "", "status": "ok"}
    base.update(values)
    total = base["model_bytes"] or base["kv_bytes"]
    if total and base["ms_kernel"]:
        base["gbps"] = round(total / base["ms_kernel"] / 1e6, 1)
    if base["rel_error"] != "":
        base["rel_error"] = f"{base['rel_error']:.2e}"
    return base


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--block-k", default=str(BLOCK_K),
                        help="comma-separated K/V block sizes of packed split_kv rows")
    args = parser.parse_args(argv)
    sweep = QUICK if args.quick else SWEEP
    shapes = list(itertools.product(sweep["n_k"], sweep["batch"]))
    ours = providers([int(x) for x in args.block_k.split(",")])
    first = Point(4096, 1, 0)
    warm([Job(who.name, problem(who, first), count) for who in ours for count in (False, True)])
    rows = []
    for i, (n_k, batch) in enumerate(shapes):
        point = Point(n_k, batch, i + 1)
        for who in ours:
            try:
                rows.append(row(who.label, point, **bench_ours(who, point)))
            except (ValueError, AssertionError) as exc:
                rows.append(row(who.label, point, status=f"failed: {str(exc)[:160]}"))
            print(rows[-1], flush=True)
        rows.append(row("torch sdpa enable_gqa", point, **bench_sdpa(point)))
        print(rows[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "bench_gqa_decode.csv", rows)
    return 1 if any(r["status"] != "ok" for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
