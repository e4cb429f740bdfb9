"""Schedules: one loop order of attention each, registered by name.

A schedule owns four things, side by side in its module under `loop_orders/schedules/`:
its loop nest as text (`LOOP_NEST`), its kernel factory (block sizes and head dims baked in as
compile-time constants, counting compiled in or out), its exact traffic model (`model`), and how
it sizes tiles from an SRAM budget of M elements (`tiles_for_sram`). Experiments loop over the
registry; they never ask which schedule they hold.
"""

from __future__ import annotations

import math
import textwrap
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .ledger import Ledger

# Limits of the kernels as written (compile-time local arrays and one thread per query row).
MAX_HEAD_DIM = 256
MAX_BLOCK_Q = 512  # up to two threads per query row, 1024 per CTA
MAX_BLOCK_K = 512
SUPPORTED_DTYPES = ("float32", "float16")


@dataclass(frozen=True)
class Problem:
    """One attention call: shapes, tiling and options. Everything a model or launch needs."""

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

    @property
    def bh(self) -> int:
        return self.batch * self.heads

    @property
    def tr(self) -> int:
        """Tr: number of query blocks."""
        return math.ceil(self.n_q / self.block_q)

    @property
    def tc(self) -> int:
        """Tc: number of key/value blocks."""
        return math.ceil(self.n_k / self.block_k)

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    def query_block_rows(self) -> np.ndarray:
        """Valid rows of each query block (the last may be a tail)."""
        starts = np.arange(self.tr, dtype=np.int64) * self.block_q
        return np.minimum(self.block_q, self.n_q - starts)

    def visible_kv_blocks(self) -> np.ndarray:
        """Per query block i, how many K/V blocks it visits (a prefix j < c_i).

        Causal skips block j when its first key j*Bc comes after block i's last query.
        """
        if not self.causal:
            return np.full(self.tr, self.tc, dtype=np.int64)
        last_query = np.minimum((np.arange(self.tr, dtype=np.int64) + 1) * self.block_q,
                                self.n_q) - 1
        return np.minimum(self.tc, last_query // self.block_k + 1)

    def first_visible_q_block(self) -> np.ndarray:
        """Per K/V block j, the first query block that visits it (a suffix i >= i0_j)."""
        if not self.causal:
            return np.zeros(self.tc, dtype=np.int64)
        return np.arange(self.tc, dtype=np.int64) * self.block_k // self.block_q

    def describe(self) -> str:
        return (f"B={self.batch} H={self.heads} N_q={self.n_q} N_k={self.n_k} d={self.d} "
                f"dv={self.dv} block_q={self.block_q} block_k={self.block_k} "
                f"causal={self.causal} dtype={self.dtype}")


class Schedule(ABC):
    """Base of every loop order. Subclasses set `name`, `summary`, `LOOP_NEST`."""

    name: ClassVar[str]
    summary: ClassVar[str]
    LOOP_NEST: ClassVar[str]
    # Whether the kernels run the flash micro-kernel (microkernel.make_micro_kernel), whose
    # thread layout (microkernel.thread_layout) results files then record.
    uses_micro_kernel: ClassVar[bool] = False

    def loop_nest(self) -> str:
        """The loop nest as pseudo-code (quoted in paper_notes.md)."""
        return textwrap.dedent(self.LOOP_NEST).strip("\n")

    @abstractmethod
    def model(self, p: Problem) -> Ledger:
        """Exact HBM traffic in elements, closed form (not a replay of the loop nest)."""

    @abstractmethod
    def tiles_for_sram(self, m: int, d: int) -> tuple[int, int]:
        """(block_q, block_k) from an SRAM budget of `m` elements at head dim `d`."""

    @abstractmethod
    def shared_bytes(self, p: Problem, count: bool) -> int:
        """Largest shared memory one CTA of this schedule declares (bytes)."""

    def shared_limit(self) -> int:
        """Shared memory one CTA may use: 48 KB of static arrays unless the schedule's
        kernels take dynamic shared memory (and opt in to more, `runtime.launch`)."""
        from .runtime import SHARED_BYTES_LIMIT

        return SHARED_BYTES_LIMIT

    @abstractmethod
    def launch(self, p: Problem, q, k, v, out, lse, counts, *, scale: float, count: bool,
               workspace=None):
        """Run the kernels on device arrays shaped (bh, n, d); fill `counts` when `count`.

        `workspace` is what `allocate_workspace(p)` returned (allocated per call if None), so
        a benchmark can allocate once and time the kernels alone.
        """

    @abstractmethod
    def kernels(self, p: Problem, count: bool) -> list:
        """The compiled kernel objects `launch` uses for p (for resource reports)."""

    def allocate_workspace(self, p: Problem) -> tuple:
        """Device arrays the kernels keep in HBM besides inputs and outputs."""
        return ()

    def workspace_bytes(self, p: Problem) -> int:
        """HBM this schedule allocates beyond q, k, v, O, lse and the counters (bytes).

        Every schedule states it next to its model (0 when nothing else lives in HBM);
        `api.check_launch` adds inputs and outputs and refuses a call that does not fit.
        """
        return 0

    def check(self, p: Problem) -> None:  # noqa: B027 - optional hook
        """Refuse what this schedule's kernels cannot run (beyond the common checks)."""

    def output_roundings(self, p: Problem) -> int:
        """How many times an output row is rounded to the input dtype before it is final.

        1 for schedules that write O once; more where O itself round-trips through HBM.
        """
        return 1

    def __repr__(self) -> str:
        return f"<schedule {self.name}: {self.summary}>"


_REGISTRY: dict[str, Schedule] = {}


def register(cls: type[Schedule]) -> type[Schedule]:
    """Class decorator: add a schedule to the registry under `cls.name`."""
    if cls.name in _REGISTRY:
        raise ValueError(f"schedule {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls()
    return cls


def schedule_names() -> list[str]:
    return list(_REGISTRY)


def get_schedule(name: str) -> Schedule:
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"schedule: unknown schedule {name!r}; known schedules: {', '.join(_REGISTRY)}"
        ) from None


def all_schedules() -> list[Schedule]:
    return list(_REGISTRY.values())


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
