"""Context parallelism: exact attention over P devices, each holding N/P rows of the sequence.

    import loop_orders.context_parallel as cp          # needs torch (torch.distributed)
    cp.schedule_names()                                # ['ring', 'allgather_kv', 'ulysses']
    res = cp.attention(q_r, k_r, v_r, schedule="ring", causal=True, count=True)
    res.out, res.lse                                   # this device's rows of O (and lse)
    res.transfers == res.model                         # counted interconnect bytes = model
    res.counts == res.hbm_model                        # counted HBM (our kernels) = model
    cp.interconnect_model("ulysses", world=8, n=65536, d=64, heads=16, itemsize=2)
    cp.shard(x, rank, world, causal), cp.unshard(shards, causal)   # the layouts

One process per device, started by torchrun, in a torch.distributed process group (NCCL on
GPUs, gloo on CPU); q_r, k_r, v_r are this device's shard (batch, heads, N/P, d) of the
sequence (`shard`: contiguous, or zig-zag when causal; layout.py), torch tensors on its
device. The local work runs our own kernels (`lo.attention`, any registered schedule:
`local_schedule`, with its block sizes and options). The schedules, one module each with its
loop nest and its traffic models beside the code:

    ring          K/V shards travel around the ring, overlapped with the local kernels
    allgather_kv  all-gather K and V, then one local pass
    ulysses       all-to-all from sequence- to head-sharded, attention, and back

Counted: the bytes of every transfer, per step and tensor, where it is issued
(`transport.Link`); the HBM elements our kernels move (their counters, summed over the local
calls). Modelled exactly: `interconnect_model` (a function of P, N, d, dv, batch, heads,
bytes per element, causal, save_lse) and `hbm_model` (the local schedule's model summed over
the local calls, per rank). Timed with `timed=True`: `Result.spans` (transport.Span), CUDA
events on GPUs, the host clock on CPU. Every check (shapes, divisibility, each local call's
launch limits) runs before the first transfer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import api
from ..api import _check_bool, _check_scale  # the single-device API's checks and messages
from ..core.ledger import Ledger
from ..core.schedule import schedule_names as local_schedules
from . import allgather_kv, ring, ulysses
from .layout import SCHEDULES, CPProblem, make_problem, rows_of, shard, unshard
from .local import Device, LocalAttention
from .transport import Link, Span, StepBytes, Timeline, Transfer, per_step

_MODULES = {"ring": ring, "allgather_kv": allgather_kv, "ulysses": ulysses}

__all__ = [
    "CPProblem", "Result", "Span", "StepBytes", "Transfer", "attention", "hbm_model",
    "interconnect_model", "make_problem", "per_step", "rows_of", "schedule_names", "shard",
    "unshard", "use_device",
]


def schedule_names() -> list[str]:
    return list(SCHEDULES)


@dataclass
class Result:
    """What `attention` returns on each device.

    out, lse: this device's rows (its shard's layout); lse float32, with save_lse.
    counts: the HBM Ledger our kernels counted, summed over the local calls (count=True).
    hbm_model: its exact model (`hbm_model`). transfers: the interconnect bytes counted per
    (step, tensor); model: `interconnect_model`'s. spans: with timed=True, where the time
    went per step (transport.Span), else None."""

    out: torch.Tensor
    lse: torch.Tensor | None
    counts: Ledger | None
    hbm_model: Ledger
    transfers: tuple[Transfer, ...]
    model: tuple[Transfer, ...]
    spans: tuple[Span, ...] | None
    problem: CPProblem
    rank: int


def _check_tensors(q, k, v) -> api.Inputs:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: context-parallel attention takes torch tensors, got "
                            f"{type(x).__name__}")
    inp = api.check_inputs(q, k, v)
    if len(inp.q_shape) != 4:
        raise ValueError(f"q: expected this device's shard (batch, heads, n_local, d), got "
                         f"shape {tuple(q.shape)}")
    if inp.n_k != inp.n_q:
        raise ValueError(f"k: must hold as many rows as q (this device's shard of the same "
                         f"sequence), got {inp.n_k} and {inp.n_q}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v: must be on one device, got {q.device}, {k.device}, "
                         f"{v.device}")
    return inp


def attention(q, k, v, schedule: str = "ring", *, group=None, causal: bool = False,
              scale: float | None = None, save_lse: bool = False, count: bool = False,
              timed: bool = False, local_schedule: str = "q_outer", block_q: int = 64,
              block_k: int = 64, options: dict | None = None, overlap: bool = True) -> Result:
    """Exact attention O = softmax(scale Q K^T) V over the devices of `group`, in the
    context-parallel order `schedule`; every device calls it with its shard.

    q, k, v: this device's (batch, heads, N/P, d) rows (v: dv columns) in the layout of
    `shard` (zig-zag when causal), torch tensors, float32, float16 or bfloat16. group: a
    torch.distributed process group (None: the default one; a single device when
    torch.distributed is not initialised). local_schedule, block_q, block_k, options: the
    loop order of the local kernels (`lo.attention`). overlap (ring only): issue each
    transfer before the compute it overlaps (False: wait for it first). count, timed: fill
    Result.counts, Result.spans. Bad input raises ValueError/TypeError before any transfer.
    """
    inp = _check_tensors(q, k, v)
    link = Link(group)
    p = make_problem(schedule, link.world, inp.n_q * link.world, inp.d, inp.dv, inp.batch,
                     inp.heads, q.element_size(), causal, save_lse)
    if not _check_bool("overlap", overlap) and schedule != "ring":
        raise ValueError(f"overlap: only ring overlaps its transfers with compute; "
                         f"{schedule} has overlap=True only")
    if local_schedule not in local_schedules():
        raise ValueError(f"local_schedule: unknown schedule {local_schedule!r}; known "
                         f"schedules: {', '.join(local_schedules())}")
    scale = _check_scale(1.0 / math.sqrt(inp.d) if scale is None else scale)
    local = LocalAttention(local_schedule, block_q, block_k, options, scale,
                           _check_bool("count", count))
    shapes = _MODULES[schedule].local_shapes(p, link.rank)
    local.check(p, shapes, inp.dtype, host_inputs=q.device.type == "cpu")
    dev = Device(p, link, local, Timeline(_check_bool("timed", timed), q.device),
                 overlap)
    part = _MODULES[schedule].run(dev, q, k, v)
    return Result(out=part.out, lse=part.lse if p.save_lse else None, counts=local.counts,
                  hbm_model=local.model(p, shapes, inp.dtype), transfers=link.transfers(),
                  model=_MODULES[schedule].transfers(p), spans=dev.timeline.spans(),
                  problem=p, rank=link.rank)


def interconnect_model(schedule: str, world: int, n: int, d: int, dv: int | None = None,
                       batch: int = 1, heads: int = 1, itemsize: int = 4,
                       causal: bool = False, save_lse: bool = False) -> tuple[Transfer, ...]:
    """The exact bytes one device sends and receives, per step and tensor (the same on
    every device): each schedule module's `transfers`."""
    p = make_problem(schedule, world, n, d, dv, batch, heads, itemsize, causal, save_lse)
    return _MODULES[schedule].transfers(p)


def hbm_model(schedule: str, rank: int, world: int, n: int, d: int, dv: int | None = None,
              batch: int = 1, heads: int = 1, causal: bool = False, save_lse: bool = False,
              local_schedule: str = "q_outer", block_q: int = 64, block_k: int = 64,
              options: dict | None = None, dtype: str = "float32") -> Ledger:
    """The exact HBM elements device `rank`'s kernels move: the local schedule's model
    summed over the schedule's local calls (`local_shapes`)."""
    p = make_problem(schedule, world, n, d, dv, batch, heads, 4, causal, save_lse)
    if not 0 <= rank < world:
        raise ValueError(f"rank: got {rank}, allowed 0 <= rank < world = {world}")
    local = LocalAttention(local_schedule, block_q, block_k, options)
    return local.model(p, _MODULES[schedule].local_shapes(p, rank), dtype)


def use_device(local_rank: int) -> torch.device:
    """This process's device: GPU `local_rank` for torch and for our kernels (Numba) on a
    GPU machine, the CPU under the simulator. Call it once, before the first kernel
    (torchrun starts one process per GPU and sets LOCAL_RANK)."""
    from ..device import runtime

    if runtime.SIMULATOR:
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    runtime.cuda.select_device(local_rank)
    return torch.device("cuda", local_rank)
