"""Sliding-window attention: HBM traffic against the window, for every loop order.

    python -m experiments.window_traffic [--quick] [--results DIR] [--figures DIR]

A causal sliding window of w keys (FlashAttention's window_size = (w, 0): query i sees keys
i - w .. i) at N = 16384, d = 64, 64 x 64 tiles: the exact traffic models of every forward
order and of every backward order (`lo.predict_traffic`, elements, in float16 bytes) for w
from 128 to N. Orders that skip the K/V blocks wholly outside the window move Theta(N w d)
elements, not Theta(N^2 d): their lines run parallel to the w line until the window covers
the sequence; dense's S and P stay N x N.

Counted == model is checked where the simulator runs (N = 64, d = 8, 8 x 8 tiles, w = 0 ..
64, every forward and backward order): the counted kernels on random inputs, their outputs
and gradients against the float64 reference with the same mask first. On a GPU the same
points run on the device.

Writes window_traffic.json (provenance, model rows, measured rows) and the figure
`window_traffic`: (a) forward bytes vs w, (b) backward bytes vs w, (c) counted against model
at the measured points.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import numpy as np

import loop_orders as lo
from loop_orders.core.schedule import backward_of, grad_variants
from loop_orders.device import runtime
from loop_orders.reference import (
    attention_grad_reference,
    attention_reference,
    grad_tolerance,
    relative_error,
    tolerance,
)
from loop_orders.results import atomic_write_json, provenance

from . import common

MODEL = {"n": 16384, "d": 64, "block": 64, "windows": [128, 256, 512, 1024, 2048, 4096,
                                                       8192, 16384], "itemsize": 2}
MEASURED = {"n": 64, "d": 8, "block": 8, "windows": [0, 4, 16, 63]}
QUICK_MEASURED = {**MEASURED, "n": 24, "windows": [3, 23]}


def model_rows(sweep: dict) -> list[dict]:
    """Forward and backward model bytes of every order at each window."""
    rows = []
    for w in sweep["windows"]:
        args = {"n": sweep["n"], "d": sweep["d"], "block_q": sweep["block"],
                "block_k": sweep["block"], "window": (w, 0), "dtype": "float16"}
        for sched in lo.all_schedules():
            ledger = lo.predict_traffic(sched.name, save_lse=True, **args)
            rows.append({"pass": "forward", "order": sched.name, "window": w,
                         "bytes": ledger.bytes(sweep["itemsize"])})
        for variant in grad_variants(forwards=True):
            ledger = lo.predict_traffic(variant.schedule, backward=True,
                                        options=variant.options, **args)
            rows.append({"pass": "backward", "order": variant.label, "window": w,
                         "bytes": ledger.bytes(sweep["itemsize"])})
    return rows


def measured_rows(sweep: dict, seed: int = 7) -> list[dict]:
    """Counted elements against the model, forward and backward, each order and window;
    outputs and gradients checked against float64 first (raises if out of tolerance)."""
    rows = []
    n, d, block = sweep["n"], sweep["d"], sweep["block"]
    rng = np.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal((n, d)).astype(np.float32) for _ in range(4))
    for w, variant in itertools.product(sweep["windows"], grad_variants(forwards=True)):
        kwargs = {"schedule": variant.schedule, "block_q": block, "block_k": block,
                  "window": (w, 0), "options": variant.options, "count": True}
        g = lo.attention_grad(q, k, v, do, **kwargs)
        mask = g.problem.mask
        ref, _ = attention_reference(q, k, v, mask=mask)
        sched = lo.get_schedule(variant.schedule)
        err = relative_error(runtime.to_host(g.out), ref)
        grads = [runtime.to_host(x) for x in (g.dq, g.dk, g.dv)]
        refs = attention_grad_reference(q, k, v, do, mask=mask)
        grad_err = max(relative_error(x, r) for x, r in zip(grads, refs, strict=True))
        if err > tolerance("float32", sched.output_roundings(g.problem), v, ref) or \
                grad_err > grad_tolerance("float32", backward_of(sched).output_roundings(
                    g.problem)):
            raise AssertionError(f"{variant.label} window={w}: error {err:.2e}, gradients "
                                 f"{grad_err:.2e}")
        for pass_, counted, model in (
                ("forward", g.counts_forward, sched.model(g.problem)),
                ("backward", g.counts_backward,
                 lo.predict_traffic(variant.schedule, n=n, d=d, block_q=block, block_k=block,
                                    window=(w, 0), options=variant.options, backward=True))):
            rows.append({"pass": pass_, "order": variant.label, "window": w,
                         "counted": counted.total, "model": model.total,
                         "equal": counted == model})
    return rows


def plot(data: dict, figures: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    n = data["model_sweep"]["n"]
    for ax, pass_ in zip(axes[:2], ("forward", "backward"), strict=True):
        rows = [r for r in data["model"] if r["pass"] == pass_]
        for order in dict.fromkeys(r["order"] for r in rows):
            pts = [(r["window"], r["bytes"] / 2**20) for r in rows if r["order"] == order]
            ax.plot(*zip(*pts, strict=True), marker="o", label=order)
        ws = np.array(data["model_sweep"]["windows"], dtype=float)
        first = min(r["bytes"] for r in rows if r["window"] == ws[0]) / 2**20
        ax.plot(ws, first * ws / ws[0], "k:", label="proportional to w")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("window w (keys before the diagonal)")
        ax.set_ylabel("HBM traffic (MiB, float16)")
        ax.set_title(f"{pass_}, N = {n}, d = {data['model_sweep']['d']}, "
                     f"{data['model_sweep']['block']} x {data['model_sweep']['block']} tiles")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[2]
    rows = data["measured"]
    for pass_, marker in (("forward", "o"), ("backward", "s")):
        pts = [(r["model"], r["counted"]) for r in rows if r["pass"] == pass_]
        ax.scatter(*zip(*pts, strict=True), marker=marker, label=pass_, alpha=0.6)
    span = [min(r["model"] for r in rows), max(r["model"] for r in rows)]
    ax.plot(span, span, "k:", label="counted = model")
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):  # decades only: the minor labels run into each other
        axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("model (elements)")
    ax.set_ylabel("counted by the kernels (elements)")
    ax.set_title(f"every order, N = {data['measured_sweep']['n']}, w in "
                 f"{data['measured_sweep']['windows']}: "
                 f"{sum(r['equal'] for r in rows)} of {len(rows)} equal")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    prov = data["provenance"]
    fig.suptitle(f"sliding window (causal, window_size = (w, 0)); {prov['device']}, git "
                 f"{prov['git_sha'][:10]}, {prov['date']}", fontsize=9)
    fig.tight_layout()
    return common.save_figure(fig, figures, "window_traffic")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer measured points")
    parser.add_argument("--results", type=Path, default=Path("results"))
    parser.add_argument("--figures", type=Path, default=Path("figures"))
    args = parser.parse_args(argv)
    measured = QUICK_MEASURED if args.quick else MEASURED
    data = {"provenance": provenance(), "model_sweep": MODEL, "measured_sweep": measured,
            "model": model_rows(MODEL), "measured": measured_rows(measured)}
    args.results.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.results / "window_traffic.json", data)
    unequal = [r for r in data["measured"] if not r["equal"]]
    for path in plot(data, args.figures):
        print(path)
    print(f"window_traffic: {len(data['measured'])} measured points, {len(unequal)} counted "
          f"!= model")
    return 1 if unequal else 0


if __name__ == "__main__":
    raise SystemExit(main())
