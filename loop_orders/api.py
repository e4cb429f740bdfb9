"""The Python API: `attention` runs a schedule, `predict_traffic` evaluates its model.

Every argument is checked before any launch; bad input raises ValueError or TypeError whose
message starts with the argument's name and states the allowed range.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from . import runtime
from .ledger import N_SLOTS, Ledger
from .schedule import (
    MAX_BLOCK_K,
    MAX_BLOCK_Q,
    MAX_HEAD_DIM,
    SUPPORTED_DTYPES,
    Problem,
    Schedule,
    get_schedule,
)


@dataclass
class Result:
    """What `attention` returns. `out` (and `lse`) are the same kind of array as q."""

    out: Any
    lse: Any
    counts: Ledger | None
    problem: Problem
    schedule: str
    backend: str
    ms: float


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
                 block_q, block_k, causal=False, save_lse=False, dtype="float32") -> Problem:
    """Validate sizes and options for `schedule` and return the Problem they describe."""
    if isinstance(schedule, str):
        get_schedule(schedule)  # refuses an unknown name, listing the known ones
    n_k = n_q if n_k is None else n_k
    dv = d if dv is None else dv
    dtype = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype: {dtype} is not supported; use one of {list(SUPPORTED_DTYPES)}")
    p = Problem(
        n_q=_check_int("n", n_q, 1), n_k=_check_int("n_k", n_k, 1),
        d=_check_int("d", d, 1, MAX_HEAD_DIM), dv=_check_int("dv", dv, 1, MAX_HEAD_DIM),
        batch=_check_int("batch", batch, 1), heads=_check_int("heads", heads, 1),
        block_q=_check_int("block_q", block_q, 1, MAX_BLOCK_Q),
        block_k=_check_int("block_k", block_k, 1, MAX_BLOCK_K),
        causal=_check_bool("causal", causal), save_lse=_check_bool("save_lse", save_lse),
        dtype=dtype,
    )
    if p.causal and p.n_q != p.n_k:
        raise ValueError(f"causal: needs as many queries as keys, got n_q={p.n_q}, n_k={p.n_k}")
    return p


def memory_need(sched: Schedule, p: Problem, count: bool,
                host_inputs: bool = True) -> dict[str, int]:
    """Device memory one call allocates (bytes), by part.

    inputs: q, k, v when they are copied from the host (device arrays are already resident);
    outputs: O (input dtype), lse (float32, with save_lse); counters: int64 slots; workspace:
    what the schedule keeps in HBM besides (`Schedule.workspace_bytes`: S and P for dense, l
    and m for kv_outer).
    """
    inputs = p.bh * (p.n_q * p.d + p.n_k * (p.d + p.dv)) * p.itemsize
    return {
        "inputs": inputs if host_inputs else 0,
        "outputs": p.bh * p.n_q * p.dv * p.itemsize + 4 * (p.bh * p.n_q if p.save_lse else 1),
        "counters": 8 * (N_SLOTS if count else 1),
        "workspace": sched.workspace_bytes(p),
    }


def _largest_block_k(sched: Schedule, p: Problem, count: bool) -> int:
    """Largest block_k whose shared memory fits at these head dims (0 if none does)."""
    lo_, hi = 0, MAX_BLOCK_K  # shared memory grows with block_k: bisect
    while lo_ < hi:
        mid = (lo_ + hi + 1) // 2
        try:
            fits = sched.shared_bytes(replace(p, block_k=mid), count) <= sched.shared_limit()
        except ValueError:  # no thread layout for this block_k (a forced one, say)
            fits = False
        if fits:
            lo_ = mid
        else:
            hi = mid - 1
    return lo_


def check_launch(sched: Schedule, p: Problem, count: bool, host_inputs: bool = True) -> None:
    """Refuse what the kernels cannot launch: shared memory, grid and device memory limits.

    Every refusal states what the call needs and the limit, before anything is allocated.
    """
    sched.check(p)
    need = sched.shared_bytes(p, count)
    if need > sched.shared_limit():
        most = _largest_block_k(sched, p, count)
        fix = (f"use 1 <= block_k <= {most} at these head dims" if most else
               f"no block_k fits: use smaller head dims (d + dv = {p.d + p.dv})")
        raise ValueError(
            f"block_k: {sched.name} needs {need} bytes of shared memory per CTA for "
            f"block_k={p.block_k}, d={p.d}, dv={p.dv}; the limit is "
            f"{sched.shared_limit()} bytes: {fix}")
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


def _shape_of(name: str, x) -> tuple[int, ...]:
    shape = getattr(x, "shape", None)
    if shape is None or not hasattr(x, "dtype"):
        raise TypeError(f"{name}: expected an array (NumPy, Numba device array or any "
                        f"__cuda_array_interface__ object), got {type(x).__name__}")
    shape = tuple(int(s) for s in shape)
    if len(shape) not in (2, 4):
        raise ValueError(f"{name}: expected shape (n, d) or (batch, heads, n, d), "
                         f"got {len(shape)} dimensions {shape}")
    return shape


def _dtype_name(x) -> str:
    try:
        return np.dtype(x.dtype).name
    except TypeError:
        return str(x.dtype).replace("torch.", "")


def _is_contiguous(x) -> bool:
    if isinstance(x, np.ndarray):
        return True  # copied to the device contiguously
    if hasattr(x, "is_c_contiguous"):
        return bool(x.is_c_contiguous())
    iface = getattr(x, "__cuda_array_interface__", None)
    if iface is None or iface.get("strides") is None:
        return True
    expected, step = [], np.dtype(iface["typestr"]).itemsize
    for extent in reversed(iface["shape"]):
        expected.append(step)
        step *= extent
    return tuple(reversed(expected)) == tuple(iface["strides"])


def _on_device(x) -> bool:
    return hasattr(x, "copy_to_host") or runtime.is_device_array(x)


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


def _check_inputs(q, k, v):
    shapes = {name: _shape_of(name, x) for name, x in (("q", q), ("k", k), ("v", v))}
    ranks = {len(s) for s in shapes.values()}
    if len(ranks) != 1:
        raise ValueError(f"q, k, v: must have the same number of dimensions, got shapes "
                         f"q{shapes['q']} k{shapes['k']} v{shapes['v']}")
    qs, ks, vs = shapes["q"], shapes["k"], shapes["v"]
    if not (qs[:-2] == ks[:-2] == vs[:-2]):
        raise ValueError(f"k, v: batch and heads must match q's, got q{qs} k{ks} v{vs}")
    if ks[-1] != qs[-1]:
        raise ValueError(f"k: head dim d must equal q's ({qs[-1]}), got k{ks}")
    if vs[-2] != ks[-2]:
        raise ValueError(f"v: must have as many rows as k ({ks[-2]}), got v{vs}")
    dtypes = {name: _dtype_name(x) for name, x in (("q", q), ("k", k), ("v", v))}
    for name, dt in dtypes.items():
        if dt not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}: dtype {dt} is not supported; use one of "
                            f"{list(SUPPORTED_DTYPES)}")
    if len(set(dtypes.values())) != 1:
        raise TypeError(f"q, k, v: dtypes must match, got {dtypes}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not _is_contiguous(x):
            raise ValueError(f"{name}: device arrays must be C-contiguous; copy it first")
    batch, heads = qs[:2] if len(qs) == 4 else (1, 1)
    return batch, heads, qs[-2], ks[-2], qs[-1], vs[-1], dtypes["q"]


def attention(q, k, v, schedule: str = "q_outer", block_q: int = 64, block_k: int = 64,
              causal: bool = False, scale: float | None = None, save_lse: bool = False,
              count: bool = False) -> Result:
    """Exact attention O = softmax(scale Q K^T) V, executed in the loop order `schedule`.

    q: (batch, heads, n_q, d) or (n_q, d); k: same with n_k rows; v: same with dv columns.
    float32 or float16 (accumulation is float32). NumPy in gives NumPy out; a device array
    (anything with __cuda_array_interface__) gives a Numba device array out. With `count`,
    the counted build of the kernels runs and `Result.counts` holds the measured Ledger.

    Numerics (README "Limits and numerics"): the running row max is subtracted before every
    exponential, so huge scores stay finite. Non-finite inputs reach exactly the outputs that
    depend on them: NaN in q[r] -> row r; in k[c] -> every row attending key c; in v[c, x] ->
    column x of those rows. Masked (causal) keys never touch the output. Everything that
    cannot run (shapes, dtypes, block sizes, shared or device memory) is refused with a
    ValueError/TypeError before any copy or launch.
    """
    sched = get_schedule(schedule)
    batch, heads, n_q, n_k, d, dv, dtype = _check_inputs(q, k, v)
    p = make_problem(sched, n_q=n_q, n_k=n_k, d=d, dv=dv, batch=batch, heads=heads,
                     block_q=block_q, block_k=block_k, causal=causal, save_lse=save_lse,
                     dtype=dtype)
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    scale = _check_scale(scale)
    count = _check_bool("count", count)
    host_in = isinstance(q, np.ndarray)
    check_launch(sched, p, count, host_inputs=not all(map(_on_device, (q, k, v))))

    dq, dk, dvv = (runtime.to_device(x).reshape(p.bh, n, width)
                   for x, n, width in ((q, n_q, d), (k, n_k, d), (v, n_k, dv)))
    out = runtime.device_empty((p.bh, n_q, dv), np.dtype(dtype))
    lse = runtime.device_empty((p.bh, n_q) if save_lse else (1, 1), np.float32)
    counts = runtime.device_zeros(N_SLOTS if count else 1, np.int64)
    with runtime.launching(), runtime.Timer() as timer:
        sched.launch(p, dq, dk, dvv, out, lse, counts, scale=float(scale), count=count)

    out_shape = _shape_of("q", q)[:-1] + (dv,)
    out = out.reshape(*out_shape)
    lse = lse.reshape(*out_shape[:-1]) if save_lse else None
    if host_in:
        out = runtime.to_host(out)
        lse = runtime.to_host(lse) if save_lse else None
    ledger = Ledger.from_array(runtime.to_host(counts)) if count else None
    return Result(out=out, lse=lse, counts=ledger, problem=p, schedule=sched.name,
                  backend=runtime.backend_name(), ms=timer.ms)


def predict_traffic(schedule: str, n: int, d: int, dv: int | None = None, batch: int = 1,
                    heads: int = 1, block_q: int = 64, block_k: int = 64, causal: bool = False,
                    save_lse: bool = False, n_k: int | None = None) -> Ledger:
    """The schedule's exact traffic model (elements moved through HBM) for these sizes."""
    sched = get_schedule(schedule)
    p = make_problem(sched, n_q=n, n_k=n_k, d=d, dv=dv, batch=batch, heads=heads,
                     block_q=block_q, block_k=block_k, causal=causal, save_lse=save_lse)
    return sched.model(p)
