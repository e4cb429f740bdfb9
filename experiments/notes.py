"""Rewrite the generated blocks of paper_notes.md from results files and the source tree.

A block is everything between `<!-- BEGIN generated:NAME -->` and `<!-- END generated:NAME -->`;
the prose around it is written by hand, every number inside it comes from here.
"""

from __future__ import annotations

import re
from pathlib import Path

import loop_orders as lo
from loop_orders import results

from . import common, explainer, gpu_notes, theorem2, theorem5, traffic

# Where the paper's statements live in our code: (label, file, a text on the line).
ANCHORS = [
    ("Algorithm 1 line 1 (Bc, Br from M)", "loop_orders/schedules/kv_outer.py",
     "# Algorithm 1, line 1"),
    ("Algorithm 1 line 2 (O, l, m initialised in HBM)", "loop_orders/schedules/kv_outer.py",
     "# Algorithm 1 line 2: O = 0"),
    ("Algorithm 1 lines 5-6 (load K_j, V_j once per j)", "loop_orders/schedules/kv_outer.py",
     "# K_j, V_j: read from HBM once"),
    ("Algorithm 1, kv_outer traffic model", "loop_orders/schedules/kv_outer.py",
     "def model("),
    ("FA-2 forward: load Q_i once", "loop_orders/schedules/q_outer.py", "# Q_i"),
    ("FA-2 forward: K_j, V_j per query block", "loop_orders/schedules/q_outer.py",
     "# K_j, V_j: reloaded from HBM"),
    ("FA-2 forward: write O_i once", "loop_orders/schedules/q_outer.py", "# O_i: written"),
    ("FA-2 forward, q_outer traffic model", "loop_orders/schedules/q_outer.py", "def model("),
    ("Shared micro-kernel (S = Q K^T, online softmax, P V)", "loop_orders/microkernel.py",
     "def online_update("),
    ("Tiles to and from HBM, coalesced", "loop_orders/tiles.py", "def _tile_copy("),
    ("online-softmax recurrence (explainer)", "loop_orders/reference.py", "def online_row("),
    ("Standard attention (Algorithm 0) model", "loop_orders/schedules/dense.py", "def model("),
    ("Theorem 2 Θ(N²d²/M), Θ(Nd + N²)", "loop_orders/theory.py", "def flash_traffic("),
    ("Saha–Ye lower bound", "loop_orders/theory.py", "def saha_ye_lower_bound("),
    ("Slope fit (scipy linregress)", "loop_orders/theory.py", "def fit_power_law("),
]


def code_refs(root: Path = common.REPO_ROOT) -> str:
    lines = ["| paper | our code |", "|---|---|"]
    for label, rel, needle in ANCHORS:
        text = (root / rel).read_text(encoding="utf-8").splitlines()
        hits = [i + 1 for i, line in enumerate(text) if needle in line]
        where = f"`{rel}:{hits[0]}`" if hits else f"`{rel}` (anchor not found: {needle!r})"
        lines.append(f"| {label} | {where} |")
    return "\n".join(lines)


def loop_nests() -> str:
    return "\n\n".join(f"`{s.name}` — {s.summary}\n\n```\n{s.loop_nest()}\n```"
                       for s in lo.all_schedules())


def traffic_summary(ctx: common.Context) -> str:
    data = results.load(ctx.results_path(traffic.NAME))
    s = traffic.summary(data)
    return (f"{s['points']} points (every registered schedule × N × block sizes × causal); "
            f"{s['measured']} measured by the counted kernels on {s['device']} "
            f"(N ∈ {s['measured_n']}), the rest model only. Largest |measured − model| over "
            f"every tensor and direction: **{s['max_abs_residual']}** elements.")


def slope_table(ctx: common.Context, study: theorem2.Study = theorem2.FORWARD) -> str:
    data = results.load(ctx.results_path(study.slopes))
    lines = ["| traffic vs | sizes | schedule | source | fit window | slope ± stderr | points "
             "| expected |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted(data["records"], key=lambda r: (r["panel"], r["set"], r["schedule"],
                                                    r["source"], r["window"])):
        fixed = ", ".join(f"{k}={v}" for k, v in r["fixed"].items())
        lines.append(f"| {r['panel']} | {fixed} | {r['schedule']} | {r['source']} | "
                     f"{r['window']} ({r['x_min']:g}–{r['x_max']:g}) | "
                     f"{r['slope']:.3f} ± {r['stderr']:.3f} | {r['points']} | "
                     f"{'' if r['expected'] is None else r['expected']} |")
    return "\n".join(lines)


def provenance_block(ctx: common.Context) -> str:
    lines = ["| results file | git SHA | device | date | numpy / numba-cuda |",
             "|---|---|---|---|---|"]
    files = [(ctx.results_path(name).name, results.load(ctx.results_path(name))["provenance"])
             for name in (traffic.NAME, theorem2.NAME, theorem2.SLOPES, theorem5.NAME,
                          theorem5.BACKWARD.slopes, explainer.NAME)]
    for name, p in files + gpu_notes.provenances(ctx.results_dir):
        v = p.get("versions", {})
        lines.append(f"| `{name}` | `{p.get('git_sha')}` | {p.get('device')} | "
                     f"{p.get('date')} | {v.get('numpy')} / {v.get('numba-cuda')} |")
    return "\n".join(lines)


def blocks(ctx: common.Context) -> dict[str, str]:
    ex = results.load(ctx.results_path(explainer.NAME))
    return {"code-refs": code_refs(), "loop-nests": loop_nests(),
            "explainer-ledger": explainer.ledger_table(ex),
            "explainer-walkthrough": explainer.walkthrough_table(ex),
            "traffic-summary": traffic_summary(ctx), "theorem2-slopes": slope_table(ctx),
            "theorem5-slopes": slope_table(ctx, theorem5.BACKWARD),
            "provenance": provenance_block(ctx), **gpu_notes.blocks(ctx.results_dir)}


def replace_blocks(text: str, new: dict[str, str]) -> str:
    """Replace each marked block's body; a marker without a matching end is an error."""
    for name, body in new.items():
        pattern = re.compile(rf"(<!-- BEGIN generated:{re.escape(name)} -->\n)(.*?)"
                             rf"(<!-- END generated:{re.escape(name)} -->)", re.S)
        if not pattern.search(text):
            raise ValueError(f"paper_notes: no block 'generated:{name}' (BEGIN/END markers)")
        text = pattern.sub(lambda m, b=body: m.group(1) + b.rstrip("\n") + "\n" + m.group(3),
                           text)
    return text


def update(ctx: common.Context, template: Path | None = None) -> Path:
    """Rewrite ctx.notes_path's generated blocks (reading `template` if it does not exist)."""
    source = ctx.notes_path if ctx.notes_path.exists() else (template or common.NOTES_PATH)
    text = replace_blocks(source.read_text(encoding="utf-8"), blocks(ctx))
    return results.atomic_write_text(ctx.notes_path, text)
