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
     "# K_j: reloaded from HBM"),
    ("FA-2 forward: write O_i once", "loop_orders/schedules/q_outer.py", "# O_i: written"),
    ("FA-2 forward, q_outer traffic model", "loop_orders/schedules/q_outer.py", "def model("),
    ("Shared micro-kernel (S = Q K^T, online softmax, P V)", "loop_orders/microkernel.py",
     "def online_update("),
    ("Tiles to and from HBM, coalesced", "loop_orders/tiles.py", "def _tile_copy("),
    ("online-softmax recurrence (explainer)", "loop_orders/reference.py", "def online_row("),
    ("Standard attention (Algorithm 0) model", "loop_orders/schedules/dense.py", "def model("),
    ("Split-KV: a split's K/V range, then its partial O and lse",
     "loop_orders/schedules/split_kv.py", "j0 = s * per"),
    ("Split-KV: the combine's weights exp(lse_is - lse_i)", "loop_orders/schedules/split_kv.py",
     "exp(lse_is - lse_i), summing"),
    ("Algorithm 4 line 4 (dQ, dK, dV = 0 in HBM)", "loop_orders/backward/kv_outer.py",
     "# Algorithm 4 line 4"),
    ("Algorithm 4 line 8 (Q_i, O_i, dO_i, dQ_i, l_i, m_i per (j, i))",
     "loop_orders/backward/kv_outer.py", "reloaded from HBM per K/V block (line 8)"),
    ("Algorithm 4 line 22 (dQ_i written back per (j, i))", "loop_orders/backward/kv_outer.py",
     "(line 22)"),
    ("FA-2 backward: delta = rowsum(dO o O) (preprocess)", "loop_orders/backward/q_outer.py",
     "# delta_r: rowsum"),
    ("FA-2 backward: K_j, V_j once per CTA", "loop_orders/backward/q_outer.py",
     "# K_j, V_j: read from HBM once"),
    ("FA-2 backward: dQ by float32 atomics", "loop_orders/backward/q_outer.py",
     "# dq_acc_i: float32 atomic adds"),
    ("Deterministic dQ: the Q-outer kernel", "loop_orders/backward/q_outer.py",
     "def q_outer_bwd_dq("),
    ("Backward tile: P, dS from S, dP (shared by the orders)", "loop_orders/backward_tiles.py",
     "def probs("),
    ("Standard attention backward (Algorithm 3) model", "loop_orders/backward/dense.py",
     "def model("),
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


def _per_tensor_table(ledgers: dict, cell, total_label: str, total) -> list[str]:
    """Markdown rows: a column per ledger (keyed by its header), a row per tensor any of
    them moves (`cell(ledger, tensor)`), then a total row (`total(ledger)`)."""
    tensors = list(dict.fromkeys(t for lg in ledgers.values() for t in lg.tensors
                                 if lg.tensor_total(t)))
    lines = ["| tensor | " + " | ".join(ledgers) + " |", "|---|" + "---|" * len(ledgers)]
    for t in tensors:
        lines.append(f"| {t} | " + " | ".join(cell(lg, t) for lg in ledgers.values()) + " |")
    lines.append(f"| {total_label} | " + " | ".join(total(lg) for lg in ledgers.values())
                 + " |")
    return lines


def split_kv_traffic() -> str:
    """split_kv's and q_outer's models at the decode target shape, per tensor."""
    shape = {"n": 1, "n_k": 65536, "d": 64, "heads": 16, "block_q": 64, "block_k": 64}
    p = lo.make_problem("split_kv", n_q=1, n_k=65536, d=64, heads=16, block_q=64, block_k=64)
    ledgers = {"q_outer": lo.predict_traffic("q_outer", **shape),
               f"split_kv (auto: S = {lo.get_schedule('split_kv').splits(p)})":
                   lo.predict_traffic("split_kv", **shape),
               "split_kv (S = 128)": lo.predict_traffic("split_kv", **shape,
                                                        options={"splits": 128})}
    lines = _per_tensor_table({f"{n} (read / write)": lg for n, lg in ledgers.items()},
                              lambda lg, t: f"{lg.read(t):,} / {lg.write(t):,}",
                              "**bytes (float32)**", lambda lg: f"**{lg.bytes(4):,}**")
    return ("N_q = 1, N_k = 65536, B·H = 16, d = dv = 64, Br = Bc = 64 (the model, "
            "`lo.predict_traffic`):\n\n" + "\n".join(lines))


def backward_traffic() -> str:
    """The three dQ strategies (and dense) per tensor at Figure 2's setting, from the
    models; what the counters measured there is in the fig2-setting block."""
    shape = {"n": 1024, "d": 64, "heads": 16, "batch": 64, "block_q": 64, "block_k": 64,
             "causal": True, "save_lse": True, "backward": True}
    ledgers = {"dense (Algorithm 3)": lo.predict_traffic("dense", **shape),
               "kv_outer (Algorithm 4: dQ_i in HBM)": lo.predict_traffic("kv_outer", **shape),
               "q_outer dq=atomic (float32 atomics)": lo.predict_traffic(
                   "q_outer", **shape, options={"dq": "atomic"}),
               "q_outer dq=separate (Q-outer dQ kernel)": lo.predict_traffic(
                   "q_outer", **shape, options={"dq": "separate"})}
    lines = _per_tensor_table(ledgers, lambda lg, t: f"{lg.tensor_total(t) / 1e6:,.1f} M",
                              "**total, float16 bytes**",
                              lambda lg: f"**{lg.bytes(2) / 1e9:.2f} GB**")
    return ("The backward pass alone, B = 64, H = 16, N = 1024, d = 64, causal, Br = Bc = 64 "
            "(elements read + written, from the models):\n\n" + "\n".join(lines))


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
            "split-kv-traffic": split_kv_traffic(), "backward-traffic": backward_traffic(),
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


def schedule_table() -> str:
    """The README's table of the registered schedules, their options and backward orders."""
    from loop_orders.backward_schedule import get_backward

    lines = ["| schedule | loop order | options | backward |", "|---|---|---|---|"]
    for sched in lo.all_schedules():
        options = ", ".join(f"`{k}` ({o.allowed}; default {o.default!r})"
                            for k, o in sched.OPTIONS.items()) or "—"
        back = "—"
        if sched.BACKWARD:
            bwd = get_backward(sched.BACKWARD)
            own = ", ".join(f"`{k}`: {o.allowed}" for k, o in bwd.OPTIONS.items())
            back = (bwd.summary if sched.name == sched.BACKWARD else
                    f"{sched.BACKWARD}'s") + (f" ({own})" if own else "")
        lines.append(f"| `{sched.name}` | {sched.summary} | {options} | {back} |")
    return "\n".join(lines)


README_PATH = common.REPO_ROOT / "README.md"


def update_readme(path: Path = README_PATH) -> Path:
    """Rewrite the README's generated blocks (the schedule table), only where it changed."""
    text = path.read_text(encoding="utf-8")
    new = replace_blocks(text, {"schedules": schedule_table()})
    return path if new == text else results.atomic_write_text(path, new)


def update(ctx: common.Context, template: Path | None = None) -> Path:
    """Rewrite ctx.notes_path's generated blocks (reading `template` if it does not exist)."""
    source = ctx.notes_path if ctx.notes_path.exists() else (template or common.NOTES_PATH)
    old = source.read_text(encoding="utf-8")
    text = replace_blocks(old, blocks(ctx))
    if ctx.notes_path == common.NOTES_PATH:  # the repository's own: its README too
        update_readme()
    if source == ctx.notes_path and text == old:
        return ctx.notes_path  # nothing changed: the file is left as it was
    return results.atomic_write_text(ctx.notes_path, text)
