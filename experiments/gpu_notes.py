"""paper_notes.md blocks drawn from the committed GPU results (bench_runtime, hw_traffic).

Each function reads its results file and returns a markdown block; a missing file gives a
one-line "not measured yet" instead, so the notes regenerate on any machine.
"""

from __future__ import annotations

import csv
import itertools
import json
import re
from collections import Counter
from pathlib import Path

import loop_orders as lo
from loop_orders.core.ledger import element_bytes
from loop_orders.core.schedule import backward_of

from .gpu_common import input_kind

REFERENCE = {"n": "4096", "d": "64", "causal": "False"}  # the B=4, H=16 shape
# Before and after issue 16's micro-kernel changes: (log, thread tile, batch), same tiles
PROFILE_LOGS = [("gpu_logs/ncu_profile_q_outer_7b8c691.txt", 64, "8 × 4", 4),
                ("gpu_logs/ncu_profile_q_outer_7b97f6e.txt", 64, "8 × 8", 1),
                ("gpu_logs/ncu_profile_q_outer_10f5e3d.txt", 64, "8 × 8", 4),
                ("gpu_logs/ncu_profile_q_outer_349917a.txt", 64, "8 × 8", 4),
                ("gpu_logs/ncu_profile_q_outer_d564bde.txt", 64, "8 × 8", 4),
                ("gpu_logs/ncu_profile_q_outer_d128_69fa7d6.txt", 128, "8 × 4", 4),
                ("gpu_logs/ncu_profile_q_outer_d128_fc723cd.txt", 128, "8 × 4", 4),
                ("gpu_logs/ncu_profile_q_outer_d128_d564bde.txt", 128, "8 × 4", 4),
                ("gpu_logs/ncu_profile_q_outer_f7f55f8.txt", 64, "8 × 8", 4)]
PROFILE_METRICS = ["Duration", "SM Frequency", "L1/TEX Cache Throughput", "Compute (SM) Throughput",
                   "Issue Slots Busy", "Executed Ipc Active", "Warp Cycles Per Issued Instruction",
                   "Registers Per Thread", "Theoretical Occupancy", "Achieved Occupancy",
                   "smsp__inst_executed.sum", "sm__sass_thread_inst_executed_op_ffma_pred_on.sum",
                   "smsp__inst_executed_op_shared_ld.sum",
                   "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum"] + [
    f"smsp__average_warps_issue_stalled_{r}_per_issue_active.ratio"
    for r in ("selected", "not_selected", "short_scoreboard", "dispatch_stall", "wait",
              "barrier", "long_scoreboard", "math_pipe_throttle", "mio_throttle")]


def _rows(path: Path) -> list[dict] | None:
    if not path.exists():
        return None
    with path.open() as f:
        return list(csv.DictReader(f))


def _missing(path: Path) -> str:
    return (f"*Not measured yet: `{path.name}` is written on a GPU machine (README, GPU "
            "experiments).*")


def _bhn(row: dict) -> int:
    """B·H·N of a results row (the benchmarks hold it fixed over N)."""
    return int(row["batch"]) * int(row["heads"]) * int(row["n"])


def _gb(x) -> str:
    return f"{int(x) / 1e9:.3f}"


def hw_traffic(results_dir: Path) -> str:
    path = results_dir / "hw_traffic.csv"
    rows = _rows(path)
    if rows is None:
        return _missing(path)
    worst = max(abs(float(r["ncu_vs_counted"])) for r in rows)
    same = sum(r["model_bytes"] == r["counted_bytes"] for r in rows)
    tiles = list(dict.fromkeys((r["block_q"], r["block_k"]) for r in rows))
    lines = [f"{len(rows)} configurations (every schedule × Br × Bc in "
             f"{', '.join(f'{q} × {k}' for q, k in tiles)} × N × causal × dtype, B·H = "
             f"{int(rows[0]['batch']) * int(rows[0]['heads'])}, d = {rows[0]['d']}): model = "
             f"counted in {same}; largest |ncu L1 bytes − counted| / counted = **{worst:.2g}**."
             f" Float32, not causal, Br × Bc = {tiles[0][0]} × {tiles[0][1]}:", "",
             "| schedule | N | counted = ncu L1 (GB) | DRAM read + write (GB) | DRAM / logical |",
             "|---|---|---|---|---|"]
    for r in rows:
        if (r["dtype"], r["causal"], (r["block_q"], r["block_k"])) == ("float32", "False",
                                                                       tiles[0]):
            dram = int(r["dram_read_bytes"]) + int(r["dram_write_bytes"])
            lines.append(f"| {r['schedule']} | {r['n']} | {_gb(r['counted_bytes'])} | "
                         f"{dram / 1e9:.3f} | {dram / int(r['counted_bytes']):.3f} |")
    before = _rows(results_dir / "hw_traffic_86ab053_uncoalesced.csv")
    if before:
        lines += ["", "Before the row accesses were staged through shared memory "
                  "(`hw_traffic_86ab053_uncoalesced.csv`), ncu L1 bytes / counted bytes:", "",
                  "| schedule | min | max |", "|---|---|---|"]
        for name in dict.fromkeys(r["schedule"] for r in before):
            ratios = [1 + float(r["ncu_vs_counted"]) for r in before if r["schedule"] == name]
            lines.append(f"| {name} | {min(ratios):.2f} | {max(ratios):.2f} |")
    return "\n".join(lines)


def _label(provider: str, dtype: str) -> str:
    """A provider's column name: its dtype named where it is not float32 FMA (tf32x3)."""
    return provider if dtype == "float32" else f"{provider} {dtype}"


def bench_summary(results_dir: Path) -> str:
    path = results_dir / "bench_runtime.csv"
    rows = _rows(path)
    if rows is None:
        return _missing(path)
    ok = [r for r in rows if r["status"] == "ok"]
    at = {(r["provider"], r["dtype"], r["d"], r["causal"]): r for r in ok
          if r["n"] == REFERENCE["n"]}
    providers = list(dict.fromkeys((r["provider"], r["dtype"]) for r in ok))

    def commits(provider, dtype):
        return {r["git_sha"] for r in ok if (r["provider"], r["dtype"]) == (provider, dtype)}

    # q_outer beside SDPA where both come from one run (float32_paths has the other path's)
    ours = [q for q in providers if q[0] == "q_outer"
            and commits(*q) <= commits("torch_sdpa_efficient", "float32")]
    lines = ["| d | causal | " + " | ".join(_label(*p) for p in providers) + " | "
             + " | ".join(f"{_label(*q)} / SDPA efficient" for q in ours) + " |",
             "|---|---|" + "---|" * (len(providers) + len(ours))]
    for d, causal in sorted({(r["d"], r["causal"]) for r in ok}, key=lambda x: (int(x[0]), x[1])):
        cells = []
        for p, dt in providers:
            r = at.get((p, dt, d, causal))
            cells.append(f"{float(r['ms_median']):.2f} ms ({float(r['tflops']):.1f})" if r else "—")
        sdpa = at.get(("torch_sdpa_efficient", "float32", d, causal))
        ratios = [_ratio(sdpa, at.get((*q, d, causal))) for q in ours]
        lines.append(f"| {d} | {causal} | " + " | ".join(cells + ratios) + " |")
    r0 = next(iter(at.values()))
    return (f"N = {REFERENCE['n']}, B·H·N = {_bhn(r0)}"
            f" (B = {r0['batch']}, H = {r0['heads']}); median ms (TFLOP/s):\n\n"
            + "\n".join(lines))


def _beside_sdpa(rows: list[dict], dtype: str) -> dict:
    """(n, d, causal) -> (q_outer's row in `dtype`, SDPA efficient's row of the same run, by
    commit and start time, or None) over a bench file's rows that ran."""
    ok = [r for r in rows if r["status"] == "ok"]

    def point(r: dict) -> tuple:
        return r["n"], r["d"], r["causal"], r["git_sha"], r["date"]

    sdpa = {point(r): r for r in ok if r["provider"] == "torch_sdpa_efficient"}
    return {(r["n"], r["d"], r["causal"]): (r, sdpa.get(point(r)))
            for r in ok if (r["provider"], r["dtype"]) == ("q_outer", dtype)}


def float32_paths(results_dir: Path) -> str:
    """q_outer's two float32 paths over the N sweep, each beside SDPA efficient float32 of its
    own run: exact FMA on CUDA cores (bench_runtime.csv) and 3xTF32 on tensor cores
    (bench_tf32x3.csv), with the float32 FMA ceiling measured beside the first."""
    paths = [("float32", results_dir / "bench_runtime.csv"),
             ("tf32x3", results_dir / "bench_tf32x3.csv")]
    runs = {}
    for dtype, path in paths:
        runs[dtype] = _beside_sdpa(_rows(path) or [], dtype)
        if not runs[dtype]:
            return _missing(path)
    lines = ["| d | causal | N | FMA ms | SDPA ms | FMA / SDPA | 3xTF32 ms | SDPA ms | "
             "3xTF32 / SDPA | error FMA, 3xTF32, SDPA | commit |", "|---" * 11 + "|"]
    fma, tf32x3 = runs["float32"], runs["tf32x3"]
    shapes = sorted(set(fma) & set(tf32x3), key=lambda k: (int(k[1]), k[2], int(k[0])))

    def tiles(r: dict) -> str:
        return f"{r['block_q']} × {r['block_k']}"

    usual = Counter(tiles(runs[dt][key][0]) for dt in runs for key in shapes).most_common(1)[0][0]

    def timed(r: dict) -> str:
        """ms, and the tiles where they are not the usual ones."""
        return _row_ms(r) + (f" ({tiles(r)})" if tiles(r) != usual else "")

    for key in shapes:
        (f, fs), (x, xs) = fma[key], tf32x3[key]
        errors = ", ".join(r["rel_error"] if r else "—" for r in (f, x, xs))
        commits = " / ".join(dict.fromkeys(r["git_sha"][:7] for r in (f, x)))
        lines.append(f"| {key[1]} | {key[2]} | {key[0]} | {timed(f)} | {_row_ms(fs)} | "
                     f"{_ratio(fs, f)} | {timed(x)} | {_row_ms(xs)} | {_ratio(xs, x)} | "
                     f"{errors} | {commits} |")
    r0 = fma[shapes[0]][0]
    head = (f"B·H·N = {_bhn(r0)}, tiles {usual} (a time taken with other tiles names them: the "
            "schedule's `short_tiles`), median ms, kernels alone; FMA (q_outer float32) and "
            "3xTF32 (precision \"tf32x3\") each beside SDPA's float32 efficient backend timed "
            "in the same run, at the commit named (FMA / 3xTF32 where they differ):")
    ceiling = results_dir / "fma_ceiling.json"
    tail = ""
    if ceiling.exists():
        c = json.loads(ceiling.read_text())
        tail = ("\n\nThe float32 FMA ceiling of this GPU, measured in the FMA run "
                f"(`bench_runtime.fma_ceiling`, {c['provenance']['git_sha'][:7]}): a "
                f"register-only FFMA loop {c['ffma_loop']['tflops']} TFLOP/s, cuBLAS SGEMM "
                "(TF32 off) " + ", ".join(f"{g['tflops']} TFLOP/s at {g['m']}³"
                                          for g in c["cublas_sgemm"]) + ".")
    return head + "\n\n" + "\n".join(lines) + tail


def causal_tiles(results_dir: Path) -> str:
    """Causal q_outer at small N with 64 x 64 and 128 x 64 tiles (bench_causal_tiles.csv: FMA
    both, 3xTF32 64 x 64; 3xTF32 at 128 x 64 from bench_tf32x3.csv), each against SDPA
    efficient float32 timed in its own run."""
    path = results_dir / "bench_causal_tiles.csv"
    small = _rows(path)
    if small is None:
        return _missing(path)
    elsewhere = {"tf32x3": _rows(results_dir / "bench_tf32x3.csv") or []}  # 128 x 64 rows

    def runs(rows: list[dict], dtype: str, block_q: int) -> dict:
        """(n, d) -> (ours, SDPA of the same run) for q_outer in dtype, causal, Br block_q."""
        tiled = [r for r in rows if r["block_q"] in (str(block_q), "")]
        return {(n, d): pair for (n, d, causal), pair in _beside_sdpa(tiled, dtype).items()
                if causal == "True"}

    lines = ["| d | N | path | 128 × 64 ms | / SDPA | 64 × 64 ms | / SDPA | commits |",
             "|---|---|---|---|---|---|---|---|"]
    for dtype, label in (("float32", "FMA"), ("tf32x3", "3xTF32")):
        tiles64 = runs(small, dtype, 64)
        tiles128 = {**runs(elsewhere.get(dtype, []), dtype, 128), **runs(small, dtype, 128)}
        for key in sorted(tiles64, key=lambda k: (int(k[1]), int(k[0]))):
            (s, ss), (b, bs) = tiles64[key], tiles128.get(key, (None, None))
            shas = " / ".join(dict.fromkeys(r["git_sha"][:7] for r in (b, s) if r))
            lines.append(f"| {key[1]} | {key[0]} | {label} | {_row_ms(b)} | {_ratio(bs, b)} | "
                         f"{_row_ms(s)} | {_ratio(ss, s)} | {shas} |")
    r0 = small[0]
    return (f"Causal, B·H·N = {_bhn(r0)}, median "
            "ms of the kernels alone; each time over SDPA efficient float32's in the same run "
            "(FMA thread tiles: 64 × 64 takes the layout rule's, "
            + ", ".join(sorted({f"d = {r['d']}: {r['layout']}" for r in small
                                if r["dtype"] == "float32" and r["provider"] == "q_outer"
                                and r["block_q"] == "64"}))
            + "):\n\n" + "\n".join(lines))


def hw_traffic_float32_paths(results_dir: Path) -> str:
    """ncu bytes of the float32 paths at this round's kernels (hw_traffic_float32_paths.csv:
    the CUDA-core micro-kernel's schedules, q_outer's 3xTF32) beside the same configurations
    measured earlier: FMA in hw_traffic_q_outer.csv or hw_traffic.csv, 3xTF32 beside plain
    TF32 (same loads) in hw_traffic_tensor_cores.csv."""
    path = results_dir / "hw_traffic_float32_paths.csv"
    rows = _rows(path)
    if rows is None:
        return _missing(path)
    earlier = {"float32": ([*(_rows(results_dir / "hw_traffic_q_outer.csv") or []),
                            *(_rows(results_dir / "hw_traffic.csv") or [])], "float32"),
               "tf32x3": (_rows(results_dir / "hw_traffic_tensor_cores.csv") or [], "tf32")}
    columns = ("schedule", "n", "causal", "block_q", "block_k", "batch", "heads", "d")
    lines = ["| schedule | dtype | N | causal | commit | model = counted | ncu loads + stores | "
             "ncu / counted − 1 | earlier row (dtype, commit) | same ncu bytes |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        before, as_dtype = earlier[r["dtype"]]
        match = next((e for e in before if e["dtype"] == as_dtype
                      and all(e[c] == r[c] for c in columns)), None)
        ncu = int(r["ncu_ld_bytes"]) + int(r["ncu_st_bytes"])
        same = "—" if match is None else \
            ("yes" if (match["ncu_ld_bytes"], match["ncu_st_bytes"])
             == (r["ncu_ld_bytes"], r["ncu_st_bytes"]) else "no")
        where = f"{as_dtype}, {match['git_sha'][:7]}" if match else "—"
        name = _with_options(r)
        lines.append(f"| {name} | {r['dtype']} | {r['n']} | {r['causal']} | "
                     f"{r['git_sha'][:7]} | {r['model_bytes'] == r['counted_bytes']} | "
                     f"{ncu:,} | {float(r['ncu_vs_counted']):+.4f} | {where} | {same} |")
    r0 = rows[0]
    return (f"B = {r0['batch']}, H = {r0['heads']}, d = {r0['d']}, tiles {r0['block_q']} × "
            f"{r0['block_k']}; ncu's l1tex global load and store bytes, summed over a "
            "schedule's kernels:\n\n" + "\n".join(lines))


def _with_options(r: dict) -> str:
    """A results row's schedule with its options, e.g. "split_kv, splits 4"."""
    options = json.loads(r["options"] or "{}")
    return r["schedule"] + "".join(f", {k} {v}" for k, v in options.items())


def _row_ms(r: dict | None) -> str:
    return f"{float(r['ms_median']):.3f}" if r else "—"


def _ratio(slow: dict | None, fast: dict | None, key: str = "ms_median") -> str:
    """How many times faster `fast` runs than `slow` (slow's ms over fast's, in column key;
    — where either row is missing)."""
    return f"{float(slow[key]) / float(fast[key]):.3f}×" if slow and fast else "—"


def tensor_cores(results_dir: Path) -> str:
    """The tensor-core micro-kernel's runtimes beside SDPA's FlashAttention-2 kernel (16-bit)
    and beside our own float32 FMA path (TF32), and the mma.sync ceiling of the same GPU."""
    path = results_dir / "bench_tensor_cores.csv"
    rows = _rows(path)
    if rows is None:
        return _missing(path)
    at = {(r["provider"], r["dtype"], r["d"], r["causal"]): r for r in rows
          if r["status"] == "ok" and r["n"] == "4096"}
    shapes = sorted({(r["d"], r["causal"]) for r in rows}, key=lambda x: (int(x[0]), x[1]))
    sixteen = ["| d | causal | q_outer f16 | kv_outer f16 | dense f16 | split_kv f16 | SDPA "
               "flash f16 | q_outer / SDPA | q_outer bf16 | SDPA flash bf16 | q_outer / SDPA "
               "(bf16) | error q_outer f16, SDPA f16 |", "|---" * 12 + "|"]
    tf32 = ["| d | causal | q_outer tf32 | kv_outer tf32 | dense tf32 | q_outer float32 FMA | "
            "SDPA efficient float32 | q_outer tf32 / FMA | error q_outer tf32 |",
            "|---" * 9 + "|"]
    for d, c in shapes:
        def g(provider, dtype, d=d, c=c):
            return at.get((provider, dtype, d, c))

        qf, sf, qb, sb = (g("q_outer", "float16"), g("torch_sdpa_flash", "float16"),
                          g("q_outer", "bfloat16"), g("torch_sdpa_flash", "bfloat16"))
        errors = f"{qf['rel_error']}, {sf['rel_error']}" if qf and sf else "—"
        sixteen.append(f"| {d} | {c} | {_row_ms(qf)} | {_row_ms(g('kv_outer', 'float16'))} | "
                       f"{_row_ms(g('dense', 'float16'))} | {_row_ms(g('split_kv', 'float16'))} | "
                       f"{_row_ms(sf)} | {_ratio(sf, qf)} | {_row_ms(qb)} | {_row_ms(sb)} | "
                       f"{_ratio(sb, qb)} | {errors} |")
        qt, q32 = g("q_outer", "tf32"), g("q_outer", "float32")
        tf32.append(f"| {d} | {c} | {_row_ms(qt)} | {_row_ms(g('kv_outer', 'tf32'))} | "
                    f"{_row_ms(g('dense', 'tf32'))} | {_row_ms(q32)} | "
                    f"{_row_ms(g('torch_sdpa_efficient', 'float32'))} | {_ratio(q32, qt)} | "
                    f"{qt['rel_error'] if qt else '—'} |")
    r0 = rows[0]
    head = (f"N = 4096, B·H·N = {_bhn(r0)}, tiles "
            f"{r0['block_q']}×{r0['block_k']}; median ms, kernels alone, each checked against "
            "float64 first (the error: max relative on sampled rows). 16-bit inputs:")
    ceiling = results_dir / "tensor_core_ceiling.json"
    tail = ""
    if ceiling.exists():
        c = json.loads(ceiling.read_text())
        best = {r["dtype"]: float(r["tflops"]) for r in rows if r["provider"] == "q_outer"
                and r["status"] == "ok" and r["n"] == "4096" and r["d"] == "64"
                and r["causal"] == "False"}
        tail = "\n\nThe mma.sync ceiling on this GPU, a register-only loop timed in the same " \
            "way (`bench_runtime.mma_ceiling`, " + c["provenance"]["git_sha"] + "): " + \
            "; ".join(f"{x['dtype']} {x['tflops']:.0f} TFLOP/s" for x in c["ceilings"]) + \
            ". q_outer at d = 64, not causal: " + "; ".join(
                f"{dt} {best[dt]:.0f} TFLOP/s" for dt in ("float16", "bfloat16", "tf32")
                if dt in best) + "."
    return (head + "\n\n" + "\n".join(sixteen) + "\n\nTF32 (float32 inputs, "
            "`precision=\"tf32\"`) beside the float32 paths:\n\n" + "\n".join(tf32) + tail)


HOPPER_PROFILE = ("gpu_logs/h100_4612fc2_2026-12-07/profile_q_outer_tma_d128_causal_n1024.log",
                  "the TMA producer kernel, 128×128, d = 128, causal, N = 1024, B = H = 16, "
                  "float16")
HOPPER_PROFILE_METRICS = ["Duration", "Registers Per Thread", "Theoretical Occupancy",
                          "Issue Slots Busy", "Compute (SM) Throughput", "DRAM Throughput",
                          "L2 Hit Rate"]
HOPPER_BUILDS_RUN = "bench_hopper_builds.csv"  # the builds swept at several N
HOPPER_TRAFFIC = "hw_traffic_hopper.csv"  # ncu on the wgmma and TMA kernels
HOPPER_GRID_RUN = "bench_hopper_grid.csv"  # the causal grid by groups of heads, swept
HOPPER_PERSISTENT_RUN = "bench_hopper_persistent.csv"  # the TMA build on persistent CTAs


def _model_gbs(r: dict) -> float:
    """The model's bytes of a timed row over its time, GB/s."""
    import loop_orders as lo

    name = r["provider"].split()[0]
    p = lo.make_problem(name, n_q=int(r["n"]), d=int(r["d"]), batch=int(r["batch"]),
                        heads=int(r["heads"]), causal=r["causal"] == "True",
                        block_q=int(r["block_q"]), block_k=int(r["block_k"]), dtype=r["dtype"])
    return lo.get_schedule(name).model(p).bytes(p.itemsize) / float(r["ms_median"]) / 1e6


# the whole table (latest first), then the runs of its N = 1024 points alone with the
# tiles and builds swept there
HOPPER_RUNS = ("bench_hopper.csv", "bench_hopper_h200.csv", "bench_hopper_n1024.csv")


def hopper(results_dir: Path) -> str:
    """The forward on wgmma beside its mma.sync build, SDPA flash and cuDNN (each of
    HOPPER_RUNS there is), and Nsight Compute on the wgmma kernel."""
    runs = [_hopper_run(results_dir / name) for name in HOPPER_RUNS
            if (results_dir / name).exists()]
    out = "\n\n".join(runs) if runs else _missing(results_dir / HOPPER_RUNS[0])
    for part in (_hopper_builds(results_dir / HOPPER_BUILDS_RUN),
                 _hopper_builds(results_dir / HOPPER_PERSISTENT_RUN),
                 _hopper_builds(results_dir / HOPPER_RUNS[-1]),
                 _hopper_grid(results_dir / HOPPER_GRID_RUN),
                 _hopper_traffic(results_dir / HOPPER_TRAFFIC)):
        out += "\n\n" + part if part else ""
    path, what = HOPPER_PROFILE
    profile = results_dir / path
    if profile.exists():
        text = profile.read_text()
        stalls = {name: _profile_value(text, f"smsp__average_warps_issue_stalled_{name}_per_"
                                       "issue_active.ratio")
                  for name in ("selected", "wait", "math_pipe_throttle", "long_scoreboard",
                               "barrier", "mio_throttle", "gmma")}
        out += ("\n\n" + f"Nsight Compute on {what} (`results/{path}`, ncu's locked "
                "clocks): " + "; ".join(
                    f"{m} {_profile_value(text, m)}" for m in HOPPER_PROFILE_METRICS)
                + "; stalls per issued instruction: " + ", ".join(
                    f"{k} {v.split()[0]}" for k, v in stalls.items()) + ".")
    return out


def _hopper_builds(path: Path) -> str | None:
    """q_outer's Hopper builds swept at several N (bench_hopper --sweep-n): ms per tiles and
    build on each build's default grid, the fastest in bold (rows naming a grid of their
    own: `_hopper_grid`); where the run's table has SDPA flash at a point, the fastest
    build's ratio to it."""
    all_rows = _rows(path) or ()
    rows = [r for r in all_rows if r["part"] == "tiles" and r["status"] == "ok"
            and not r.get("causal_heads")]
    if not rows:
        return None
    times = _swept_builds(rows)
    tiles = sorted({(int(r["block_q"]), int(r["block_k"])) for r in rows})
    names = {"ring": "ring", "sync": "waited", "tma": "TMA producer",
             "persistent": "TMA, persistent CTAs"}
    swept = {_build_of(r) for r in rows}
    builds = [b for b in names if b in swept]
    flash = {(int(r["n"]), int(r["d"]), r["causal"]): float(r["ms_median"]) for r in all_rows
             if r["part"] == "table" and r["provider"] == "torch_sdpa_flash"
             and r["status"] == "ok" and r["dtype"] == "float16"}
    lines = ["| N | d | causal | " + " | ".join(f"{names[b]} {bq}×{bk}" for bq, bk in tiles
                                               for b in builds) + " |"
             + (" SDPA flash | fastest / flash |" if flash else ""),
             "|---" * (3 + len(tiles) * len(builds) + 2 * bool(flash)) + "|"]
    for (n, d, causal), at in sorted(times.items()):
        best = min(at.values())
        cells = [at.get((*t, b)) for t in tiles for b in builds]
        theirs = flash.get((n, d, causal))
        lines.append(f"| {n} | {d} | {causal} | " + " | ".join(
            "—" if c is None else (f"**{c:.3f}**" if c == best else f"{c:.3f}")
            for c in cells) + " |" + ("" if not flash else " — | — |" if theirs is None
                                      else f" {theirs:.3f} | {theirs / best:.3f}× |"))
    first = rows[0]
    return (f"q_outer's builds on the {first['device']} at {first['git_sha'][:7]} "
            f"(`results/{path.name}`; float16, B·H·N = {_bhn(first)}, median ms, kernels alone, "
            "each checked against float64 first):\n\n" + "\n".join(lines))


def _swept_builds(rows: list) -> dict:
    """Swept rows (one grid each) as {(N, d, causal): {(block_q, block_k, build): ms}}; where
    two variants ran one build (`_build_of`), the faster."""
    times: dict = {}
    for r in rows:
        at = times.setdefault((int(r["n"]), int(r["d"]), r["causal"]), {})
        key = (int(r["block_q"]), int(r["block_k"]), _build_of(r))
        at[key] = min(at.get(key, float("inf")), float(r["ms_median"]))
    return times


def _build_of(row: dict) -> str:
    """The build a swept row ran, from its layout ("wgmma.f16x2.pipelined.tma": tma): a
    variant asked of tiles it does not fit runs another (the TMA producer on 64-row tiles,
    one warpgroup, runs the ring)."""
    parts = row["layout"].split(".")
    for part, build in (("persistent", "persistent"), ("tma", "tma"), ("pipelined", "ring")):
        if part in parts:
            return build
    return "sync"


def _grid_heads(layout: str) -> int:
    """The heads a group of a causal grid, from a row's build (".heads8"; 0: every head)."""
    return int(layout.rsplit(".heads", 1)[1]) if ".heads" in layout else 0


def _hopper_grid(path: Path) -> str | None:
    """q_outer's causal Hopper grid by groups of heads (bench_hopper --causal-heads): ms per
    N, head dim, tiles and build, over every head and by each group size swept."""
    swept = [r for r in _rows(path) or () if r["part"] == "tiles" and r["status"] == "ok"
             and r["causal"] == "True"]
    if not swept:
        return None
    groups = sorted({_grid_heads(r["layout"]) for r in swept} - {0})
    at: dict = {}
    for r in swept:
        build = r["layout"].split(".heads")[0]
        at.setdefault((int(r["n"]), int(r["d"]), f"{r['block_q']}×{r['block_k']}, {build}"),
                      {})[_grid_heads(r["layout"])] = float(r["ms_median"])
    lines = ["| N | d | tiles, build | over every head | " + " | ".join(
        f"{g} heads a group" for g in groups) + " | every head ÷ fastest |",
             "|---" * (5 + len(groups)) + "|"]
    for (n, d, build), ms in sorted(at.items()):
        best = min(ms.values())
        lines.append(f"| {n} | {d} | {build} | " + " | ".join(
            "—" if ms.get(g) is None else (f"**{ms[g]:.3f}**" if ms[g] == best
                                            else f"{ms[g]:.3f}") for g in (0, *groups))
            + (f" | {ms[0] / best:.3f}× |" if 0 in ms else " | — |"))
    first = swept[0]
    return (f"The causal grid by groups of heads, each group's heaviest query blocks first "
            f"(`tiles.grouped_block`; q_outer's HOPPER_CAUSAL_HEADS; on the {first['device']} "
            f"at {first['git_sha'][:7]}, `results/{path.name}`, float16, B·H·N = "
            f"{_bhn(first)}, median ms):\n\n" + "\n".join(lines))


def _hopper_traffic(path: Path) -> str | None:
    """ncu's bytes on the Hopper kernels (hw_traffic --name hw_traffic_hopper)."""
    rows = _rows(path)
    if not rows:
        return None
    lines = ["| schedule | tiles, build | causal | counted bytes | ncu loads (plain + cp.async "
             "+ TMA) | ncu stores | ncu / counted − 1 | DRAM bytes |", "|---" * 8 + "|"]
    for r in rows:
        loads = sum(int(float(r[k])) for k in r if r[k] != "" and (
            k in ("ncu_ld_bytes", "ncu_tma_ld_bytes")
            or (k.startswith("ncu_ldgsts") and "_lookup_" not in k)))
        copies = "TMA" if float(r.get("ncu_tma_ld_bytes") or 0) > 0 else "cp.async"
        lines.append(f"| {r['schedule']} | {r['block_q']}×{r['block_k']}, "
                     f"{r.get('build') or 'wgmma'}, tiles by {copies} | "
                     f"{r['causal']} | {int(r['counted_bytes']):,} | {loads:,} | "
                     f"{int(r['ncu_st_bytes']):,} | {float(r['ncu_vs_counted']):+.4f} | "
                     f"{int(r['dram_read_bytes']) + int(r['dram_write_bytes']):,} |")
    first = rows[0]
    return (f"Nsight Compute on the wgmma and TMA kernels ({first['device']}, "
            f"{first['git_sha'][:7]}, `results/{path.name}`; B = {first['batch']}, H = "
            f"{first['heads']}, N = {first['n']}, d = {first['d']}, {first['dtype']}; TMA's "
            "loads are ncu's l1tex__m_xbar2l1tex_read_bytes_mem_global_op_tma_ld):\n\n"
            + "\n".join(lines))


def _hopper_provider(provider: str) -> str:
    """A bench_hopper row's column: its schedule ("q_outer wgmma-sync": q_outer), " mma" on
    mma.sync, "public" for q_outer's public call."""
    if provider == "q_outer public call":
        return "public"
    return provider.split()[0] + (" mma" if "mma.sync" in provider else "")


def _hopper_run(path: Path) -> str:
    """One bench_hopper run: its table and what its tile sweep found."""
    rows = _rows(path)
    table = [r for r in rows if r["part"] == "table" and r["status"] == "ok"]
    points = list(dict.fromkeys((r["n"], r["d"], r["causal"], r["dtype"]) for r in table))
    public = any(r["provider"] == "q_outer public call" for r in table)
    lines = ["| N | d | causal | dtype | SDPA flash | SDPA cuDNN | q_outer wgmma (tiles, build) "
             "| / flash | / cuDNN | q_outer mma.sync 128×64 | wgmma / mma.sync | kv_outer "
             "wgmma | kv_outer, model bytes / time |"
             + (" public call | / flash | dense wgmma | dense mma.sync |" if public else ""),
             "|---" * (17 if public else 13) + "|"]
    for point in points:
        at = {_hopper_provider(r["provider"]): r
              for r in table if (r["n"], r["d"], r["causal"], r["dtype"]) == point}
        wg, mma, kv = at.get("q_outer"), at.get("q_outer mma"), at.get("kv_outer")
        fl, cu = at.get("torch_sdpa_flash"), at.get("torch_sdpa_cudnn")
        build = f"{wg['block_q']}×{wg['block_k']}, {wg['layout']}" if wg else ""
        lines.append(f"| {' | '.join(point)} | {_row_ms(fl)} | {_row_ms(cu)} | "
                     f"{_row_ms(wg)} ({build}) | {_ratio(fl, wg)} | {_ratio(cu, wg)} | "
                     f"{_row_ms(mma)} | {_ratio(mma, wg)} | {_row_ms(kv)} | "
                     + (f"{_model_gbs(kv):.0f} GB/s |" if kv else "— |")
                     + (f" {_row_ms(at.get('public'))} | {_ratio(fl, at.get('public'))} | "
                        f"{_row_ms(at.get('dense'))} | {_row_ms(at.get('dense mma'))} |"
                        if public else ""))
    sweep = [r for r in rows if r["part"] == "tiles" and r["status"] == "ok"
             and not r.get("causal_heads")]
    times = _swept_builds(sweep)
    pairs: dict = {}  # (N, d, causal, tiles) -> {build: ms}
    for point, at in times.items():
        for (bq, bk, build), ms in at.items():
            pairs.setdefault((point, bq, bk), {})[build] = ms
    both = [v for v in pairs.values() if "ring" in v and "sync" in v]
    faster = sum(1 for v in both if v["ring"] < v["sync"])
    produced = [v["ring"] / v["tma"] for v in pairs.values() if "tma" in v and "ring" in v]
    first = table[0] if table else rows[0]
    swept = " and ".join(str(n) for n in sorted({n for n, _, _ in times})) or "—"
    out = [f"On the {first['device']} at {first['git_sha'][:7]} (`results/{path.name}`; B·H·N "
           f"= {_bhn(first)}, median ms, kernels alone, each checked against float64 first; "
           f"q_outer's tiles and build the fastest of the tile sweep at N = {swept} (the "
           "largest swept N up to the point's) for that head dim and mask):", "", *lines, "",
           f"The tile sweep (N = {swept}, float16): the pipelined update (P V_j-1 under S_ij's "
           f"softmax) was faster than the one that waits for each product at {faster} of "
           f"{len(both)} tiles and masks."
           + (f" A producer warpgroup filling the ring by TMA (`wgmma-tma`) against every "
              f"thread copying by cp.async: {min(produced):.2f}-{max(produced):.2f}× the "
              f"speed over {len(produced)} tiles and masks." if produced else "")]
    return "\n".join(out)


def tc_tiles(results_dir: Path) -> str:
    path = results_dir / "bench_tc_tiles.csv"
    rows = _rows(path)
    if rows is None:
        return _missing(path)
    lines = ["| dtype | d | Br × Bc | K/V buffers | registers | local bytes | ms | TFLOP/s |",
             "|---|---|---|---|---|---|---|---|"]
    base = []
    for r in rows:
        if r["schedule"] != "q_outer":
            base.append(f"SDPA flash float16 at d = {r['d']}: {r['ms_median']} ms")
            continue
        ms = r["ms_median"] or r["status"][:60]
        lines.append(f"| {r['dtype']} | {r['d']} | {r['block_q']} × {r['block_k']} | "
                     f"{r['stages']} | {r['regs'] or '—'} | {r['local_bytes'] or '—'} | {ms} | "
                     f"{r['tflops'] or '—'} |")
    return (f"q_outer on tensor cores, N = {rows[0]['n']}, not causal ("
            + "; ".join(base) + "):\n\n" + "\n".join(lines))


def hw_traffic_tensor_cores(results_dir: Path) -> str:
    path = results_dir / "hw_traffic_tensor_cores.csv"
    rows = _rows(path)
    if rows is None:
        return _missing(path)
    lines = ["| schedule | dtype | N | causal | counted bytes | ncu loads | ncu stores | "
             "ncu / counted − 1 | DRAM bytes |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        dram = int(r["dram_read_bytes"]) + int(r["dram_write_bytes"])
        name = _with_options(r)
        lines.append(f"| {name} | {r['dtype']} | {r['n']} | {r['causal']} | "
                     f"{int(r['counted_bytes']):,} | {int(r['ncu_ld_bytes']):,} | "
                     f"{int(r['ncu_st_bytes']):,} | {float(r['ncu_vs_counted']):+.4f} | "
                     f"{dram:,} |")
    r0 = rows[0]
    return (f"B = {r0['batch']}, H = {r0['heads']}, d = {r0['d']}, tiles {r0['block_q']}×"
            f"{r0['block_k']}; ncu's l1tex global load and store bytes:\n\n" + "\n".join(lines))


LDGSTS_PROBE = "gpu_logs/ncu_ldgsts_probe_4715661.txt"  # one launch, hw_traffic's first shape
PROBE_METRICS = ("smsp__inst_executed_op_global_ld.sum", "smsp__inst_executed_op_ldgsts.sum",
                 "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum",
                 "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum",
                 "lts__t_sectors_srcunit_tex_op_read.sum")


def _count(text: str, name: str) -> int:
    return int(_profile_value(text, name).split()[0].replace(",", ""))


def hw_traffic_cp_async(results_dir: Path) -> str:
    """q_outer's float32 kernel with K/V rows by cp.async (hw_traffic_q_outer.csv, d = 64,
    and hw_traffic_q_outer_d128.csv where measured): ncu's l1tex bytes against the counted
    ones, the excess as a share of the cp.async bytes, and the sector probe (LDGSTS_PROBE)
    that locates it."""
    path, probe = results_dir / "hw_traffic_q_outer.csv", results_dir / LDGSTS_PROBE
    rows = _rows(path)
    if rows is None or not probe.exists():
        return _missing(path if rows is None else probe)
    first = rows[0]  # the probe's configuration
    rows += _rows(results_dir / "hw_traffic_q_outer_d128.csv") or []
    lines = ["| d | Br × Bc | configurations | model = counted | ncu / counted − 1 | "
             "(ncu − counted) / cp.async bytes |", "|---|---|---|---|---|---|"]
    for d, *tiles in dict.fromkeys((r["d"], r["block_q"], r["block_k"]) for r in rows):
        mine = [r for r in rows if [r["d"], r["block_q"], r["block_k"]] == [d, *tiles]]
        over = [float(r["ncu_vs_counted"]) for r in mine]
        shares = []
        for r in mine:  # cp.async moves K and V: the counted loads less Q's (plain loads)
            q_bytes = int(r["batch"]) * int(r["heads"]) * int(r["n"]) * int(r["d"]) * 4
            copied = int(r["counted_bytes"]) - int(r["ncu_st_bytes"]) - q_bytes
            excess = int(r["ncu_ld_bytes"]) + int(r["ncu_st_bytes"]) - int(r["counted_bytes"])
            shares.append(excess / copied)
        same = sum(r["model_bytes"] == r["counted_bytes"] for r in mine)
        lines.append(f"| {d} | {tiles[0]} × {tiles[1]} | {len(mine)} | {same} | "
                     f"{min(over):+.4f} … {max(over):+.4f} | "
                     f"{min(shares):.5f} … {max(shares):.5f} |")
    text = probe.read_text()
    ld, ldgsts, requests, sectors, l2 = (_count(text, m) for m in PROBE_METRICS)
    counted_sectors = (int(first["counted_bytes"]) - int(first["ncu_st_bytes"])) // 32
    lines += ["", f"The probe (`results/{LDGSTS_PROBE}`: B = {first['batch']}, H = "
              f"{first['heads']}, N = {first['n']}, {first['block_q']} × {first['block_k']}, "
              "not causal):", "",
              "| warp loads (4-byte) | warp cp.async (16-byte) | l1tex requests | l1tex sectors "
              "| (sectors − 4 × loads) / cp.async | L2 sectors from L1 | counted load sectors |",
              "|---|---|---|---|---|---|---|",
              f"| {ld:,} | {ldgsts:,} | {requests:,} | {sectors:,} | "
              f"{(sectors - 4 * ld) / ldgsts:g} | {l2:,} | {counted_sectors:,} |"]
    return "\n".join(lines)


def _hw_traffic_model(row: dict):
    """An hw_traffic row's Problem and the model (elements) of the pass it measured, as the
    run built them (`hw_traffic.problem`, `measured`), with the options it resolved."""
    from experiments import hw_traffic

    cfg = {"schedule": row["schedule"], "n": int(row["n"]), "d": int(row["d"]),
           "n_k": int(row["n_k"]) if row.get("n_k") else None, "batch": int(row["batch"]),
           "heads": int(row["heads"]),
           "kv_heads": int(row["kv_heads"]) if row.get("kv_heads") else None,
           "pack_gqa": row.get("pack_gqa") == "True", "block_q": int(row["block_q"]),
           "block_k": int(row["block_k"]), "causal": row["causal"] == "True",
           "backward": row.get("backward") == "True", "asked": json.loads(row["options"]),
           "dtype": row["dtype"]}
    p = hw_traffic.problem(cfg)
    return p, hw_traffic.measured(cfg).model(p)


def _read_bytes(ledger, itemsize: int, tensors) -> int:
    return sum(ledger.read(t) * element_bytes(t, itemsize) for t in tensors)


def l1tex_line_rule(results_dir: Path) -> str:
    """ncu's load bytes against the counted ones where mma.sync tiles arrive by cp.async, and
    the excess `hw_traffic.l1tex_copy_ratio` gives their padded rows, tile by tile: q_outer's
    forward (hw_traffic_tensor_cores.csv: every load a tile copy), grouped-query decode
    (hw_traffic_gqa_decode.csv: K_j, V_j in whole tiles, Q_i in tiles of the query rows a
    block holds, one per head or the group's four packed; the combine's partials by plain
    loads) and q_outer's backward with dQ by atomics (hw_traffic_backward.csv: the K/V-outer
    kernel copies K_j, V_j and, per visited pair, Q_i and dO_i, as many dO elements as Q's;
    the preprocess and the dQ conversion load plainly; the reductions are ncu's own column,
    half of it their reads). Plain loads count whole sectors: split_kv's combine reads a
    (split, head)'s lse_part values of the block's rows, 4 bytes each, in one 32-byte
    sector."""
    from experiments.hw_traffic import SECTOR, l1tex_copy_ratio
    from loop_orders.microkernel.tensor_cores import TensorCores, tc_shared_layout

    lines = ["| results file | schedule | dtype | N | n_k | causal | counted loads | ncu loads "
             "| ncu − counted | the rule's excess | whole sectors of lse_part | left over |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    sources = (("hw_traffic_tensor_cores.csv", False), ("hw_traffic_gqa_decode.csv", False),
               ("hw_traffic_backward.csv", True))
    for name, _ in sources:
        if not (results_dir / name).exists():
            return _missing(results_dir / name)
    for name, backward in sources:
        # split_kv on tensor cores at decode only (CUDA cores in hw_traffic_tensor_cores.csv)
        ours = ("q_outer", "split_kv") if name == "hw_traffic_gqa_decode.csv" else ("q_outer",)
        rows = [r for r in _rows(results_dir / name) if r["schedule"] in ours
                and r["dtype"] in ("float16", "bfloat16", "tf32")]
        for r in rows:
            p, model = _hw_traffic_model(r)
            size = p.itemsize
            kind = input_kind(r["dtype"])  # the mma.sync build these runs ran
            spec = TensorCores(r["dtype"] if kind["dtype"] != "float32" else kind["precision"])
            stride = size * tc_shared_layout(p.block_q, p.block_k, p.d, p.dv, False, spec).ks
            loads = _read_bytes(model, size, model.tensors)
            q_bytes = _read_bytes(model, size, ("q",)) * (2 if backward else 1)  # and dO's
            if backward:  # the reductions' reads are in ncu's red column, not its loads
                loads -= int(r["ncu_red_bytes"]) // 2
            kv = _read_bytes(model, size, ("k", "v"))
            rule = (kv * (l1tex_copy_ratio(p.d * size, stride) - 1)
                    + q_bytes * (l1tex_copy_ratio(p.d * size, stride, p.block_q) - 1))
            parts = model.read("lse_part") // p.block_q  # (split, head) parts of a block each
            sectors = parts * (SECTOR - element_bytes("lse_part", size) * p.block_q)
            ncu = int(r["ncu_ld_bytes"])
            lines.append(f"| {name} | {_with_options(r)} | {r['dtype']} | {r['n']} | "
                         f"{r.get('n_k') or r['n']} | {r['causal']} | {loads:,} | {ncu:,} | "
                         f"{ncu - loads:,} | {rule:,.0f} | {sectors:,} | "
                         f"{ncu - loads - rule - sectors:,.0f} |")
    return "\n".join(lines)


def bench_tuning(results_dir: Path) -> str:
    path = results_dir / "bench_layouts.csv"
    rows = _rows(path)
    if rows is None:
        return _missing(path)
    lines = ["| schedule | d | Br × Bc | layout (RM, KN) | registers | local bytes | ms | "
             "TFLOP/s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tiles = f"{r['block_q']} × {r['block_k']}" if r["block_q"] else "—"
        lines.append(f"| {r['schedule']} | {r['d']} | {tiles} | {r['layout'] or '—'} | "
                     f"{r['regs'] or '—'} | {r['local_bytes'] or '—'} | {r['ms_median']} | "
                     f"{r['tflops']} |")
    return "\n".join(lines)


def bench_kernels(results_dir: Path) -> str:
    path = results_dir / "bench_kernels.json"
    if not path.exists():
        return _missing(path)
    report = json.loads(path.read_text())
    lines = ["| schedule | N | d | counting off (ms) | counting on (ms) | on / off |",
             "|---|---|---|---|---|---|"]
    for c in report["counting"]:
        lines.append(f"| {c['schedule']} | {c['n']} | {c['d']} | {c['ms_off']:.3f} | "
                     f"{c['ms_on']:.3f} | {c['ms_on'] / c['ms_off']:.3f} |")
    lines += ["", "| kernel | counting | Br, Bc | RM, KN | registers | local bytes | shared "
              "bytes | atomics in PTX | ld.shared.v4 |", "|---|---|---|---|---|---|---|---|---|"]
    for k in report["kernels"]:
        c = k["constants"]
        tiles = f"{c['BR']}, {c['BC']}" if "BR" in c else "—"
        layout = k.get("layout", "").replace(",", ", ") or "—"
        lines.append(f"| {k['kernel']} | {k['count']} | {tiles} | {layout} | {k['regs']} | "
                     f"{k['local_bytes']} | {k['shared_bytes']} | {k['atomics_in_ptx']} | "
                     f"{k['vector_shared_loads']} |")
    return "\n".join(lines)


def bench_blocksize(results_dir: Path) -> str:
    path = results_dir / "bench_blocksize.csv"
    rows = _rows(path)
    if rows is None:
        return _missing(path)
    lines = ["| schedule | Br | Bc | model HBM bytes (GB) | ms |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['schedule']} | {r['block_q']} | {r['block_k']} | "
                     f"{_gb(r['model_bytes'])} | {r['ms_median'] or r['status']} |")
    return "\n".join(lines)


def _profile_value(text: str, name: str) -> str:
    m = re.search(rf"^\s+{re.escape(name)}\s+(?:(\S+(?:/\S+)?)\s+)?([\d.,]+)\s*$", text,
                  re.M)
    return f"{m.group(2)} {m.group(1) or ''}".strip() if m else "—"


def q_outer_profile(results_dir: Path) -> str:
    logs = [(results_dir / log, d, tile, batch) for log, d, tile, batch in PROFILE_LOGS]
    missing = [path for path, *_ in logs if not path.exists()]
    if missing:
        return _missing(missing[0])
    texts = [path.read_text() for path, *_ in logs]
    head = " | ".join(f"`{path.name}`: d = {d}, {tile}, B = {batch}"
                      for path, d, tile, batch in logs)
    lines = ["Nsight Compute on one q_outer launch (H = 16, N = 4096, Br = 128, Bc = 64, "
             "float32; ncu locks the SM clock, so durations are longer than the benchmark's; "
             "the stall ratios are cycles per issued instruction):", "",
             f"| metric | {head} |", "|---|" + "---|" * len(logs)]
    for name in PROFILE_METRICS:
        lines.append(f"| {name} | " + " | ".join(_profile_value(t, name) for t in texts) + " |")
    pipes = [re.search(r"(\w+) is the highest-utilized pipeline \(([\d.]+)%\)", t) for t in texts]
    lines.append("| busiest pipeline | " + " | ".join(
        f"{m.group(1)} ({m.group(2)} %)" if m else "—" for m in pipes) + " |")
    return "\n".join(lines)


# What the FlashAttention paper prints in Figure 2 (left) for GPT-2 medium's attention,
# forward + backward, on an A100 (arXiv 2205.14135; the stored transcripts we could read of
# its later versions print these, one of an earlier version 35.3 GB and 35.1 / 11.7 ms).
PAPER_FIG2 = {"standard": {"gflops": 66.6, "hbm_gb": 40.3, "ms": 41.7},
              "FlashAttention": {"gflops": 75.2, "hbm_gb": 4.4, "ms": 7.3}}
DECODE_TARGET = {"n_q": "1", "n_k": "65536", "bh": "16", "d": "64", "dtype": "float32"}


def _ms(x) -> str:
    return f"{float(x):.3f}" if x not in ("", None) else "—"


def decode_summary(results_dir: Path) -> str:
    path = results_dir / "bench_decode.csv"
    rows = _rows(path)
    if rows is None:
        return _missing(path)
    ok = [r for r in rows if r["status"] == "ok"]

    def at(shape, provider):
        return next((r for r in ok if r["provider"] == provider
                     and all(r[k] == v for k, v in shape.items())), None)

    split, q, sdpa = (at(DECODE_TARGET, name) for name in
                      ("split_kv", "q_outer", "torch_sdpa_efficient"))
    lines = [f"Target shape (N_q = 1, B·H = 16, N_k = 65536, d = 64, float32): split_kv "
             f"(splits = auto → S = {split['splits']}) **{float(split['ms_kernel']):.3f} ms**, "
             f"q_outer {float(q['ms_kernel']):.2f} ms "
             f"(**{float(q['ms_kernel']) / float(split['ms_kernel']):.1f}×** slower), torch SDPA "
             f"efficient {float(sdpa['ms_kernel']):.3f} ms "
             f"(split_kv **{float(sdpa['ms_kernel']) / float(split['ms_kernel']):.2f}×** "
             f"faster); through the public call `lo.attention` on torch tensors "
             f"{float(split['ms_call']):.3f} ms. Our schedules' counters equal the model at "
             f"every point ({sum(1 for r in ok if r['counted_bytes'])} points).", "",
             "| N_q | N_k | dtype | split_kv ms (S) | q_outer ms | SDPA ms | split_kv GB/s "
             "(model bytes) |", "|---|---|---|---|---|---|---|"]
    for n_q in ("1", "16", "128"):
        for n_k in ("4096", "16384", "65536", "131072"):
            for dtype in ("float32", "float16"):
                shape = {"n_q": n_q, "n_k": n_k, "bh": "16", "d": "64", "dtype": dtype}
                sk, qo = at(shape, "split_kv"), at(shape, "q_outer")
                sd = at(shape, "torch_sdpa_efficient") or at(shape, "torch_sdpa_flash")
                if sk and qo and sd:
                    lines.append(f"| {n_q} | {n_k} | {dtype} | {_ms(sk['ms_kernel'])} "
                                 f"({sk['splits']}) | {_ms(qo['ms_kernel'])} | "
                                 f"{_ms(sd['ms_kernel'])} ({sd['provider'][11:]}) | "
                                 f"{sk['gbps']} |")
    sweep = sorted((int(r["splits"]), r) for r in ok if r["provider"].startswith("split_kv_s"))
    lines += ["", "Split count at the target shape (the model's bytes beside the time):", "",
              "| S | ms | model HBM bytes (GB) |", "|---|---|---|"]
    lines += [f"| {s} | {_ms(r['ms_kernel'])} | {int(r['model_bytes']) / 1e9:.3f} |"
              for s, r in sweep]
    from .bench_decode import SWEEP

    measured = {(r["n_q"], r["n_k"], r["bh"], r["d"], r["dtype"]) for r in rows}
    declared = list(itertools.product(*([str(v) for v in SWEEP[k]]
                                        for k in ("n_q", "n_k", "bh", "d", "dtype"))))
    missing: dict = {}
    for n_q, n_k, bh, d, dtype in declared:
        if (n_q, n_k, bh, d, dtype) not in measured:
            missing.setdefault((n_q, bh, d, dtype), []).append(n_k)
    lines += ["", f"{len(measured)} of the sweep's {len(declared)} shapes were measured in "
              "the run" + ("; not measured (the stage's time ran out): " + "; ".join(
                  f"N_q = {a}, B·H = {b}, d = {c}, {t} at N_k = {', '.join(ks)}"
                  for (a, b, c, t), ks in missing.items()) if missing else "") + "."]
    return "\n".join(lines)


# The SDPA backend each input kind of bench_backward.csv is held to (a TF32 label is float32
# at that precision, beside SDPA's float32 efficient backend), and the next mark beside it
BACKWARD_BASELINE = {"float16": "torch_sdpa_flash", "bfloat16": "torch_sdpa_flash",
                     "float32": "torch_sdpa_efficient", "tf32": "torch_sdpa_efficient",
                     "tf32x3": "torch_sdpa_efficient"}
BACKWARD_NEXT = {"float16": "torch_sdpa_cudnn", "bfloat16": "torch_sdpa_cudnn"}


def _beside(rows: list[dict], r: dict, provider: str | None) -> dict | None:
    """`provider`'s row timed in the same process as r (same date), at r's shape."""
    key = ("n", "d", "causal", "date")
    return next((x for x in rows if provider and x["provider"] == provider
                 and x["dtype"] == input_kind(r["dtype"])["dtype"]
                 and all(x[k] == r[k] for k in key)), None)


def _backward_tiles(r: dict) -> tuple[int, int]:
    """The backward pass's tiles of a bench_backward.csv row of ours (the forward's in rows
    from before the passes chose their own)."""
    return tuple(int(x) for x in r["backward_tiles"].split("x")) if r.get("backward_tiles") \
        else (int(r["block_q"]), int(r["block_k"]))


def _backward_model(r: dict):
    """The backward pass's modelled traffic of a bench_backward.csv row of ours (a Ledger)."""
    name, *opts = r["provider"].split()
    block_q, block_k = _backward_tiles(r)
    return lo.predict_traffic(
        name, int(r["n"]), int(r["d"]), batch=int(r["batch"]), heads=int(r["heads"]),
        block_q=block_q, block_k=block_k, causal=r["causal"] == "True",
        save_lse=True, options=dict(o.split("=") for o in opts) or None, backward=True,
        **input_kind(r["dtype"]))


def _fa_tflops(r: dict, ms: float) -> float:
    """Forward + backward TFLOP/s by FlashAttention's count: 3.5 times the forward's
    4 B H N^2 d, halved under a causal mask."""
    flops = 3.5 * 4 * int(r["batch"]) * int(r["heads"]) * int(r["n"]) ** 2 * int(r["d"])
    return flops / (2 if r["causal"] == "True" else 1) / ms / 1e9


def backward_verdicts(rows: list[dict]) -> list[dict]:
    """Per (n, d, causal, input kind) of bench_backward.csv: the fastest of our orders, its
    ms and the baselines timed beside it."""
    ok = [r for r in rows if r["status"].startswith("ok")]
    ours = [r for r in ok if r["block_q"]]
    best = {}
    for r in ours:
        key = (int(r["n"]), int(r["d"]), r["causal"], r["dtype"])
        if key not in best or float(r["ms_total"]) < float(best[key]["ms_total"]):
            best[key] = r
    return [{"row": r, "ms": float(r["ms_total"]),
             "baseline": _beside(ok, r, BACKWARD_BASELINE.get(r["dtype"])),
             "next": _beside(ok, r, BACKWARD_NEXT.get(r["dtype"]))}
            for _, r in sorted(best.items())]


def _tiles_of(r: dict) -> str:
    """A row's tiles: "forward BQxBK, backward BQxBK", or one pair where both passes ran it."""
    forward, backward = (int(r["block_q"]), int(r["block_k"])), _backward_tiles(r)
    return ("{}x{}".format(*forward) if forward == backward else
            "forward {}x{}, backward {}x{}".format(*forward, *backward))


def backward_summary(results_dir: Path) -> str:
    """The training verdict: per shape and input kind, the fastest backward order's forward +
    backward against SDPA's same-dtype backend (and cuDNN) timed in the same process."""
    path = results_dir / "bench_backward.csv"
    rows = _rows(path)
    if rows is None:
        return _missing(path)
    lines = ["| N | d | causal | inputs | fastest order (tiles) | forward + backward ms | vs SDPA "
             "(flash; efficient for float32) | vs SDPA cuDNN | TFLOP/s | GPU, commit |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for v in backward_verdicts(rows):
        r = v["row"]
        base = v["baseline"]
        theirs = f" ({_ms(base['ms_total'])} ms)" if base else ""
        lines.append(f"| {r['n']} | {r['d']} | {'yes' if r['causal'] == 'True' else 'no'} | "
                     f"{r['dtype']} | {r['provider']} ({_tiles_of(r)}) | {v['ms']:.2f} | "
                     f"{_ratio(base, r, 'ms_total')}{theirs}"
                     f" | {_ratio(v['next'], r, 'ms_total')} | {_fa_tflops(r, v['ms']):.0f} | "
                     f"{r['device'].replace('NVIDIA ', '')}, {r['git_sha']} |")
    return "\n".join(lines)


def backward_bench(results_dir: Path) -> str:
    """Every order's forward + backward in bench_backward.csv, beside the SDPA rows of the
    same process, with the backward's modelled HBM bytes and the rate they would take."""
    path = results_dir / "bench_backward.csv"
    rows = _rows(path)
    if rows is None:
        return _missing(path)
    ok = [r for r in rows if r["status"].startswith("ok")]
    lines = ["| causal | N | d | B·H | inputs | provider | forward ms | backward ms | total ms | "
             "torch op ms | vs SDPA | vs cuDNN | backward model GB | model GB / backward ms "
             "(TB/s) | gradient error |", "|---|" * 15]
    lines[-1] = lines[-1].replace("||", "|")
    order = {name: i for i, name in enumerate(dict.fromkeys(r["provider"] for r in ok))}
    for r in sorted(ok, key=lambda r: (r["causal"], int(r["n"]), int(r["d"]), r["dtype"],
                                       order[r["provider"]])):
        mine = bool(r["block_q"])
        vs = vs_next = model = rate = "—"
        if mine:
            vs = _ratio(_beside(ok, r, BACKWARD_BASELINE.get(r["dtype"])), r, "ms_total")
            vs_next = _ratio(_beside(ok, r, BACKWARD_NEXT.get(r["dtype"])), r, "ms_total")
            itemsize = 2 if r["dtype"] in ("float16", "bfloat16") else 4
            gb = _backward_model(r).bytes(itemsize) / 1e9
            model, rate = f"{gb:.2f}", f"{gb / float(r['ms_backward']):.2f}"
        lines.append(f"| {'yes' if r['causal'] == 'True' else 'no'} | {r['n']} | {r['d']} | "
                     f"{int(r['batch']) * int(r['heads'])} | {r['dtype']} | "
                     f"{r['provider']}{f' ({_tiles_of(r)})' if mine else ''} | "
                     f"{_ms(r['ms_forward'])} | {_ms(r['ms_backward'])} | "
                     f"{_ms(r['ms_total'])} | {_ms(r['ms_torch_op'])} | {vs} | {vs_next} | "
                     f"{model} | {rate} | {r['rel_error'] or '—'} |")
    runs = sorted({(r["device"], r["git_sha"], r["date"]) for r in ok})
    lines += ["", "Runs (each row's SDPA baseline is from its own run): " + "; ".join(
        f"{dev} at {sha}, {date}" for dev, sha, date in runs) + "."]
    return "\n".join(lines)


def train_summary(results_dir: Path) -> str:
    path = results_dir / "train_tiny.json"
    if not path.exists():
        return _missing(path)
    data = json.loads(path.read_text())
    st, summary = data["setting"], data["summary"]
    rows = _rows(results_dir / "train_tiny.csv") or []
    counted = {r["run"]: r for r in rows if r["counted"] == "True" and r["step"] == "0"}
    lines = [f"{st['layers']} layers × {st['heads']} heads × head dim {st['head_dim']}, "
             f"sequence {st['seq']}, batch {st['batch']}, {st['steps']} steps, {st['dtype']}, "
             f"the same initial weights and batches for every run:", "",
             "| run | mean loss, last 20 steps | / SDPA's | median step ms | one step's attention "
             "traffic, forward + backward (counted = model) |", "|---|---|---|---|---|"]
    for run, s in summary.items():
        c = counted.get(run)
        traffic = (f"{(int(c['forward_bytes']) + int(c['backward_bytes'])) / 1e9:.3f} GB "
                   f"({int(c['forward_elements']) + int(c['backward_elements']):,} elements)"
                   if c else "—")
        lines.append(f"| {run} | {s['mean_last_20']:.5f} | {s.get('final_vs_sdpa', 1):.5f} | "
                     f"{s['median_step_ms']:.1f} | {traffic} |")
    return "\n".join(lines)


def fig2_table(results_dir: Path) -> str:
    path = results_dir / "fig2_setting.csv"
    rows = _rows(path)
    if rows is None:
        return _missing(path)
    lines = ["| run | dtype | pass | model = counted (GB) | ncu L1 ld + st (GB) | ncu RED "
             "(GB) | DRAM rd + wr (GB) | ms |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['dtype']} | {r['pass']} | "
                     f"{int(r['counted_bytes']) / 1e9:.3f} | "
                     f"{(int(r['ncu_ld_bytes']) + int(r['ncu_st_bytes'])) / 1e9:.3f} | "
                     f"{int(r['ncu_red_bytes']) / 1e9:.3f} | "
                     f"{(int(r['dram_read_bytes']) + int(r['dram_write_bytes'])) / 1e9:.3f} | "
                     f"{float(r['ms']):.2f} |")
    same = sum(r["model_bytes"] == r["counted_bytes"] for r in rows)
    plain = [abs(float(r["ncu_vs_counted"])) for r in rows if int(r["ncu_red_bytes"]) == 0]
    lines += ["", f"Model = counted in {same} of {len(rows)} rows. Where no atomics run, "
              f"|ncu L1 ld + st − counted| / counted ≤ **{max(plain):.2%}**."]
    for r in rows:
        if int(r["ncu_red_bytes"]) and r["dtype"] == "float32" and r["schedule"] == "q_outer":
            p = lo.make_problem("q_outer", n_q=int(r["n"]), d=int(r["d"]), batch=int(r["batch"]),
                                heads=int(r["heads"]), block_q=int(r["block_q"]),
                                block_k=int(r["block_k"]), causal=r["causal"] == "True",
                                save_lse=True, options={"dq": "atomic"})
            adds = backward_of(lo.get_schedule("q_outer")).model(p).read("dq_acc") \
                - p.bh * p.n_q * p.d  # the convert kernel's plain loads
            rest = int(r["counted_bytes"]) - 8 * adds
            ld_st = int(r["ncu_ld_bytes"]) + int(r["ncu_st_bytes"])
            lines.append(f"The atomic dQ order's backward ({r['dtype']}): {adds / 1e6:,.1f} M "
                         f"float32 atomic adds, which ncu's l1tex RED bytes count at "
                         f"{int(r['ncu_red_bytes']) / adds:.2f} bytes each (we count 4 + 4); "
                         f"the loads and stores beside them: ncu {ld_st / 1e9:.3f} GB against "
                         f"{rest / 1e9:.3f} GB counted ({ld_st / rest - 1:+.2%}).")
            break
    totals = {}
    for r in rows:
        key = (r["run"], r["dtype"])
        t = totals.setdefault(key, {"counted": 0, "dram": 0, "ms": 0.0})
        t["counted"] += int(r["counted_bytes"])
        t["dram"] += int(r["dram_read_bytes"]) + int(r["dram_write_bytes"])
        t["ms"] += float(r["ms"])
    lines += ["", "Forward + backward beside the paper (A100, GPT-2 medium's attention):", "",
              "| | HBM traffic (GB): elements moved | DRAM after the L2 (GB) | ms |",
              "|---|---|---|---|"]
    for name, printed in PAPER_FIG2.items():
        lines.append(f"| paper, {name} | {printed['hbm_gb']} (as printed) | | {printed['ms']} |")
    for (run, dtype), t in totals.items():
        lines.append(f"| {run}, {dtype} | {t['counted'] / 1e9:.2f} | {t['dram'] / 1e9:.2f} | "
                     f"{t['ms']:.1f} |")
    return "\n".join(lines)


def host_overhead(results_dir: Path) -> str:
    path = results_dir / "host_overhead.json"
    if not path.exists():
        return _missing(path)
    data = json.loads(path.read_text())
    tiny = data["tiny_per_call_us"]
    prov = data["provenance"]
    lines = [f"On the {prov['device']} at {prov['git_sha'][:7]} (`results/{path.name}`):", "",
             "| call (B = H = 1, N = 64, d = 64) | µs per call | ÷ SDPA's same call |",
             "|---|---|---|"]
    for name, us in tiny.items():
        lines.append(f"| {name} | {us:.1f} | {_per_sdpa(name, tiny)} |")
    n = data["n1024_ms"]
    cache = data["compile_cache"]
    lines += ["", f"At N = 1024 (B = 4, H = 16): the q_outer kernel {n['q_outer kernel']:.3f} ms, "
              f"through `lo.attention` {n['q_outer lo.attention']:.3f} ms, torch SDPA efficient "
              f"{n['torch sdpa efficient']:.3f} ms" + causal_n1024(data) + ".", "",
              f"A new process's first forward + backward (float16, the torch op) at a shape no "
              f"process had compiled: {cache['first_process']['first_call_s']:.2f} s; the next "
              f"new process's first call there (kernels from the disk cache): "
              f"**{cache['second_process']['first_call_s'] * 1e3:.1f} ms** ("
              + _imports(cache["second_process"]) + "). " + _serial(cache) +
              "Two processes filling an empty cache at once: first calls "
              + ", ".join(f"{r['first_call_s']:.2f} s" for r in cache["racing_processes"])
              + ", both right (max |error| "
              + ", ".join(f"{r['max_abs_error']:.1e}" for r in cache["racing_processes"])
              + f"); a third process then loaded in "
              f"{cache['after_the_race']['first_call_s'] * 1e3:.1f} ms."
              + _cold_parts(cache)]
    return "\n".join(lines)


def _per_sdpa(name: str, tiny: dict) -> str:
    """A tiny call's time over SDPA's same call ("—" for SDPA's own and for kinds of arrays
    SDPA does not take)."""
    if name.startswith("torch sdpa"):
        return "—"
    if name.startswith("lo.attention") and not name.endswith("torch"):
        return "—"
    what = name.removeprefix("loop_orders.torch.attention").removeprefix("lo.attention torch")
    theirs = tiny.get(("torch sdpa" + what) if what else "torch sdpa")
    return f"{tiny[name] / theirs:.2f}×" if theirs else "—"


def _cold_parts(cache: dict) -> str:
    """The first process's forward alone, and the cold start taken apart
    (`host_overhead.cold_parts`), where the run has them."""
    first, parts = cache["first_process"], cache.get("cold_parts")
    out = (f" In the first process the forward alone took {first['first_forward_s']:.2f} s "
           f"of its {first['first_call_s']:.2f} s.")
    if not parts:
        return out
    builds = ", ".join(f"{b['kernel']} {b['compile_s']:.2f} s" for b in parts["builds"])
    worker = parts["worker"]
    return out + (f" Taken apart in a fresh process: importing loop_orders "
                  f"{parts['import_s']:.2f} s, a CUDA context {parts['cuda_context_s']:.2f} s, "
                  f"each build compiled there one after another ({builds}); the longest "
                  f"({worker['kernel']}) compiled by a `compile_ahead` worker process, from its "
                  f"start to its entry on disk: {worker['worker_s']:.2f} s, then loaded here in "
                  f"{worker['load_and_link_s'] * 1e3:.1f} ms.")


def _imports(process: dict) -> str:
    """What a fresh process's imports took (runs before the split timed them together)."""
    if "import_torch_s" not in process:
        return f"importing numba, torch and loop_orders: {process['import_s']:.1f} s"
    return (f"importing torch {process['import_torch_s']:.1f} s, then loop_orders "
            f"{process['import_s']:.1f} s")


def _serial(cache: dict) -> str:
    """The first call compiling its kernels one after another, where the run timed it."""
    serial = cache.get("first_process_compiling_serially")
    if not serial:
        return ""
    return (f"The same first call compiling its kernels one after another "
            f"(LOOP_ORDERS_COMPILE_AHEAD=0) instead of at once: {serial['first_call_s']:.2f} s. ")


def causal_n1024(data: dict) -> str:
    """The causal half of host_overhead's N = 1024 sentence, where the run timed it."""
    n = data.get("n1024_causal_ms")
    if not n:
        return ""
    return (f"; causal {n['q_outer kernel']:.3f}, {n['q_outer lo.attention']:.3f} and "
            f"{n['torch sdpa efficient']:.3f} ms")


def _hot_loop(lp: dict) -> str:
    """A hot loop's FFMA share, and its register-bank conflict cycles a trip where the run
    counted them (sass_loops runs before 8395752 did not)."""
    share = f"{lp['ffma_share']:.0%}"
    return f"{share} ({lp['bank_conflicts']})" if "bank_conflicts" in lp else share


def sass_loops(results_dir: Path) -> str:
    """The float32 kernel's SASS, now and at the commits kept in gpu_logs
    (`experiments.sass_loops`): static counts per kernel build."""
    paths = [*sorted((results_dir / "gpu_logs").glob("sass_loops_*.json")),
             results_dir / "sass_loops.json"]
    # oldest first, by when each was built
    runs = sorted((json.loads(p.read_text()) for p in paths if p.exists()),
                  key=lambda run: run["provenance"]["date"])
    if not runs:
        return ("*Not measured yet: `sass_loops.json` is written by `python -m experiments."
                "sass_loops --out results/sass_loops.json`.*")
    lines = ["| commit | d | dtype | causal | registers | K/V loop: instructions, FFMA | inner "
             "loops: FFMA share (register-bank conflict cycles a trip, where counted) | "
             "cheapest cp.async block: instructions a copy |",
             "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        sha = run["provenance"]["git_sha"][:7]
        for r in run["kernels"]:
            outer = max(r["loops"], key=lambda lp: lp["instructions"])  # the K/V loop
            hot = [lp for lp in r["loops"] if not lp["nested"] and lp["ffma"] >= 256]
            cheapest = min((c["per_copy"] for c in r["copies"]), default=None)
            lines.append(f"| {sha} | {r['d']} | {r['dtype']} | {r['causal']} | "
                         f"{r['registers']} | {outer['instructions']}, {outer['ffma']} | "
                         + (" / ".join(map(_hot_loop, hot)) or "—") + " | "
                         + ("—" if cheapest is None else f"{cheapest:g}") + " |")
    return "\n".join(lines)


def ptxas_kernels(results_dir: Path) -> str:
    path = results_dir / "kernels_ptxas.json"
    if not path.exists():
        return (f"*Not measured yet: `{path.name}` is written by `python -m experiments."
                "ptx_check --out results/kernels_ptxas.json`.*")
    data = json.loads(path.read_text())
    rows = [r for r in data["kernels"] if not r["count"] and "error" not in r]
    lines = ["| schedule | kernel | d | dtype | causal | tiles | forward build | registers | "
             "shared (B) | stack (B) | spills (stores / loads, B) | ld.shared.v4 in PTX |",
             "|---" * 12 + "|"]
    for r in rows:
        lines.append(f"| {r['schedule']} | {r['kernel']} | {r['d']} | {r['dtype']} | "
                     f"{r['causal']} | {r.get('tiles', '')} | {r.get('build', '')} | "
                     f"{r['registers']} | {r.get('shared_bytes', '')} | {r['stack']} | "
                     f"{r['spill_stores']} / {r['spill_loads']} | {r['ld_shared_v4']} |")
    failed = sum(1 for r in data["kernels"] if "error" in r)
    return (f"{len(data['kernels'])} kernel builds (counted and not) compiled by ptxas for "
            f"sm_90a, {failed} failed; the uncounted builds:\n\n" + "\n".join(lines))


def provenances(results_dir: Path) -> list[tuple[str, dict]]:
    """(file name, provenance) of each GPU results file present; the csv files carry it in
    their columns (versions as JSON), bench_kernels.json under "provenance"."""
    out = []
    for name in ("hw_traffic.csv", "bench_runtime.csv", "bench_layouts.csv",
                 "bench_blocksize.csv", "bench_decode.csv", "bench_backward.csv",
                 "fig2_setting.csv", "train_tiny.csv", "bench_tensor_cores.csv",
                 "bench_tc_tiles.csv", "hw_traffic_tensor_cores.csv", "hw_traffic_q_outer.csv",
                 "bench_tf32x3.csv", "bench_causal_tiles.csv", "hw_traffic_float32_paths.csv",
                 "hw_traffic_q_outer_d128.csv", "bench_hopper.csv", "bench_hopper_h200.csv"):
        rows = _rows(results_dir / name)
        if rows:  # a file re-measured in part names every commit its rows come from
            shas = " + ".join(dict.fromkeys(r["git_sha"] for r in rows))
            dates = " + ".join(dict.fromkeys(r["date"] for r in rows))
            out.append((name, {**rows[0], "git_sha": shas, "date": dates,
                               "versions": json.loads(rows[0]["versions"])}))
    for name in ("bench_kernels.json", "host_overhead.json", "train_tiny.json",
                 "kernels_ptxas.json", "tensor_core_ceiling.json", "sass_loops.json",
                 "fma_ceiling.json"):
        path = results_dir / name
        if path.exists():
            out.append((name, json.loads(path.read_text())["provenance"]))
    return out


def masks_and_layouts(results_dir: Path) -> str:
    """FlashAttention's test grid by its error rule (fa_grid.json) and the sliding-window
    benchmark (bench_window.csv)."""
    grid_path, window_path = results_dir / "fa_grid.json", results_dir / "bench_window.csv"
    lines = []
    if grid_path.exists():
        grid = json.loads(grid_path.read_text())
        ratios = [max(e["ours"] / e["plain"] for e in r["errors"].values())
                  for r in grid["rows"] if "errors" in r]
        t, prov = grid["totals"], grid["provenance"]
        lines.append(
            f"FlashAttention's test grid through the torch op (`{grid['schedule']}`, batch "
            f"{grid['batch']}, {grid['heads']} heads; {grid['cells']} cells: 10 length pairs, "
            f"d 32-256, float16 and bfloat16, causal bottom-right aligned or not) on the "
            f"{prov['device']} at {prov['git_sha']}: **{t['ok']} ok, {t['refused']} refused, "
            f"{t['failed']} failed** by FlashAttention's rule; the largest ratio of our error "
            f"to plain PyTorch's over out, dq, dk, dv is {max(ratios):.2f} (the rule allows 2), "
            f"the median cell's {sorted(ratios)[len(ratios) // 2]:.2f}.")
    else:
        lines.append(_missing(grid_path))
    rows = _rows(window_path)
    if rows is None:
        return "\n\n".join([*lines, _missing(window_path)])
    ours = {(r["d"], r["window"]): r for r in rows if r["provider"].startswith("q_outer")}
    sdpa = {(r["d"], r["window"]): r for r in rows if r["provider"].startswith("torch")}
    table = ["| d | window w | q_outer ms | counted = model | SDPA efficient, bool mask, ms | "
             "SDPA / ours |", "|---|---|---|---|---|---|"]
    for key, r in ours.items():
        theirs = sdpa.get(key)
        same = "yes" if r["counted_bytes"] == r["model_bytes"] else "**no**"
        w = "causal, none" if int(key[1]) < 0 else key[1]
        table.append(f"| {key[0]} | {w} | {float(r['ms_kernel']):.3f} | {same} | "
                     f"{float(theirs['ms_kernel']):.2f} | "
                     f"{float(theirs['ms_kernel']) / float(r['ms_kernel']):.1f}x |"
                     if theirs else f"| {key[0]} | {w} | {float(r['ms_kernel']):.3f} | {same} "
                     f"| – | – |")
    first = rows[0]
    lines.append(f"Sliding window (causal, w keys to the left) at N = {first['n']}, "
                 f"{first['heads']} heads, float16, on the {first['device']} at "
                 f"{first['git_sha']} (`results/bench_window.csv`, kernels alone):")
    return "\n\n".join([*lines, "\n".join(table)])


def blocks(results_dir: Path) -> dict[str, str]:
    return {"hw-traffic": hw_traffic(results_dir), "bench-summary": bench_summary(results_dir),
            "float32-paths": float32_paths(results_dir),
            "causal-tiles": causal_tiles(results_dir),
            "hw-traffic-float32-paths": hw_traffic_float32_paths(results_dir),
            "bench-tuning": bench_tuning(results_dir),
            "bench-kernels": bench_kernels(results_dir),
            "bench-blocksize": bench_blocksize(results_dir),
            "q-outer-profile": q_outer_profile(results_dir),
            "decode-summary": decode_summary(results_dir),
            "backward-bench": backward_bench(results_dir),
            "backward-summary": backward_summary(results_dir),
            "train-summary": train_summary(results_dir), "fig2-setting": fig2_table(results_dir),
            "host-overhead": host_overhead(results_dir),
            "ptxas-kernels": ptxas_kernels(results_dir), "sass-loops": sass_loops(results_dir),
            "tensor-cores": tensor_cores(results_dir), "tc-tiles": tc_tiles(results_dir),
            "hopper": hopper(results_dir),
            "hw-traffic-tensor-cores": hw_traffic_tensor_cores(results_dir),
            "hw-traffic-cp-async": hw_traffic_cp_async(results_dir),
            "l1tex-line-rule": l1tex_line_rule(results_dir),
            "masks-and-layouts": masks_and_layouts(results_dir)}
