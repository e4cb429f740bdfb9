"""The Python API: `attention` runs a schedule, `predict_traffic` evaluates its model.

Every argument is checked before any launch; bad input raises ValueError or TypeError whose
message starts with the argument's name and states the allowed range.

A call's checks, kernels and buffers depend only on what the inputs look like (kind, shapes,
dtypes, layout) and on the arguments, so they are worked out once per such key (`_Call`) and
kept, with the launches its first run made (`runtime.Taped`): a repeated call only allocates
its outputs, views its inputs and launches those again on them (host time per call:
results/host_overhead.json).
"""

from __future__ import annotations

import math
import numbers
import os
import warnings
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .core.ledger import Ledger, n_slots
from .core.mask import check_window
from .core.schedule import (
    MAX_BLOCK_K,
    MAX_BLOCK_Q,
    MAX_HEAD_DIM,
    PRECISIONS,
    SUPPORTED_DTYPES,
    Problem,
    Schedule,
    all_schedules,
    backward_of,
    get_schedule,
)
from .device import arrays, runtime
from .microkernel import tuning
from .microkernel.group_sum import group_sum_traffic


@dataclass
class Result:
    """What `attention` returns. `out` (and `lse`) are the same kind of array as q.

    `ms`: the kernels' time with `timed=True` (CUDA events; a host clock on the simulator),
    else None. `clamped`: block sizes larger than the problem, {name: (asked, used)}.
    A varlen call (cu_seqlens) has no one Problem: `problem` is None and `problems` holds
    each sequence's with queries, in order."""

    out: Any
    lse: Any
    counts: Ledger | None
    problem: Problem | None
    schedule: str
    backend: str
    ms: float | None = None
    clamped: dict | None = None
    problems: tuple | None = None


def _check_int(name: str, value, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: must be an integer, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < low or (high is not None and value > high):
        bound = f"{low} <= {name} <= {high}" if high is not None else f"{name} >= {low}"
        raise ValueError(f"{name}: got {value}, allowed {bound}")
    return value


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: must be True or False, got {value!r}")
    return bool(value)


def make_problem(schedule: Schedule | str, *, n_q, n_k=None, d, dv=None, batch=1, heads=1,
                 block_q, block_k, causal=False, save_lse=False, dtype="float32",
                 options=None, precision="ieee", window=(-1, -1), kv_heads=None,
                 pack_gqa=False) -> Problem:
    """Validate sizes and options for `schedule` and return the Problem they describe.
    `causal` is bottom-right aligned (query i sees keys j <= i + n_k - n_q); `window` =
    (left, right) is FlashAttention's window_size (`core.mask`).

    Block sizes larger than the problem are clamped to it (block_q to n_q, block_k to n_k):
    the traffic is the same, and the CTA is not sized for rows that do not exist.
    `kv_heads` (default `heads`): K/V heads of grouped-query attention, dividing `heads`;
    query head h reads K/V head h // (heads / kv_heads). `pack_gqa`: the packed loop order
    (`pack_gqa`): the Problem returned is the packed one the kernels run."""
    sched = get_schedule(schedule) if isinstance(schedule, str) else schedule
    n_k = n_q if n_k is None else n_k
    dv = d if dv is None else dv
    dtype = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype: {dtype} is not supported; use one of {list(SUPPORTED_DTYPES)}")
    n_q, n_k = _check_int("n", n_q, 1), _check_int("n_k", n_k, 1)
    group = _group(heads, kv_heads)
    if _check_bool("pack_gqa", pack_gqa):
        n_q, heads, causal = packed_rows(n_q, heads, group, causal, window)
        group = 1
    p = Problem(
        n_q=n_q, n_k=n_k,
        d=_check_int("d", d, 1, MAX_HEAD_DIM), dv=_check_int("dv", dv, 1, MAX_HEAD_DIM),
        batch=_check_int("batch", batch, 1), heads=_check_int("heads", heads, 1),
        block_q=min(_check_int("block_q", block_q, 1, MAX_BLOCK_Q), n_q),
        block_k=min(_check_int("block_k", block_k, 1, MAX_BLOCK_K), n_k),
        causal=_check_bool("causal", causal), save_lse=_check_bool("save_lse", save_lse),
        dtype=dtype, options=sched.options_for(options),
        precision=_check_precision(sched, precision, dtype), window=check_window(window),
        group=group,
    )
    return p


def packed_rows(n_q, heads, group, causal, window) -> tuple[int, int, bool]:
    """(n_q, heads, causal) of the packed loop order of grouped-query attention: the query
    rows of a group's `group` heads are one block of rows against its one K/V head
    (FlashAttention-3's PackGQA), so a (B, H_q, n_q, d) q is viewed, without a copy, as
    (B, H_q / group, group n_q, d) and K/V are read once per group instead of once per query
    head. A packed row no longer knows its query index, so no mask is taken, except causal
    with one query row (decode), where the row sees every key anyway."""
    if causal and n_q == 1:
        causal = False  # query 0 of 1 sees keys j <= 0 + n_k - 1: all of them
    if causal or tuple(window) != (-1, -1):
        raise ValueError(f"pack_gqa: packing a group's query rows into one block takes no "
                         f"causal mask or window (its rows lose their query index), unless "
                         f"n_q = 1 with causal; got n_q={n_q}, causal={causal}, "
                         f"window={tuple(window)}: use pack_gqa=False (per query head)")
    return group * n_q, heads // group, causal

def _group(heads, kv_heads) -> int:
    """Query heads per K/V head, or a ValueError naming both counts."""
    heads = _check_int("heads", heads, 1)
    kv_heads = heads if kv_heads is None else _check_int("kv_heads", kv_heads, 1)
    if heads % kv_heads:
        raise ValueError(f"kv_heads: grouped-query attention needs the query heads to be a "
                         f"multiple of the K/V heads, got {heads} query heads and {kv_heads} "
                         f"K/V heads")
    return heads // kv_heads


def _check_precision(sched: Schedule, precision, dtype: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision: got {precision!r}, allowed {list(PRECISIONS)}")
    if precision != "ieee" and dtype != "float32":
        raise ValueError(f"precision: {precision!r} is for float32 inputs (got {dtype}, which "
                         f"runs on tensor cores already)")
    if precision != "ieee" and not sched.TENSOR_CORES:
        with_tc = [s.name for s in all_schedules() if s.TENSOR_CORES]
        raise ValueError(f"precision: {sched.name} has no tensor-core path; {precision!r} "
                         f"runs {with_tc}")
    return precision


def memory_need(sched: Schedule, p: Problem, count: bool,
                host_inputs: bool = True) -> dict[str, int]:
    """Device memory one call allocates (bytes), by part.

    inputs: q, k, v when they are copied from the host (device arrays are already resident);
    outputs: O (input dtype), lse (float32, with save_lse); counters: int64 slots; workspace:
    what the schedule keeps in HBM besides (`Schedule.workspace_bytes`).
    """
    inputs = p.bh * (p.n_q * p.d + p.n_k * (p.d + p.dv)) * p.itemsize
    return {
        "inputs": inputs if host_inputs else 0,
        "outputs": p.bh * p.n_q * p.dv * p.itemsize + 4 * (p.bh * p.n_q if p.save_lse else 1),
        "counters": 8 * (n_slots() if count else 1),
        "workspace": sched.workspace_bytes(p),
    }


def _first_too_big(sched: Schedule, p: Problem, count: bool):
    """The first kernel of p whose shared memory exceeds its limit, or None."""
    return next((kern for kern in sched.kernels(p, count)
                 if kern.shared_bytes > kern.shared_limit), None)


def _largest_block_k(sched: Schedule, p: Problem, count: bool) -> int:
    """Largest block_k whose kernels' shared memory fits at these head dims (0 if none)."""
    lo_, hi = 0, MAX_BLOCK_K  # shared memory grows with block_k: bisect
    while lo_ < hi:
        mid = (lo_ + hi + 1) // 2
        try:
            fits = _first_too_big(sched, replace(p, block_k=mid), count) is None
        except ValueError:  # no thread layout for this block_k (a forced one, say)
            fits = False
        if fits:
            lo_ = mid
        else:
            hi = mid - 1
    return lo_


# What the Numba CUDA simulator manages (one Python thread per CUDA thread), measured on a
# 2-core machine like CI's: SIM_OPS_PER_S multiply-adds and element moves a second, plus
# SIM_CTA_S per CTA, slowed by the square root of a CTA's threads (its Python threads
# contend for the interpreter), SIM_LAUNCH_S per kernel launched; on tensor cores, where
# the products are NumPy's, SIM_TC_VISIT_S per visited tile (its barriers and loads, slowed
# by the square root of the CTA's warps) and SIM_WARP_EXCHANGE_S per warp and
# warp-collective call (emulated: intrinsics._warp_gather) instead of the multiply-adds.
# tests/test_simulator_budget.py times a few calls against it.
SIM_OPS_PER_S = 2.0e5
SIM_CTA_S = 2e-3
SIM_LAUNCH_S = 0.05
SIM_TC_VISIT_S = 0.03
SIM_WARP_EXCHANGE_S = 3.3e-3
SIMULATOR_BUDGET_S = 60.0


def simulated_seconds(sched: Schedule, p: Problem, backward: bool = False) -> float:
    """A rough estimate of how long the simulator takes for p (seconds), forward and, with
    `backward`, the backward pass too (five products to the forward's two)."""
    flops = p.bh * p.visited_pairs() * p.block_q * p.block_k * (p.d + p.dv)
    threads = sched.threads(p)
    pb = p.for_backward() if backward else p  # the backward on its own tiles
    if backward:
        flops = flops * 7 // 2
        from .core.schedule import backward_of

        threads = max(threads, backward_of(sched).threads(pb))
    moved = sched.model(p).total
    ctas = max(sched.ctas(p), p.bh * max(p.tr, p.tc, pb.tr, pb.tc))
    launches = len(sched.kernels(p, False)) + (3 if backward else 0)
    exchanges = sched.warp_exchanges(p)
    if exchanges and not backward:  # tensor cores: the products are NumPy's, per warp
        visits = p.bh * p.visited_pairs() * math.sqrt(threads / 32)
        return visits * SIM_TC_VISIT_S + exchanges * SIM_WARP_EXCHANGE_S \
            + ctas * SIM_CTA_S * math.sqrt(threads) + launches * SIM_LAUNCH_S
    return ((flops + moved) / SIM_OPS_PER_S + ctas * SIM_CTA_S) * math.sqrt(threads) \
        + launches * SIM_LAUNCH_S + exchanges * SIM_WARP_EXCHANGE_S


def check_simulator_budget(sched: Schedule, p: Problem, backward: bool = False) -> None:
    """Refuse (or, with LOOP_ORDERS_ALLOW_SLOW=1, warn about) a call the simulator would take
    longer than LOOP_ORDERS_SIMULATOR_BUDGET_S seconds (default 60) to run."""
    if runtime.SIMULATOR:
        check_simulator_seconds(simulated_seconds(sched, p, backward),
                                f"{sched.name} at {p.describe()}")


def check_simulator_seconds(estimate: float, what: str) -> None:
    """`check_simulator_budget` for an estimate of `estimate` seconds to run `what`."""
    budget = float(os.environ.get("LOOP_ORDERS_SIMULATOR_BUDGET_S", SIMULATOR_BUDGET_S))
    if estimate <= budget:
        return
    message = (f"n: the Numba CUDA simulator would take about {estimate:,.3g} s for "
               f"{what} (its budget is {budget:g} s, "
               f"LOOP_ORDERS_SIMULATOR_BUDGET_S): use a smaller n, d, batch or heads, or "
               f"run on a GPU; LOOP_ORDERS_ALLOW_SLOW=1 runs it anyway")
    if os.environ.get("LOOP_ORDERS_ALLOW_SLOW") == "1":
        warnings.warn(message, stacklevel=4)
        return
    raise ValueError(message)


def check_launch(sched: Schedule, p: Problem, count: bool, host_inputs: bool = True,
                 simulator_budget: bool = True) -> None:
    """Refuse what the kernels cannot launch: shared memory of every kernel, grid and device
    memory limits, the simulator's budget (unless `simulator_budget` is False). Every refusal
    states what the call needs and the limit, before anything is allocated."""
    sched.check(p)
    too_big = _first_too_big(sched, p, count)
    if too_big is not None:
        most = _largest_block_k(sched, p, count)
        fix = (f"use 1 <= block_k <= {most} at these head dims" if most else
               f"no block_k fits: use smaller head dims (d + dv = {p.d + p.dv})")
        raise ValueError(
            f"block_k: {sched.name} needs {too_big.shared_bytes} bytes of shared memory per "
            f"CTA in kernel {too_big.name} for block_k={p.block_k}, d={p.d}, dv={p.dv}; the "
            f"limit is {too_big.shared_limit} bytes: {fix}")
    if p.bh > runtime.MAX_GRID_Y:
        raise ValueError(f"batch: batch*heads = {p.bh} exceeds {runtime.MAX_GRID_Y}")
    parts = memory_need(sched, p, count, host_inputs)
    total = sum(parts.values())
    limit, where = runtime.memory_limit()
    if total > limit:
        detail = ", ".join(f"{name} {size:,}" for name, size in parts.items() if size)
        raise ValueError(
            f"n: {sched.name} needs {total:,} bytes of device memory for {p.describe()} "
            f"({detail}); the limit is {limit:,} bytes ({where}): use a smaller n, batch or "
            f"heads" + (", or a schedule without quadratic workspace"
                        if parts["workspace"] > limit // 2 else ""))
    if simulator_budget:
        check_simulator_budget(sched, p)


def _check_shape(name: str, x) -> tuple[int, ...]:
    shape = arrays.shape_of(x)
    if len(shape) not in (2, 4):
        raise ValueError(f"{name}: expected shape (n, d) or (batch, heads, n, d), "
                         f"got {len(shape)} dimensions {shape}")
    return shape


def _kind(name: str, x) -> arrays.Kind:
    try:
        kind = arrays.kind_of(x)
    except TypeError as exc:
        raise TypeError(f"{name}: {exc}") from None
    if not hasattr(x, "dtype") and not hasattr(x, "__cuda_array_interface__"):
        raise TypeError(f"{name}: expected an array, got {type(x).__name__}")
    return kind


# The kernels multiply scores by scale * log2(e) in float32: outside float32's normal range
# the factor would flush to 0 (every row uniform) or overflow to inf (every row NaN).
SCALE_RANGE = (float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max) / 2)


def _check_scale(scale) -> float:
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not (
            math.isfinite(scale) and scale != 0):
        raise ValueError(f"scale: must be a finite non-zero real number, got {scale!r}")
    low, high = SCALE_RANGE
    if not low <= abs(float(scale)) <= high:
        raise ValueError(f"scale: got {scale!r}; allowed {low:.3g} <= |scale| <= {high:.3g} "
                         f"(scores are scaled in float32)")
    return float(scale)


@dataclass(frozen=True)
class Inputs:
    """What a call's q, k, v look like: their kinds (q's decides the outputs' kind), batch
    and heads, sizes and dtype."""

    kinds: tuple
    batch: int
    heads: int
    n_q: int
    n_k: int
    d: int
    dv: int
    dtype: str
    q_shape: tuple
    kv_heads: int

    @property
    def kind(self) -> arrays.Kind:
        return self.kinds[0]

    @property
    def host(self) -> bool:
        """Whether any input is copied from the host."""
        return any(kind.host for kind in self.kinds)


def check_inputs(q, k, v, **extra) -> Inputs:
    """Shapes, dtypes, kinds and layouts of q, k, v (and of `extra` arrays shaped like the
    output, e.g. the backward's `do`)."""
    named = (("q", q), ("k", k), ("v", v))
    kinds = {name: _kind(name, x) for name, x in named}
    shapes = {name: _check_shape(name, x) for name, x in named}
    if len({len(s) for s in shapes.values()}) != 1:
        raise ValueError(f"q, k, v: must have the same number of dimensions, got shapes "
                         f"q{shapes['q']} k{shapes['k']} v{shapes['v']}")
    qs, ks, vs = shapes["q"], shapes["k"], shapes["v"]
    q_heads, kv_heads = (qs[1], ks[1]) if len(qs) == 4 else (1, 1)
    if not (qs[:-3] == ks[:-3] == vs[:-3] and ks[:-2] == vs[:-2] and kv_heads
            and q_heads % kv_heads == 0):
        raise ValueError(f"k, v: batch must match q's, and K/V heads must equal q's heads or "
                         f"divide them (grouped-query attention), got q{qs} k{ks} v{vs}: "
                         f"{q_heads} query heads, {kv_heads} K/V heads")
    if ks[-1] != qs[-1]:
        raise ValueError(f"k: head dim d must equal q's ({qs[-1]}), got k{ks}")
    if vs[-2] != ks[-2]:
        raise ValueError(f"v: must have as many rows as k ({ks[-2]}), got v{vs}")
    dtype = check_arrays(named, kinds, qs[:-1] + (vs[-1],), extra)
    batch, heads = qs[:2] if len(qs) == 4 else (1, 1)
    return Inputs(tuple(kinds.values()), batch, heads, qs[-2], ks[-2], qs[-1], vs[-1],
                  dtype, qs, kv_heads)


def check_arrays(named: tuple, kinds: dict, out_shape: tuple, extra: dict) -> str:
    """The checks of q, k, v (`named`: (name, array) pairs) that do not depend on their
    layout: dtypes (returned, one for all), bfloat16's frameworks, `extra` arrays shaped
    `out_shape` (their kinds added to `kinds`), C-contiguity."""
    dtypes = {name: arrays.dtype_name(x) for name, x in named}
    for name, dt in dtypes.items():
        if dt not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}: dtype {dt} is not supported; use one of "
                            f"{list(SUPPORTED_DTYPES)}")
    if len(set(dtypes.values())) != 1:
        raise TypeError(f"q, k, v: dtypes must match, got {dtypes}")
    if dtypes["q"] == "bfloat16":
        for name, kind in kinds.items():
            if not kind.name.startswith(arrays.BFLOAT16_FRAMEWORKS):
                raise TypeError(f"{name}: bfloat16 arrays are taken as torch tensors only "
                                f"(NumPy has no bfloat16), got {kind.name}")
    for name, x in extra.items():
        kinds[name] = _kind(name, x)
        if arrays.shape_of(x) != out_shape:
            raise ValueError(f"{name}: must have the output's shape {out_shape}, got "
                             f"{arrays.shape_of(x)}")
        if arrays.dtype_name(x) != dtypes["q"]:
            raise TypeError(f"{name}: dtype must match q's ({dtypes['q']}), got "
                            f"{arrays.dtype_name(x)}")
    for name, x in (*named, *extra.items()):
        if not arrays.is_c_contiguous(x):
            raise ValueError(f"{name}: device arrays must be C-contiguous; copy it first")
    return dtypes["q"]


class _Call:
    """One key's worth of `attention`: the Problem, checks done, buffers kept. Calling it
    views the inputs, allocates the outputs, launches and returns the Result."""

    def __init__(self, sched: Schedule, p: Problem, inputs: Inputs, scale: float,
                 count: bool, timed: bool, clamped: dict):
        self.sched, self.p, self.inputs, self.count, self.timed = sched, p, inputs, count, timed
        self.scale, self.clamped = scale, clamped or None
        self.out_shape = inputs.q_shape[:-1] + (p.dv,)
        self.dtype = p.kernel_dtype
        self.need = sum(memory_need(sched, p, count, inputs.host).values())
        self.recheck = self.need > runtime.memory_limit()[0] // 4  # a big call: check each time
        self._scratch: dict = {}  # stream -> (workspace, placeholder lse, placeholder counts)
        self.taped = runtime.Taped()  # the launches, replayed after the first call

    def scratch(self, stream: int, like):
        """Buffers this key's launches reuse on one stream (stream order makes that safe),
        allocated like the outputs (`like`: the caller's first input; torch's allocator for
        CUDA tensors, so that a CUDA graph's capture may make the first call on its stream)."""
        held = self._scratch.get(stream)
        if held is None:
            kind = self.inputs.kind

            def empty(shape, dtype):
                return arrays.resident(kind.empty(like, shape, dtype)[1])

            held = self._scratch[stream] = (self.sched.allocate_workspace(self.p, empty),
                                            empty((1, 1), np.float32), empty((1,), np.int64))
        return held

    def __call__(self, q, k, v) -> Result:
        p, kind = self.p, self.inputs.kind
        if self.recheck:
            check_launch(self.sched, p, self.count, self.inputs.host)
        operands = operands_of(self.inputs, q, k, v)
        stream = kind.stream(q)
        workspace, no_lse, no_counts = self.scratch(stream, q)
        out = kind.alloc(q, self.out_shape, self.dtype)
        lse = kind.alloc(q, self.out_shape[:-1], np.float32) if p.save_lse else None
        counts = runtime.device_zeros(n_slots(), np.int64) if self.count else no_counts
        slots = (*operands, out, no_lse if lse is None else lse, counts, *workspace)

        def launches():  # the kernels' views are made here: a replay needs the addresses only
            self.sched.launch(p, *kernel_views(p, self.inputs.kinds, operands),
                              kind.as_kernel(out, (p.bh, p.n_q, p.dv)),
                              no_lse if lse is None else kind.as_kernel(lse, (p.bh, p.n_q)),
                              counts, scale=self.scale, count=self.count, workspace=workspace)

        if self.timed:
            with runtime.Timer(True, stream) as timer:
                self.taped.run(stream, slots, launches, tuning.current())
            ms = timer.ms
        else:  # the host path a user's loop takes: after the first call, the tape's launches
            self.taped.run(stream, slots, launches, tuning.current())
            ms = None
        ledger = (Ledger.from_array(runtime.to_host(counts), self.sched.ledger_tensors())
                  if self.count else None)
        return Result(out=kind.finish(out), lse=kind.finish(lse) if p.save_lse else None,
                      counts=ledger, problem=p, schedule=self.sched.name,
                      backend=runtime.BACKEND, ms=ms, clamped=self.clamped)


def operands_of(inputs: Inputs, q, k, v) -> tuple:
    """q, k, v as the device arrays the kernels read (`Kind.operand`: host arrays copied)."""
    kq, kk, kv = inputs.kinds[:3]  # a gradient call's do comes fourth
    return kq.operand(q), kk.operand(k), kv.operand(v)


def kernel_views(p: Problem, kinds: tuple, operands: tuple) -> tuple:
    """The kernels' (heads, n, width) views of q, k, v's operands (`kinds`: theirs first)."""
    (kq, kk, kv), (q, k, v) = kinds[:3], operands
    return (kq.as_kernel(q, (p.bh, p.n_q, p.d)), kk.as_kernel(k, (p.bh_kv, p.n_k, p.d)),
            kv.as_kernel(v, (p.bh_kv, p.n_k, p.dv)))


_CALLS: OrderedDict = OrderedDict()
MAX_CALLS = 256  # keys kept (least recently used first out)
# Calls with cu_seqlens run through `loop_orders.varlen`, which builds on this module: it
# puts its entry points here ("attention", "attention_grad", "predict_traffic") on import.
VARLEN: dict = {}


def _hashable(value) -> tuple:
    """(type, value): True and 1, or 0.5 and np.float32(0.5), make different keys."""
    return (type(value), value)


def call_key(schedule, inputs: tuple, args: tuple, options) -> tuple | None:
    """The key of a call (what its checks and kernels depend on: its arguments, its inputs'
    signatures and the `tuning` override in effect, which chooses kernels), or None when its
    arguments cannot form one (the full checks then say what is wrong with them)."""
    try:
        frozen = None if options is None else tuple(sorted(
            (name, _hashable(value)) for name, value in options.items()))
        key = (schedule, *[(type(a), a) for a in args], frozen,  # `_hashable`, inline
               tuning.current(), *[arrays.signature(x) for x in inputs])
        hash(key)
    except (TypeError, AttributeError):
        return None
    return key


def clamped_blocks(p: Problem, block_q, block_k) -> dict:
    return {name: (asked, used) for name, asked, used in
            (("block_q", block_q, p.block_q), ("block_k", block_k, p.block_k))
            if asked is not None and asked != used}


def attention(q, k, v, schedule: str = "q_outer", block_q: int | None = None,
              block_k: int | None = None, causal: bool = False, scale: float | None = None,
              save_lse: bool = False,
              count: bool = False, options: dict | None = None, timed: bool = False,
              precision: str = "ieee", window: tuple = (-1, -1),
              pack_gqa: bool = False, cu_seqlens_q=None, cu_seqlens_k=None) -> Result:
    """Exact attention O = softmax(scale Q K^T) V, executed in the loop order `schedule`.

    q: (batch, heads, n_q, d) or (n_q, d); k: same with n_k rows; v: same with dv columns.
    k and v may have fewer heads than q (grouped-query and multi-query attention): H_kv
    dividing H_q, query head h reading K/V head h // (H_q / H_kv). Each query head then
    reads its K/V head (K/V read H_q / H_kv times), or with `pack_gqa` the query rows of a
    group's heads run as one block against it (K/V read once per group; no mask but causal
    decode, `packed_rows`).
    `block_q` x `block_k` are the tiles (Br x Bc): left out (None), 64 x 64, or where those do
    not fit in shared memory the first of `DEFAULT_TILES` that does, and on a Hopper GPU with
    16-bit inputs first the tiles the schedule was measured fastest with there for the head
    dim, mask and N (`Schedule.fast_tiles`: q_outer's HOPPER_TILES, 128 x 64 or 128 x 128 at
    d = 64 and 128); tiles named that do not fit are refused. Tiles larger than the problem
    are clamped to it (`Result.clamped`).
    float32, float16 or bfloat16 (torch tensors: NumPy has no bfloat16); accumulation is
    float32, 16-bit inputs run on tensor cores. Outputs are the same kind of array as q
    (NumPy, torch, CuPy, Numba; README "Arrays in, arrays out"); with torch or CuPy inputs the
    kernels run on the framework's current stream. With `count`, the counted build of the
    kernels runs and `Result.counts` holds the measured Ledger. `options` are the schedule's
    (`lo.schedule_options(schedule)`); `timed` fills `Result.ms`. `precision="tf32"` runs
    float32 inputs on TF32 tensor cores (10 mantissa bits per operand: errors near 1e-3
    instead of 1e-6; the schedules with TENSOR_CORES) instead of exact float32 FMA, and
    `precision="tf32x3"` on them with each operand split into a TF32 head and tail (3xTF32,
    three products: about float32's accuracy, as SDPA's float32 efficient backend does).
    `causal` is bottom-right aligned: with n_q != n_k query i sees keys j <= i + n_k - n_q.
    `window=(left, right)` (FlashAttention's window_size, -1 unbounded) lets query i see
    keys i + n_k - n_q - left <= j <= i + n_k - n_q + right; with causal, right is 0. K/V
    blocks no row of a query block sees are skipped (`core.mask`). A row that sees no key
    gets output 0 and lse -inf.

    Packed variable-length batches (FlashAttention's varlen): `cu_seqlens_q`, `cu_seqlens_k`
    int32 prefix sums of length batch + 1, q (total_q, heads, d), k and v (total_k, kv_heads,
    .); out (total_q, heads, dv), lse (heads, total_q). Each sequence runs as its own problem
    on views of the packed arrays, masks per sequence (`loop_orders.varlen`).

    Numerics (README "Limits and numerics"): the running row max is subtracted before every
    exponential, so huge scores stay finite. Non-finite inputs reach exactly the outputs that
    depend on them: NaN in q[r] -> row r; in k[c] -> every row attending key c; in v[c, x] ->
    column x of those rows. Masked keys (causal, window) never touch the output. Everything that
    cannot run (shapes, dtypes, block sizes, options, shared or device memory, the
    simulator's budget) is refused with a ValueError/TypeError before any copy or launch.
    """
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        return VARLEN["attention"](q, k, v, cu_seqlens_q, cu_seqlens_k, schedule, block_q,
                                   block_k, causal, scale, save_lse, count, options, timed,
                                   precision, window, pack_gqa)
    key = call_key(schedule, (q, k, v), (block_q, block_k, causal, scale, save_lse, count,
                                         timed, precision, window, pack_gqa), options)
    call = _CALLS.get(key) if key is not None else None
    if call is None:
        call = _prepare(q, k, v, schedule, block_q, block_k, causal, scale, save_lse, count,
                        options, timed, precision, window, pack_gqa)
        if key is not None:
            _CALLS[key] = call
            if len(_CALLS) > MAX_CALLS:
                _CALLS.popitem(last=False)
    else:
        _CALLS.move_to_end(key)
    return call(q, k, v)


def _prepare(q, k, v, schedule, block_q, block_k, causal, scale, save_lse, count, options,
             timed, precision, window=(-1, -1), pack_gqa=False) -> _Call:
    """Every check of `attention`, in the order the error messages promise."""
    sched = get_schedule(schedule)
    inp = check_inputs(q, k, v)

    def problem(bq: int, bk: int) -> Problem:
        return make_problem(sched, n_q=inp.n_q, n_k=inp.n_k, d=inp.d, dv=inp.dv,
                            batch=inp.batch, heads=inp.heads, block_q=bq, block_k=bk,
                            causal=causal, save_lse=save_lse, dtype=inp.dtype, options=options,
                            precision=precision, window=window, kv_heads=inp.kv_heads,
                            pack_gqa=pack_gqa)

    p = problem(*named_tiles(block_q, block_k))
    scale = _check_scale(1.0 / math.sqrt(inp.d) if scale is None else scale)
    count = _check_bool("count", count)
    timed = _check_bool("timed", timed)
    p = attention_tiles(sched, p, problem, block_q, block_k, count, inp.host)
    return _Call(sched, p, inp, scale, count, timed, clamped_blocks(p, block_q, block_k))


# Tiles tried in turn when the caller names none: the first whose kernels fit in shared memory
# runs (a gradient call chooses its forward's and its backward's apart: `api_grad.grad_tiles`).
# 64 x 64 fits every schedule up to d = 128; wide heads (d >= 160) in float32, and dense's
# backward, need smaller ones.
DEFAULT_TILES = ((64, 64), (64, 32), (32, 32), (32, 16), (16, 16))


def named_tiles(block_q: int | None, block_k: int | None) -> tuple[int, int]:
    """The tiles a call asks for: those named, 64 for each the caller left out (None)."""
    return (DEFAULT_TILES[0][0] if block_q is None else block_q,
            DEFAULT_TILES[0][1] if block_k is None else block_k)


def fitting_tiles(p: Problem, problem, block_q, block_k, check, first=None) -> Problem:
    """p (its tiles `named_tiles(block_q, block_k)`) after `check(p)`; when the caller named
    neither tile, the first Problem of `first` (a schedule's `fast_tiles`, if any) and then
    `DEFAULT_TILES` (`problem(block_q, block_k)` makes one) that `check` accepts, where only
    refusals of the tiles (a ValueError naming block_q or block_k: shared memory) move on to
    the next; if none fits, the first default's refusal."""
    if block_q is not None or block_k is not None:
        check(p)
        return p
    refused = None
    for tiles in ((first,) if first else ()) + DEFAULT_TILES:
        candidate = p if tiles == DEFAULT_TILES[0] else problem(*tiles)
        try:
            check(candidate)
            return candidate
        except ValueError as exc:
            if not str(exc).startswith(("block_q:", "block_k:")):
                raise
            if tiles != first:
                refused = refused or exc
    raise refused


def attention_tiles(sched: Schedule, p: Problem, problem, block_q, block_k, count: bool,
                    host: bool, simulator_budget: bool = True, fast: bool = True) -> Problem:
    """p on the tiles `lo.attention` runs: `fitting_tiles` over `check_launch` (its
    `simulator_budget`), trying first the schedule's `fast_tiles` unless `fast` is False."""
    return fitting_tiles(p, problem, block_q, block_k, lambda c: check_launch(
        sched, c, count, host_inputs=host, simulator_budget=simulator_budget),
        sched.fast_tiles(p) if fast else None)


def predict_traffic(schedule: str, n: int | None, d: int, dv: int | None = None, batch: int = 1,
                    heads: int = 1, block_q: int = 64, block_k: int = 64, causal: bool = False,
                    save_lse: bool = False, n_k: int | None = None, options: dict | None = None,
                    backward: bool = False, dtype: str = "float32",
                    precision: str = "ieee", window: tuple = (-1, -1),
                    kv_heads: int | None = None, pack_gqa: bool = False,
                    cu_seqlens_q=None, cu_seqlens_k=None) -> Ledger:
    """The schedule's exact traffic model (elements moved through HBM) for these sizes:
    the forward pass, or with `backward` the backward pass alone. The elements do not depend
    on dtype or precision (checked as a call's would be); bytes do (`Ledger.bytes`).
    `kv_heads` and `pack_gqa` as for `attention` (grouped-query attention). With
    `cu_seqlens_q` and `cu_seqlens_k` (a varlen batch; n and n_k None, batch 1) the sum of
    each sequence's model."""
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        if n is not None or n_k is not None or batch != 1:
            raise ValueError("n: with cu_seqlens the lengths come from them; leave n, n_k "
                             "and batch out")
        return VARLEN["predict_traffic"](
            schedule, cu_seqlens_q, cu_seqlens_k, d=d, dv=dv, heads=heads, kv_heads=kv_heads,
            block_q=block_q, block_k=block_k, backward=backward, causal=causal,
            save_lse=save_lse, options=options, dtype=dtype, precision=precision,
            window=window, pack_gqa=pack_gqa)
    sched = get_schedule(schedule)
    p = make_problem(sched, n_q=n, n_k=n_k, d=d, dv=dv, batch=batch, heads=heads,
                     block_q=block_q, block_k=block_k, causal=causal, save_lse=save_lse,
                     options=options, dtype=dtype, precision=precision, window=window,
                     kv_heads=kv_heads, pack_gqa=pack_gqa)
    if backward:
        return backward_traffic(backward_of(sched), p)
    return sched.model(p)


def backward_traffic(bwd, p: Problem) -> Ledger:
    """What the backward pass of p moves: its loop order's model (on `Problem.for_backward`'s
    tiles), plus (grouped-query attention per query head) the sums of dK and dV over each
    K/V head's query heads."""
    return bwd.model(p.for_backward()) + group_sum_traffic(p)
