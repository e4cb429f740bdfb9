"""`attention_grad`: a schedule's forward pass, then its backward loop order, with counters.

    g = lo.attention_grad(q, k, v, do, schedule="q_outer", options={"dq": "atomic"}, count=True)
    g.out, g.lse, g.dq, g.dk, g.dv        # the same kind of array as q (lse float32)
    g.counts_forward, g.counts_backward   # Ledgers with count=True

The forward runs with save_lse and keeps what its backward reads (lse; dense's P, kv_outer's
l and m, its workspace), allocated per call (the torch op saves them between the passes).
Every argument is checked before any launch, as `attention`'s are.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from .api import (
    MAX_CALLS,
    VARLEN,
    Inputs,
    _check_bool,
    _check_scale,
    attention_tiles,
    call_key,
    check_inputs,
    check_launch,
    check_simulator_budget,
    clamped_blocks,
    fitting_tiles,
    kernel_views,
    make_problem,
    memory_need,
    named_tiles,
    operands_of,
)
from .core.backward_schedule import BackwardSchedule
from .core.ledger import Ledger, n_slots
from .core.schedule import Problem, Schedule, backward_of, get_schedule
from .device import arrays, runtime
from .microkernel import tuning
from .microkernel.group_sum import launch_group_sums
from .warm import Job, compile_ahead


@dataclass
class GradResult:
    """What `attention_grad` returns: the forward's out and lse, the gradients, and the
    counted ledgers of each pass (count=True). Varlen: `problem` None, `problems` each
    sequence's (as `Result`'s)."""

    out: Any
    lse: Any
    dq: Any
    dk: Any
    dv: Any
    counts_forward: Ledger | None
    counts_backward: Ledger | None
    problem: Problem
    schedule: str
    backward: str
    backend: str
    ms: float | None = None
    clamped: dict | None = None
    problems: tuple | None = None


@dataclass
class Saved:
    """What a forward leaves for its backward: O, lse and the forward's workspace, O and lse
    as device arrays of the caller's kind (`finish` hands them over), the workspace as the
    kernels see it (`workspace`) and as the caller's arrays (`kept`)."""

    out: Any
    lse: Any
    workspace: tuple
    counts: Ledger | None
    kept: tuple = ()


def backward_memory(bwd: BackwardSchedule, p: Problem, count: bool,
                    host_do: bool) -> dict[str, int]:
    """Device memory the backward pass adds to the forward's (bytes), by part."""
    grads = p.bh * (p.n_q * p.d + p.n_k * (p.d + p.dv)) * p.itemsize
    return {"do": p.bh * p.n_q * p.dv * p.itemsize if host_do else 0, "gradients": grads,
            "counters": 8 * n_slots() if count else 0, "workspace": bwd.workspace_bytes(p)}


def check_backward(sched: Schedule, bwd: BackwardSchedule, p: Problem, count: bool,
                   host: bool, simulator_budget: bool = True) -> None:
    """The backward's own refusals (on `Problem.for_backward`'s tiles): its checks, every
    kernel's shared memory, device memory of both passes together, the simulator's budget
    (unless `simulator_budget` is False)."""
    pb = p.for_backward()
    bwd.check_kernels(pb, count)
    backward = backward_memory(bwd, pb, count, host)
    parts = {**{f"forward {k}": v for k, v in memory_need(sched, p, count, host).items()},
             **{f"backward {k}": v for k, v in backward.items()}}
    total = sum(parts.values())
    limit, where = runtime.memory_limit()
    if total > limit:
        detail = ", ".join(f"{name} {size:,}" for name, size in parts.items() if size)
        raise ValueError(f"n: {sched.name} forward + backward needs {total:,} bytes of device "
                         f"memory for {p.describe()} ({detail}); the limit is {limit:,} bytes "
                         f"({where}): use a smaller n, batch or heads")
    if simulator_budget:
        check_simulator_budget(sched, p, backward=True)


class GradCall:
    """One key's worth of `attention_grad` (and of the torch op): Problem, checks, kernels.
    `forward` runs the forward and keeps what the backward needs; `backward` runs the
    backward schedule on it."""

    def __init__(self, sched: Schedule, bwd: BackwardSchedule, p: Problem, inputs: Inputs,
                 scale: float, count: bool, timed: bool, clamped: dict):
        self.sched, self.bwd, self.p, self.inputs = sched, bwd, p, inputs
        self.p_backward = p.for_backward()  # the backward's tiles (`grad_tiles`)
        self.scale, self.count, self.timed, self.clamped = scale, count, timed, clamped or None
        self.out_shape = inputs.q_shape[:-1] + (p.dv,)
        self.dtype = p.kernel_dtype
        # each pass's launches, replayed after the first call (`runtime.Taped`)
        self.taped_forward, self.taped_backward = runtime.Taped(), runtime.Taped()
        self._placeholder = None  # uncounted calls' counters (`_counts`)

    def _empty(self, like):
        kind = self.inputs.kind
        return lambda shape, dtype: kind.empty(like, shape, dtype)[1]

    def _workspace(self, like) -> tuple[tuple, tuple]:
        """The forward's workspace allocated as the caller's kind of array: (as the kernels
        see it, as the caller's arrays) — the torch op returns the latter for its backward."""
        kind, callers = self.inputs.kind, {}

        def empty(shape, dtype):
            caller, dev = kind.empty(like, shape, dtype)
            callers[id(dev)] = caller
            return dev

        workspace = self.sched.allocate_workspace(self.p, empty)
        return workspace, tuple(callers[id(dev)] for dev in workspace)

    def _counts(self, like):
        """Zeroed counters when counting, else a placeholder the kernels never touch, this
        key's one, allocated like the outputs at its first call (torch's allocator for CUDA
        tensors, so that a CUDA graph can capture the call)."""
        if self.count:
            return runtime.device_zeros(n_slots(), np.int64)
        if self._placeholder is None:
            self._placeholder = self.inputs.kind.empty(like, (1,), np.int64)[1]
        return self._placeholder

    def _ledger(self, counts, sched) -> Ledger | None:
        """The counted ledger over `sched`'s tensors (counting calls only)."""
        if not self.count:
            return None
        return Ledger.from_array(runtime.to_host(counts), sched.ledger_tensors())

    def forward(self, q, k, v) -> Saved:
        p, kind = self.p, self.inputs.kind
        operands = operands_of(self.inputs, q, k, v)
        out = kind.alloc(q, self.out_shape, self.dtype)
        lse = kind.alloc(q, self.out_shape[:-1], np.float32)
        workspace, kept = self._workspace(q)
        counts = self._counts(q)

        def launches():  # the kernels' views are made here: a replay needs the addresses only
            self.sched.launch(p, *kernel_views(p, self.inputs.kinds, operands),
                              kind.as_kernel(out, (p.bh, p.n_q, p.dv)),
                              kind.as_kernel(lse, (p.bh, p.n_q)), counts, scale=self.scale,
                              count=self.count, workspace=workspace)

        self.taped_forward.run(kind.stream(q), (*operands, out, lse, counts, *workspace),
                               launches, tuning.current())
        return Saved(out, lse, workspace, self._ledger(counts, self.sched), kept)

    def resume(self, out, lse, kept) -> Saved:
        """A forward's Saved rebuilt from the caller's arrays it returned (out, lse and
        `Saved.kept`): how the torch op's backward, a separate op, picks up its forward."""
        kind = self.inputs.kind
        return Saved(kind.operand(out), kind.operand(lse), tuple(kind.view(x) for x in kept),
                     None, tuple(kept))

    def backward(self, saved: Saved, q, k, v, do):
        """(dq, dk, dv, backward ledger) as the caller's kind of array."""
        p, kind, inputs = self.p_backward, self.inputs.kind, self.inputs
        operands = operands_of(inputs, q, k, v)
        do_kind = arrays.kind_of(do)
        do = do_kind.operand(do)
        kv_lead = inputs.q_shape[:-3] + (inputs.kv_heads,) if len(inputs.q_shape) == 4 else ()
        grads = [kind.alloc(q, shape, self.dtype) for shape in
                 (inputs.q_shape, kv_lead + (p.n_k, p.d), kv_lead + (p.n_k, p.dv))]
        # per query head under grouping: each head's dK, dV parts, summed below
        parts = [kind.alloc(q, (p.bh, p.n_k, width), self.dtype) for width in (p.d, p.dv)] \
            if p.group > 1 else []
        counts = self._counts(q)
        workspace = self.bwd.allocate_workspace(p, self._empty(q))

        def launches():  # the kernels' views are made here: a replay needs the addresses only
            dq, dk, dv = (kind.as_kernel(g, shape) for g, shape in zip(grads, (
                (p.bh, p.n_q, p.d), (p.bh_kv, p.n_k, p.d), (p.bh_kv, p.n_k, p.dv)), strict=True))
            dk_parts, dv_parts = (kind.as_kernel(g, (p.bh, p.n_k, width)) for g, width in
                                  zip(parts, (p.d, p.dv), strict=True)) if parts else (dk, dv)
            self.bwd.launch(p, *kernel_views(p, inputs.kinds, operands),
                            kind.as_kernel(saved.out, (p.bh, p.n_q, p.dv)),
                            do_kind.as_kernel(do, (p.bh, p.n_q, p.dv)),
                            kind.as_kernel(saved.lse, (p.bh, p.n_q)), dq, dk_parts, dv_parts,
                            counts, scale=self.scale, count=self.count,
                            forward_workspace=saved.workspace, workspace=workspace)
            if p.group > 1:
                launch_group_sums(p, dk_parts, dv_parts, dk, dv, counts, self.count)

        slots = (*operands, saved.out, do, saved.lse, *grads, counts, *saved.workspace,
                 *workspace, *parts)
        self.taped_backward.run(kind.stream(q), slots, launches, tuning.current())
        dq, dk, dv = (kind.finish(g) for g in grads)
        return dq, dk, dv, self._ledger(counts, self.bwd)

    def __call__(self, q, k, v, do) -> GradResult:
        with runtime.Timer(self.timed, self.inputs.kind.stream(q)) as timer:
            saved = self.forward(q, k, v)
            dq, dk, dv, counts_backward = self.backward(saved, q, k, v, do)
        kind = self.inputs.kind
        return GradResult(out=kind.finish(saved.out), lse=kind.finish(saved.lse), dq=dq, dk=dk,
                          dv=dv, counts_forward=saved.counts, counts_backward=counts_backward,
                          problem=self.p, schedule=self.sched.name, backward=self.bwd.name,
                          backend=runtime.backend_name(), ms=timer.ms, clamped=self.clamped)


_CALLS: OrderedDict = OrderedDict()


def grad_problem(sched, n_q, n_k, d, dv, batch, heads, kv_heads, dtype, causal, options,
                 window, pack_gqa, precision="ieee"):
    """problem(block_q, block_k): the Problem of a gradient call (lse saved) with those
    tiles."""
    def problem(block_q: int, block_k: int) -> Problem:
        return make_problem(sched, n_q=n_q, n_k=n_k, d=d, dv=dv, batch=batch, heads=heads,
                            block_q=block_q, block_k=block_k, causal=causal, save_lse=True,
                            dtype=dtype, options=options, window=window, kv_heads=kv_heads,
                            pack_gqa=pack_gqa, precision=precision)

    return problem


def check_grad_launch(sched, bwd, p: Problem, count: bool, host: bool,
                      simulator_budget: bool = True) -> None:
    """A gradient call's launch checks: the forward's (no simulator budget of its own) and
    the backward's (with both passes' simulator budget unless `simulator_budget` is
    False)."""
    check_launch(sched, p, count, host_inputs=host, simulator_budget=False)
    check_backward(sched, bwd, p, count, host, simulator_budget)


def grad_tiles(sched, bwd, p: Problem, problem, block_q, block_k, count: bool, host: bool,
               simulator_budget: bool = True, forward_fast: bool = True) -> Problem:
    """The checked Problem of a gradient call: p (its tiles `named_tiles(block_q, block_k)`;
    `problem(block_q, block_k)` makes others). Tiles named: both passes run them. None
    named: each pass its own, as `fitting_tiles` chooses them for that pass alone, trying
    first the tiles it was measured fastest with (the forward's `Schedule.fast_tiles`, the
    backward's `BackwardSchedule.fast_tiles`); the backward's go in `Problem.backward_tiles`
    where they differ (a backward reads the forward's O and lse, and a workspace whose
    shape no tile sets). `simulator_budget` as for `check_grad_launch`; `forward_fast`
    False: the forward does not try its fast tiles (varlen, whose `lo.attention` does not)."""
    if block_q is None and block_k is None:
        forward = attention_tiles(sched, p, problem, None, None, count, host,
                                  simulator_budget=False, fast=forward_fast)
        backward = fitting_tiles(p, problem, None, None, lambda c: check_backward(
            sched, bwd, c, count, host, simulator_budget=False), bwd.fast_tiles(p))
        p = forward.with_backward_tiles(backward.block_q, backward.block_k)
    check_grad_launch(sched, bwd, p, count, host, simulator_budget)
    return p


def prepare_grad(q, k, v, do, schedule, block_q, block_k, causal, scale, options, count,
                 timed, window=(-1, -1), pack_gqa=False, precision="ieee") -> GradCall:
    """Every check of `attention_grad`, in the order the error messages promise (a call
    key seen before skips them). `do` None: the caller gives the output's gradient later,
    of the output's shape and dtype (the torch op: autograd guarantees it)."""
    arrays_in = (q, k, v) if do is None else (q, k, v, do)
    key = call_key(schedule, arrays_in, (block_q, block_k, causal, scale, count, timed, window,
                                         pack_gqa, precision), options)
    if key is not None:
        call = _CALLS.get(key)
        if call is not None:
            _CALLS.move_to_end(key)
            return call
    sched = get_schedule(schedule)
    bwd = backward_of(sched)
    inp = check_inputs(q, k, v, **({} if do is None else {"do": do}))
    problem = grad_problem(sched, inp.n_q, inp.n_k, inp.d, inp.dv, inp.batch, inp.heads,
                           inp.kv_heads, inp.dtype, causal, options, window, pack_gqa,
                           precision)
    p = problem(*named_tiles(block_q, block_k))
    scale = _check_scale(1.0 / math.sqrt(inp.d) if scale is None else scale)
    count, timed = _check_bool("count", count), _check_bool("timed", timed)
    p = grad_tiles(sched, bwd, p, problem, block_q, block_k, count, inp.host)
    call = GradCall(sched, bwd, p, inp, scale, count, timed, clamped_blocks(p, block_q,
                                                                            block_k))
    # a new shape: its forward and backward kernels compile at once, not pass by pass
    compile_ahead(Job(sched.name, p, count, backward=True))
    if key is not None:
        _CALLS[key] = call
        if len(_CALLS) > MAX_CALLS:
            _CALLS.popitem(last=False)
    return call


def attention_grad(q, k, v, do, schedule: str = "q_outer", block_q: int | None = None,
                   block_k: int | None = None, causal: bool = False, scale: float | None = None,
                   options: dict | None = None, count: bool = False,
                   timed: bool = False, window: tuple = (-1, -1),
                   pack_gqa: bool = False, cu_seqlens_q=None, cu_seqlens_k=None,
                   precision: str = "ieee") -> GradResult:
    """Attention's forward pass in the loop order `schedule`, then the gradients of
    sum(O * do) with respect to q, k, v in its backward loop order (`backward_schedule_names`;
    options such as {"dq": "separate"} choose among a backward's variants).

    q, k, v as for `attention`; do: the output's shape and dtype. Outputs are the same kind of
    array as q; `lse` is float32. With `count`, the counted kernels run and the ledgers of
    each pass are returned (the forward's includes what it saves for the backward).
    `causal` and `window` as for `attention`; a row that sees no key gets zero gradients.
    Tiles named run both passes; none named, each pass runs the tiles it chooses
    (`grad_tiles`: the backward's in `problem.backward_tiles` where they differ, its Problem
    `problem.for_backward()`; varlen: each sequence's, `problems`). With fewer K/V heads
    than query heads (grouped-query attention) dk and dv have k's and v's heads; `pack_gqa`
    and `cu_seqlens_q`, `cu_seqlens_k` (varlen: do packed like the output, dq, dk, dv like
    q, k, v) as for `attention`. `precision` ("tf32", "tf32x3":
    float32 inputs) as for `attention`, for both passes: the backward's five products on TF32
    tensor cores (3xTF32: about float32's accuracy) instead of float32 FMA.
    """
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        return VARLEN["attention_grad"](q, k, v, do, cu_seqlens_q, cu_seqlens_k, schedule,
                                        block_q, block_k, causal, scale, options, count,
                                        timed, window, pack_gqa, precision)
    call = prepare_grad(q, k, v, do, schedule, block_q, block_k, causal, scale, options,
                        count, timed, window, pack_gqa, precision)
    return call(q, k, v, do)
