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


def plot(rows: list[dict], out: Path) -> list[Path]:
    ok = [r for r in rows if r["status"] == "ok"]
    panels = sorted({(int(r["d"]), r["causal"]) for r in ok})
    plt = common.pyplot()
    fig, axes = plt.subplots(2, len(panels), figsize=(5.5 * len(panels), 7.5), squeeze=False)
    # one colour per provider and dtype in every panel
    lines = dict.fromkeys((r["provider"], r["dtype"]) for r in ok)
    colour = {line: plt.get_cmap("tab10")(i % 10) for i, line in enumerate(lines)}
    for col, (d, causal) in enumerate(panels):
        sel = [r for r in ok if int(r["d"]) == d and r["causal"] == causal]
        for provider, dtype in dict.fromkeys((r["provider"], r["dtype"]) for r in sel):
            pts = sorted((int(r["n"]), float(r["ms_median"]), float(r["tflops"]))
                         for r in sel if (r["provider"], r["dtype"]) == (provider, dtype))
            n, ms, tf = zip(*pts, strict=True)
            style = {"label": f"{provider} ({dtype})", "base": 2,
                     "color": colour[provider, dtype]}
            axes[0, col].loglog(n, ms, "o-", **style)
            axes[1, col].loglog(n, tf, "o-", **style)
        axes[0, col].set_title(f"d={d}, causal={causal}, batch*heads*N = 262144")
        axes[0, col].set_ylabel("median ms per forward")
        axes[1, col].set_ylabel("TFLOP/s (4 B H N^2 d)")
        axes[1, col].set_xlabel("N")
        axes[0, col].legend(fontsize=7)
    shas = " + ".join(dict.fromkeys(r["git_sha"][:7] for r in rows))
    dates = sorted(r["date"][:10] for r in rows)
    when = dates[0] if dates[0] == dates[-1] else f"{dates[0]} … {dates[-1]}"
    merged = {**rows[0], "git_sha": shas if " + " in shas else rows[0]["git_sha"], "date": when}
    return save_with_provenance(fig, merged, out, "bench_runtime")


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
