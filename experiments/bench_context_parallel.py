"""Context parallelism over P devices: ring, allgather_kv and ulysses against one device.

    torchrun --nproc_per_node=P -m experiments.bench_context_parallel [--out DIR] [--lengths N ...]
    torchrun --standalone --nproc_per_node=2 -m experiments.bench_context_parallel --tiny
    python -m experiments.bench_context_parallel --tiny         # one process: P = 1

One process per GPU (NCCL), or per CPU process with gloo and the kernels on the Numba CUDA
simulator (`--tiny`: tiny shapes, one timed repetition; files go under a temporary folder
unless --out is given). Declared as data below: every schedule (ring with and without
overlap) x causal x N (up to what device memory allows: a point whose estimated need exceeds
MEMORY_SHARE of the free memory of any device is recorded as skipped), at one head shape.

Each point: inputs drawn on every device from one seed, sharded (`cp.shard`); one counted
call, its output checked against the float64 reference on sampled rows of the first and last
head before anything is timed (correctness gates timing); then WARMUP calls and REPS timed
calls (CUDA events around each transfer and kernel: `cp.attention(timed=True).spans`, the
medians per step kept); where NVML's NVLink counters can be read (the nvidia-ml-py package),
the bytes the device's links carried during one more call. Rank 0 times the single-device
call (lo.attention, the same local schedule and blocks, the whole problem) for the scaling
efficiency T_1 / (P T_P), T_P the slowest device's time.

Writes context_parallel.<backend>.json (loop_orders.results format, resumable: points
already stored are skipped; provenance from rank 0, with world size and torch.distributed's
backend), one record per point: per step the model's bytes, every device's counted bytes and
its median times; per device the HBM ledgers counted and modelled; the NVLink bytes; the
times and the efficiency.
"""

from __future__ import annotations

import argparse
import itertools
import os
import socket
import statistics
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import loop_orders as lo
import loop_orders.context_parallel as cp
from experiments.common import QUICK_DIR, seed_for
from experiments.gpu_common import reference_rows
from loop_orders import results
from loop_orders.device import runtime
from loop_orders.reference import relative_error, tolerance

SWEEP = {"schedule": cp.schedule_names(), "causal": [False, True],
         "n": [4096, 8192, 16384, 32768, 65536, 131072]}
SHAPE = {"batch": 1, "heads": 16, "d": 64, "dv": 64, "dtype": "float16", "local": "q_outer",
         "block_q": 128, "block_k": 64}  # q_outer's tuned tiles at d = 64 (bench_runtime)
TINY_SWEEP = {"schedule": cp.schedule_names(), "causal": [False, True], "n": [8, 16]}
TINY_SHAPE = {"batch": 1, "heads": 4, "d": 3, "dv": 5, "dtype": "float32", "local": "q_outer",
              "block_q": 4, "block_k": 4}
REPS, WARMUP = 10, 2
CHECK_ROWS = 16  # sampled query rows per device and checked head
# A point runs when its estimated device memory is below this share of the free memory.
MEMORY_SHARE = 0.5


class Session:
    """This process's device, rank and the sizes of its process group."""

    def __init__(self):
        self.device = cp.use_device(int(os.environ.get("LOCAL_RANK", "0")))
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        if "RANK" not in os.environ:  # plain `python -m`, not torchrun: one device, P = 1
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(free_port()))
        dist.init_process_group(self.backend)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.nvlink = NvlinkCounters(self.device)

    def provenance(self) -> dict:
        nccl = torch.cuda.nccl.version() if self.backend == "nccl" else None
        return results.provenance(world_size=self.world, dist_backend=self.backend,
                                  torch=torch.__version__, nccl=nccl)


class NvlinkCounters:
    """Bytes this GPU's NVLinks carried (data payload, NVML's cumulative KiB counters over
    every link), or None with the reason where NVML or the counters are not there."""

    UINT_MAX = 0xFFFFFFFF  # NVML's scope id for "every link"

    def __init__(self, device: torch.device):
        self.handle, self.reason = None, None
        if device.type != "cuda":
            self.reason = "no GPU"
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            gpu = runtime.cuda.get_current_device()
            bus = f"{gpu.PCI_DOMAIN_ID:08x}:{gpu.PCI_BUS_ID:02x}:{gpu.PCI_DEVICE_ID:02x}.0"
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByPciBusId_v2(bus)
            self.fields = [(pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, self.UINT_MAX),
                           (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, self.UINT_MAX)]
            self.read()
        except Exception as exc:  # no pynvml, no NVLink, an old driver: not measured
            self.handle, self.reason = None, f"NVML NVLink counters unavailable: {exc!r}"

    def read(self) -> tuple[int, int]:
        values = self.nvml.nvmlDeviceGetFieldValues(self.handle, self.fields)
        for v in values:
            if v.nvmlReturn != 0:
                raise RuntimeError(f"NVML field {v.fieldId}: return code {v.nvmlReturn}")
        return tuple(1024 * int(v.value.ullVal) for v in values)

    def measure(self, call) -> dict:
        """{"sent", "received"}: the link bytes during call(), None where not measured."""
        if self.handle is None:
            return {"sent": None, "received": None, "how": self.reason}
        torch.cuda.synchronize()
        dist.barrier()
        tx0, rx0 = self.read()
        call()
        torch.cuda.synchronize()
        dist.barrier()
        tx1, rx1 = self.read()
        return {"sent": tx1 - tx0, "received": rx1 - rx0,
                "how": "NVML NVLINK_THROUGHPUT_DATA_TX/RX (KiB resolution)"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def configs(sweep: dict, shape: dict, world: int) -> list[dict]:
    return [{"schedule": schedule, "world": world, "n": n, "causal": causal,
             "overlap": overlap, **shape}
            for schedule, causal, n in itertools.product(sweep["schedule"], sweep["causal"],
                                                         sweep["n"])
            for overlap in ((True, False) if schedule == "ring" else (True,))]


def problem(config: dict) -> cp.CPProblem:
    return cp.make_problem(config["schedule"], config["world"], config["n"], config["d"],
                           config["dv"], config["batch"], config["heads"],
                           np.dtype(config["dtype"]).itemsize, config["causal"])


def memory_need(config: dict) -> int:
    """A generous estimate of one device's bytes at its peak: the global inputs every
    device draws (q, k, v, and O of the single-device call), all-gathered K/V and the
    permuted copies of them, the float32 combine: about eight global tensors."""
    p = problem(config)
    return 8 * p.bh * p.n * (p.d + p.dv) * 4


def skip_reason(config: dict, session: Session) -> str | None:
    """Why this point cannot run here (the same answer on every device), or None."""
    try:
        problem(config)
    except ValueError as exc:
        return str(exc)
    if session.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info()
        if memory_need(config) > MEMORY_SHARE * free:
            return f"memory: needs about {memory_need(config):,} bytes, {free:,} free"
    return None


class Point:
    """One point's inputs: the global q, k, v (drawn from one seed on every device), this
    device's shard, and the float64 reference on sampled rows of the first and last head."""

    def __init__(self, config: dict, session: Session):
        p = self.p = problem(config)
        self.dtype = config["dtype"]
        gen = torch.Generator(session.device).manual_seed(seed_for(
            {k: config[k] for k in ("n", "causal", "batch", "heads", "d", "dv", "dtype")}))
        dtype = getattr(torch, config["dtype"])
        self.full = [torch.randn(p.batch, p.heads, p.n, w, generator=gen,
                                 device=session.device).to(dtype) for w in (p.d, p.d, p.dv)]
        self.q, self.k, self.v = (cp.shard(x, session.rank, p.world, p.causal)
                                  for x in self.full)
        rng = np.random.default_rng(seed_for(config) + session.rank)
        self.local_rows = np.sort(rng.choice(p.n_local, min(CHECK_ROWS, p.n_local),
                                             replace=False))
        self.heads = sorted({0, p.bh - 1})
        host = [x.reshape(p.bh, p.n, -1)[self.heads].float().cpu().numpy() for x in self.full]
        rows = cp.rows_of(p, session.rank)[self.local_rows]
        self.ref = reference_rows(*host, range(len(self.heads)), rows, p.causal)
        self.v_checked = host[2]

    def error(self, out, roundings: int) -> float:
        """Relative error of this device's sampled rows; raises if out of tolerance."""
        got = out.reshape(self.p.bh, self.p.n_local, -1)[self.heads].float().cpu().numpy()
        got = got[:, self.local_rows]
        err = relative_error(got, self.ref)
        tol = tolerance(self.dtype, roundings, self.v_checked, self.ref)
        if not (np.isfinite(got).all() and err <= tol):
            raise AssertionError(f"{self.p}: relative error {err:.2e} > {tol:.2e}")
        return err


def medians(spans_per_call) -> dict[int, dict[str, float]]:
    """{step: {what: median ms over the calls}}."""
    found: dict[int, dict[str, list[float]]] = {}
    for spans in spans_per_call:
        for span in spans:
            found.setdefault(span.step, {}).setdefault(span.what, []).append(span.ms)
    return {step: {what: statistics.median(ms) for what, ms in parts.items()}
            for step, parts in sorted(found.items())}


def roundings(config: dict) -> int:
    """The local kernel's roundings of an output row, plus the combine's final one."""
    p = lo.make_problem(config["local"], n_q=config["n"], d=config["d"], dv=config["dv"],
                        block_q=config["block_q"], block_k=config["block_k"],
                        causal=config["causal"], dtype=config["dtype"])
    return lo.get_schedule(config["local"]).output_roundings(p) + 1


def measure(config: dict, point: Point, session: Session, reps: int, warmup: int) -> dict:
    """This device's values at one point (every device runs this together)."""

    def call(**kwargs):
        return cp.attention(point.q, point.k, point.v, config["schedule"],
                            causal=config["causal"], local_schedule=config["local"],
                            block_q=config["block_q"], block_k=config["block_k"],
                            overlap=config["overlap"], **kwargs)

    counted = call(count=True)
    err = point.error(counted.out, roundings(config))  # correctness gates the timing
    for _ in range(warmup):
        call()
    spans = [call(timed=True).spans for _ in range(reps)]
    return {"rank": session.rank, "rel_error": err, "model": counted.model,
            "transfers": counted.transfers, "hbm_counted": counted.counts.to_dict(),
            "hbm_model": counted.hbm_model.to_dict(), "ms": medians(spans),
            "nvlink": session.nvlink.measure(call)}


def single_device_ms(config: dict, point: Point, reps: int, warmup: int) -> float:
    """The whole problem on one device (lo.attention, the same local order and tiles)."""
    q, k, v = point.full

    def call():
        return lo.attention(q, k, v, config["local"], block_q=config["block_q"],
                            block_k=config["block_k"], causal=config["causal"], timed=True)

    for _ in range(warmup):
        call()
    return statistics.median(call().ms for _ in range(reps))


def record(per_rank: list[dict], p1_ms: float) -> dict:
    """The stored values of one point from every device's `measure`."""
    model = cp.per_step(per_rank[0]["model"])
    counted = [cp.per_step(r["transfers"]) for r in per_rank]
    steps = []
    for step in sorted(set(model) | set(per_rank[0]["ms"])):
        bytes_ = model.get(step, cp.StepBytes(0, 0))
        got = [c.get(step, cp.StepBytes(0, 0)) for c in counted]
        ms = {what: [r["ms"].get(step, {}).get(what) for r in per_rank]
              for what in per_rank[0]["ms"].get(step, {})}
        transfer_ms = ms.get("transfer")
        steps.append({
            "step": step, "model_sent": bytes_.sent, "model_received": bytes_.received,
            "counted_sent": [g.sent for g in got], "counted_received": [g.received for g in got],
            "ms": ms,
            # the received bytes over the transfer's own time (steps that do not overlap it)
            "GBps": None if transfer_ms is None or not bytes_.received else
            [bytes_.received / t / 1e6 for t in transfer_ms]})
    totals = [sum(r["ms"][s]["step"] for s in r["ms"]) for r in per_rank]
    return {
        "rel_error": max(r["rel_error"] for r in per_rank), "steps": steps,
        "hbm": [{"rank": r["rank"], "counted": r["hbm_counted"], "model": r["hbm_model"]}
                for r in per_rank],
        "nvlink": [r["nvlink"] for r in per_rank],
        "ms_per_device": totals, "ms": max(totals), "ms_single_device": p1_ms,
        "efficiency": p1_ms / (len(per_rank) * max(totals))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="where the results file goes (results/; --tiny: a temporary "
                             "folder)")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny shapes, one repetition (CPU with gloo, the simulator)")
    parser.add_argument("--lengths", type=int, nargs="+", metavar="N",
                        help="sequence lengths N (default: SWEEP's)")
    parser.add_argument("--schedules", nargs="+", choices=cp.schedule_names())
    parser.add_argument("--fresh", action="store_true", help="discard stored points")
    args = parser.parse_args(argv)
    session = Session()
    sweep_decl, shape = (TINY_SWEEP, TINY_SHAPE) if args.tiny else (SWEEP, SHAPE)
    sweep_decl = {**sweep_decl, "n": args.lengths or sweep_decl["n"],
                  "schedule": args.schedules or sweep_decl["schedule"]}
    reps, warmup = (1, 0) if args.tiny else (REPS, WARMUP)
    out = args.out or (QUICK_DIR / "results" if args.tiny else results.results_dir())
    todo = [None]
    if session.rank == 0:
        sweep = results.Sweep(f"context_parallel.{runtime.backend_name()}", out,
                              meta={"tiny": args.tiny, "shape": shape}, fresh=args.fresh,
                              provenance_fn=session.provenance)
        todo = [sweep.pending(configs(sweep_decl, shape, session.world))]
    dist.broadcast_object_list(todo, src=0)
    single: dict[tuple, float] = {}
    for config in todo[0]:
        reasons = [None] * session.world
        dist.all_gather_object(reasons, skip_reason(config, session))
        reason = next((r for r in reasons if r), None)
        if reason is not None:
            if session.rank == 0:
                sweep.add(config, {"skipped": reason})
            continue
        point = Point(config, session)
        mine = measure(config, point, session, reps, warmup)
        key = (config["n"], config["causal"])
        if session.rank == 0 and key not in single:
            single[key] = single_device_ms(config, point, reps, warmup)
        per_rank = [None] * session.world
        dist.all_gather_object(per_rank, mine)
        if session.rank == 0:
            values = record(per_rank, single[key])
            sweep.add(config, values)
            print(f"{config['schedule']:>12} overlap={config['overlap']!s:5} "
                  f"causal={config['causal']!s:5} N={config['n']:>6}: {values['ms']:.3f} ms, "
                  f"efficiency {values['efficiency']:.2f}", flush=True)
        del point
        runtime.release_memory()
    if session.rank == 0:
        print(sweep.finish())
    dist.barrier()  # no device leaves while another still talks to it
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
