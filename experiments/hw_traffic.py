"""Hardware-measured traffic: Nsight Compute bytes beside our counters and the model.

    python -m experiments.hw_traffic [--out DIR] [--quick] [--d D] [--n N ...] [--blocks 128x64]
    python -m experiments.hw_traffic --backward --dtypes float16 ...   # the backward passes
    python -m experiments.hw_traffic --gqa-decode --n 4096 16384 --name hw_traffic_gqa_decode

For every registered schedule and configuration (tiles, N, causal, dtype): the counted build gives
the counters (model == counted is asserted); the uncounted build, the one we time, runs once
under `ncu`, which reports global load/store bytes seen by L1 (the logical traffic) and the
bytes that reached DRAM after the L2, summed over all of a schedule's kernels. So the counter
atomics are never in the hardware numbers. ncu flushes caches before each kernel (its default
cache control), so DRAM bytes are those of a kernel starting from a cold L2.

The tensor-core kernels copy their tiles with cp.async (LDGSTS), which ncu counts apart from
plain loads: the run asks ncu which l1tex__t_bytes_pipe_lsu_mem_global_op_ldgsts metrics it
has and adds them to the loads (the columns say which it used). On Hopper q_outer's producer
warpgroup copies by TMA, outside the LSU pipe: ncu's
l1tex__m_xbar2l1tex_read_bytes_mem_global_op_tma_ld (bytes from the L2 into the SM for TMA
loads) is added to the loads where ncu has it (`ncu_tma_ld_bytes`).

With --backward each configuration's backward pass is measured instead (the forward runs
first, unprofiled and uncounted; ncu sees the backward's kernels only): its counters against
the backward's model and float64 gradients, then ncu's bytes. An atomic or reduction (q_outer's
dQ accumulator, `red.global.add.f32`) reads and writes the element it updates, a read and a
write in our ledgers; ncu's l1tex ..._op_red bytes came to 8 a float32 reduction, the same
(`logical_bytes`).

Writes hw_traffic.csv; without a GPU or ncu it says so in one line and writes nothing.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

import loop_orders as lo
from experiments.bench_runtime import layout_in_effect
from experiments.gpu_common import (
    Buffers,
    GradBuffers,
    check_gradients,
    check_output,
    input_kind,
    runs,
    write_csv,
)
from loop_orders.core.schedule import backward_of
from loop_orders.device import runtime
from loop_orders.results import provenance

SWEEP = {"n": [256, 512, 1024, 2048, 4096], "causal": [False, True],
         "blocks": [(64, 64), (128, 64), (32, 32)],  # (block_q, block_k)
         "dtype": ["float32", "float16"]}
BATCH, HEADS, D = 2, 4, 64  # D: the head dim unless --d says otherwise
METRICS = {
    "ncu_ld_bytes": "l1tex__t_bytes_pipe_lsu_mem_global_op_ld.sum",
    "ncu_st_bytes": "l1tex__t_bytes_pipe_lsu_mem_global_op_st.sum",
    # float32 atomic adds (q_outer's backward dQ): reductions and atomics, counted by us as a
    # read and a write of each element they update
    "ncu_red_bytes": "l1tex__t_bytes_pipe_lsu_mem_global_op_red.sum",
    "ncu_atom_bytes": "l1tex__t_bytes_pipe_lsu_mem_global_op_atom.sum",
    "dram_read_bytes": "dram__bytes_read.sum",
    "dram_write_bytes": "dram__bytes_write.sum",
    # the sectors the L2 served the SM's L1TEX (loads and cp.async): whether a sector l1tex
    # counts twice (`l1tex_copy_sectors`) is also read twice
    "ncu_l2_read_sectors": "lts__t_sectors_srcunit_tex_op_read.sum",
    "kernel_ns": "gpu__time_duration.sum",
}
SECTOR, LINE, COPY, WARP = 32, 128, 16, 32  # bytes of a global sector, a shared-memory line
# (32 banks of 4 bytes) and a cp.async; lanes of a warp


def l1tex_copy_sectors(row_bytes: int, stride_bytes: int, rows: int) -> int:
    """The sectors ncu's l1tex load metrics count for `rows` rows of `row_bytes` contiguous
    global bytes copied by cp.async into shared rows `stride_bytes` apart, 16 bytes a lane
    and a warp instruction 32 consecutive copies (`tiles.make_row_copier`), by the rule the
    committed runs fit: each global sector an instruction reads is counted once per 128-byte
    shared-memory line it is written into. A row padded by 16 bytes starts an odd number of
    16-byte steps into a line every other row, so a sector of those rows lands in two lines
    and counts twice; unpadded rows (and wgmma's swizzled 128-byte rows) count each once."""
    copies = [(r, c) for r in range(rows) for c in range(row_bytes // COPY)]
    counted = 0
    for first in range(0, len(copies), WARP):
        by_line: dict[int, set] = {}
        for r, c in copies[first:first + WARP]:
            line = (r * stride_bytes + c * COPY) // LINE
            by_line.setdefault(line, set()).add((r * row_bytes + c * COPY) // SECTOR)
        counted += sum(map(len, by_line.values()))
    return counted


def l1tex_copy_ratio(row_bytes: int, stride_bytes: int, rows: int = 64) -> float:
    """`l1tex_copy_sectors` over the sectors copied, for a tile of `rows` rows (the pattern
    repeats every 8 rows)."""
    return l1tex_copy_sectors(row_bytes, stride_bytes, rows) / (rows * row_bytes // SECTOR)


LDGSTS = "l1tex__t_bytes_pipe_lsu_mem_global_op_ldgsts"  # cp.async's global -> shared bytes


# Hopper's TMA loads (cp.async.bulk.tensor, q_outer's producer warpgroup) bypass the LSU pipe:
# ncu counts them as the bytes the L2 sends the SM's L1TEX M-stage for them
TMA_LD = "l1tex__m_xbar2l1tex_read_bytes_mem_global_op_tma_ld"


def copy_metrics(ncu: str) -> dict[str, str]:
    """The columns and metrics of the asynchronous copies' bytes this ncu offers: cp.async's
    aggregate if it has one, else each of its parts (cache access, cache bypass); and TMA's
    loads (`ncu_tma_ld_bytes`) where the GPU has them."""
    listed = subprocess.run([ncu, "--query-metrics"], capture_output=True, text=True).stdout
    names = {words[0] for words in map(str.split, listed.splitlines()) if words}
    # (not the lookup hit/miss split of the cache-access part: parts of a part)
    ldgsts = {n for n in names if n.startswith(LDGSTS) and "_lookup_" not in n}
    chosen = [LDGSTS] if LDGSTS in ldgsts else sorted(ldgsts)
    columns = {"ncu_" + n.removeprefix("l1tex__t_bytes_pipe_lsu_mem_global_op_") + "_bytes":
               n + ".sum" for n in chosen}
    if TMA_LD in names:
        columns["ncu_tma_ld_bytes"] = TMA_LD + ".sum"
    return columns


def configs(quick: bool, dtypes=None, schedules=None, d: int = D, ns=None,
            blocks=None, backward: bool = False, options=None) -> list[dict]:
    ns = ns or (SWEEP["n"][:2] if quick else SWEEP["n"])
    blocks = blocks or (SWEEP["blocks"][:1] if quick else SWEEP["blocks"])
    return [{"schedule": s, "n": n, "causal": c, "dtype": t, "block_q": bq, "block_k": bk,
             "d": d, "backward": backward, "asked": _declared(s, options or {})}
            for s in schedules or lo.schedule_names() for (bq, bk) in blocks for n in ns
            for c in SWEEP["causal"] for t in dtypes or SWEEP["dtype"]
            if runs(lo.get_schedule(s), t) and (not backward or _own_backward(s))]


def _own_backward(name: str) -> bool:
    """Whether the schedule has a backward loop order of its own (split_kv's is q_outer's,
    measured under q_outer)."""
    sched = lo.get_schedule(name)
    return bool(sched.BACKWARD) and backward_of(sched).name == name


def _declared(name: str, options: dict) -> dict:
    """The `options` the schedule or its backward declares (`--option` applies to those)."""
    sched = lo.get_schedule(name)
    names = set(sched.OPTIONS) | (set(backward_of(sched).OPTIONS) if sched.BACKWARD else set())
    return {key: value for key, value in options.items() if key in names}


def decode_configs(ns_k=None) -> list[dict]:
    """Grouped-query decode as bench_gqa_decode runs it (n_q = 1, 32 query heads over 8 K/V
    heads, d = 128, float16, causal, 64-key blocks), per query head and packed, for
    split_kv and q_outer: where packing reads K/V a quarter as often."""
    from experiments import bench_gqa_decode as decode

    return [{"schedule": s, "n": 1, "n_k": n_k, "causal": True, "dtype": "float16",
             "block_q": decode.BLOCK_Q, "block_k": decode.BLOCK_K, "d": decode.D,
             "backward": False, "asked": {}, "batch": 1, "heads": decode.H_Q,
             "kv_heads": decode.H_KV, "pack_gqa": packed}
            for s, packed in decode.PROVIDERS for n_k in ns_k or (4096, 16384)]


def measured(cfg: dict):
    """The schedule whose kernels a configuration profiles: its forward, or its backward."""
    sched = lo.get_schedule(cfg["schedule"])
    return backward_of(sched) if cfg.get("backward") else sched


def kernel_regex(cfgs: list[dict]) -> str:
    """ncu's kernel filter: the names of every kernel the configurations measure (so a new
    schedule's kernels are profiled with no edit here; a backward's names are its own)."""
    names = {kern.name for cfg in cfgs for kern in measured(cfg).kernels(problem(cfg), False)}
    return "regex:" + "|".join(sorted(names))


def problem(cfg) -> lo.Problem:
    return lo.make_problem(cfg["schedule"], n_q=cfg["n"], n_k=cfg.get("n_k"), d=cfg["d"],
                           batch=cfg.get("batch", BATCH), heads=cfg.get("heads", HEADS),
                           kv_heads=cfg.get("kv_heads"), pack_gqa=cfg.get("pack_gqa", False),
                           block_q=cfg["block_q"], block_k=cfg["block_k"],
                           causal=cfg["causal"], save_lse=cfg.get("backward", False),
                           options=cfg.get("asked") or None, **input_kind(cfg["dtype"]))


def launch_all(config_file: Path) -> None:
    """Under ncu: one launch of the uncounted build per configuration, in file order (a
    backward configuration: its forward, then the backward ncu profiles)."""
    rng = np.random.default_rng()
    for cfg in json.loads(config_file.read_text()):
        sched = lo.get_schedule(cfg["schedule"])
        if cfg.get("backward"):
            GradBuffers(sched, problem(cfg), rng).launch_both(0)
        else:
            Buffers(sched, problem(cfg), rng).launch(0)
        runtime.synchronize()


def counted_row(cfg: dict, rng) -> dict:
    """A configuration's counted run (counters == model asserted, output or gradients
    checked against float64) as a row, ncu's columns to come."""
    sched, p = lo.get_schedule(cfg["schedule"]), problem(cfg)
    if cfg.get("backward"):
        bufs = GradBuffers(sched, p, rng)
        bufs.launch(0)
        bufs.launch_backward(0, count=True)
        check_gradients(sched, p, *bufs.host[0], bufs.do_host,
                        [runtime.to_host(g) for g in bufs.grads], rng)
    else:
        bufs = Buffers(sched, p, rng)
        bufs.launch(0, count=True)
        check_output(sched, p, *bufs.host[0], runtime.to_host(bufs.out), rng)
    counted = lo.Ledger.from_array(runtime.to_host(bufs.counts))
    ran = measured(cfg)
    model = ran.model(p)
    assert counted == model, f"counters != model for {cfg}"
    return {"batch": BATCH, "heads": HEADS, **cfg, "dv": cfg["d"],
            # the forward's build, named as the benchmarks name it (a backward's: none)
            "build": "" if cfg.get("backward") else layout_in_effect(sched, p),
            "options": json.dumps(sched.resolved_options(p), sort_keys=True),
            "model_bytes": model.bytes(p.itemsize), "counted_bytes": counted.bytes(p.itemsize),
            "kernels": len(ran.kernels(p, False))}


def logical_bytes(row: dict) -> int:
    """ncu's logical global traffic in our convention: loads (plain, cp.async, TMA) + stores
    + reductions and atomics, whose ncu bytes are already twice what each updates (8 for a
    float32 reduction: q_outer's 8,388,608 dQ reductions at N = 1024 came to 67,108,864
    bytes, results/hw_traffic_backward.csv), as our ledgers count a read and a write."""
    copies = sum(v for k, v in row.items()
                 if k.startswith(("ncu_ldgsts", "ncu_tma_ld")) and v != "")
    return (row["ncu_ld_bytes"] + copies + row["ncu_st_bytes"]
            + row.get("ncu_red_bytes", 0) + row.get("ncu_atom_bytes", 0))


def parse_ncu_csv(text: str) -> list[dict]:
    """One dict per profiled kernel launch, in launch order: {metric: value, 'name': ...}."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    launches: dict[str, dict] = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines))):
        entry = launches.setdefault(row["ID"], {"name": row["Kernel Name"]})
        value = row["Metric Value"].replace(",", "")
        unit = row.get("Metric Unit", "")
        scale = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "nsecond": 1,
                 "usecond": 1e3, "msecond": 1e6}.get(unit, 1)
        entry[row["Metric Name"]] = float(value) * scale
    return [launches[k] for k in sorted(launches, key=int)]


def profile_rows(ncu: str, rows: list[dict], cfgs: list[dict], regex: str, module: str,
                 log: Path, log_chars: int) -> bool:
    """Run `python -m module --launch CONFIGS` (one launch per configuration; CONFIGS is
    `cfgs` written beside `log` as <name>_configs.json for <name>_ncu.log) under ncu with
    METRICS on the kernels `regex` names, keep the tail of its output in `log`, and give each
    row the metrics summed over its `kernels` launches and `ncu_vs_counted`. False, rows as
    they were, if ncu reported another number of launches than the rows expect."""
    config_file = log.with_name(log.stem.removesuffix("_ncu") + "_configs.json")
    config_file.write_text(json.dumps(cfgs))
    cmd = [ncu, "--csv", "--print-units", "base", "--clock-control", "none",
           "--metrics", ",".join(METRICS.values()), "-k", regex, sys.executable, "-m",
           module, "--launch", str(config_file)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log.write_text(proc.stdout[-log_chars:] + proc.stderr[-20000:])
    return fill_from_launches(rows, parse_ncu_csv(proc.stdout), module.rsplit(".", 1)[-1])


def fill_from_launches(rows: list[dict], launches: list[dict], name: str) -> bool:
    """Each row's METRICS columns: the sum over its `kernels` launches, in row order, and
    `ncu_vs_counted`. False (rows untouched) if the launches do not add up to the rows'."""
    expected = sum(r["kernels"] for r in rows)
    if len(launches) != expected:
        print(f"{name}: ncu reported {len(launches)} kernel launches, expected {expected}")
        return False
    it = iter(launches)
    for row in rows:
        mine = [next(it) for _ in range(row["kernels"])]
        for column, metric in METRICS.items():
            row[column] = int(sum(k.get(metric, 0) for k in mine))
        row["ncu_vs_counted"] = round(logical_bytes(row) / row["counted_bytes"] - 1, 5)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dtypes", help="comma-separated (default: float32,float16; tf32 "
                        "and tf32x3 are float32 inputs at that precision)")
    parser.add_argument("--schedules", help="comma-separated (default: every registered one)")
    parser.add_argument("--d", type=int, default=D, help=f"head dim (default {D})")
    parser.add_argument("--n", type=int, nargs="+", help="sequence lengths (default: the "
                        "sweep's, or its first two with --quick)")
    parser.add_argument("--blocks", help="comma-separated BQxBK tiles, e.g. 128x64 (default: "
                        "the sweep's, or its first with --quick)")
    parser.add_argument("--name", default="hw_traffic", help="results file stem")
    parser.add_argument("--backward", action="store_true", help="measure the backward "
                        "passes (the forward runs first, unprofiled)")
    parser.add_argument("--gqa-decode", action="store_true", help="grouped-query decode "
                        "instead (`decode_configs`; --n: the key lengths)")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="a schedule option for every configuration, e.g. dq=separate")
    parser.add_argument("--launch", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.launch:
        launch_all(args.launch)
        return 0
    ncu = shutil.which("ncu")
    if runtime.SIMULATOR or ncu is None:
        print("hw_traffic: needs a CUDA GPU and Nsight Compute (ncu); plotting the committed "
              "results/hw_traffic.csv instead")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng()
    blocks = ([tuple(map(int, b.split("x"))) for b in args.blocks.split(",")]
              if args.blocks else None)
    cfgs = configs(args.quick, args.dtypes.split(",") if args.dtypes else None,
                   args.schedules.split(",") if args.schedules else None, args.d, args.n,
                   blocks, args.backward, dict(o.split("=", 1) for o in args.option)) \
        if not args.gqa_decode else decode_configs(args.n)
    METRICS.update(copy_metrics(ncu))
    print(f"hw_traffic: metrics {sorted(METRICS.values())}", flush=True)
    # counted builds: counters, checked against the model and the reference
    rows = [counted_row(cfg, rng) for cfg in cfgs]
    if not profile_rows(ncu, rows, cfgs, kernel_regex(cfgs), "experiments.hw_traffic",
                        args.out / f"{args.name}_ncu.log", 200000):
        return 1
    for row in rows:
        shape = f"N={row['n']:5d}" + (f" n_k={row['n_k']} packed={row['pack_gqa']}"
                                      if "n_k" in row else "")
        print(f"{row['schedule']:9s}{' bwd' if row['backward'] else ''} {shape} "
              f"causal={row['causal']!s:5} "
              f"{row['dtype']}: counted {row['counted_bytes']:>12,} ncu "
              f"{logical_bytes(row):>12,} dram "
              f"{row['dram_read_bytes'] + row['dram_write_bytes']:>12,}", flush=True)
    write_csv(args.out / f"{args.name}.csv", rows, provenance())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
