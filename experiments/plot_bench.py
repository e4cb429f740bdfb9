"""Plot results/bench_runtime.csv (written on a GPU by experiments.bench_runtime).

    python -m experiments.plot_bench [--results results] [--figures figures]

Runtime and TFLOP/s vs N, one line per provider, one panel per (d, causal) present in the
file. Reads the results file only; rows whose status is not "ok" are listed, not plotted.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from experiments import common

# What each line is, in the legend's fixed order: our schedules, then torch SDPA's backends.
LINE_LABELS = {
    ("q_outer", "float32"): "q_outer, float32 (CUDA-core FMA)",
    ("q_outer", "tf32x3"): "q_outer, float32 inputs on tensor cores (3xTF32)",
    ("kv_outer", "float32"): "kv_outer, float32",
    ("dense", "float32"): "dense, float32",
    ("torch_sdpa_efficient", "float32"): "SDPA efficient, float32",
    ("torch_sdpa_math", "float32"): "SDPA math, float32",
    ("torch_sdpa_flash", "float16"): "SDPA flash (FlashAttention-2), float16",
    ("torch_sdpa_flash", "bfloat16"): "SDPA flash (FlashAttention-2), bfloat16",
}
LINE_STYLES = {"q_outer": "-", "kv_outer": "-", "dense": "-"}  # SDPA's lines dashed


def _lines(ok: list[dict]) -> list[tuple[str, str]]:
    """(provider, dtype) of every line, in LINE_LABELS' order, then any other."""
    present = dict.fromkeys((r["provider"], r["dtype"]) for r in ok)
    return [k for k in LINE_LABELS if k in present] + [k for k in present
                                                       if k not in LINE_LABELS]


def _plain_log_axis(ax, axis: str) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    target = ax.xaxis if axis == "x" else ax.yaxis
    target.set_major_locator(LogLocator(base=2 if axis == "x" else 10,
                                        subs=(1.0,) if axis == "x" else (1.0, 2.0, 5.0)))
    target.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    target.set_minor_formatter(NullFormatter())


def plot(rows: list[dict], out: Path) -> list[Path]:
    """Forward runtime (top) and TFLOP/s (bottom) vs N, a column per (d, causal), a line per
    provider and dtype in one colour and one legend order everywhere."""
    ok = [r for r in rows if r["status"] == "ok"]
    panels = sorted({(int(r["d"]), r["causal"]) for r in ok})
    plt = common.pyplot()
    fig, axes = plt.subplots(2, len(panels), figsize=(4.6 * len(panels), 7.5), squeeze=False)
    lines = _lines(ok)
    colour = {line: plt.get_cmap("tab10")(i % 10) for i, line in enumerate(lines)}
    handles = {}
    for col, (d, causal) in enumerate(panels):
        sel = [r for r in ok if int(r["d"]) == d and r["causal"] == causal]
        for provider, dtype in lines:
            pts = sorted((int(r["n"]), float(r["ms_median"]), float(r["tflops"]))
                         for r in sel if (r["provider"], r["dtype"]) == (provider, dtype))
            if not pts:
                continue
            n, ms, tf = zip(*pts, strict=True)
            style = {"color": colour[provider, dtype], "ls": LINE_STYLES.get(provider, "--"),
                     "marker": "o", "ms": 4}
            handles[provider, dtype] = axes[0, col].plot(n, ms, **style)[0]
            axes[1, col].plot(n, tf, **style)
        causal_text = "causal" if causal == "True" else "not causal"
        axes[0, col].set_title(f"d = {d}, {causal_text}", fontsize=11)
        for ax in axes[:, col]:
            ax.set(xscale="log", yscale="log")
            _plain_log_axis(ax, "x")
            _plain_log_axis(ax, "y")
            ax.grid(True, which="major", alpha=0.3)
        axes[1, col].set_xlabel("sequence length N")
    axes[0, 0].set_ylabel("median ms per forward call")
    axes[1, 0].set_ylabel("TFLOP/s")
    fig.legend([handles[k] for k in lines if k in handles],
               [LINE_LABELS.get(k, f"{k[0]}, {k[1]}") for k in lines if k in handles],
               loc="lower center", ncol=4, fontsize=8, frameon=False)
    bh = {int(r["batch"]) * int(r["heads"]) * int(r["n"]) for r in ok}
    tokens = f"B·H·N = {bh.pop():,}" if len(bh) == 1 else "B·H·N varies"
    fig.suptitle(f"Forward attention on the {ok[0]['device']}: our loop orders beside "
                 f"torch SDPA's backends ({tokens}, B shrinking as N grows; median of "
                 f"launches back to back, each output checked first)\n"
                 f"TFLOP/s count 4·B·H·N²·d FLOPs, half of that in the causal panels "
                 f"(the work the causal mask leaves)", fontsize=10)
    shas = list(dict.fromkeys(r["git_sha"][:7] for r in rows))
    dates = sorted(r["date"][:10] for r in rows)
    fig.text(0.99, 0.005, f"results/bench_runtime.csv: {len(shas)} runs (git {shas[0]} … "
             f"{shas[-1]}), {dates[0]} … {dates[-1]}", ha="right", fontsize=7, color="0.4")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return common.save_figure(fig, out, "bench_runtime")


def read_rows(path: Path, required: str) -> list[dict]:
    """Rows of a GPU results csv; refuses a file without the `required` column."""
    with path.open() as f:
        rows = list(csv.DictReader(f))
    if not rows or required not in rows[0]:
        raise ValueError(f"{path}: not the expected results file (no column {required!r})")
    return rows


def save_with_provenance(fig, row: dict, out: Path, stem: str) -> list[Path]:
    """Title the figure with the results' device, git SHA (or "a + b" for rows of several
    runs) and date; save PNG and PDF."""
    sha = row["git_sha"] if " + " in row["git_sha"] else row["git_sha"][:10]
    fig.suptitle(f"{row['device']}, git {sha}, {row['date']}", fontsize=9)
    fig.tight_layout()
    return common.save_figure(fig, out, stem)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=Path("results"))
    parser.add_argument("--figures", type=Path, default=Path("figures"))
    args = parser.parse_args(argv)
    rows = read_rows(args.results / "bench_runtime.csv", "provider")
    for r in rows:
        if r["status"] != "ok":
            print(f"not plotted: {r['provider']} N={r['n']} d={r['d']}: {r['status']}")
    for p in plot(rows, args.figures):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
