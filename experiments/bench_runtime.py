"""Runtime of every registered schedule beside PyTorch SDPA, on a GPU (needs torch there).

    python -m experiments.bench_runtime [--out DIR] [--quick]

Declared as data below: schedules from the registry x N x d x causal, batch*heads sized so
that batch*heads*N stays constant (the chip stays full); torch SDPA baselines in the same run.
Tiles are BLOCKS' per head dim, or a schedule's own for a short sequence (`short_tiles`).
Every configuration is checked against the float64 reference (sampled rows, all outputs
finite) before it is timed; timing is the median of REPS launches queued back to back with a
CUDA event between consecutive ones (after 3 warm-ups, still running when the first event is
recorded), so each launch's host time overlaps the kernel before it instead of counting as GPU
time; input sets are rotated so the 60 MB L2 does not flatter. A configuration whose
predicted launch time (4x the previous N's) exceeds POINT_BUDGET_S is recorded as skipped.

Writes bench_runtime.csv (provider,dtype,batch,heads,n,d,causal,block_q,block_k,ms_median,
tflops,...), bench_blocksize.csv (block sizes vs model traffic and time) and bench_kernels.json
(registers, local memory, counting overhead), and the ceilings measured in the same run:
tensor_core_ceiling.json (mma.sync, for the tensor-core dtypes) and fma_ceiling.json (float32:
a register-only FFMA loop and cuBLAS SGEMM), each with provenance. With --backward:
bench_backward.csv, every backward order's forward + backward beside SDPA's as a call naming
no tiles runs them (each pass on the tiles it chooses), or bench_backward_tiles.csv on each
build of --grad-tiles.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import itertools
import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import numpy as np

import loop_orders as lo
from experiments.gpu_common import (
    Buffers,
    check_output,
    flops,
    input_kind,
    runs,
    warm,
    write_csv,
)
from loop_orders.api_grad import check_grad_launch, grad_problem, grad_tiles
from loop_orders.core.schedule import backward_of
from loop_orders.device import runtime
from loop_orders.microkernel import tuning
from loop_orders.microkernel.tensor_cores import TensorCores
from loop_orders.results import atomic_write_text, provenance
from loop_orders.schedules.q_outer.warp_specialised import Specialised

SWEEP = {"n": [512, 1024, 2048, 4096, 8192, 16384], "d": [64, 128], "causal": [False, True]}
TOKENS = 4 * 16 * 4096  # batch * heads * N, the reference shape B=4, H=16, N=4096
HEADS = 16
# (block_q, block_k) per head dim, unless --tune: the fastest q_outer tiles of the tuning
# sweep (results/bench_layouts.csv)
BLOCKS = {64: (128, 64), 128: (128, 64)}
# Whether a schedule's own tiles for short sequences (Schedule.short_tiles) replace BLOCKS in
# the sweep; --blocks and --tune, which name the tiles, turn it off
SHORT_TILES = True
LAYOUTS: dict = {}  # forced thread layout per head dim ("RM,KN"), set by --tune
BLOCKSIZE_SWEEP = {"schedules": ["q_outer"], "n": 4096, "d": 64,
                   "block_q": [16, 32, 64, 128, 256]}  # block_k from BLOCKS
# Tuning at N = 4096: tile sizes x thread layouts (query rows and keys of S per thread; see
# microkernel.Layout), per head dim.
LAYOUT_SWEEP = {"n": 4096, "d": {
    64: {"blocks": [(128, 64), (256, 64)], "layouts": [(8, 4), (8, 8)]},
    128: {"blocks": [(128, 64)], "layouts": [(4, 4), (8, 4), (4, 8), (8, 2)]}}}
REPS, WARMUP, POINT_BUDGET_S = 20, 3, 1.5
L2_BYTES = 60 * 2**20


def shape_for(n: int) -> tuple[int, int]:
    bh = max(1, TOKENS // n)
    heads = min(HEADS, bh)
    return bh // heads, heads


def input_sets(p) -> int:
    """Enough input sets that one pass over them is three times the L2."""
    one = p.bh * (p.n_q * p.d + p.n_k * (p.d + p.dv)) * p.itemsize
    return int(min(4, max(1, np.ceil(3 * L2_BYTES / one))))


def time_launches(launch, reps=REPS, warmup=WARMUP) -> float:
    """Median milliseconds of `launch(i)` over `reps` launches queued back to back, each
    between two CUDA events. The GPU is still busy with the warm-ups when the first event
    is recorded, and the host queues launch i + 1 while launch i runs, so the time between
    consecutive events is the kernel's alone: the Python host time of a launch (tens of
    microseconds for a Numba kernel, and it varies with the host's CPU) is hidden, for the
    schedules and torch alike."""
    runtime.synchronize()
    for i in range(warmup):
        launch(i)
    events = [runtime.cuda.event() for _ in range(reps + 1)]
    events[0].record()
    for i in range(reps):
        launch(i)
        events[i + 1].record()
    events[-1].synchronize()
    return float(np.median([runtime.cuda.event_elapsed_time(a, b)
                            for a, b in zip(events, events[1:], strict=False)]))


def bench_schedule(sched, p, rng):
    bufs = Buffers(sched, p, rng, sets=input_sets(p))
    bufs.launch(0)
    err = check_output(sched, p, *bufs.host[0], runtime.to_host(bufs.out), rng)
    return time_launches(bufs.launch), err


def bench_torch(backend, dtype, p, rng):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tdt = getattr(torch, dtype)
    sets = [tuple(torch.randn(p.batch, p.heads, n, w, device="cuda", dtype=tdt)
                  for n, w in ((p.n_q, p.d), (p.n_k, p.d), (p.n_k, p.dv)))
            for _ in range(input_sets(p))]
    chosen = {"efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH,
              "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

    def launch(i):
        q, k, v = sets[i % len(sets)]
        with sdpa_kernel(chosen):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=p.causal)

    out = launch(0).float().cpu().numpy().reshape(p.bh, p.n_q, p.dv)
    host = [t.float().cpu().numpy().reshape(p.bh, -1, t.shape[-1]) for t in sets[0]]
    err = check_output(_TorchRef(), p, *host, out, rng)
    return time_launches(launch), err


class _TorchRef:
    name = "torch"

    @staticmethod
    def output_roundings(p):
        return 1


PROVIDERS = [("torch_sdpa_efficient", "float32", "efficient"),
             ("torch_sdpa_math", "float32", "math"), ("torch_sdpa_flash", "float16", "flash"),
             ("torch_sdpa_flash", "bfloat16", "flash")]


def finished_rows(path: Path) -> dict:
    """Rows a previous run of this same commit measured (an interrupted sweep resumes)."""
    if not path.exists():
        return {}
    with path.open() as f:
        return {tuple(r[c] for c in ("provider", "dtype", "n", "d", "causal")): r
                for r in csv.DictReader(f)
                if r["status"] == "ok" and r["git_sha"] == PROV["git_sha"]}


def blank_row(name, dtype, what, p, status="ok") -> dict:
    """A row for provider `name` (what: its Schedule, or the torch backend's name)."""
    return {"provider": name, "dtype": dtype, "batch": p.batch, "heads": p.heads, "n": p.n_q,
            "d": p.d, "causal": p.causal, "block_q": p.block_q, "block_k": p.block_k,
            "layout": "" if isinstance(what, str) else layout_in_effect(what, p),
            "ms_median": "", "tflops": "", "rel_error": "", "status": status}


def layout_in_effect(sched, p) -> str:
    """The micro-kernel at p: RM,KN of the CUDA-core one (microkernel.Layout; RM,KN,STAGES,1
    where it keeps P_ij^T in K_j's place), "ws" for q_outer's warp-specialised kernel (as
    LOOP_ORDERS_LAYOUT takes it), mma.f16, mma.bf16, mma.tf32 or mma.tf32x3 for the
    tensor-core one (dense's too), "" for CUDA-core kernels of their own."""
    if not sched.uses_micro_kernel:
        lay = sched.layout(p) if sched.TENSOR_CORES else None
        return "" if lay is None else str(lay)
    try:
        lay = sched.layout(p)
    except ValueError:
        return "invalid"
    if isinstance(lay, TensorCores | Specialised):
        return str(lay)
    # RM,KN, and where P_ij^T is kept in K_j's place, STAGES,1 (as LOOP_ORDERS_LAYOUT takes it)
    return f"{lay.rm},{lay.kn}" + (f",{lay.stages},1" if lay.p_in_k else "")


@contextmanager
def tuning_override(layout: str | None = None, kv_stages: int | None = None):
    """Run with this override of the kernel choice (`loop_orders.microkernel.tuning`), or
    unchanged where both are None."""
    if layout is None and kv_stages is None:
        yield
        return
    with tuning.tuned(layout, kv_stages):
        yield


def forced_layout(layout: str | None):
    """Run with this layout forced (as LOOP_ORDERS_LAYOUT takes it), or unchanged if None."""
    return tuning_override(layout=layout)


def measure(name, dtype, what, p, rng) -> dict:
    """One row: time a schedule (what = Schedule) or a torch SDPA backend (what = str)."""
    row = blank_row(name, dtype, what, p)
    try:
        if isinstance(what, str):
            ms, err = bench_torch(what, dtype, p, rng)
            row["block_q"] = row["block_k"] = row["layout"] = ""
        else:
            lo.api.check_launch(what, p, count=False)
            ms, err = bench_schedule(what, p, rng)
    except (ValueError, RuntimeError, MemoryError) as exc:
        row["status"] = f"refused: {str(exc).splitlines()[0][:160]}"
        return row
    row.update(ms_median=round(ms, 4), tflops=round(flops(p) / ms / 1e9, 3),
               rel_error=f"{err:.2e}")
    print(f"{name:22s} d={p.d} causal={p.causal!s:5} N={p.n_q:6d}: {ms:9.3f} ms "
          f"{row['tflops']:8} TFLOP/s  err {err:.1e}", flush=True)
    return row


def sweep_problem(name, what, dtype, n, d, causal) -> lo.Problem:
    """The sweep's problem for a provider at one point: BLOCKS' tiles, or the schedule's own
    for a short sequence (SHORT_TILES). A torch backend times q_outer's problem."""
    batch, heads = shape_for(n)
    sched = "q_outer" if isinstance(what, str) else name
    sizes = {"n_q": n, "d": d, "batch": batch, "heads": heads, "causal": causal,
             **input_kind(dtype)}
    p = lo.make_problem(sched, block_q=BLOCKS[d][0], block_k=BLOCKS[d][1], **sizes)
    tiles = SHORT_TILES and not isinstance(what, str) and what.short_tiles(p)
    return lo.make_problem(sched, block_q=tiles[0], block_k=tiles[1], **sizes) if tiles else p


def warm_sweep(sweep: dict, providers: list) -> None:
    """Compile the sweep's kernels (every schedule, d, causal; counted and not) at once first:
    the points then load them (a problem a schedule refuses is left to its point to report)."""
    problems = []
    for d, causal in itertools.product(sweep["d"], sweep["causal"]):
        for name, dtype, what in providers:
            if not isinstance(what, str):  # a schedule, not a torch backend
                with contextlib.suppress(ValueError, TypeError):  # `warm` drops refused ones
                    problems.append((name, sweep_problem(name, what, dtype, sweep["n"][0], d,
                                                         causal), False))
    warm(problems)


def run_sweep(out_dir: Path, sweep: dict, only: set | None, rng,
              dtypes: tuple = ("float32",)) -> list[dict]:
    path = out_dir / "bench_runtime.csv"
    done = finished_rows(path)
    rows, last_ms = list(done.values()), {}
    providers = [(s.name, dtype, s) for dtype in dtypes for s in lo.all_schedules()
                 if runs(s, dtype)] + PROVIDERS
    providers = [pr for pr in providers
                 if only is None or pr[0] in only or f"{pr[0]}/{pr[1]}" in only]
    for d, causal, n in itertools.product(sweep["d"], sweep["causal"], sweep["n"]):
        for name, dtype, what in providers:
            p = sweep_problem(name, what, dtype, n, d, causal)
            key, trend = (name, dtype, str(n), str(d), str(causal)), (name, d, causal)
            if key in done:
                last_ms[trend] = float(done[key]["ms_median"])
                continue
            predicted = 4 * last_ms.get(trend, 0) / 1e3  # time grows about as N^2
            if predicted > POINT_BUDGET_S:
                row = blank_row(name, dtype, what, p,
                                f"skipped: predicted {predicted:.1f} s per launch")
            else:
                with forced_layout(LAYOUTS.get(d)):
                    row = measure(name, dtype, what, p, rng)
                if row["status"] == "ok":
                    last_ms[trend] = row["ms_median"]
            rows.append(row)
            write_csv(path, rows, PROV)
    return rows


BACKWARD_SWEEP = {"n": [1024, 4096, 16384], "d": [64], "causal": [False, True]}
# SDPA's backends timed beside ours, per torch dtype (a TF32 label's is float32)
BACKWARD_TORCH = [("torch_sdpa_efficient", "float32", "efficient"),
                  *((f"torch_sdpa_{backend}", dtype, backend)
                    for dtype in ("float16", "bfloat16") for backend in ("flash", "cudnn"))]


def backward_providers(only: set[str] | None = None) -> list[tuple[str, dict | None]]:
    """(schedule, options) for every backward order and value of its options, or for the
    schedules named in `only`."""
    return [(v.schedule, v.options) for v in lo.core.schedule.grad_variants()
            if only is None or v.schedule in only]


def bench_grad(name: str, options, p, rng, op_tiles) -> tuple[float, float, float | str, float]:
    """(forward ms, backward ms, forward + backward through the torch op ms, gradient
    error) of one backward order, its passes on p's tiles (`Problem.for_backward`'s for the
    backward); kernels alone except the torch op's, which names `op_tiles` (None, None: it
    chooses them as p's were; None: not timed, the op naming no pair of p's)."""
    import torch

    import loop_orders.torch as lot
    from experiments.gpu_common import GradBuffers, check_gradients

    sched = lo.get_schedule(name)
    bufs = GradBuffers(sched, p, rng, sets=input_sets(p))
    bufs.launch_both(0)
    grads = [runtime.to_host(g) for g in bufs.grads]
    err = check_gradients(sched, p, *bufs.host[0], bufs.do_host, grads, rng)
    fwd = time_launches(bufs.launch)
    bwd = time_launches(bufs.launch_backward)
    if op_tiles is None:
        return fwd, bwd, "", err
    shape = (p.batch, p.heads)

    def tensor(x):  # bfloat16 host arrays hold its bits as uint16
        t = torch.from_numpy(x.reshape(*shape, *x.shape[1:])).cuda()
        return t.view(torch.bfloat16) if p.dtype == "bfloat16" else t

    tq, tk, tv = (tensor(x).requires_grad_() for x in bufs.host[0])
    tdo = tensor(bufs.do_host)

    def op(_i):
        out = lot.attention(tq, tk, tv, schedule=name, causal=p.causal, block_q=op_tiles[0],
                            block_k=op_tiles[1], options=options, precision=p.precision)
        out.backward(tdo)

    return fwd, bwd, time_launches(op), err


def bench_torch_grad(backend: str, dtype: str, p, rng) -> float:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tdt = getattr(torch, dtype)
    q, k, v = (torch.randn(p.batch, p.heads, p.n_q, p.d, device="cuda", dtype=tdt)
               .requires_grad_() for _ in range(3))
    do = torch.randn(p.batch, p.heads, p.n_q, p.dv, device="cuda", dtype=tdt)
    chosen = {"efficient": SDPBackend.EFFICIENT_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
              "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

    def launch(_i):
        with sdpa_kernel(chosen):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=p.causal)
        out.backward(do)

    return time_launches(launch)


class GradTiles(NamedTuple):
    """A backward sweep's build: tiles (the backward's own where `backward` names them), and
    the Q_i/dO_i buffers of a tensor-core K/V-outer kernel (`tuning` q_stages; None: the
    schedule's rule)."""

    block_q: int
    block_k: int
    q_stages: int | None = None
    backward: tuple = ()

    def label(self) -> str:
        text = f"{self.block_q}x{self.block_k}"
        text += ",{}x{}".format(*self.backward) if self.backward else ""
        return text + (f"/{self.q_stages}" if self.q_stages else "")


def grad_point(name: str, options, n: int, d: int, causal: bool, dtype: str,
               tiles: GradTiles | None) -> lo.Problem:
    """The Problem of one gradient call of the sweep (B, H from `shape_for`): on `tiles`,
    or (None) as a call naming no tiles runs it, each pass on the tiles it chooses
    (`api_grad.grad_tiles`: a refusal is a ValueError)."""
    sched, kind = lo.get_schedule(name), input_kind(dtype)
    problem = grad_problem(sched, n, n, d, d, *shape_for(n), None, kind["dtype"], causal,
                           options, (-1, -1), False, kind.get("precision", "ieee"))
    if tiles is None:
        return grad_tiles(sched, backward_of(sched), problem(64, 64), problem, None, None,
                          False, False)
    p = problem(tiles.block_q, tiles.block_k)
    return p.with_backward_tiles(*tiles.backward) if tiles.backward else p


def run_backward(out_dir: Path, sweep: dict, rng, only: set[str] | None = None,
                 dtypes: tuple = ("float32", "float16"), tiles: tuple = ()) -> list[dict]:
    """Forward + backward of every backward order beside torch SDPA's (same run, same
    shapes, B H N fixed), gradients checked against float64 on two heads first: as a call
    naming no tiles runs (each pass on the tiles it chooses) into bench_backward.csv, or on
    each `GradTiles` of `tiles` into bench_backward_tiles.csv (a q_stages column more). The
    block_q, block_k columns are the forward's, backward_tiles the backward's. dtypes are
    labels (`input_kind`: "tf32x3" is float32 at that precision, beside SDPA's float32)."""
    swept, builds = bool(tiles), tiles or (None,)
    rows, last, timed = [], {}, set()
    points = {}  # (name, options, d, causal, n, dtype, build): its Problem, or the refusal

    def point(name, options, d, causal, n, dtype, build):
        key = (name, str(options), d, causal, n, dtype, build)
        if key not in points:
            with tuning.tuned(q_stages=build.q_stages if build else None):
                try:
                    points[key] = grad_point(name, options, n, d, causal, dtype, build)
                except ValueError as exc:
                    points[key] = exc
        return points[key]

    warm((name, p, True, (("q_stages", build.q_stages),) if build and build.q_stages else ())
         for d, causal, n in itertools.product(sweep["d"], sweep["causal"], sweep["n"][:1])
         for dtype in dtypes for name, options in backward_providers(only) for build in builds
         if isinstance(p := point(name, options, d, causal, n, dtype, build), lo.Problem))
    for d, causal, n in itertools.product(sweep["d"], sweep["causal"], sweep["n"]):
        batch, heads = shape_for(n)
        for dtype in dtypes:
            for (name, options), build in itertools.product(backward_providers(only), builds):
                p = point(name, options, d, causal, n, dtype, build)
                label = " ".join([name, *(f"{k}={v}" for k, v in (options or {}).items())])
                row = {"provider": label, "dtype": dtype, "batch": batch, "heads": heads,
                       "n": n, "d": d, "causal": causal, "block_q": "", "block_k": "",
                       "backward_tiles": "",
                       **({"q_stages": build.q_stages or ""} if swept else {}),
                       "ms_forward": "", "ms_backward": "", "ms_total": "", "ms_torch_op": "",
                       "rel_error": "", "status": "ok"}
                trend = (label, dtype, d, causal, build)
                predicted = 4 * last.get(trend, 0) / 1e3
                if isinstance(p, lo.Problem):
                    pb = p.for_backward()
                    row.update(block_q=p.block_q, block_k=p.block_k,
                               backward_tiles=f"{pb.block_q}x{pb.block_k}")
                # the torch op names the sweep's tiles, or none as a user would
                op_tiles = ((None, None) if build is None else
                            None if build.backward else (build.block_q, build.block_k))
                if not isinstance(p, lo.Problem):
                    row["status"] = f"refused: {str(p).splitlines()[0][:160]}"
                elif predicted > 4 * POINT_BUDGET_S:
                    row["status"] = f"skipped: predicted {predicted:.1f} s per launch"
                else:
                    try:
                        with tuning.tuned(q_stages=build.q_stages if build else None):
                            sched = lo.get_schedule(name)
                            check_grad_launch(sched, backward_of(sched), p, False, False)
                            fwd, bwd, op, err = bench_grad(name, options, p, rng, op_tiles)
                        row.update(ms_forward=round(fwd, 4), ms_backward=round(bwd, 4),
                                   ms_total=round(fwd + bwd, 4),
                                   ms_torch_op=round(op, 4) if op != "" else "",
                                   rel_error=f"{err:.2e}")
                        last[trend] = fwd + bwd
                    except (ValueError, RuntimeError, MemoryError) as exc:
                        row["status"] = f"refused: {str(exc).splitlines()[0][:160]}"
                rows.append(row)
                runtime.release_memory()
                shown = build.label() if build else (
                    f"{row['block_q']}x{row['block_k']},{row['backward_tiles']} (chosen)")
                print(f"backward {label:22s} {dtype} d={d} causal={causal!s:5} N={n:6d} "
                      f"{shown}: {row['ms_total']} ms (fwd {row['ms_forward']}, bwd "
                      f"{row['ms_backward']}; torch op {row['ms_torch_op']}) {row['status'][:40]}",
                      flush=True)
            for provider, tdtype, backend in BACKWARD_TORCH:
                point_key = (provider, tdtype, d, causal, n)
                if tdtype != input_kind(dtype)["dtype"] or point_key in timed:
                    continue
                timed.add(point_key)
                p = lo.make_problem("q_outer", n_q=n, d=d, batch=batch, heads=heads,
                                    block_q=64, block_k=64, causal=causal, dtype=tdtype)
                row = {"provider": provider, "dtype": tdtype, "batch": batch, "heads": heads,
                       "n": n, "d": d, "causal": causal, "block_q": "", "block_k": "",
                       "backward_tiles": "", **({"q_stages": ""} if swept else {}),
                       "ms_forward": "", "ms_backward": "", "ms_total": "", "ms_torch_op": "",
                       "rel_error": "", "status": "ok"}
                try:
                    row["ms_total"] = round(bench_torch_grad(backend, tdtype, p, rng), 4)
                except RuntimeError as exc:  # a backend that does not take the shape
                    row["status"] = f"refused: {str(exc).splitlines()[0][:160]}"
                rows.append(row)
                print(f"backward {provider:22s} {tdtype} d={d} causal={causal!s:5} N={n:6d}: "
                      f"{row['ms_total']} ms forward + backward {row['status'][:40]}",
                      flush=True)
            write_csv(out_dir / f"bench_backward{'_tiles' if swept else ''}.csv", rows, PROV)
    return rows


def run_blocksize(out_dir: Path, rng) -> None:
    """Block size vs model traffic and runtime (cf. FlashAttention Figure 2, middle)."""
    rows = []
    n, d = BLOCKSIZE_SWEEP["n"], BLOCKSIZE_SWEEP["d"]
    block_k = BLOCKS[d][1]
    batch, heads = shape_for(n)
    for sched in map(lo.get_schedule, BLOCKSIZE_SWEEP["schedules"]):
        for block_q in BLOCKSIZE_SWEEP["block_q"]:
            p = lo.make_problem(sched.name, n_q=n, d=d, batch=batch, heads=heads,
                                block_q=block_q, block_k=block_k)
            model = sched.model(p)
            row = {"schedule": sched.name, "n": n, "d": d, "batch": batch, "heads": heads,
                   "block_q": block_q, "block_k": block_k, "model_elements": model.total,
                   "model_bytes": model.bytes(p.itemsize), "ms_median": "", "status": "ok"}
            try:
                lo.api.check_launch(sched, p, count=False)
                ms, _ = bench_schedule(sched, p, rng)
                row["ms_median"] = round(ms, 4)
            except (ValueError, RuntimeError, MemoryError) as exc:
                row["status"] = f"refused: {str(exc).splitlines()[0][:160]}"
            rows.append(row)
            print(f"blocksize {sched.name} Br={block_q}: {row['ms_median']} ms", flush=True)
    write_csv(out_dir / "bench_blocksize.csv", rows, PROV)


# Tensor-core tiles of q_outer at N = 4096, not causal, per head dim, each with single and
# double-buffered K/V (LOOP_ORDERS_KV_STAGES), and the dtypes they are timed in
TC_TILE_SWEEP = {"n": 4096, "dtypes": ["float16", "tf32"], "stages": [1, 2], "d": {
    64: [(64, 64), (128, 64), (64, 128), (128, 128)],
    128: [(64, 64), (128, 64), (64, 128)]}}


def run_tc_tiles(out_dir: Path, rng) -> list[dict]:
    """q_outer on tensor cores over tiles and K/V buffering: registers, local memory and
    runtime, beside SDPA flash float16 (bench_tc_tiles.csv). Returns the rows."""
    rows, seen = [], set()
    n = TC_TILE_SWEEP["n"]
    batch, heads = shape_for(n)
    sched = lo.get_schedule("q_outer")
    for d, tiles in TC_TILE_SWEEP["d"].items():
        p = lo.make_problem("q_outer", n_q=n, d=d, batch=batch, heads=heads, block_q=64,
                            block_k=64, dtype="float16")
        base = measure("torch_sdpa_flash", "float16", "flash", p, rng)
        rows.append({"schedule": base["provider"], **base, "stages": "", "regs": "",
                     "local_bytes": ""})
        for label, (block_q, block_k), stages in itertools.product(
                TC_TILE_SWEEP["dtypes"], tiles, TC_TILE_SWEEP["stages"]):
            p = lo.make_problem("q_outer", n_q=n, d=d, batch=batch, heads=heads,
                                block_q=block_q, block_k=block_k, **input_kind(label))
            with tuning_override(kv_stages=stages):
                timed = time_layout(sched, p, seen, rng)
                # the buffers in effect: q_outer's TC_KV_STAGES may take fewer than asked
                row = {"schedule": sched.name, **blank_row(sched.name, label, sched, p),
                       "stages": sched.layout(p).stages, "regs": "", "local_bytes": "",
                       **(timed or {})}
            rows.append(row)
            print(f"tc tiles q_outer {label} d={d} {block_q}x{block_k} x{row['stages']}: "
                  f"{row['ms_median']} ms {row['tflops']} TFLOP/s regs {row['regs']} local "
                  f"{row['local_bytes']} {row['status'][:60]}", flush=True)
        write_csv(out_dir / "bench_tc_tiles.csv", rows, PROV)
    return rows


def run_layouts(out_dir: Path, only: set | None, rng) -> list[dict]:
    """Every tile size and thread layout of the flash micro-kernel: registers, local memory
    and runtime, beside SDPA (efficient) at the same shape. Returns the rows.

    The layout is forced through LOOP_ORDERS_LAYOUT; kernels that do not change with it
    (dense's) are timed once per tile size."""
    rows, seen = [], set()
    n = LAYOUT_SWEEP["n"]
    batch, heads = shape_for(n)
    schedules = [s for s in lo.all_schedules() if only is None or s.name in only]
    for d, grid in LAYOUT_SWEEP["d"].items():
        p = lo.make_problem("q_outer", n_q=n, d=d, batch=batch, heads=heads,
                            block_q=BLOCKS[d][0], block_k=BLOCKS[d][1])
        base = measure("torch_sdpa_efficient", "float32", "efficient", p, rng)
        rows.append({"schedule": base["provider"], **base, "regs": "", "local_bytes": ""})
        for sched, (block_q, block_k), layout in itertools.product(
                schedules, grid["blocks"], grid["layouts"]):
            p = lo.make_problem(sched.name, n_q=n, d=d, batch=batch, heads=heads,
                                block_q=block_q, block_k=block_k)
            with forced_layout(f"{layout[0]},{layout[1]}"):
                timed = time_layout(sched, p, seen, rng)
                if timed is None:  # these kernels were timed already
                    continue
                row = {"schedule": sched.name, **blank_row(sched.name, "float32", sched, p),
                       "regs": "", "local_bytes": "", **timed}
            rows.append(row)
            print(f"tuning {sched.name:8s} d={d} {block_q}x{block_k} {row['layout']}: "
                  f"{row['ms_median']} ms {row['tflops']} TFLOP/s regs {row['regs']} local "
                  f"{row['local_bytes']} {row['status'][:60]}", flush=True)
        write_csv(out_dir / "bench_layouts.csv", rows, PROV)
    return rows


def time_layout(sched, p, seen: set, rng) -> dict | None:
    """Time one tuning point (None if its kernels were timed already): fields to update."""
    try:
        kernels = tuple(sched.kernels(p, False))
        if kernels in seen:
            return None
        seen.add(kernels)
        lo.api.check_launch(sched, p, count=False)
        ms, _ = bench_schedule(sched, p, rng)
    except (ValueError, RuntimeError, MemoryError) as exc:
        return {"status": f"refused: {str(exc).splitlines()[0][:160]}"}
    return {"ms_median": round(ms, 4), "tflops": round(flops(p) / ms / 1e9, 3),
            **runtime.launched_resources(kernels[0].fn)}


def finished_tuning(path: Path) -> list[dict]:
    """The tuning rows a previous run of this same commit wrote (numbers parsed), if any."""
    if not path.exists():
        return []
    with path.open() as f:
        rows = [r for r in csv.DictReader(f) if r["git_sha"] == PROV["git_sha"]]
    for r in rows:
        r["d"] = int(r["d"])
        if r["block_q"]:
            r["block_q"], r["block_k"] = int(r["block_q"]), int(r["block_k"])
        if r["ms_median"]:
            r["ms_median"] = float(r["ms_median"])
    return rows


def fastest_configs(rows: list[dict]) -> dict:
    """{d: (block_q, block_k, layout)}: the fastest of our schedules' tuning rows per d."""
    best = {}
    for r in rows:
        ours = r["status"] == "ok" and r["block_q"] != ""  # torch rows have no tiles
        if ours and (r["d"] not in best or r["ms_median"] < best[r["d"]]["ms_median"]):
            best[r["d"]] = r
    return {d: (r["block_q"], r["block_k"], r["layout"]) for d, r in best.items()}


def kernel_report(rng) -> dict:
    """Registers and local memory of every kernel, and counting on vs off at one size."""
    report = {"kernels": [], "counting": []}
    n, d = 4096, 64
    batch, heads = shape_for(n)
    for sched in lo.all_schedules():
        p = lo.make_problem(sched.name, n_q=n, d=d, batch=batch, heads=heads,
                            block_q=BLOCKS[d][0], block_k=BLOCKS[d][1])
        bufs = Buffers(sched, p, rng)
        times = {}
        with forced_layout(LAYOUTS.get(d)):
            for count in (False, True):
                bufs.launch(0, count=count)
                times[count] = time_launches(lambda i, c=count, b=bufs: b.launch(i, count=c))
            kernels = {count: sched.kernels(p, count) for count in (False, True)}
            layout = layout_in_effect(sched, p)
        report["counting"].append({"schedule": sched.name, "n": n, "d": d, "ms_off": times[False],
                                   "ms_on": times[True]})
        for count in (False, True):
            for record in kernels[count]:
                # each build launched (compiled or from the kernel cache), by argument types
                for build in runtime.launched_builds(record.fn):
                    asm = build.inspect_asm(runtime.cuda.get_current_device().compute_capability)
                    report["kernels"].append({
                        "schedule": sched.name, "kernel": record.name, "count": count,
                        "constants": _closure(record.fn), "layout": layout,
                        "regs": build.regs_per_thread, "local_bytes": build.local_mem_per_thread,
                        "shared_bytes": record.shared_bytes,
                        "atomics_in_ptx": asm.count("atom."),
                        "vector_shared_loads": asm.count("ld.shared.v4")})
    return report


def _closure(kernel) -> dict:
    names = kernel.py_func.__code__.co_freevars
    cells = kernel.py_func.__closure__ or ()
    return {n: c.cell_contents for n, c in zip(names, cells, strict=True)
            if isinstance(c.cell_contents, (int, bool))}


MMA_FLOPS = {"float16": 2 * 16 * 8 * 16, "bfloat16": 2 * 16 * 8 * 16,  # m16n8k16
             "tf32": 2 * 16 * 8 * 8}  # m16n8k8: one warp's mma.sync
CEILING_CHAINS = 8  # independent accumulators per warp: enough in flight to fill the pipe
CEILING_ITERS, CEILING_THREADS = 2048, 128


def ceiling_kernel(dtype: str):
    """A register-only loop of mma.sync (m16n8k16 for `dtype` float16 or bfloat16, m16n8k8
    for tf32; float32 accumulators), CEILING_CHAINS independent products per warp; it writes
    one sum per thread so the compiler keeps the loop."""
    from numba import float32

    from loop_orders.device.intrinsics import mma_bf16, mma_f16, mma_tf32, pack_bf16x2, pack_f16x2

    mma = {"float16": mma_f16, "bfloat16": mma_bf16, "tf32": mma_tf32}[dtype]
    pack = pack_bf16x2 if dtype == "bfloat16" else pack_f16x2
    tf32 = dtype == "tf32"
    iters, chains, threads = CEILING_ITERS, CEILING_CHAINS, CEILING_THREADS
    n_acc = 4 * chains

    @runtime.cuda.jit
    def mma_ceiling(out):
        t = runtime.cuda.threadIdx.x
        x = float32(t) * float32(1e-3)
        a = x if tf32 else pack(x, float32(1e-3))
        acc = runtime.cuda.local.array(n_acc, float32)
        for e in range(n_acc):
            acc[e] = float32(0.0)
        for _ in range(iters):
            for c in range(chains):
                acc[4 * c], acc[4 * c + 1], acc[4 * c + 2], acc[4 * c + 3] = mma(
                    a, a, a, a, a, a, acc[4 * c], acc[4 * c + 1], acc[4 * c + 2], acc[4 * c + 3])
        total = float32(0.0)
        for e in range(n_acc):
            total += acc[e]
        out[runtime.cuda.blockIdx.x * threads + t] = total

    return mma_ceiling


def mma_ceiling(dtype: str) -> dict:
    """What the tensor cores give code from this toolchain: TFLOP/s of `ceiling_kernel`
    with 4 warps a CTA and 8 CTAs an SM, timed as the schedules are."""
    kernel = ceiling_kernel(dtype)
    ctas = 8 * runtime.multiprocessor_count()
    out = runtime.device_empty(ctas * CEILING_THREADS, np.float32)
    ms = time_launches(lambda i: kernel[ctas, CEILING_THREADS](out))
    flops = ctas * CEILING_THREADS // 32 * CEILING_ITERS * CEILING_CHAINS * MMA_FLOPS[dtype]
    return {"dtype": dtype, "ms_median": round(ms, 4), "tflops": round(flops / ms / 1e9, 1),
            "ctas": ctas, "threads": CEILING_THREADS, "iterations": CEILING_ITERS,
            "chains": CEILING_CHAINS}


FFMA_CHAINS, FFMA_ITERS, FFMA_THREADS = 16, 4096, 256
SGEMM_SHAPES = [(8192, 8192, 8192), (4096, 4096, 4096)]  # (m, n, k) of cuBLAS's float32 GEMM


def ffma_kernel():
    """A register-only loop of float32 FMAs, FFMA_CHAINS independent ones per thread (enough
    in flight to fill the pipe); it writes one sum per thread so the compiler keeps the loop."""
    from numba import float32

    chains, iters, threads = FFMA_CHAINS, FFMA_ITERS, FFMA_THREADS

    @runtime.cuda.jit
    def ffma_ceiling(out):
        t = runtime.cuda.threadIdx.x
        x = float32(1.0) - float32(t) * float32(1e-6)
        acc = runtime.cuda.local.array(chains, float32)
        for c in range(chains):
            acc[c] = float32(c) * float32(1e-3)
        for _ in range(iters):
            for c in range(chains):
                acc[c] = acc[c] * x + float32(1e-3)  # one FFMA
        total = float32(0.0)
        for c in range(chains):
            total += acc[c]
        out[runtime.cuda.blockIdx.x * threads + t] = total

    return ffma_ceiling


def fma_ceiling() -> dict:
    """What float32 on CUDA cores can reach here, in the same run as the schedules: our own
    register-only FFMA loop (4 CTAs of 256 threads an SM), and cuBLAS's float32 GEMM with
    TF32 off (torch.matmul; the best an FMA GEMM from NVIDIA's library reaches)."""
    import torch

    kernel = ffma_kernel()
    ctas = 4 * runtime.multiprocessor_count()
    out = runtime.device_empty(ctas * FFMA_THREADS, np.float32)
    ms = time_launches(lambda i: kernel[ctas, FFMA_THREADS](out))
    ffma = {"ms_median": round(ms, 4), "ctas": ctas, "threads": FFMA_THREADS,
            "tflops": round(2 * ctas * FFMA_THREADS * FFMA_ITERS * FFMA_CHAINS / ms / 1e9, 1)}
    allowed = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # cuBLAS's FMA kernels, not TF32
    sgemm = []
    try:
        for m, n, k in SGEMM_SHAPES:
            a, b = (torch.randn(r, c, device="cuda") for r, c in ((m, k), (k, n)))
            ms = time_launches(lambda i, a=a, b=b: torch.matmul(a, b))
            sgemm.append({"m": m, "n": n, "k": k, "ms_median": round(ms, 4),
                          "tflops": round(2 * m * n * k / ms / 1e9, 1)})
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
    return {"ffma_loop": ffma, "cublas_sgemm": sgemm}


PROV: dict = {}


def grad_build(text: str) -> GradTiles:
    """--grad-tiles' "BQxBK", with ",BQxBK" for the backward's own and "/S" (S Q_i/dO_i
    buffers), as a GradTiles."""
    tiles, _, stages = text.partition("/")
    pairs = [tuple(int(x) for x in pair.split("x")) for pair in tiles.split(",")]
    return GradTiles(*pairs[0], int(stages) if stages else None,
                     pairs[1] if len(pairs) > 1 else ())


def main(argv=None) -> int:
    global PROV, SHORT_TILES
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--quick", action="store_true", help="N up to 2048 only")
    parser.add_argument("--n", type=int, nargs="+", help="override the sweep's N values")
    parser.add_argument("--d", type=int, nargs="+", choices=sorted(BLOCKS))
    parser.add_argument("--causal", choices=["off", "on", "both"], default="both")
    parser.add_argument("--providers", help="comma-separated subset, e.g. q_outer,kv_outer; "
                        "name/dtype for one dtype of a provider, e.g. q_outer/float32")
    parser.add_argument("--report", action="store_true",
                        help="only the kernel report (bench_kernels.json): registers, local "
                        "memory, counting on vs off")
    parser.add_argument("--no-extras", action="store_true",
                        help="skip the block-size sweep and the kernel report")
    parser.add_argument("--layouts", action="store_true",
                        help="only the tuning sweep of tiles and layouts (bench_layouts.csv)")
    parser.add_argument("--tc-tiles", action="store_true",
                        help="only the tensor-core tile sweep of q_outer (bench_tc_tiles.csv)")
    parser.add_argument("--tune", action="store_true",
                        help="run the tuning sweep first; the sweep then uses, per d, the "
                             "fastest tiles and layout it found")
    parser.add_argument("--tune-providers", default="q_outer",
                        help="schedules the tuning sweep times (comma-separated)")
    parser.add_argument("--dtypes", default=None,
                        help="input dtypes the schedules run in (comma-separated; float16 "
                             "and bfloat16 run on tensor cores; tf32 and tf32x3 are float32 "
                             "inputs at that precision; default float32, and float32,float16 "
                             "for --backward)")
    parser.add_argument("--blocks", help="block_q,block_k for every d (default: BLOCKS)")
    parser.add_argument("--backward", action="store_true",
                        help="only forward + backward beside SDPA's (bench_backward.csv)")
    parser.add_argument("--grad-tiles", nargs="+", type=grad_build,
                        metavar="BQxBK[,BQxBK][/S]",
                        default=(), help="--backward: each order on each of these tiles "
                        "(a second pair: the backward's own; S: Q_i/dO_i buffers of a "
                        "tensor-core K/V-outer kernel, `tuning` q_stages), into "
                        "bench_backward_tiles.csv (default: the tiles a call naming none "
                        "runs, into bench_backward.csv)")
    args = parser.parse_args(argv)
    if runtime.SIMULATOR:
        print("bench_runtime: no CUDA GPU here; nothing timed (plots use committed results)")
        return 0
    import torch

    PROV = provenance(torch=torch.__version__)
    args.out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng()
    t0 = time.time()
    sweep = {"n": args.n or (SWEEP["n"][:3] if args.quick else SWEEP["n"]),
             "d": args.d or SWEEP["d"],
             "causal": {"off": [False], "on": [True], "both": SWEEP["causal"]}[args.causal]}
    only = set(args.providers.split(",")) if args.providers else None
    SHORT_TILES = not (args.blocks or args.tune)
    if args.blocks:
        for d in BLOCKS:
            BLOCKS[d] = tuple(int(b) for b in args.blocks.split(","))
    if args.backward:
        causal = {"off": [False], "on": [True], "both": BACKWARD_SWEEP["causal"]}[args.causal]
        run_backward(args.out, {**BACKWARD_SWEEP, **({"n": args.n} if args.n else {}),
                                **({"d": args.d} if args.d else {}), "causal": causal},
                     rng, only, tuple((args.dtypes or "float32,float16").split(",")),
                     tuple(args.grad_tiles))
        print(f"bench_runtime: backward done in {time.time() - t0:.0f} s")
        return 0
    if args.tc_tiles:
        run_tc_tiles(args.out, rng)
        print(f"bench_runtime: tensor-core tiles done in {time.time() - t0:.0f} s")
        return 0
    if args.layouts or args.tune:
        rows = (finished_tuning(args.out / "bench_layouts.csv") if args.tune else None) or \
            run_layouts(args.out, set(args.tune_providers.split(",")), rng)
        tuned = fastest_configs(rows)
        print(f"bench_runtime: tuning done in {time.time() - t0:.0f} s: {tuned}", flush=True)
        if args.layouts:
            return 0
        for d, (block_q, block_k, layout) in tuned.items():
            BLOCKS[d], LAYOUTS[d] = (block_q, block_k), layout
    report_file = args.out / "bench_kernels.json"
    reported = report_file.exists() and \
        json.loads(report_file.read_text())["provenance"]["git_sha"] == PROV["git_sha"]
    if (args.report or not args.no_extras) and not reported:  # counting overhead, registers
        report = kernel_report(rng)
        report["provenance"] = PROV
        atomic_write_text(report_file, json.dumps(report, indent=1, default=str))
        print(json.dumps(report["counting"], indent=1), flush=True)
    if args.report:
        return 0
    if not args.no_extras:
        run_blocksize(args.out, rng)
    dtypes = tuple((args.dtypes or "float32").split(","))
    # (tf32x3 runs on the tf32 mma: its ceiling is tf32's)
    ceilings = [mma_ceiling(dt) for dt in dict.fromkeys(
        "tf32" if dt == "tf32x3" else dt for dt in dtypes) if dt in MMA_FLOPS]
    if ceilings:  # the tensor cores' ceiling, in the same run as the schedules
        print(f"tensor-core ceiling: {ceilings}", flush=True)
        atomic_write_text(args.out / "tensor_core_ceiling.json",
                          json.dumps({"provenance": PROV, "ceilings": ceilings}, indent=1))
    if "float32" in dtypes:  # what CUDA cores reach here, in the same run
        fma = fma_ceiling()
        print(f"float32 FMA ceiling: {fma}", flush=True)
        atomic_write_text(args.out / "fma_ceiling.json",
                          json.dumps({"provenance": PROV, **fma}, indent=1))
    run_sweep(args.out, sweep, only, rng, dtypes)
    print(f"bench_runtime: done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
