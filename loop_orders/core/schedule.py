"""Schedules: one loop order of attention each, registered by name.

A schedule is one module under `loop_orders/schedules/` (found and imported by that
package); it owns, side by side: its loop nest as text (`LOOP_NEST`), its kernel factories
(block sizes and head dims baked in as compile-time constants, counting compiled in or out),
its exact traffic model (`model`), a brute-force walk of its loop nest (`walk`, written
independently of the model so that tests can compare the two), how it sizes tiles from an SRAM
budget of M elements (`tiles_for_sram`), the HBM tensors it keeps beyond the common ones
(`TENSORS`), its options (`OPTIONS`) and what the experiments should expect of it
(`EXPECTED_SLOPES`, `WORKED_EXAMPLE`, `TRAFFIC_CLASS`). Experiments loop over the registry;
they never ask which schedule they hold.
"""

from __future__ import annotations

import math
import numbers
import textwrap
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar, NamedTuple

import numpy as np

from .ledger import TENSORS, Ledger, declare_tensor
from .mask import Mask, kv_block_range, mask_of, q_block_range

# Limits of the kernels as written (compile-time local arrays, 1024 threads per CTA).
MAX_HEAD_DIM = 256
MAX_BLOCK_Q = 512
MAX_BLOCK_K = 512
# The element type the kernels see for each input dtype: bfloat16 has no NumPy dtype, so its
# arrays arrive as their bits, uint16 (converted by `intrinsics.widen` and `narrow`).
KERNEL_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
                 "bfloat16": np.dtype(np.uint16)}
SUPPORTED_DTYPES = tuple(KERNEL_DTYPES)
# How float32 inputs are multiplied: "ieee" exactly in float32 (FMA, on CUDA cores); on TF32
# tensor cores, "tf32" each operand as TF32 (10 mantissa bits), "tf32x3" each split into a
# TF32 head and tail, three products (3xTF32: about float32's accuracy)
PRECISIONS = ("ieee", "tf32", "tf32x3")


@dataclass(frozen=True)
class Option:
    """A schedule option: its default, what it means, and how a value is checked.

    `check(value)` returns the value to use (normalised, e.g. an int) or raises ValueError;
    `allowed` says in words what passes, for error messages and `loop-orders schedules`.
    `backward` options only change the backward pass (the forward accepts and ignores them,
    so one options dict can serve both passes). `examples`: values the tests draw from."""

    default: Any
    help: str
    allowed: str
    check: Callable[[Any], Any]
    backward: bool = False
    examples: tuple = ()


def int_option(low: int, high: int, *, also: tuple = ()) -> Callable[[Any], Any]:
    """A check for an integer option in [low, high], or one of the literal values `also`."""

    def check(value):
        if isinstance(value, str) and value in also:
            return value
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)  # from the command line
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"got {value!r}")
        if not low <= int(value) <= high:
            raise ValueError(f"got {value}")
        return int(value)

    return check


def choice_option(*values: str) -> Callable[[Any], Any]:
    def check(value):
        if value not in values:
            raise ValueError(f"got {value!r}")
        return value

    return check


@dataclass(frozen=True)
class Problem:
    """One attention call: shapes, tiling and options. Everything a model or launch needs.

    `options` holds every option of the schedule (defaults filled in) as sorted
    (name, value) pairs, so a Problem stays hashable; `option(name)` reads one."""

    n_q: int
    n_k: int
    d: int
    dv: int
    block_q: int
    block_k: int
    batch: int = 1
    heads: int = 1
    causal: bool = False
    save_lse: bool = False
    dtype: str = "float32"
    options: tuple = ()
    precision: str = "ieee"  # "tf32", "tf32x3": float32 inputs on TF32 tensor cores
    window: tuple = (-1, -1)  # (left, right) keys around a row's diagonal; -1: unbounded
    group: int = 1  # query heads per K/V head (grouped-query attention: heads / kv_heads)
    # (block_q, block_k) of a gradient call's backward pass where they are not the forward's:
    # chosen apart when the caller names no tiles (`api_grad.grad_tiles`); () otherwise
    backward_tiles: tuple = ()

    @property
    def mask(self) -> Mask:
        """The mask the kernels compile (`core.mask`): the window, causal bounding its right."""
        return mask_of(self.causal, self.window)

    @property
    def bh(self) -> int:
        return self.batch * self.heads

    @property
    def kv_heads(self) -> int:
        """K/V heads: query head h reads K/V head h // group (SDPA's and FlashAttention's
        grouping)."""
        return self.heads // self.group

    @property
    def bh_kv(self) -> int:
        return self.batch * self.kv_heads

    @property
    def tr(self) -> int:
        """Tr: number of query blocks."""
        return math.ceil(self.n_q / self.block_q)

    @property
    def tc(self) -> int:
        """Tc: number of key/value blocks."""
        return math.ceil(self.n_k / self.block_k)

    @property
    def kernel_dtype(self) -> np.dtype:
        """The element type of q, k, v and o as the kernels see them (`KERNEL_DTYPES`)."""
        return KERNEL_DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return self.kernel_dtype.itemsize

    def for_backward(self) -> Problem:
        """The Problem a gradient call's backward pass runs: this one, on `backward_tiles`
        where they are set (its model, kernels and checks read this one)."""
        if not self.backward_tiles:
            return self
        block_q, block_k = self.backward_tiles
        return replace(self, block_q=min(block_q, self.n_q), block_k=min(block_k, self.n_k),
                       backward_tiles=())

    def with_backward_tiles(self, block_q: int, block_k: int) -> Problem:
        """This Problem with its backward pass on block_q x block_k, clamped to its lengths as
        `make_problem` clamps (`backward_tiles` left empty where that is its own pair)."""
        if not (isinstance(block_q, numbers.Integral) and isinstance(block_k, numbers.Integral)
                and 1 <= block_q <= MAX_BLOCK_Q and 1 <= block_k <= MAX_BLOCK_K):
            raise ValueError(f"backward_tiles: got {block_q} x {block_k}; each must be an "
                             f"int in 1 .. {MAX_BLOCK_Q} (block_q), 1 .. {MAX_BLOCK_K} "
                             f"(block_k)")
        tiles = (min(int(block_q), self.n_q), min(int(block_k), self.n_k))
        return replace(self, backward_tiles=() if tiles == (self.block_q, self.block_k)
                       else tiles)

    def option(self, name: str):
        for key, value in self.options:
            if key == name:
                return value
        raise KeyError(f"option {name!r} is not set on this problem ({dict(self.options)})")

    def query_block_rows(self) -> np.ndarray:
        """Valid rows of each query block (the last may be a tail)."""
        starts = np.arange(self.tr, dtype=np.int64) * self.block_q
        return np.minimum(self.block_q, self.n_q - starts)

    def key_block_rows(self) -> np.ndarray:
        """Valid keys of each K/V block (the last may be a tail)."""
        starts = np.arange(self.tc, dtype=np.int64) * self.block_k
        return np.minimum(self.block_k, self.n_k - starts)

    def kv_block_ranges(self) -> tuple[np.ndarray, np.ndarray]:
        """Per query block i, the K/V blocks [first_i, end_i) it visits (`mask.kv_block_range`:
        all Tc without a mask; the blocks holding keys some row of block i sees)."""
        m = self.mask
        pairs = [kv_block_range(i * self.block_q, int(r), self.n_q, self.n_k, self.block_k,
                                m.left, m.right) for i, r in enumerate(self.query_block_rows())]
        first, end = np.array(pairs, dtype=np.int64).reshape(-1, 2).T
        return first, end

    def q_block_ranges(self) -> tuple[np.ndarray, np.ndarray]:
        """Per K/V block j, the query blocks [first_j, end_j) that visit it
        (`mask.q_block_range`)."""
        m = self.mask
        pairs = [q_block_range(j * self.block_k, int(c), self.n_q, self.n_k, self.block_q,
                               m.left, m.right) for j, c in enumerate(self.key_block_rows())]
        first, end = np.array(pairs, dtype=np.int64).reshape(-1, 2).T
        return first, end

    def visible_kv_blocks(self) -> np.ndarray:
        """Per query block i, how many K/V blocks it visits (end_i - first_i)."""
        first, end = self.kv_block_ranges()
        return end - first

    def visited_keys(self) -> np.ndarray:
        """Per query block i, the keys of the K/V blocks it visits (the last may be a tail)."""
        first, end = self.kv_block_ranges()
        return np.minimum(end * self.block_k, self.n_k) - np.minimum(first * self.block_k,
                                                                       self.n_k)

    def visiting_rows(self) -> np.ndarray:
        """Per K/V block j, the query rows of the blocks that visit it."""
        first, end = self.q_block_ranges()
        return np.minimum(end * self.block_q, self.n_q) - np.minimum(first * self.block_q,
                                                                       self.n_q)

    def visited_pairs(self) -> int:
        """Number of (i, j) block pairs the mask visits (Tr Tc without a mask)."""
        return int(self.visible_kv_blocks().sum())

    def describe(self) -> str:
        text = (f"B={self.batch} H={self.heads} N_q={self.n_q} N_k={self.n_k} d={self.d} "
                f"dv={self.dv} block_q={self.block_q} block_k={self.block_k} "
                f"causal={self.causal} dtype={self.dtype}")
        if self.window != (-1, -1):
            text += f" window={self.window}"
        if self.group > 1:
            text += f" H_kv={self.kv_heads}"
        if self.precision != "ieee":
            text += f" precision={self.precision}"
        if self.backward_tiles:
            block_q, block_k = self.backward_tiles
            text += f" backward_tiles={block_q}x{block_k}"
        return text + "".join(f" {k}={v}" for k, v in self.options)


class Kernel(NamedTuple):
    """One kernel a schedule launches for a problem, as resource checks and reports see it.

    `fn` is the (lazily compiled) Numba kernel; `shared_bytes` the shared memory one CTA
    uses (static arrays and dynamic buffer); `shared_limit` what it may use (48 KB of static
    arrays, or the GPU's opt-in limit for kernels whose tiles live in dynamic shared
    memory, see `runtime.launch`)."""

    name: str
    fn: Any
    shared_bytes: int
    shared_limit: int


class Schedule(ABC):
    """Base of every loop order. Subclasses set `name`, `summary`, `LOOP_NEST`."""

    PASS: ClassVar[str] = "forward"  # its place in the registry (`register`)
    name: ClassVar[str]
    summary: ClassVar[str]
    LOOP_NEST: ClassVar[str]
    # HBM tensors beyond the common ones (ledger.TENSORS): name -> "input" or "float32".
    TENSORS: ClassVar[Mapping[str, str]] = {}
    OPTIONS: ClassVar[Mapping[str, Option]] = {}
    # Whether the kernels run the flash micro-kernel (microkernel.make_micro_kernel), whose
    # thread layout (microkernel.thread_layout) results files then record.
    uses_micro_kernel: ClassVar[bool] = False
    # Whether the forward's products run on tensor cores for 16-bit inputs and, opted in,
    # for float32 inputs as TF32 (precision="tf32"); else always on CUDA cores.
    TENSOR_CORES: ClassVar[bool] = False
    # Log-log slope of model traffic against M, N and d (tiles from `tiles_for_sram`) that
    # Theorem 2 predicts for this order (experiments/theorem2.py fits and checks them).
    EXPECTED_SLOPES: ClassVar[Mapping[str, float]] = {}
    # Which Theta(.) of Theorem 2 the order belongs to: "flash" (N^2 d^2 / M) or
    # "standard" (N d + N^2); the theorem figure scales each overlay through such a line.
    TRAFFIC_CLASS: ClassVar[str | None] = None
    # A case worked by hand in the module docstring: (make_problem keyword arguments, the
    # total elements moved), checked against the model and the counted kernels.
    WORKED_EXAMPLE: ClassVar[tuple[Mapping[str, Any], int] | None] = None
    # Whether partial results are combined through a float32 log-sum-exp: the combine
    # weights then lose log l where |scores| reach ~1e7 (README, numerics).
    COMBINES_BY_LSE: ClassVar[bool] = False
    # The name of the backward schedule (`get_backward`) that differentiates this
    # forward, if any: its own name unless the forward shares another's backward.
    BACKWARD: ClassVar[str | None] = None

    def expected_slopes(self, options: dict) -> dict:
        """EXPECTED_SLOPES, for a schedule whose expectations depend on its options."""
        return dict(self.EXPECTED_SLOPES)

    def short_tiles(self, p: Problem) -> tuple[int, int] | None:
        """(block_q, block_k) measured faster for p's short sequence than the tiles the
        benchmark takes at every N (experiments/bench_runtime.py BLOCKS), else None."""
        return None

    def fast_tiles(self, p: Problem) -> tuple[int, int] | None:
        """(block_q, block_k) a forward call that names no tiles tries first, where this loop
        nest was measured faster at p's head dim with other tiles than 64 x 64 on this device
        (`api.fitting_tiles`), else None."""
        return None

    def ctas(self, p: Problem) -> int:
        """CTAs of the main kernel: how many tile chains run side by side (B H Tr)."""
        return p.bh * p.tr

    def threads(self, p: Problem) -> int:
        """Threads of a CTA of the main kernel (one per query row unless said otherwise)."""
        return p.block_q

    def loop_nest(self) -> str:
        """The loop nest as pseudo-code (quoted in paper_notes.md)."""
        return textwrap.dedent(self.LOOP_NEST).strip("\n")

    def ledger_tensors(self) -> tuple[str, ...]:
        """The tensors this schedule's ledgers list: the common ones, then its own."""
        return TENSORS + tuple(t for t in self.TENSORS if t not in TENSORS)

    def ledger(self, per_head: dict, bh: int) -> Ledger:
        """A model's {tensor: {direction: n}} for one head as a Ledger over bh heads, listing
        every tensor of `ledger_tensors` (zero where the model moves none)."""
        return Ledger({t: per_head.get(t, {}) for t in self.ledger_tensors()}).scaled(bh)

    @abstractmethod
    def model(self, p: Problem) -> Ledger:
        """Exact HBM traffic in elements, closed form (not a replay of the loop nest)."""

    @abstractmethod
    def walk(self, p: Problem) -> Counter:
        """The loop nest replayed block by block in plain Python, counting every transfer:
        {(tensor, direction): elements} for one (batch, head). Independent of `model`."""

    @abstractmethod
    def tiles_for_sram(self, m: int, d: int) -> tuple[int, int]:
        """(block_q, block_k) from an SRAM budget of `m` elements at head dim `d`."""

    @abstractmethod
    def kernels(self, p: Problem, count: bool) -> list[Kernel]:
        """Every kernel `launch` runs for p, in launch order (resource checks, reports)."""

    @abstractmethod
    def launch(self, p: Problem, q, k, v, out, lse, counts, *, scale: float, count: bool,
               workspace=None):
        """Run the kernels on device arrays shaped (bh, n, d); fill `counts` when `count`.

        `workspace` is what `allocate_workspace(p)` returned (allocated per call if None), so
        a benchmark can allocate once and time the kernels alone.
        """

    def allocate_workspace(self, p: Problem, empty=None) -> tuple:
        """Device arrays the kernels keep in HBM besides inputs and outputs, allocated by
        `empty(shape, dtype)` (runtime.device_empty unless given: the torch op passes
        torch's allocator)."""
        return ()

    def workspace_bytes(self, p: Problem) -> int:
        """HBM this schedule allocates beyond q, k, v, O, lse and the counters (bytes).

        Every schedule states it next to its model (0 when nothing else lives in HBM);
        `api.check_launch` adds inputs and outputs and refuses a call that does not fit.
        """
        return 0

    def check(self, p: Problem) -> None:  # noqa: B027 - optional hook
        """Refuse what this schedule's kernels cannot run (beyond the common checks)."""

    def warp_exchanges(self, p: Problem) -> int:
        """Warp-collective calls (ldmatrix, mma, shuffles) of the forward pass, summed over
        warps: what the simulator's emulation of tensor cores costs (0 on CUDA cores)."""
        return 0

    def output_roundings(self, p: Problem) -> int:
        """How many times an output row is rounded to the input dtype before it is final.

        1 for schedules that write O once; more where O itself round-trips through HBM.
        """
        return 1

    def resolved_options(self, p: Problem) -> dict:
        """p's options of this (forward) schedule as they take effect (e.g. "auto" replaced
        by what it chose), for results files; the backward's own are not among them."""
        return {k: v for k, v in p.options if k in self.OPTIONS}

    def options_for(self, given: Mapping[str, Any] | None, backward: bool = True) -> tuple:
        """Every option of this schedule (and of its backward, when `backward`) with
        `given` checked and defaults filled in, as sorted (name, value) pairs. An unknown
        option or a bad value raises ValueError naming it and listing what is allowed."""
        known = dict(self.OPTIONS)
        if backward and self.BACKWARD:
            known.update(get_backward(self.BACKWARD).OPTIONS)
        given = dict(given or {})
        unknown = sorted(set(given) - set(known))
        if unknown:
            listed = ", ".join(f"{k} ({o.allowed})" for k, o in known.items()) or "none"
            raise ValueError(f"options: unknown option {unknown[0]!r} for {self.name}; "
                             f"its options: {listed}")
        values = {}
        for key, opt in known.items():
            value = given.get(key, opt.default)
            try:
                values[key] = opt.check(value)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"options: {key} of {self.name}: {exc}; allowed "
                                 f"{opt.allowed}") from None
        return tuple(sorted(values.items()))

    def __repr__(self) -> str:
        return f"<schedule {self.name}: {self.summary}>"


def per_head_ledger(walk: Counter, bh: int) -> Ledger:
    """A walk's {(tensor, direction): n} for one head as a Ledger over bh heads."""
    out: dict = {}
    for (tensor, direction), n in walk.items():
        out.setdefault(tensor, {})[direction] = n * bh
    return Ledger(out)


# One registry for both passes: forward schedules by name, and backward schedules by the name
# of the forward they differentiate (a forward names its backward in BACKWARD).
_REGISTRY: dict[str, dict[str, Any]] = {"forward": {}, "backward": {}}


def register(cls: type) -> type:
    """Class decorator: add a schedule (a `Schedule`, or a `backward_schedule.BackwardSchedule`:
    its PASS says which) to the registry under `cls.name`, and declare the HBM tensors it
    lists in TENSORS."""
    entries = _REGISTRY[cls.PASS]
    if cls.name in entries:
        raise ValueError(f"{cls.PASS} schedule {cls.name!r} is already registered")
    for tensor, element in cls.TENSORS.items():
        declare_tensor(tensor, element)
    entries[cls.name] = cls()
    return cls


def schedule_names() -> list[str]:
    return list(_REGISTRY["forward"])


def get_schedule(name: str) -> Schedule:
    try:
        return _REGISTRY["forward"][name]
    except (KeyError, TypeError):
        raise ValueError(f"schedule: unknown schedule {name!r}; known schedules: "
                         f"{', '.join(_REGISTRY['forward'])}") from None


def all_schedules() -> list[Schedule]:
    return list(_REGISTRY["forward"].values())


def schedule_options(name: str) -> dict[str, Any]:
    """The options of schedule `name` (and of its backward pass) with their defaults."""
    return dict(get_schedule(name).options_for({}))


def backward_schedule_names() -> list[str]:
    return list(_REGISTRY["backward"])


def get_backward(name: str):
    """The backward schedule registered under `name` (a `backward_schedule.BackwardSchedule`)."""
    try:
        return _REGISTRY["backward"][name]
    except KeyError:
        raise ValueError(f"schedule: no backward schedule {name!r}; backward schedules: "
                         f"{', '.join(_REGISTRY['backward'])}") from None


def backward_of(sched: Schedule):
    """The backward schedule that differentiates forward `sched`."""
    if not sched.BACKWARD:
        raise ValueError(f"schedule: {sched.name} has no backward pass; backward schedules: "
                         f"{', '.join(_REGISTRY['backward'])}")
    return get_backward(sched.BACKWARD)


class GradVariant(NamedTuple):
    """One (schedule, backward options) pair to run or measure, and its label."""

    label: str  # "q_outer dq=atomic", or the schedule's name when its backward has no options
    schedule: str
    options: dict | None


def grad_variants(forwards: bool = False) -> list[GradVariant]:
    """Every backward order with every example value of its options: one per backward
    schedule, or with `forwards` one per forward schedule that has a backward pass (split_kv
    with q_outer's options too)."""
    pairs = ([(s.name, s.BACKWARD) for s in all_schedules() if s.BACKWARD] if forwards
             else [(name, name) for name in backward_schedule_names()])
    out = []
    for name, backward in pairs:
        bwd = get_backward(backward)
        values = [{k: v} for k, opt in bwd.OPTIONS.items() for v in opt.examples]
        for options in values or [None]:
            label = " ".join([name, *(f"{k}={v}" for k, v in (options or {}).items())])
            out.append(GradVariant(label, name, options))
    return out


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def rows(start: int, block: int, n: int) -> range:
    """The valid rows of the block starting at `start` (for walks)."""
    return range(start, min(start + block, n))


def sees(p: Problem, query_rows: range, key_rows: range) -> bool:
    """Does any query in `query_rows` see any key in `key_rows`? Row by row, from the mask's
    rule (`Mask.sees`; for walks, independent of the block ranges the models use)."""
    return p.mask.sees(query_rows, key_rows, p.n_q, p.n_k)
