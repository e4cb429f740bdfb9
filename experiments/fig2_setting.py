"""The FlashAttention paper's Figure 2 (left) setting, measured: one forward + backward pass of
attention in GPT-2 medium's shape, N = 1024, d = 64, 16 heads, batch 64 (causal), for every
schedule and backward option, float16 and float32.

    python -m experiments.fig2_setting [--out DIR]            # on a GPU with ncu (and torch)

Per (run, dtype, pass): the model's bytes, the counted bytes (counters == model asserted),
Nsight Compute's global load + store bytes seen by L1 (the logical traffic) and DRAM bytes
(after the 60 MB L2), summed over the pass's kernels, and the pass's runtime (its kernels
alone, launched back to back). Outputs and gradients are checked against float64 on two
heads first. Writes fig2_setting.csv with provenance.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np

import loop_orders as lo
from experiments.bench_runtime import time_launches
from experiments.gpu_common import (
    GradBuffers,
    check_gradients,
    check_output,
    warm,
    write_csv,
)
from experiments.hw_traffic import profile_rows
from loop_orders.core.schedule import backward_of, grad_variants
from loop_orders.device import runtime
from loop_orders.results import provenance

SETTING = {"n": 1024, "d": 64, "heads": 16, "batch": 64, "causal": True}
DTYPES = ["float16", "float32"]
BLOCKS = (64, 64)


def runs() -> list[dict]:
    """Every schedule with a backward pass, with every value of its backward's options."""
    return [{"run": v.label, "schedule": v.schedule, "options": v.options}
            for v in grad_variants(forwards=True)]


def problem(run: dict, dtype: str) -> lo.Problem:
    return lo.make_problem(run["schedule"], n_q=SETTING["n"], d=SETTING["d"],
                           batch=SETTING["batch"], heads=SETTING["heads"],
                           block_q=BLOCKS[0], block_k=BLOCKS[1], causal=SETTING["causal"],
                           save_lse=True, dtype=dtype, options=run["options"])


def configs() -> list[dict]:
    return [{**run, "dtype": dtype} for run in runs() for dtype in DTYPES]


def launch_all(config_file: Path) -> None:
    """Under ncu: one uncounted forward + backward per configuration, in file order."""
    rng = np.random.default_rng()
    for cfg in json.loads(config_file.read_text()):
        sched = lo.get_schedule(cfg["schedule"])
        bufs = GradBuffers(sched, problem(cfg, cfg["dtype"]), rng)
        bufs.launch_both(0)
        runtime.synchronize()
        del bufs


def measure(cfg: dict, rng) -> list[dict]:
    """Counted passes (== model), checked outputs and gradients, kernel times."""
    sched = lo.get_schedule(cfg["schedule"])
    p = problem(cfg, cfg["dtype"])
    bwd = backward_of(sched)
    bufs = GradBuffers(sched, p, rng)
    rows = []
    for pass_, order, launch in (("forward", sched, bufs.launch),
                                 ("backward", bwd, bufs.launch_backward)):
        bufs.counts.copy_to_device(np.zeros(lo.core.ledger.n_slots(), np.int64))
        if pass_ == "backward":
            bufs.launch(0)  # the forward the backward reads, uncounted
        launch(0, count=True)
        counted = lo.Ledger.from_array(runtime.to_host(bufs.counts), order.ledger_tensors())
        model = order.model(p)
        assert counted == model, f"{cfg['run']} {pass_}: counters != model"
        rows.append({"run": cfg["run"], "schedule": cfg["schedule"],
                     "options": json.dumps(cfg["options"] or {}), "dtype": cfg["dtype"],
                     "pass": pass_, **SETTING, "block_q": p.block_q, "block_k": p.block_k,
                     "kernels": len(order.kernels(p, False)),
                     "model_elements": model.total, "model_bytes": model.bytes(p.itemsize),
                     "counted_bytes": counted.bytes(p.itemsize)})
    bufs.launch_both(0)
    err = check_output(sched, p, *bufs.host[0], runtime.to_host(bufs.out), rng)
    grads = [runtime.to_host(g) for g in bufs.grads]
    grad_err = check_gradients(sched, p, *bufs.host[0], bufs.do_host, grads, rng)
    rows[0]["ms"] = time_launches(bufs.launch)
    rows[1]["ms"] = time_launches(bufs.launch_backward)
    rows[0]["rel_error"], rows[1]["rel_error"] = f"{err:.2e}", f"{grad_err:.2e}"
    for row in rows:
        print(f"{row['run']:22s} {row['dtype']} {row['pass']:8s}: model "
              f"{row['model_bytes'] / 1e9:7.3f} GB, {row['ms']:8.3f} ms", flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--launch", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--no-ncu", action="store_true", help="skip the Nsight Compute pass")
    args = parser.parse_args(argv)
    if args.launch:
        launch_all(args.launch)
        return 0
    if runtime.SIMULATOR:
        print("fig2_setting: needs a CUDA GPU; nothing measured")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng()
    cfgs = configs()
    warm((cfg["schedule"], problem(cfg, cfg["dtype"]), True) for cfg in cfgs)
    rows = []
    for cfg in cfgs:
        rows += measure(cfg, rng)
        runtime.release_memory()
    ncu = shutil.which("ncu")
    if ncu and not args.no_ncu:
        names = {k.name for cfg in cfgs for order in (lo.get_schedule(cfg["schedule"]),
                                                      backward_of(lo.get_schedule(cfg["schedule"])))
                 for k in order.kernels(problem(cfg, cfg["dtype"]), False)}
        profile_rows(ncu, rows, cfgs, "regex:" + "|".join(sorted(names)),
                     "experiments.fig2_setting", args.out / "fig2_ncu.log", 100000)
    import torch

    write_csv(args.out / "fig2_setting.csv", rows, provenance(torch=torch.__version__))
    print(f"fig2_setting: {len(rows)} rows -> {args.out / 'fig2_setting.csv'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
