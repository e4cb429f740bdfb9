"""The seed explainer's example: N=6, d=dv=2, the vectors of the seed file.

Two questions. (1) The transfer ledger at query blocks of 2 rows (and key blocks of 2):
per tensor, model and kernel-measured, for every registered schedule (the seed quotes dense
240 and the query-resident order 96; kv_outer, Algorithm 1 as written, sits beside them).
(2) The one-query walkthrough: running m, l and a/l for query 0 after each key tile, for key
tiles of 1, 2, 3, 4 and 7 (`loop_orders.reference.online_row`), against the dense row; the
kernels' output row 0 for each tile size is recorded too.

    python -m experiments.explainer [--results-dir DIR] [--figures-dir DIR]
"""

from __future__ import annotations

import sys

import numpy as np

import loop_orders as lo
from loop_orders import results
from loop_orders.core.ledger import Ledger
from loop_orders.device import runtime
from loop_orders.reference import attention_reference, online_row

from . import common

NAME = "explainer"

# The explainer's vectors (seed file, "Check the recurrence on CPU").
Q = [[1, 0], [0, 1], [1, 1], [-1, 0], [0, -1], [1, -1]]
K = [[-1, 0], [0, 1], [2, 0], [1, 1], [3, -1], [-1, 2]]
V = [[1, 0], [0, 2], [-1, 1], [2, -1], [0.5, 3], [-2, 0.5]]
SWEEP = {"ledger_blocks": [2, 2], "query": 0, "key_tiles": [1, 2, 3, 4, 7]}


def arrays():
    return tuple(np.array(x, dtype=np.float32) for x in (Q, K, V))


def configs(sweep: dict) -> list[dict]:
    bq, bk = sweep["ledger_blocks"]
    out = [{"part": "ledger", "schedule": s.name, "block_q": bq, "block_k": bk}
           for s in lo.all_schedules()]
    out += [{"part": "walkthrough", "query": sweep["query"], "key_tile": t}
            for t in sweep["key_tiles"]]
    return out


def evaluate(config: dict) -> dict:
    q, k, v = arrays()
    dense, _ = attention_reference(q, k, v)
    if config["part"] == "ledger":
        model = lo.predict_traffic(config["schedule"], n=6, d=2, block_q=config["block_q"],
                                   block_k=config["block_k"])
        res = lo.attention(q, k, v, schedule=config["schedule"], block_q=config["block_q"],
                           block_k=config["block_k"], count=True)
        return {"model": model.to_dict(), "measured": res.counts.to_dict(),
                "backend": runtime.backend_name(),
                "max_abs_error": float(np.abs(runtime.to_host(res.out) - dense).max())}
    row = config["query"]
    steps = online_row(q[row], k, v, config["key_tile"])
    kernels = {}
    for sched in lo.all_schedules():
        res = lo.attention(q, k, v, schedule=sched.name, block_q=2, block_k=config["key_tile"])
        kernels[sched.name] = [float(x) for x in runtime.to_host(res.out)[row]]
    final = steps[-1].partial_output
    return {"steps": [{"keys_seen": s.keys_seen, "m": s.m, "l": s.l,
                       "a_over_l": [float(x) for x in s.partial_output]} for s in steps],
            "dense_row": [float(x) for x in dense[row]],
            "online_vs_dense": float(np.abs(final - dense[row]).max()),
            "kernel_rows": kernels, "backend": runtime.backend_name(),
            "kernel_vs_dense": max(float(np.abs(np.array(r) - dense[row]).max())
                                   for r in kernels.values())}


def run(ctx: common.Context) -> results.Sweep:
    sweep = ctx.sweep(NAME, meta={"q": Q, "k": K, "v": V})
    sweep.run(configs(SWEEP), evaluate, progress=ctx.progress, desc=NAME)
    sweep.finish()
    return sweep


def ledger_table(data: dict) -> str:
    """Markdown table: per tensor, model (= measured) elements for each schedule."""
    rows = [r for r in data["records"] if r["key"]["part"] == "ledger"]
    names = [r["key"]["schedule"] for r in rows]
    ledgers = {r["key"]["schedule"]: (Ledger.from_dict(r["model"]),
                                      Ledger.from_dict(r["measured"])) for r in rows}
    lines = ["| tensor | " + " | ".join(f"{n} (read / write)" for n in names) + " |",
             "|---|" + "---|" * len(names)]
    tensors = common.declared_tensors(names, [lg for pair in ledgers.values() for lg in pair])
    for t in tensors:
        if not any(m.tensor_total(t) or x.tensor_total(t) for m, x in ledgers.values()):
            continue
        cells = [f"{m.read(t)} / {m.write(t)}" for m, _ in ledgers.values()]
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    lines.append("| **total (model)** | " +
                 " | ".join(f"**{m.total}**" for m, _ in ledgers.values()) + " |")
    lines.append("| total (measured by kernels) | " +
                 " | ".join(f"{x.total}" for _, x in ledgers.values()) + " |")
    blocks = rows[0]["key"]
    lines.append("")
    lines.append(f"N=6, d=dv=2, block_q={blocks['block_q']}, block_k={blocks['block_k']}; "
                 f"measured on {data['provenance'].get('device')}.")
    return "\n".join(lines)


def walkthrough_table(data: dict) -> str:
    rows = sorted((r for r in data["records"] if r["key"]["part"] == "walkthrough"),
                  key=lambda r: r["key"]["key_tile"])
    dense = rows[0]["dense_row"]
    lines = [f"Query {rows[0]['key']['query']}; dense row (float64 reference): "
             f"({dense[0]:.6f}, {dense[1]:.6f}).", "",
             "| keys per tile (Bc) | keys seen | m | ℓ | a/ℓ |", "|---|---|---|---|---|"]
    for r in rows:
        for s in r["steps"]:
            lines.append(f"| {r['key']['key_tile']} | {s['keys_seen']} | {s['m']:.6f} | "
                         f"{s['l']:.6f} | ({s['a_over_l'][0]:.6f}, {s['a_over_l'][1]:.6f}) |")
    lines.append("")
    worst_online = max(r["online_vs_dense"] for r in rows)
    worst_kernel = max(r["kernel_vs_dense"] for r in rows)
    lines.append(f"Largest |online − dense| after the last tile, over all tile sizes: "
                 f"{worst_online:.1e} (float64); largest |kernel row 0 − dense| over every "
                 f"schedule and tile size: {worst_kernel:.1e} (float32 kernels).")
    return "\n".join(lines)


def plot(ctx: common.Context) -> list:
    data = results.load(ctx.results_path(NAME))
    plt = common.pyplot()
    fig, (ax_l, ax_w) = plt.subplots(1, 2, figsize=(14, 5))
    rows = [r for r in data["records"] if r["key"]["part"] == "ledger"]
    names = [r["key"]["schedule"] for r in rows]
    measured = [Ledger.from_dict(r["measured"]) for r in rows]
    tensors = common.declared_tensors(names, measured)
    drawn = [t for t in tensors if any(lg.tensor_total(t) for lg in measured)]
    tensor_colors = common.tensor_colors(drawn)
    bottom = np.zeros(len(rows))
    for t in drawn:
        h = np.array([lg.tensor_total(t) for lg in measured], float)
        ax_l.bar(names, h, bottom=bottom, color=tensor_colors[t], label=t)
        for x, (b, hh) in enumerate(zip(bottom, h, strict=True)):
            if hh:
                ax_l.text(x, b + hh / 2, f"{t} {int(hh)}", ha="center", va="center",
                          fontsize=7, color="white")
        bottom += h
    for x, r in enumerate(rows):
        ax_l.text(x, bottom[x] + 3, f"{Ledger.from_dict(r['model']).total} model\n"
                  f"{Ledger.from_dict(r['measured']).total} measured", ha="center",
                  va="bottom", fontsize=8)
    b = rows[0]["key"]
    ax_l.set(ylim=(0, bottom.max() * 1.45), ylabel="elements moved through HBM",
             title=f"(a) transfer ledger, N=6, d=dv=2, block_q={b['block_q']}, "
                   f"block_k={b['block_k']}")
    ax_l.legend(fontsize=7, ncol=(len(drawn) + 1) // 2, loc="upper center")
    walk = sorted((r for r in data["records"] if r["key"]["part"] == "walkthrough"),
                  key=lambda r: r["key"]["key_tile"])
    dense = walk[0]["dense_row"]
    cmap = plt.get_cmap("viridis")
    for i, r in enumerate(walk):
        xs = [s["keys_seen"] for s in r["steps"]]
        for comp, ls in ((0, "-"), (1, "--")):
            ax_w.plot(xs, [s["a_over_l"][comp] for s in r["steps"]], ls, marker="o",
                      color=cmap(i / max(1, len(walk) - 1)),
                      label=f"tiles of {r['key']['key_tile']} key(s)" if comp == 0 else None)
    for comp, ls in ((0, "-"), (1, "--")):
        ax_w.axhline(dense[comp], color="k", ls=ls, lw=0.8,
                     label=f"dense row, component {comp}")
    ax_w.set(xlabel="keys seen", ylabel="a / ℓ (solid: component 0, dashed: component 1)",
             title=f"(b) query {walk[0]['key']['query']}: a/ℓ after each key tile; "
                   f"max |online − dense| = {max(r['online_vs_dense'] for r in walk):.0e}")
    ax_w.legend(fontsize=7)
    fig.suptitle("The seed explainer's example — ledger measured by the counted kernels "
                 f"({data['provenance'].get('device')}), walkthrough from "
                 "loop_orders.reference.online_row", fontsize=10)
    fig.tight_layout()
    return common.save_figure(fig, ctx.figures_dir, NAME)


def main(argv=None) -> int:
    ctx = common.run_experiment(sys.modules[__name__], argv)
    print(ledger_table(results.load(ctx.results_path(NAME))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
