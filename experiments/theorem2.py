"""Theorem 2 scaling: HBM traffic vs SRAM budget M, sequence length N and head dim d.

Each schedule sizes its own tiles from M (`Schedule.tiles_for_sram(M, d)`). Three panels, each
a sweep declared below: traffic vs M (N, d fixed), vs N (M, d fixed), vs d (N, M fixed). Every
panel has a large "model" sweep (closed-form models, measured too where the backend can launch
it: a GPU run) and a small "kernel" sweep at sizes the simulator runs, measured by the counted
kernels. Log-log slopes are fitted with scipy over the points inside Theorem 2's range
d <= M <= N d and written to results/theorem2_slopes.<backend>.json.

Expected (each schedule's EXPECTED_SLOPES): the FlashAttention orders -1 vs M, 2 vs N, 2 vs
d; standard attention 2 vs N.
Overlays: Theta(N^2 d^2 / M), Theta(N d + N^2) and the Saha–Ye lower bound
Theta(min(N^2 d / sqrt(M), N^2 d^2 / M)), with M < d^2 (FA not optimal) shaded.

    python -m experiments.theorem2 [--quick] [--results-dir DIR] [--figures-dir DIR]
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import numpy as np

import loop_orders as lo
from loop_orders import results, theory
from loop_orders.core.schedule import get_backward, grad_variants

from . import common

NAME = "theorem2"
SLOPES = "theorem2_slopes"


def _pow2(lo_exp: int, hi_exp: int) -> list[int]:
    return [2**e for e in range(lo_exp, hi_exp + 1)]


# Each panel: the swept variable, its values, and the fixed sizes; "model" is large,
# "kernel" small enough for the simulator.
SWEEP = {
    "m": {"model": {"n": 4096, "d": 16, "m": _pow2(4, 16)},       # d .. N d
          "kernel": {"n": 32, "d": 4, "m": _pow2(2, 7)}},          # d .. N d
    "n": {"model": {"m": 4096, "d": 16, "n": _pow2(8, 14)},        # N >= M / d
          "kernel": {"m": 64, "d": 4, "n": _pow2(4, 6)}},
    "d": {"model": {"n": 1024, "m": 4096, "d": _pow2(3, 6)},       # d^2 <= M, M <= N d
          "kernel": {"n": 32, "m": 64, "d": _pow2(1, 3)}},
}
QUICK_SWEEP = {
    "m": {"model": {"n": 256, "d": 16, "m": _pow2(4, 12)},
          "kernel": {"n": 16, "d": 4, "m": _pow2(2, 6)}},
    "n": {"model": {"m": 1024, "d": 16, "n": _pow2(6, 10)},
          "kernel": {"m": 32, "d": 4, "n": _pow2(3, 5)}},
    "d": {"model": {"n": 256, "m": 1024, "d": _pow2(3, 5)},
          "kernel": {"n": 16, "m": 32, "d": _pow2(1, 3)}},
}
PANEL_LABEL = {"m": "SRAM budget M (elements)", "n": "sequence length N", "d": "head dim d"}


@dataclass(frozen=True)
class Study:
    """The forward pass (Theorem 2) or the backward pass (Theorem 5, experiments/theorem5.py)
    of every registered schedule, one line per (schedule, option variant)."""

    name: str
    slopes: str
    backward: bool
    theorem: str

    def lines(self) -> dict[str, tuple[str, dict | None]]:
        """{label: (schedule name, options)}: a forward's default options; a backward's
        every example value of its options (e.g. q_outer dq=atomic, dq=separate)."""
        if not self.backward:
            return {s.name: (s.name, None) for s in lo.all_schedules()}
        return {v.label: (v.schedule, v.options) for v in grad_variants()}

    def order(self, label: str):
        """The Schedule (forward) or BackwardSchedule of a line, or None if unknown here."""
        line = self.lines().get(label)
        if line is None:
            return None
        return get_backward(line[0]) if self.backward else lo.get_schedule(line[0])

    def expected(self, label: str, panel: str):
        order = self.order(label)
        if order is None:
            return None
        return order.expected_slopes(dict(self.lines()[label][1] or {})).get(panel)


FORWARD = Study("theorem2", "theorem2_slopes", False, "Theorem 2")


def declaration(ctx: common.Context) -> dict:
    return QUICK_SWEEP if ctx.quick else SWEEP


def configs(sweep: dict, study: Study = FORWARD) -> list[dict]:
    """One point per (panel, size set, line, swept value)."""
    out = []
    for var, sets in sweep.items():
        for size_set, spec in sets.items():
            for label in study.lines():
                for value in spec[var]:
                    sizes = {k: v for k, v in spec.items() if k != var}
                    sizes[var] = value
                    out.append({"panel": var, "set": size_set, "schedule": label,
                                "n": sizes["n"], "d": sizes["d"], "m": sizes["m"]})
    return out


def evaluate(config: dict, study: Study = FORWARD) -> dict:
    sched = lo.get_schedule(study.lines()[config["schedule"]][0])
    p = point_problem(config, study)
    return {"block_q": p.block_q, "block_k": p.block_k,
            **common.model_and_measure(sched, p, common.seed_for(config),
                                       backward=study.backward)}


def point_problem(config: dict, study: Study) -> lo.Problem:
    name, options = study.lines()[config["schedule"]]
    sched = lo.get_schedule(name)
    block_q, block_k = study.order(config["schedule"]).tiles_for_sram(config["m"],
                                                                       config["d"])
    return common.problem(sched, config["n"], config["d"], block_q, block_k, options=options)


def run(ctx: common.Context, study: Study = FORWARD) -> results.Sweep:
    sweep = ctx.sweep(study.name, meta={})
    todo = sweep.pending(configs(declaration(ctx), study))
    if ctx.backend == "gpu":  # compile what will be measured in parallel first; cheap first
        from .gpu_common import warm

        todo.sort(key=lambda c: common.gpu_seconds(study.order(c["schedule"]),
                                                   point_problem(c, study)))
        points = [(study.lines()[c["schedule"]][0], point_problem(c, study)) for c in todo]
        warm(((name, p, study.backward) for name, p in points
              if common.measurable(lo.get_schedule(name), p, backward=study.backward)),
             counted=(True,))
    sweep.run(todo, lambda c: evaluate(c, study), progress=ctx.progress, desc=study.name)
    sweep.finish()
    write_slopes(ctx, study)  # the fitted slopes are part of this experiment's results
    return sweep


def series(records: list[dict], panel: str, size_set: str, schedule: str,
           which: str = "model") -> tuple[np.ndarray, np.ndarray]:
    """(x, traffic) of one line, sorted by x; `which` is "model" or "measured"."""
    rows = sorted((r for r in records if r["key"]["panel"] == panel
                   and r["key"]["set"] == size_set and r["key"]["schedule"] == schedule
                   and r[which] is not None), key=lambda r: r["key"][panel])
    return (np.array([r["key"][panel] for r in rows], dtype=float),
            np.array([common.total(r[which]) for r in rows], dtype=float))


# Fit windows. "theorem": Theorem 2's range d <= M <= N d. "interior": 4d <= M <= N d / 8, where
# Algorithm 1's Bc = ceil(M / 4d) is not rounded up to 1 and every K/V (or Q) block is re-read
# at least 32 times, so the N^2 d^2 / M term dominates the once-only N d terms.
WINDOWS = {
    "theorem": lambda n, d, m: theory.in_theorem2_range(n, d, m),
    "interior": lambda n, d, m: 4 * d <= m <= n * d // 8,
}


def in_range(records: list[dict], panel: str, size_set: str, x: np.ndarray,
             window: str = "theorem") -> np.ndarray:
    """Mask of x values whose point lies in the fit window (default: d <= M <= N d)."""
    any_row = next(r["key"] for r in records
                   if r["key"]["panel"] == panel and r["key"]["set"] == size_set)
    keep = []
    for value in x:
        key = {**any_row, panel: int(value)}
        keep.append(WINDOWS[window](key["n"], key["d"], key["m"]))
    return np.array(keep, dtype=bool)


def fit_slopes(data: dict, study: Study = FORWARD) -> list[dict]:
    """Log-log slope of every (panel, size set, schedule, model/measured) line in range."""
    records = data["records"]
    out = []
    lines = sorted({(r["key"]["panel"], r["key"]["set"], r["key"]["schedule"]) for r in records})
    for panel, size_set, schedule in lines:
        for which in ("model", "measured"):
            for window in WINDOWS:
                x, y = series(records, panel, size_set, schedule, which)
                if len(x) == 0:
                    continue
                mask = in_range(records, panel, size_set, x, window)
                x, y = x[mask], y[mask]
                if len(x) < 3:
                    continue
                fit = theory.fit_power_law(x, y)
                first = next(r["key"] for r in records if r["key"]["panel"] == panel
                             and r["key"]["set"] == size_set)
                fixed = {k: first[k] for k in ("n", "d", "m") if k != panel}
                out.append({"panel": panel, "set": size_set, "schedule": schedule,
                            "source": which, "window": window, "fixed": fixed,
                            "x_min": float(x.min()), "x_max": float(x.max()), **fit.to_dict(),
                            "expected": study.expected(schedule, panel)})
    return out


def reference_line(names: list[str], traffic_class: str, study: Study = FORWARD) -> str | None:
    """The first plotted line of a Theorem 2 class ("flash" or "standard"), whose line the
    theorem's Theta(.) overlay is scaled through."""
    return next((n for n in names if study.order(n) is not None
                 and traffic_class == study.order(n).TRAFFIC_CLASS), None)


def write_slopes(ctx: common.Context, study: Study = FORWARD) -> dict:
    """Fit and store the slopes; the file (and its provenance) is rewritten only when the
    fits changed, so a run with nothing new leaves it as it was."""
    data = results.load(ctx.results_path(study.name))
    key_fields = ("panel", "set", "schedule", "source", "window")
    records = [{"key": {k: s[k] for k in key_fields}, "run": 0, **s}
               for s in fit_slopes(data, study)]
    meta = {"from": ctx.results_path(study.name).name, "from_provenance": data["provenance"]}
    path = ctx.results_path(study.slopes)
    if path.exists():
        old = results.load(path)
        if old["records"] == json.loads(json.dumps(records)) and old["meta"] == meta:
            return old
    prov = results.provenance()
    payload = {"format": results.FORMAT, "name": f"{study.slopes}.{ctx.backend}",
               "complete": True, "meta": meta, "provenance": prov, "runs": [prov],
               "n_records": len(records), "records": records}
    results.atomic_write_json(path, payload)
    return payload


def _scaled(reference_x, reference_y, x, shape):
    """`shape(x)` scaled to pass through (reference_x, reference_y)."""
    return shape(x) * reference_y / shape(np.array([reference_x]))[0]


def _slope_text(s: dict | None) -> str:
    return "" if s is None else f"{s['slope']:.2f}"


def _expected_text(study: Study, names: list[str], panel: str) -> str:
    """'expected slope: kv_outer, q_outer 2; dense 2' for a panel's title."""
    by_value: dict = {}
    for name in names:
        value = study.expected(name, panel)
        if value is not None:
            by_value.setdefault(value, []).append(name)
    return "; ".join(f"{', '.join(n)} {v:g}" for v, n in by_value.items()) or "none stated"


def _power_of_two_ticks(ax, x) -> None:
    """Major ticks at the swept powers of two (at most seven, plain numbers), no minor
    labels: nothing overlaps."""
    from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator

    values = sorted({int(v) for v in x})
    step = max(1, -(-len(values) // 7))
    ticks = values[::step]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.set_xticklabels([f"{t:,}" for t in ticks])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())


def _overlays(ax, records, panel, names, study) -> list:
    """Theta(.) curves through the middle of a flash line and the end of the standard line,
    the Saha-Ye bound, and M < d^2 shaded (model sweep). Returns the artists, for the
    figure's legend."""
    fixed = next(r["key"] for r in records
                 if r["key"]["panel"] == panel and r["key"]["set"] == "model")
    x, y_fa = series(records, panel, "model", reference_line(names, "flash", study) or names[0])
    sizes = {k: np.full(len(x), fixed[k], dtype=float) for k in ("n", "d", "m")}
    sizes[panel] = x
    mid = len(x) // 2
    fa = theory.flash_traffic(sizes["n"], sizes["d"], sizes["m"])
    out = ax.plot(x, fa * y_fa[mid] / fa[mid], "k--", lw=1, label="Θ(N²d²/M)")
    sy = theory.saha_ye_lower_bound(sizes["n"], sizes["d"], sizes["m"])
    out += ax.plot(x, sy * y_fa[mid] / fa[mid], color="0.4", ls="-.", lw=1,
                   label="Saha–Ye lower bound Θ(min(N²d/√M, N²d²/M))")
    standard = reference_line(names, "standard", study)
    if standard:
        _, y_dense = series(records, panel, "model", standard)
        st = theory.standard_traffic(sizes["n"], sizes["d"])
        out += ax.plot(x, st * y_dense[-1] / st[-1], color="k", ls=(0, (1, 3)), lw=1.2,
                       label="Θ(Nd + N²)")
    not_optimal = ~theory.flash_optimal(sizes["d"], sizes["m"])
    if not_optimal.any():
        edge = x[not_optimal]
        out.append(ax.axvspan(edge.min(), edge.max() if panel != "m" else fixed["d"] ** 2,
                              color="0.85", alpha=0.6, lw=0, label="M < d² (FA not optimal)"))
    return out


def _fixed_text(records, panel: str, size_set: str) -> str:
    key = next(r["key"] for r in records
               if r["key"]["panel"] == panel and r["key"]["set"] == size_set)
    return ", ".join(f"{k.upper() if k != 'd' else k}={key[k]:,}" for k in ("n", "d", "m")
                     if k != panel)


def plot(ctx: common.Context, study: Study = FORWARD) -> list:
    """Two rows of three panels (traffic vs M, N, d). Top: the large sweep, model lines with
    the committed GPU counts as squares. Bottom: the sizes the simulator runs, model lines
    with the kernels' counts as circles. Each legend gives the fitted slopes (d <= M <= N d);
    each title the expected ones."""
    data = results.load(ctx.results_path(study.name))
    slopes = {(s["key"]["panel"], s["key"]["set"], s["key"]["schedule"], s["key"]["source"]):
              s for s in results.load(ctx.results_path(study.slopes))["records"]
              if s["key"]["window"] == "theorem"}
    gpu = ctx.gpu_results(study.name)
    gpu_slopes_file = ctx.gpu_results(study.slopes)
    gpu_slopes = {} if gpu_slopes_file is None else {
        (s["key"]["panel"], s["key"]["set"], s["key"]["schedule"], s["key"]["source"]): s
        for s in gpu_slopes_file["records"] if s["key"]["window"] == "theorem"}
    records = data["records"]
    plt = common.pyplot()
    from matplotlib.legend_handler import HandlerTuple
    from matplotlib.ticker import NullFormatter

    names = [label for label in study.lines()
             if any(r["key"]["schedule"] == label for r in records)]
    colors = common.schedule_colors(names)
    here = data["provenance"].get("backend", "?")
    fig, grid = plt.subplots(2, 3, figsize=(17, 10))
    overlay_handles = []
    for col, panel in enumerate(("m", "n", "d")):
        top, bottom = grid[0, col], grid[1, col]
        entries = {top: [], bottom: []}
        for name in names:
            x, y = series(records, panel, "model", name)
            line = top.plot(x, y, "-", color=colors[name], lw=2)[0]
            text = f"{name}: {_slope_text(slopes.get((panel, 'model', name, 'model')))} model"
            counted = [(series(records, panel, "model", name, "measured"),
                        slopes.get((panel, "model", name, "measured")), here)]
            if gpu is not None:
                counted.append((series(gpu["records"], panel, "model", name, "measured"),
                                gpu_slopes.get((panel, "model", name, "measured")), "GPU"))
            handle = [line]
            for (xm, ym), s, where in counted:
                if len(xm):
                    handle += top.plot(xm, ym, "s", color=colors[name], ms=5)
                    text += f", {_slope_text(s)} counted ({where})"
            entries[top].append((tuple(handle), text))
            x, y = series(records, panel, "kernel", name)
            line = bottom.plot(x, y, "-", color=colors[name], lw=1.5)[0]
            text = f"{name}: {_slope_text(slopes.get((panel, 'kernel', name, 'model')))} model"
            handle = [line]
            xk, yk = series(records, panel, "kernel", name, "measured")
            if len(xk):
                handle += bottom.plot(xk, yk, "o", color=colors[name], mfc="none", ms=8)
                s = slopes.get((panel, "kernel", name, "measured"))
                text += f", {_slope_text(s)} counted ({here})"
            entries[bottom].append((tuple(handle), text))
        handles = _overlays(top, records, panel, names, study)
        overlay_handles = overlay_handles if len(overlay_handles) >= len(handles) else handles
        expected = _expected_text(study, names, panel)
        var = PANEL_LABEL[panel].split(" (")[0]
        for ax, size_set in ((top, "model"), (bottom, "kernel")):
            xs = np.concatenate([series(records, panel, size_set, n)[0] for n in names])
            ax.set(xscale="log", yscale="log", xlabel=PANEL_LABEL[panel],
                   ylabel="HBM traffic (elements)")
            _power_of_two_ticks(ax, xs)
            ax.yaxis.set_minor_formatter(NullFormatter())
            ax.grid(True, which="major", alpha=0.3)
            ax.set_title(f"traffic vs {var} ({_fixed_text(records, panel, size_set)})\n"
                         f"expected slope: {expected}", fontsize=9)
            ax.legend(*zip(*entries[ax], strict=True), fontsize=7, loc="best",
                      title="fitted log-log slope", title_fontsize=7,
                      handler_map={tuple: HandlerTuple(ndivide=None)})
    what = "backward pass" if study.backward else "forward pass"
    fig.text(0.5, 0.965, "top: at scale — lines the closed-form model, squares the counts of "
             "the kernels on a GPU (committed results)", ha="center", fontsize=10)
    fig.text(0.5, 0.495, f"bottom: at sizes the simulator runs — lines the model, circles the "
             f"counts of the kernels ({data['provenance'].get('device')})", ha="center",
             fontsize=10)
    fig.suptitle(f"{study.theorem}, the {what}: counted traffic follows the model; "
                 f"log-log slopes fitted in d ≤ M ≤ Nd", fontsize=12, y=1.0)
    fig.legend(handles=overlay_handles, loc="lower center", ncol=len(overlay_handles),
               fontsize=8, frameon=False, bbox_to_anchor=(0.5, -0.01))
    fig.tight_layout(rect=(0, 0.03, 1, 0.97), h_pad=4)
    return common.save_figure(fig, ctx.figures_dir, study.name)


def main(argv=None) -> int:
    common.run_experiment(sys.modules[__name__], argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
