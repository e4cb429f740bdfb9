"""FlashAttention's own test grid, by FlashAttention's own error rule, through the torch op.

    python -m experiments.fa_grid [--schedule q_outer] [--out DIR]     # on a GPU, torch there

The cells of flash-attention's test_flash_attn_output: (n_q, n_k) in SEQLENS (unequal,
odd, tails), head dims 32 ... 256 (odd ones among them), float16 and bfloat16, causal
(bottom-right aligned) or not, batch 2, 3 heads. Each cell runs `loop_orders.torch.attention`
forward and backward on CUDA tensors and passes when out, dq, dk and dv are each within 2x
plain PyTorch attention's error in the same dtype, both measured against a float32
reference of the same plain attention (FlashAttention's rule: max |ours - ref| <=
2 max |plain - ref|). A call the op refuses is a refused cell; the target is 0 refused,
0 failed. The kernels are compiled ahead in parallel (`loop_orders.warm`).

Writes fa_grid.json (every cell: errors, outcome; totals; provenance).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import time
from pathlib import Path

import loop_orders as lo
from loop_orders.api import named_tiles
from loop_orders.api_grad import grad_problem, grad_tiles
from loop_orders.core.schedule import backward_of
from loop_orders.results import atomic_write_text, provenance
from loop_orders.warm import Job, warm

SEQLENS = [(113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256),
           (1024, 1024), (1023, 1024), (1024, 1023), (2048, 2048)]
DIMS = [32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256]
DTYPES = ["float16", "bfloat16"]
BATCH, HEADS = 2, 3


def plain_attention(q, k, v, do, causal: bool, dtype):
    """Plain PyTorch attention in `dtype` (scores, softmax and P V in it, as FlashAttention's
    reference without upcasting; causal bottom-right aligned, a row that sees no key giving
    0) and its gradients for the output gradient do: [out, dq, dk, dv]."""
    import torch

    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    n_q, n_k = q.shape[-2], k.shape[-2]
    s = (leaves[0] @ leaves[1].transpose(-1, -2)) * q.shape[-1] ** -0.5
    seen = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device)
    if causal:
        seen = torch.arange(n_k, device=q.device)[None] <= \
            torch.arange(n_q, device=q.device)[:, None] + n_k - n_q
    p = torch.softmax(s.masked_fill(~seen, float("-inf")), dim=-1)
    p = torch.where(seen.any(-1, keepdim=True), p, 0.0).to(dtype)
    out = p @ leaves[2]
    out.backward(do.to(dtype))
    return [out.detach()] + [x.grad for x in leaves]


def check_cell(schedule: str, n_q: int, n_k: int, d: int, dtype: str, causal: bool,
               device: str = "cuda", batch: int = BATCH, heads: int = HEADS,
               seed: int = 0) -> dict:
    """One cell: outcome ("ok", "failed", "refused"), and per output ours' and plain
    PyTorch's max error against the float32 reference."""
    import torch

    import loop_orders.torch as lot

    gen = torch.Generator(device=device).manual_seed(seed)
    tdt = getattr(torch, dtype)
    q, do = (torch.randn(batch, heads, n_q, d, device=device, generator=gen).to(tdt)
             for _ in range(2))
    k, v = (torch.randn(batch, heads, n_k, d, device=device, generator=gen).to(tdt)
            for _ in range(2))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    try:
        out = lot.attention(*leaves, schedule=schedule, causal=causal)
        out.backward(do)
    except (ValueError, TypeError) as exc:
        return {"outcome": "refused", "reason": str(exc)[:300]}
    ours = [out.detach()] + [x.grad for x in leaves]
    ref = plain_attention(q, k, v, do, causal, torch.float32)
    plain = plain_attention(q, k, v, do, causal, tdt)
    errors, failed = {}, []
    for name, a, r, p in zip(("out", "dq", "dk", "dv"), ours, ref, plain, strict=True):
        mine, theirs = (float((x.float() - r).abs().max()) for x in (a, p))
        errors[name] = {"ours": mine, "plain": theirs}
        if not mine <= 2 * theirs:
            failed.append(name)
    return {"outcome": "failed" if failed else "ok", "failed": failed, "errors": errors}


def grad_job(schedule: str, d: int, dtype: str, causal: bool) -> Job:
    """The torch op's kernels for a head dim, dtype and mask, at the tiles it chooses."""
    sched = lo.get_schedule(schedule)
    problem = grad_problem(sched, 1024, 1024, d, d, BATCH, HEADS, None, dtype, causal, None,
                           (-1, -1), False)
    p = grad_tiles(sched, backward_of(sched), problem(*named_tiles(None, None)), problem,
                   None, None, False, False)
    return Job(schedule, p, False, backward=True)


def cells(dims=DIMS, seqlens=SEQLENS, dtypes=DTYPES):
    return [dict(n_q=n_q, n_k=n_k, d=d, dtype=dtype, causal=causal)
            for (n_q, n_k), d, dtype, causal in itertools.product(seqlens, dims, dtypes,
                                                                  (False, True))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", default="q_outer")
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--workers", type=int, default=16, help="compile processes")
    args = parser.parse_args(argv)
    grid = cells()
    jobs = []
    for key in {(c["d"], c["dtype"], c["causal"]) for c in grid}:
        with contextlib.suppress(ValueError):  # refused: the cell says so when it runs
            jobs.append(grad_job(args.schedule, *key))
    warm(jobs, args.workers)
    rows, t0 = [], time.time()
    for i, c in enumerate(grid):
        rows.append({**c, **check_cell(args.schedule, **c, seed=i)})
        print(f"[{i + 1}/{len(grid)}] {rows[-1]['outcome']:8s} {c} "
              f"{rows[-1].get('failed') or rows[-1].get('reason') or ''}", flush=True)
    totals = {k: sum(r["outcome"] == k for r in rows) for k in ("ok", "refused", "failed")}
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "fa_grid.json", json.dumps(
        {"provenance": provenance(), "schedule": args.schedule, "batch": BATCH,
         "heads": HEADS, "cells": len(rows), "totals": totals,
         "seconds": round(time.time() - t0, 1), "rows": rows}, indent=1))
    print(f"fa_grid: {totals}", flush=True)
    return 0 if totals["ok"] == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
