"""Rewrite the generated blocks of paper_notes.md, its appendix (paper_notes_appendix.md) and
the README from results files and the source tree.

A block is everything between `<!-- BEGIN generated:NAME -->` and `<!-- END generated:NAME -->`;
the prose around it is written by hand, every number inside it comes from here.
"""

from __future__ import annotations

import re
from pathlib import Path

import loop_orders as lo
from loop_orders import results

from . import common, explainer, gpu_notes, theorem2, theorem5, traffic

# Where the paper's statements live in our code: (label, file under loop_orders/, a text on
# the line).
ANCHORS = [
    ("Algorithm 1 line 1 (Bc, Br from M)", "schedules/kv_outer/forward.py",
     "# Algorithm 1, line 1"),
    ("Algorithm 1 line 2 (O, l, m initialised in HBM)", "schedules/kv_outer/forward.py",
     "# Algorithm 1 line 2: O = 0"),
    ("Algorithm 1 lines 5-6 (load K_j, V_j once per j)", "schedules/kv_outer/forward.py",
     "# K_j, V_j: read from HBM once"),
    ("Algorithm 1, kv_outer traffic model", "schedules/kv_outer/forward.py",
     "def model("),
    ("FA-2 forward: load Q_i once", "microkernel/stream.py", "# Q_i: read from HBM once"),
    ("FA-2 forward: K_j, V_j per query block", "microkernel/stream.py",
     "# K_j: reloaded from HBM"),
    ("FA-2 forward: write O_i once", "schedules/q_outer/forward.py", "# O_i: written"),
    ("FA-2 forward, q_outer traffic model", "schedules/q_outer/forward.py", "def model("),
    ("Shared micro-kernel (S = Q K^T, online softmax, P V)", "microkernel/cuda_cores.py",
     "def online_update("),
    ("Tiles to and from HBM, coalesced", "microkernel/tiles.py", "def _tile_copy("),
    ("online-softmax recurrence (explainer)", "reference.py", "def online_row("),
    ("Standard attention (Algorithm 0) model", "schedules/dense/forward.py", "def model("),
    ("Split-KV: a split's K/V range, then its partial O and lse",
     "schedules/split_kv.py", "j0 = s * per"),
    ("Split-KV: the combine's weights exp(lse_is - lse_i)", "schedules/split_kv.py",
     "exp(lse_is - lse_i), summing"),
    ("Algorithm 4 line 4 (dQ, dK, dV = 0 in HBM)", "schedules/kv_outer/backward.py",
     "# Algorithm 4 line 4"),
    ("Algorithm 4 line 8 (Q_i, O_i, dO_i, dQ_i, l_i, m_i per (j, i))",
     "schedules/kv_outer/backward.py", "reloaded from HBM per K/V block (line 8)"),
    ("Algorithm 4 line 22 (dQ_i written back per (j, i))", "schedules/kv_outer/backward.py",
     "(line 22)"),
    ("FA-2 backward: delta = rowsum(dO o O) (preprocess)", "schedules/q_outer/backward.py",
     "# delta_r: rowsum"),
    ("FA-2 backward: K_j, V_j once per CTA", "schedules/q_outer/backward.py",
     "# K_j, V_j: read from HBM once"),
    ("FA-2 backward: dQ by float32 atomics", "schedules/q_outer/backward.py",
     "# dq_acc_i: float32 atomic adds"),
    ("Deterministic dQ: the Q-outer kernel", "schedules/q_outer/backward.py",
     "def q_outer_bwd_dq("),
    ("Backward tile: P, dS from S, dP (shared by the orders)", "microkernel/grad_tiles.py",
     "def probs("),
    ("Standard attention backward (Algorithm 3) model", "schedules/dense/backward.py",
     "def model("),
    ("Theorem 2 Θ(N²d²/M), Θ(Nd + N²)", "theory.py", "def flash_traffic("),
    ("Saha–Ye lower bound", "theory.py", "def saha_ye_lower_bound("),
    ("Slope fit (scipy linregress)", "theory.py", "def fit_power_law("),
]


def code_refs(root: Path = common.REPO_ROOT) -> str:
    lines = ["| paper | our code |", "|---|---|"]
    for label, path, needle in ANCHORS:
        rel = f"loop_orders/{path}"
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


def slope_summary(ctx: common.Context, study: theorem2.Study = theorem2.FORWARD) -> str:
    """One row per (panel, order): the expected slope and the fitted ones in Theorem 2's
    window d <= M <= N d: the model at scale, the GPU's counts at scale (when a GPU slopes
    file is committed), the kernels' counts at simulator sizes."""
    def fits(path):
        if not path.exists():
            return {}
        return {(r["panel"], r["set"], r["schedule"], r["source"]): r
                for r in results.load(path)["records"] if r["window"] == "theorem"}

    here = fits(ctx.results_path(study.slopes))
    gpu = fits(ctx.results_path(study.slopes, "gpu")) if ctx.backend != "gpu" else here
    orders = list(dict.fromkeys(k[2] for k in here))
    cell = lambda r: "—" if r is None else f"{r['slope']:.2f} ± {r['stderr']:.2f}"  # noqa: E731
    lines = ["| traffic vs | order | expected | model, at scale | counted on the GPU, at scale "
             "| counted by the kernels, small sizes |", "|---|---|---|---|---|---|"]
    for panel in ("m", "n", "d"):
        for order in orders:
            expected = study.expected(order, panel)
            lines.append(f"| {panel.upper() if panel != 'd' else 'd'} | {order} | "
                         f"{'—' if expected is None else expected} | "
                         f"{cell(here.get((panel, 'model', order, 'model')))} | "
                         f"{cell(gpu.get((panel, 'model', order, 'measured')))} | "
                         f"{cell(here.get((panel, 'kernel', order, 'measured')))} |")
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
    """Every generated block, by name; "findings" (the abstract's and the README's) is made
    from the others."""
    new = _blocks(ctx)
    return {**new, "findings": findings(ctx, new)}


def _blocks(ctx: common.Context) -> dict[str, str]:
    ex = results.load(ctx.results_path(explainer.NAME))
    return {"code-refs": code_refs(), "loop-nests": loop_nests(),
            "explainer-ledger": explainer.ledger_table(ex),
            "explainer-walkthrough": explainer.walkthrough_table(ex),
            "traffic-summary": traffic_summary(ctx), "theorem2-slopes": slope_table(ctx),
            "theorem5-slopes": slope_table(ctx, theorem5.BACKWARD),
            "theorem2-slope-summary": slope_summary(ctx),
            "theorem5-slope-summary": slope_summary(ctx, theorem5.BACKWARD),
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
    from loop_orders.core.schedule import get_backward

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


def _slopes_line(ctx: common.Context, panel: str) -> str:
    """'kv_outer 1.95, q_outer 1.95, dense 1.99' : the model's fitted slopes at scale."""
    fits = [r for r in results.load(ctx.results_path(theorem2.SLOPES))["records"]
            if r["window"] == "theorem" and r["set"] == "model" and r["source"] == "model"
            and r["panel"] == panel and r["expected"] is not None]
    return ", ".join(f"{r['schedule']} {r['slope']:.2f} (expected {r['expected']})"
                     for r in fits)


def _speed_line(ctx: common.Context) -> str | None:
    """q_outer float32 against SDPA's float32 efficient backend and its float16 flash kernel
    at N = 4096, from results/bench_runtime.csv (None without it)."""
    rows = gpu_notes._rows(ctx.results_dir / "bench_runtime.csv")
    if rows is None:
        return None
    ms = {(r["provider"], r["dtype"], int(r["d"]), r["causal"]): float(r["ms_median"])
          for r in rows if r["status"] == "ok" and r["n"] == gpu_notes.REFERENCE["n"]}
    cases = sorted({(k[2], k[3]) for k in ms if k[0] == "q_outer"})

    def ratio(provider, dtype, d, causal):
        return ms[provider, dtype, d, causal] / ms["q_outer", "float32", d, causal]

    eff = "; ".join(f"d = {d}{', causal' if c == 'True' else ''} "
                    f"{ratio('torch_sdpa_efficient', 'float32', d, c):.2f}×" for d, c in cases)
    flash = [1 / ratio("torch_sdpa_flash", "float16", d, c) for d, c in cases]
    one = next(r for r in rows if r["n"] == gpu_notes.REFERENCE["n"] and r["status"] == "ok")
    return (f"forward pass on the {one['device']}, N = {one['n']}, B = {one['batch']}, "
            f"H = {one['heads']}: q_outer in exact float32 runs at {eff} the speed of SDPA's "
            f"float32 efficient backend; SDPA's float16 FlashAttention-2 kernel (tensor cores) "
            f"is {min(flash):.1f}–{max(flash):.1f}× faster than it "
            f"(`results/bench_runtime.csv`).")


def findings(ctx: common.Context, new: dict[str, str]) -> str:
    """The findings in a few lines (the paper's abstract, the README's first screen), from the
    other blocks and the results files."""
    hw = new.get("hw-traffic", "").split("\n")[0]
    hw = hw[:hw.index("**.") + 3] if "**." in hw else ""
    hw_rows = gpu_notes._rows(ctx.results_dir / "hw_traffic.csv")
    out = [f"- **Counted traffic = model, exactly.** {new['traffic-summary']}"]
    if hw and hw_rows:
        out.append(f"- **The hardware agrees** (Nsight Compute on the {hw_rows[0]['device']}): "
                   f"{hw}")
    out.append(f"- **Theorem 2's scaling.** Fitted log-log slopes of the models at scale: vs N "
               f"{_slopes_line(ctx, 'n')}; vs M {_slopes_line(ctx, 'm')}.")
    speed = _speed_line(ctx)
    if speed:
        out.append(f"- **Speed:** {speed}")
    return "\n".join(out)


def update_readme(path: Path = README_PATH, new: dict[str, str] | None = None) -> Path:
    """Rewrite the README's generated blocks (the schedule table, and any notes block it
    carries), only where it changed."""
    text = path.read_text(encoding="utf-8")
    fill = {"schedules": schedule_table(),
            **{k: v for k, v in (new or {}).items() if k in marked_blocks(text)}}
    out = replace_blocks(text, fill)
    return path if out == text else results.atomic_write_text(path, out)


def marked_blocks(text: str) -> list[str]:
    """The names of the generated blocks a text carries."""
    return re.findall(r"<!-- BEGIN generated:([\w-]+) -->", text)


def appendix_path(notes_path: Path) -> Path:
    """The appendix beside a notes file: paper_notes.md -> paper_notes_appendix.md."""
    return notes_path.with_name(f"{notes_path.stem}_appendix{notes_path.suffix}")


def update(ctx: common.Context, template: Path | None = None) -> Path:
    """Rewrite the generated blocks of ctx.notes_path and of its appendix (each read from the
    repository's own file when it does not exist yet): every block goes where it is marked,
    and a block marked in neither file is an error."""
    template = template or common.NOTES_PATH
    files = {ctx.notes_path: template,
             appendix_path(ctx.notes_path): appendix_path(template)}
    new = blocks(ctx)
    texts = {}
    for path, fallback in files.items():
        source = path if path.exists() else fallback
        texts[path] = (source, source.read_text(encoding="utf-8"))
    marked = {name for _, text in texts.values() for name in marked_blocks(text)}
    missing = sorted(set(new) - marked)
    if missing:
        raise ValueError(f"paper_notes: no block 'generated:{missing[0]}' (BEGIN/END markers) "
                         f"in {' or '.join(str(p) for p in files)}")
    for path, (source, old) in texts.items():
        here = set(marked_blocks(old))
        text = replace_blocks(old, {k: v for k, v in new.items() if k in here})
        if source != path or text != old:  # else the file is left as it was
            results.atomic_write_text(path, text)
    if ctx.notes_path == common.NOTES_PATH:  # the repository's own: its README too
        update_readme(new=new)
    return ctx.notes_path
