"""Overrides of the kernel choice, for tuning sweeps and tests: one value, read once.

Which build runs is the schedules' tables' choice (`MicroKernelSchedule.layout`). A sweep
overrides it with a `Tuning`: `layout`, a CUDA-core thread tile "RM,KN[,STAGES[,P_IN_K]]"
(`cuda_cores.thread_layout`) or a loop nest's own kernel "ws[,CHUNKS,KEYS[,PEEL[,PERSISTENT]]]"
(q_outer's `Specialised.parse`); `kv_stages`, at most this many K/V buffers (1 turns off the
double-buffered or staggered loads); `q_stages`, this many Q_i/dO_i buffers (1 or 2) in a
tensor-core backward's K/V-outer kernel where they fit a CTA (q_outer's `tc_q_stages`);
`products`, "mma" to multiply 16-bit tiles on mma.sync where Hopper's wgmma build would run
(the A/B baseline), or the wgmma build's K/V loop (`MicroKernelSchedule.hopper_build`):
"wgmma-sync" without the pipelined update, "wgmma-ring" pipelined with every thread copying
into the ring, "wgmma-tma" pipelined with a producer warpgroup copying by TMA (where the loop
nest has that kernel), "wgmma-persistent" the same on persistent CTAs (a CTA an SM folding
query blocks in turn); `causal_heads`, heads a causal q_outer grid on tensor cores takes at a
time, its heaviest query blocks first within each group (`tiles.grouped_block`; 0: first over
every head; `MicroKernelSchedule.causal_heads`). The environment gives the process's value,
read once at import (LOOP_ORDERS_LAYOUT, LOOP_ORDERS_KV_STAGES, LOOP_ORDERS_Q_STAGES,
LOOP_ORDERS_PRODUCTS, LOOP_ORDERS_CAUSAL_HEADS: a sweep run by a shell script); within a
process `tuned(...)` overrides it for a block.
"""

from __future__ import annotations

import contextlib
import os
from typing import NamedTuple


class Tuning(NamedTuple):
    """A sweep's override of the kernel choice (None: the tables decide)."""

    layout: str | None = None
    kv_stages: int | None = None
    q_stages: int | None = None
    products: str | None = None
    causal_heads: int | None = None

    @classmethod
    def from_environment(cls) -> Tuning:
        stages = os.environ.get("LOOP_ORDERS_KV_STAGES")
        q_stages = os.environ.get("LOOP_ORDERS_Q_STAGES")
        heads = os.environ.get("LOOP_ORDERS_CAUSAL_HEADS")
        return cls(os.environ.get("LOOP_ORDERS_LAYOUT") or None,
                   int(stages) if stages else None, int(q_stages) if q_stages else None,
                   os.environ.get("LOOP_ORDERS_PRODUCTS") or None,
                   int(heads) if heads else None)

    def forces_own_kernel(self) -> bool:
        """Whether `layout` names a loop nest's own kernel ("ws...") rather than a thread tile."""
        return bool(self.layout) and self.layout.split(",")[0] == "ws"


CURRENT = Tuning.from_environment()  # the process's: the environment, read once


def current() -> Tuning:
    return CURRENT


@contextlib.contextmanager
def tuned(layout: str | None = None, kv_stages: int | None = None,
          q_stages: int | None = None, products: str | None = None,
          causal_heads: int | None = None):
    """Inside the block, kernels are chosen under this override (a tuning sweep's row)."""
    global CURRENT
    previous, CURRENT = CURRENT, Tuning(layout, kv_stages, q_stages, products, causal_heads)
    try:
        yield CURRENT
    finally:
        CURRENT = previous
