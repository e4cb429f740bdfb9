"""GPU fuzz: random calls the API accepts, every schedule, forward and backward, on a GPU.

    python -m experiments.gpu_fuzz --configs 200 --out results      # on a GPU (torch there)

Each configuration is drawn from a seeded generator: a schedule with one example value of each
of its forward and backward options, a dtype (float32 exact or on TF32 tensor cores, float16,
bfloat16), head dims (odd ones, dv != d), tiles (odd ones), a mask (none, causal, sliding
windows; n_q != n_k bottom-right aligned), lengths with tail blocks, batch and heads. The
compile-time part (schedule, options, dtype, dims, tiles, mask) is drawn from FAMILIES
families so that their kernels can be compiled ahead in parallel (`loop_orders.warm`); the
lengths, batch and heads are drawn per configuration. Through the public calls on torch CUDA
tensors (what users run), each configuration runs

    lo.attention, counted and not        -> output against the float64 reference, within the
                                            library's tolerance; counters == model exactly
    lo.attention_grad, counted and not   -> dq, dk, dv likewise; backward counters == model

A call the API refuses (ValueError/TypeError before anything is copied) is recorded with its
reason, as allowed; anything else raised (a launch failure) or a wrong number is a failure.
Writes gpu_fuzz.json (every configuration, its outcome, provenance) and exits 1 on a failure.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from dataclasses import replace
from pathlib import Path

import numpy as np

import loop_orders as lo
from loop_orders.api_grad import grad_problem
from loop_orders.core.schedule import backward_of, grad_variants
from loop_orders.reference import (
    attention_grad_reference,
    attention_reference,
    grad_tolerances,
    relative_error,
    tf32_grad_tolerance,
    tf32_tolerance,
    tolerance,
)
from loop_orders.results import atomic_write_text, provenance
from loop_orders.warm import Job, warm

FAMILIES = 48
DIMS = [(64, 64), (128, 128), (40, 72), (96, 32), (24, 24), (256, 128), (33, 17), (80, 80)]
TILES = [(64, 64), (128, 64), (64, 128), (32, 32), (16, 16), (128, 128), (48, 80), (112, 16)]
MASKS = [(False, (-1, -1)), (True, (-1, -1)), (False, (64, 0)), (True, (100, -1)),
         (False, (32, 32))]
DTYPES = [("float32", "ieee"), ("float32", "tf32"), ("float16", "ieee"), ("bfloat16", "ieee"),
          ("float16", "ieee"), ("bfloat16", "ieee")]
MAX_N = 700
DEVICE = "cuda"  # where the inputs live ("cpu" tries the script on the simulator)


def draw_family(rng, variant) -> dict:
    """The compile-time part of a configuration (what its kernels depend on)."""
    sched = lo.get_schedule(variant.schedule)
    options = {key: opt.examples[rng.integers(len(opt.examples))]
               for key, opt in sched.OPTIONS.items() if opt.examples}
    options.update(variant.options or {})
    dtype, precision = DTYPES[rng.integers(len(DTYPES))]
    if precision != "ieee" and not sched.TENSOR_CORES:
        precision = "ieee"
    d, dv = DIMS[rng.integers(len(DIMS))]
    block_q, block_k = TILES[rng.integers(len(TILES))]
    causal, window = MASKS[rng.integers(len(MASKS))]
    return {"schedule": variant.schedule, "label": variant.label, "options": options,
            "dtype": dtype, "precision": precision, "d": d, "dv": dv, "block_q": block_q,
            "block_k": block_k, "causal": causal, "window": window}


def draw_config(rng, family: dict) -> dict:
    """A family with lengths (a tail block mostly; a quarter shorter than a tile: the tiles
    clamp), batch and heads."""
    short = rng.random() < 0.25
    low = 1 if short else max(family["block_q"], family["block_k"])
    n_q = int(rng.integers(low, MAX_N + 1))
    n_k = n_q if rng.random() < 0.4 else int(rng.integers(low, MAX_N + 1))
    heads = int(rng.integers(1, 5))
    # grouped-query attention in a third of the cases with an even head count, packed in
    # half of those where the mask allows it
    kv_heads = heads // 2 if heads % 2 == 0 and rng.random() < 1 / 3 else heads
    pack = kv_heads < heads and not family["causal"] and family["window"] == (-1, -1) \
        and bool(rng.random() < 0.5)
    return {**family, "n_q": n_q, "n_k": n_k, "batch": int(rng.integers(1, 3)),
            "heads": heads, "kv_heads": kv_heads, "pack_gqa": pack,
            "save_lse": bool(rng.random() < 0.5), "seed": int(rng.integers(2**31))}


def problem_of(c: dict) -> lo.Problem:
    return lo.make_problem(c["schedule"], n_q=c["n_q"], n_k=c["n_k"], d=c["d"], dv=c["dv"],
                           batch=c["batch"], heads=c["heads"], block_q=c["block_q"],
                           block_k=c["block_k"], causal=c["causal"], save_lse=c["save_lse"],
                           dtype=c["dtype"], options=c["options"], precision=c["precision"],
                           window=c["window"], kv_heads=c["kv_heads"], pack_gqa=c["pack_gqa"])


def inputs(c: dict):
    """q, k, v, dO as torch CUDA tensors of the configuration's dtype (unit normal entries)
    and as float64 NumPy arrays of the same (rounded) values, for the reference (K and V
    repeated over each group's query heads)."""
    import torch

    gen = torch.Generator(device=DEVICE).manual_seed(c["seed"])
    dt = getattr(torch, c["dtype"])
    b, h, h_kv = c["batch"], c["heads"], c["kv_heads"]
    shapes = [(b, h, c["n_q"], c["d"]), (b, h_kv, c["n_k"], c["d"]),
              (b, h_kv, c["n_k"], c["dv"]), (b, h, c["n_q"], c["dv"])]
    dev = [torch.randn(s, generator=gen, device=DEVICE).to(dt) for s in shapes]
    host = [x.double().cpu().numpy() for x in dev]
    host[1:3] = [np.repeat(x, h // h_kv, axis=1) for x in host[1:3]]
    return dev, host


def mask_of(c: dict):
    """The configuration's mask as the reference takes it (before any packing)."""
    return lo.make_problem(c["schedule"], n_q=c["n_q"], n_k=c["n_k"], d=c["d"],
                           block_q=c["block_q"], block_k=c["block_k"], causal=c["causal"],
                           window=c["window"]).mask


def check_forward(c, dev, host, count: bool) -> dict:
    sched = lo.get_schedule(c["schedule"])
    q, k, v, _ = dev
    res = lo.attention(q, k, v, schedule=c["schedule"], block_q=c["block_q"],
                       block_k=c["block_k"], causal=c["causal"], save_lse=c["save_lse"],
                       options=c["options"], count=count, precision=c["precision"],
                       window=c["window"], pack_gqa=c["pack_gqa"])
    out = res.out.double().cpu().numpy()
    mask = mask_of(c)
    ref, _ = attention_reference(*host[:3], mask=mask)
    if c["precision"] != "ieee":
        tol = tf32_tolerance(*host[:3], ref, mask=mask, precision=c["precision"])
    else:
        tol = tolerance(c["dtype"], sched.output_roundings(res.problem), host[2], ref)
    err = relative_error(out, ref)
    problems = []
    if not (np.isfinite(out).all() and err <= tol):
        problems.append(f"output error {err:.3g} > {tol:.3g}")
    if count and res.counts != sched.model(res.problem):
        problems.append(f"counted {res.counts} != model {sched.model(res.problem)}")
    return {"error": err, "tolerance": tol, "problems": problems}


def check_backward(c, dev, host, count: bool) -> dict:
    sched = lo.get_schedule(c["schedule"])
    bwd = backward_of(sched)
    q, k, v, do = dev
    g = lo.attention_grad(q, k, v, do, schedule=c["schedule"], block_q=c["block_q"],
                          block_k=c["block_k"], causal=c["causal"], options=c["options"],
                          count=count, window=c["window"], pack_gqa=c["pack_gqa"],
                          precision=c["precision"])
    mask = mask_of(c)
    refs = attention_grad_reference(*host, mask=mask)
    tol = grad_tolerances(*host, refs, c["dtype"], bwd.output_roundings(g.problem.for_backward()),
                          mask=mask)
    if c["precision"] != "ieee":  # TF32 in both passes: its bound for every gradient
        bound = tf32_grad_tolerance(*host[:2], precision=c["precision"], mask=mask)
        tol = replace(tol, dq=bound, dk=bound, dv=bound)
    group = c["heads"] // c["kv_heads"]
    if group > 1:  # dk, dv of a K/V head: the sum over its query heads (and their bounds)
        refs = [refs[0], *(r.reshape(r.shape[0], -1, group, *r.shape[2:]).sum(2)
                           for r in refs[1:])]
        tol = replace(tol, dk=group * tol.dk, dv=group * tol.dv)
    errs, problems = [], []
    for name, got, ref, bound in zip(("dq", "dk", "dv"), (g.dq, g.dk, g.dv), refs,
                                     (tol.dq, tol.dk, tol.dv), strict=True):
        got = got.double().cpu().numpy()
        err = relative_error(got, ref)
        errs.append(err)
        if not (np.isfinite(got).all() and err <= bound):
            problems.append(f"{name} error {err:.3g} > {bound:.3g}")
    model = lo.api.backward_traffic(bwd, g.problem)
    if count and g.counts_backward != model:
        problems.append(f"backward counted {g.counts_backward} != model {model}")
    return {"errors": errs, "problems": problems}


def run_config(c: dict) -> dict:
    """One configuration through the four calls; its outcome: ok, refused (with the reason)
    or failed (with what went wrong)."""
    try:
        p = problem_of(c)
        lo.api.check_launch(lo.get_schedule(c["schedule"]), p, count=True)
    except (ValueError, TypeError) as exc:
        return {"outcome": "refused", "reason": str(exc)}
    dev, host = inputs(c)
    steps = {}
    try:
        for count in (True, False):
            steps[f"forward count={count}"] = check_forward(c, dev, host, count)
        for count in (True, False):
            try:
                steps[f"backward count={count}"] = check_backward(c, dev, host, count)
            except (ValueError, TypeError) as exc:  # a backward refused up front
                steps[f"backward count={count}"] = {"refused": str(exc), "problems": []}
    except Exception as exc:  # a launch failure: what this fuzz is for
        return {"outcome": "failed", "steps": steps,
                "problems": [f"{type(exc).__name__}: {exc}"],
                "traceback": traceback.format_exc(limit=6)}
    problems = [f"{step}: {x}" for step, r in steps.items() for x in r["problems"]]
    return {"outcome": "failed" if problems else "ok", "steps": steps, "problems": problems}


def call_jobs(c: dict) -> list:
    """The calls a configuration makes, as `warm` jobs, counted and not: lo.attention's, and
    lo.attention_grad's, whose forward saves lse, at the configuration's precision --
    kernels of their own (the forward's job left out where they are the same)."""
    p = problem_of(c)
    sched = lo.get_schedule(c["schedule"])
    grad = grad_problem(sched, c["n_q"], c["n_k"], c["d"], c["dv"], c["batch"], c["heads"],
                        c["kv_heads"], c["dtype"], c["causal"], c["options"], c["window"],
                        c["pack_gqa"], c["precision"])
    grad_p = grad(c["block_q"], c["block_k"])
    return [job for count in (True, False)
            for job in (Job(c["schedule"], grad_p, count, backward=True),
                        *([Job(c["schedule"], p, count)] if p != grad_p else []))]


def warm_families(configs: list, workers: int) -> None:
    """Compile the configurations' kernels ahead, in parallel (`warm` drops what the API
    refuses: a refused forward, or a refused backward leaving the forward to compile)."""
    jobs = []
    for c in configs:
        try:
            jobs += call_jobs(c)
        except (ValueError, TypeError):
            continue
    warm(jobs, workers)


def write_summary(args, configs: list, rows: list, seconds: float) -> dict:
    """gpu_fuzz.json with the rows so far; returns the totals."""
    totals = {k: sum(r["outcome"] == k for r in rows) for k in ("ok", "refused", "failed")}
    summary = {"provenance": provenance(), "seed": args.seed, "families": FAMILIES,
               "configs": len(configs), "done": len(rows), "totals": totals,
               "schedules": sorted({c["label"] for c in configs}),
               "seconds": round(seconds, 1), "rows": rows}
    atomic_write_text(args.out / "gpu_fuzz.json", json.dumps(summary, indent=1, default=str))
    return totals


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=20261205)
    parser.add_argument("--workers", type=int, default=16, help="compile processes")
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    variants = grad_variants(forwards=True)
    families = [draw_family(rng, variants[i % len(variants)]) for i in range(FAMILIES)]
    configs = [draw_config(rng, families[i % len(families)]) for i in range(args.configs)]
    warm_families(configs, args.workers)
    rows, t0 = [], time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    for i, c in enumerate(configs):
        outcome = run_config(c)
        rows.append({"config": c, **outcome})
        print(f"[{i + 1}/{len(configs)}] {outcome['outcome']:8s} {c['label']} {c['dtype']} "
              f"{c['precision']} n_q={c['n_q']} n_k={c['n_k']} d={c['d']} dv={c['dv']} "
              f"tiles={c['block_q']}x{c['block_k']} causal={c['causal']} "
              f"window={c['window']} {'; '.join(outcome.get('problems', [])) or ''}"
              f"{outcome.get('reason', '')[:100]}", flush=True)
        # after every configuration: a run cut short keeps what it did
        totals = write_summary(args, configs, rows, time.time() - t0)
    print(f"gpu_fuzz: {totals} in {time.time() - t0:.0f} s", flush=True)
    return 1 if totals["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
