"""Figures of the GPU experiments, drawn from their committed results files.

The measurements themselves need a GPU and minutes of device time, so `loop-orders figures`
does not rerun them: `python -m experiments.bench_runtime` and `python -m
experiments.hw_traffic` do (README, "GPU experiments"). This step plots whatever of
bench_runtime.csv, hw_traffic.csv and bench_blocksize.csv the results directory holds, and
says which is missing.
"""

from __future__ import annotations

from pathlib import Path

from . import common, plot_bench

NAME = "gpu"


def run(ctx: common.Context) -> None:
    """Nothing to measure here; see the module docstring."""


L2_BYTES = 60 * 2**20  # the H200 we measure on (DESIGN.md: 132 SMs, 60 MB L2)


def plot_hw(rows: list[dict], out: Path) -> list[Path]:
    """Two figures: per schedule, model, counted, ncu logical and DRAM bytes vs N (float32,
    not causal); and DRAM / logical bytes vs N, where the L2 absorbs re-reads, with the N at
    which one B·H·N² float32 matrix (dense's S or P) fills the L2. Tiles: the file's first."""
    tiles = (rows[0]["block_q"], rows[0]["block_k"])
    sel = [r for r in rows if r["dtype"] == "float32" and r["causal"] == "False"
           and (r["block_q"], r["block_k"]) == tiles]
    schedules = list(dict.fromkeys(r["schedule"] for r in sel))
    fig, axes = common.pyplot().subplots(1, len(schedules), figsize=(4.6 * len(schedules), 4.2),
                                         squeeze=False)
    ratio_fig, ratio_ax = common.pyplot().subplots(figsize=(6.4, 4.4))
    for ax, name in zip(axes[0], schedules, strict=True):
        pts = sorted((int(r["n"]), r) for r in sel if r["schedule"] == name)
        n = [p[0] for p in pts]
        series = {
            "model": [int(r["model_bytes"]) for _, r in pts],
            "counted": [int(r["counted_bytes"]) for _, r in pts],
            "ncu ld+st (L1)": [int(r["ncu_ld_bytes"]) + int(r["ncu_st_bytes"]) for _, r in pts],
            "DRAM rd+wr": [int(r["dram_read_bytes"]) + int(r["dram_write_bytes"])
                           for _, r in pts],
        }
        for (label, ys), style in zip(series.items(), ["-", "o", "x", "s--"], strict=True):
            ax.loglog(n, ys, style, label=label, base=2)
        ax.set_title(f"{name} (Br × Bc = {tiles[0]} × {tiles[1]})", fontsize=10)
        ax.set_xlabel("N")
        ax.set_ylabel("bytes")
        ax.legend(fontsize=7)
        ratio = [d / max(1, c) for d, c in zip(series["DRAM rd+wr"], series["counted"],
                                               strict=True)]
        ratio_ax.semilogx(n, ratio, "o-", label=name, base=2)
    bh = int(sel[0]["batch"]) * int(sel[0]["heads"])
    ratio_ax.axvline((L2_BYTES / (4 * bh)) ** 0.5, color="grey", ls=":",
                     label=f"B·H·N²·4 B = L2 ({L2_BYTES >> 20} MB), B·H = {bh}")
    ratio_ax.axhline(1.0, color="grey", lw=0.8)
    ratio_ax.set_title("DRAM bytes / logical bytes (< 1: L2 hits)", fontsize=10)
    ratio_ax.set_xlabel("N")
    ratio_ax.legend(fontsize=7)
    return (plot_bench.save_with_provenance(fig, rows[0], out, "hw_traffic")
            + plot_bench.save_with_provenance(ratio_fig, rows[0], out, "hw_traffic_l2"))


def plot_blocksize(rows: list[dict], out: Path) -> list[Path]:
    """Block size Br vs the model's HBM bytes and the measured runtime, side by side (the
    analogue of the FlashAttention paper's Figure 2, middle), one schedule per row."""
    schedules = list(dict.fromkeys(r["schedule"] for r in rows))
    fig, axes = common.pyplot().subplots(len(schedules), 2, figsize=(9, 3.6 * len(schedules)),
                                         squeeze=False)
    for (left, right), name in zip(axes, schedules, strict=True):
        pts = sorted((int(r["block_q"]), int(r["model_bytes"]), r["ms_median"], r["status"])
                     for r in rows if r["schedule"] == name)
        labels = [str(p[0]) for p in pts]
        left.bar(labels, [p[1] / 1e9 for p in pts], color="tab:blue")
        left.set_ylabel("HBM traffic, model (GB)")
        timed = [(str(p[0]), float(p[2])) for p in pts if p[3] == "ok"]
        right.bar([t[0] for t in timed], [t[1] for t in timed], color="tab:orange")
        right.set_ylabel("runtime (ms, median)")
        first = next(r for r in rows if r["schedule"] == name)
        for ax in (left, right):
            ax.set_xlabel("Br (query rows per block)")
            ax.set_title(f"{name}: N={first['n']}, d={first['d']}, Bc={first['block_k']}, "
                         f"B·H={int(first['batch']) * int(first['heads'])}", fontsize=9)
    return plot_bench.save_with_provenance(fig, rows[0], out, "bench_blocksize")


def plot(ctx: common.Context) -> list:
    written = []
    for name, required, draw in (("bench_runtime.csv", "provider", plot_bench.plot),
                                 ("hw_traffic.csv", "ncu_ld_bytes", plot_hw),
                                 ("bench_blocksize.csv", "model_bytes", plot_blocksize)):
        path = ctx.results_dir / name
        if path.exists():
            written += draw(plot_bench.read_rows(path, required), ctx.figures_dir)
        else:
            print(f"gpu: no {path} yet (measured on a GPU machine; README, GPU experiments)")
    return written
