"""Measured vs analytical HBM traffic, for every registered schedule.

Sweep (declared below as data): N x (block_q, block_k) x causal at head dim d, for each
schedule in the registry. Every point stores the schedule's closed-form model per tensor and
direction; points the backend can run are also measured by the counted kernels (GPU: all that
launch; simulator: N <= 64), and those are checked against the float64 reference first.

Figure `traffic`: (a) total traffic vs N on log-log axes, model as lines, measurements as
markers; (b) per-tensor breakdown at the largest measured N; (c) measured - model, which must
be zero. Without a GPU, measurements from a committed `traffic.gpu.json` are overlaid.

    python -m experiments.traffic [--quick] [--results-dir DIR] [--figures-dir DIR]
"""

from __future__ import annotations

import sys

import numpy as np

import loop_orders as lo
from loop_orders import results
from loop_orders.core.ledger import Ledger

from . import common

NAME = "traffic"

SWEEP = {
    "d": 16,
    "n": [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192],
    "blocks": [[16, 16], [32, 16], [16, 32]],   # (block_q, block_k)
    "causal": [False, True],
    "lines": "schedule",                       # one line per registered schedule
}
QUICK_SWEEP = {**SWEEP, "n": [16, 32, 128, 1024], "blocks": [[16, 16]], "causal": [False]}
# The configuration drawn as lines in panel (a) and bars in panel (b).
PLOT_BLOCKS, PLOT_CAUSAL = [16, 16], False


def declaration(ctx: common.Context) -> dict:
    return QUICK_SWEEP if ctx.quick else SWEEP


def configs(sweep: dict) -> list[dict]:
    """Every point of the sweep, one dict per (schedule, N, blocks, causal)."""
    return [{"schedule": sched.name, "n": n, "d": sweep["d"], "block_q": bq, "block_k": bk,
             "causal": causal}
            for sched in lo.all_schedules() for (bq, bk) in sweep["blocks"]
            for causal in sweep["causal"] for n in sweep["n"]]


def evaluate(config: dict) -> dict:
    sched = lo.get_schedule(config["schedule"])
    p = common.problem(sched, config["n"], config["d"], config["block_q"], config["block_k"],
                       config["causal"])
    return common.model_and_measure(sched, p, common.seed_for(config))


def run(ctx: common.Context) -> results.Sweep:
    sweep = ctx.sweep(NAME, meta={"d": declaration(ctx)["d"]})
    sweep.run(configs(declaration(ctx)), evaluate, progress=ctx.progress, desc=NAME)
    sweep.finish()
    return sweep


def residuals(records: list[dict]) -> list[dict]:
    """measured - model per measured point (per tensor and direction, and in total)."""
    out = []
    for rec in records:
        if rec["measured"] is None:
            continue
        measured, model = Ledger.from_dict(rec["measured"]), Ledger.from_dict(rec["model"])
        diff = measured - model
        tensors = common.declared_tensors([rec["key"].get("schedule")], [measured, model])
        worst = max(abs(n) for t in tensors for n in (diff.read(t), diff.write(t)))
        out.append({**rec["key"], "backend": rec["backend"], "total": diff.total,
                    "max_abs": worst})
    return out


def summary(data: dict) -> dict:
    """Numbers quoted in paper_notes.md."""
    res = residuals(data["records"])
    measured_n = sorted({r["n"] for r in res})
    return {"points": len(data["records"]), "measured": len(res),
            "max_abs_residual": max((r["max_abs"] for r in res), default=None),
            "measured_n": measured_n,
            "backend": data["provenance"].get("backend"),
            "device": data["provenance"].get("device")}


def _select(records, schedule, blocks, causal):
    rows = [r for r in records if r["key"]["schedule"] == schedule
            and [r["key"]["block_q"], r["key"]["block_k"]] == blocks
            and r["key"]["causal"] == causal]
    return sorted(rows, key=lambda r: r["key"]["n"])


def plot(ctx: common.Context) -> list:
    data = results.load(ctx.results_path(NAME))
    gpu = ctx.gpu_results(NAME)
    plt = common.pyplot()
    names = sorted({r["key"]["schedule"] for r in data["records"]},
                   key=lambda s: [x.name for x in lo.all_schedules()].index(s)
                   if s in lo.schedule_names() else 99)
    colors = common.schedule_colors(names)
    fig, (ax_n, ax_bar, ax_res) = plt.subplots(1, 3, figsize=(16, 4.8),
                                               gridspec_kw={"width_ratios": [1.3, 1, 1]})
    here = data["provenance"].get("backend", "?")
    for name in names:
        rows = _select(data["records"], name, PLOT_BLOCKS, PLOT_CAUSAL)
        n = [r["key"]["n"] for r in rows]
        ax_n.plot(n, [common.total(r["model"]) for r in rows], "-", color=colors[name],
                  label=f"{name} model")
        meas = [(r["key"]["n"], common.total(r["measured"])) for r in rows if r["measured"]]
        if meas:
            ax_n.plot(*zip(*meas, strict=True), "o", color=colors[name], ms=7, mfc="none",
                      label=f"{name} measured ({here})")
        if gpu is not None:
            g = [(r["key"]["n"], common.total(r["measured"]))
                 for r in _select(gpu["records"], name, PLOT_BLOCKS, PLOT_CAUSAL)
                 if r["measured"]]
            if g:
                ax_n.plot(*zip(*g, strict=True), "s", color=colors[name], ms=4,
                          label=f"{name} measured (gpu, committed)")
    measured_n = [r["key"]["n"] for r in data["records"] if r["measured"]]
    if measured_n:
        ax_n.axvspan(max(measured_n), max(r["key"]["n"] for r in data["records"]),
                     color="0.92", lw=0, label="model only (not measured here)")
    ax_n.set(xscale="log", yscale="log", xlabel="sequence length N",
             ylabel="HBM traffic (elements)",
             title=f"(a) traffic vs N, d={data['meta']['d']}, Br=Bc={PLOT_BLOCKS[0]}")
    ax_n.grid(True, which="both", alpha=0.3)
    ax_n.legend(fontsize=7, loc="upper left")

    # (b) per-tensor breakdown at the largest measured N of the plotted configuration
    measured_rows = [r for name in names for r in _select(data["records"], name, PLOT_BLOCKS,
                                                          PLOT_CAUSAL) if r["measured"]]
    n_bar = max(r["key"]["n"] for r in measured_rows) if measured_rows else None
    bar_rows = []
    for name in names:
        rows = [r for r in _select(data["records"], name, PLOT_BLOCKS, PLOT_CAUSAL)
                if r["key"]["n"] == n_bar]
        bar_rows.append(rows[0] if rows else None)
    bar_ledgers = [r["measured"] or r["model"] for r in bar_rows if r]
    tensors = common.declared_tensors(names, [Ledger.from_dict(x) for x in bar_ledgers])
    totals = [common.tensor_totals(r["measured"] or r["model"], tensors) if r else {}
              for r in bar_rows]
    drawn = [t for t in tensors if any(tot.get(t) for tot in totals)]
    tensor_colors = common.tensor_colors(drawn)
    bottom = np.zeros(len(names))
    for tensor in drawn:
        heights = np.array([tot.get(tensor, 0) for tot in totals], dtype=float)
        ax_bar.bar(names, heights, bottom=bottom, color=tensor_colors[tensor], label=tensor)
        bottom += heights
    for x, r in enumerate(bar_rows):
        if r:
            ax_bar.text(x, bottom[x], f"{common.total(r['model']):,}\n(model)", ha="center",
                        va="bottom", fontsize=8)
    source = "measured" if measured_rows else "model"
    ax_bar.set(ylabel="elements (read + write)", ylim=(0, bottom.max() * 1.2),
               title=f"(b) per tensor at N={n_bar} ({source})")
    ax_bar.legend(fontsize=7, ncol=2)

    # (c) residuals over every measured point of every configuration
    for label, d in (("", data), (" (gpu)", gpu)):
        if d is None:
            continue
        res = residuals(d["records"])
        for i, name in enumerate(names):  # nudged sideways so coinciding zeros stay visible
            pts = [(r["n"] * (1 + 0.06 * (i - 1)), r["total"]) for r in res
                   if r["schedule"] == name]
            if pts:
                ax_res.plot(*zip(*pts, strict=True), "o" if not label else "s",
                            color=colors[name], mfc="none" if not label else None,
                            label=f"{name}{label}")
    res_all = residuals(data["records"]) + (residuals(gpu["records"]) if gpu else [])
    worst = max((r["max_abs"] for r in res_all), default=0)
    ax_res.axhline(0, color="k", lw=0.8)
    ax_res.set(xscale="log", ylim=(-1, 1), xlabel="N", ylabel="measured − model (elements)",
               title=f"(c) residual: max |Δ| = {worst} over {len(res_all)} measured points\n"
                     f"(every tensor, direction, block size, causal or not)")
    ax_res.legend(fontsize=7)
    fig.suptitle(f"Measured vs modelled HBM traffic — markers: kernels with counters "
                 f"({data['provenance'].get('device')}); lines: closed-form model "
                 f"(model only beyond the measured N)", fontsize=10)
    fig.tight_layout()
    return common.save_figure(fig, ctx.figures_dir, NAME)


def main(argv=None) -> int:
    common.run_experiment(sys.modules[__name__], argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
