"""paper_notes.md blocks drawn from the committed GPU results (bench_runtime, hw_traffic).

Each function reads its results file and returns a markdown block; a missing file gives a
one-line "not measured yet" instead, so the notes regenerate on any machine.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

REFERENCE = {"n": "4096", "d": "64", "causal": "False"}  # the B=4, H=16 shape
PROFILE_LOG = "gpu_logs/ncu_profile_q_outer_6296e24.txt"
PROFILE_METRICS = ["Duration", "SM Frequency", "L1/TEX Cache Throughput", "Compute (SM) Throughput",
                   "Issue Slots Busy", "Executed Ipc Active", "Warp Cycles Per Issued Instruction",
                   "Registers Per Thread", "Theoretical Occupancy", "Achieved Occupancy"]


def _rows(path: Path) -> list[dict] | None:
    if not path.exists():
        return None
    with path.open() as f:
        return list(csv.DictReader(f))


def _missing(path: Path) -> str:
    return (f"*Not measured yet: `{path.name}` is written on a GPU machine (README, GPU "
            "experiments).*")


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


def bench_summary(results_dir: Path) -> str:
    path = results_dir / "bench_runtime.csv"
    rows = _rows(path)
    if rows is None:
        return _missing(path)
    ok = [r for r in rows if r["status"] == "ok"]
    at = {(r["provider"], r["d"], r["causal"]): r for r in ok if r["n"] == REFERENCE["n"]}
    providers = list(dict.fromkeys(r["provider"] for r in ok))
    lines = ["| d | causal | " + " | ".join(providers) + " | q_outer / SDPA efficient |",
             "|---|---|" + "---|" * (len(providers) + 1)]
    for d, causal in sorted({(r["d"], r["causal"]) for r in ok}, key=lambda x: (int(x[0]), x[1])):
        cells = []
        for p in providers:
            r = at.get((p, d, causal))
            cells.append(f"{float(r['ms_median']):.2f} ms ({float(r['tflops']):.1f})" if r else "—")
        q, s = at.get(("q_outer", d, causal)), at.get(("torch_sdpa_efficient", d, causal))
        ratio = f"{float(s['ms_median']) / float(q['ms_median']):.3f}×" if q and s else "—"
        lines.append(f"| {d} | {causal} | " + " | ".join(cells) + f" | {ratio} |")
    r0 = next(iter(at.values()))
    return (f"N = {REFERENCE['n']}, B·H·N = {int(r0['batch']) * int(r0['heads']) * int(r0['n'])}"
            f" (B = {r0['batch']}, H = {r0['heads']}); median ms (TFLOP/s):\n\n"
            + "\n".join(lines))


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


def q_outer_profile(results_dir: Path) -> str:
    path = results_dir / PROFILE_LOG
    if not path.exists():
        return _missing(path)
    text = path.read_text()
    lines = [f"From `results/{PROFILE_LOG}` (Nsight Compute sections on one q_outer launch at "
             "B=4, H=16, N=4096, d=64, Br=128, Bc=64; ncu locks the SM clock, so its duration "
             "is longer than the benchmark's):", "", "| metric | value |", "|---|---|"]
    for name in PROFILE_METRICS:
        m = re.search(rf"^\s+{re.escape(name)}\s+(\S+(?:/\S+)?)\s+([\d.,]+)\s*$", text, re.M)
        if m:
            lines.append(f"| {name} | {m.group(2)} {m.group(1)} |")
    pipe = re.search(r"(\w+) is the highest-utilized pipeline \(([\d.]+)%\)", text)
    if pipe:
        lines.append(f"| busiest pipeline | {pipe.group(1)} ({pipe.group(2)} %) |")
    return "\n".join(lines)


def provenances(results_dir: Path) -> list[tuple[str, dict]]:
    """(file name, provenance) of each GPU results file present; the csv files carry it in
    their columns (versions as JSON), bench_kernels.json under "provenance"."""
    out = []
    for name in ("hw_traffic.csv", "bench_runtime.csv", "bench_layouts.csv",
                 "bench_blocksize.csv"):
        rows = _rows(results_dir / name)
        if rows:  # a file re-measured in part names every commit its rows come from
            shas = " + ".join(dict.fromkeys(r["git_sha"] for r in rows))
            dates = " + ".join(dict.fromkeys(r["date"] for r in rows))
            out.append((name, {**rows[0], "git_sha": shas, "date": dates,
                               "versions": json.loads(rows[0]["versions"])}))
    kernels = results_dir / "bench_kernels.json"
    if kernels.exists():
        out.append((kernels.name, json.loads(kernels.read_text())["provenance"]))
    return out


def blocks(results_dir: Path) -> dict[str, str]:
    return {"hw-traffic": hw_traffic(results_dir), "bench-summary": bench_summary(results_dir),
            "bench-tuning": bench_tuning(results_dir),
            "bench-kernels": bench_kernels(results_dir),
            "bench-blocksize": bench_blocksize(results_dir),
            "q-outer-profile": q_outer_profile(results_dir)}
