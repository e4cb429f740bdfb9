"""Backward schedules: the loop orders of attention's backward pass, registered by the name of
the forward schedule they differentiate.

A backward schedule is the `backward` module of its forward's package under
`loop_orders/schedules/` (registered by `schedule.register`, the one registry). Like a
forward schedule it owns its loop nest, kernels, exact traffic model and an independent
brute-force walk, its own HBM tensors (`TENSORS`) and options (`OPTIONS`, given
through the same options dict as the forward's). It reads what its forward saved: the
forward's lse, and the forward's workspace (dense's P, kv_outer's l and m).

The common backward tensors, in elements per (batch, head): do, dq, dk, dv (input dtype);
delta = rowsum(dO o O) and dq_acc (float32).
"""

from __future__ import annotations

import textwrap
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Mapping
from typing import ClassVar

from .ledger import TENSORS, Ledger, declare_tensor
from .schedule import Kernel, Option, Problem, Schedule, get_schedule

BACKWARD_TENSORS = {"do": "input", "dq": "input", "dk": "input", "dv": "input",
                    "delta": "float32", "dq_acc": "float32"}
for _name, _element in BACKWARD_TENSORS.items():
    declare_tensor(_name, _element)


class BackwardSchedule(ABC):
    """Base of every backward loop order. Subclasses set `name` (the forward's), `summary`,
    `LOOP_NEST`."""

    PASS: ClassVar[str] = "backward"  # its place in the registry (`schedule.register`)
    name: ClassVar[str]
    summary: ClassVar[str]
    LOOP_NEST: ClassVar[str]
    TENSORS: ClassVar[Mapping[str, str]] = {}
    OPTIONS: ClassVar[Mapping[str, Option]] = {}
    EXPECTED_SLOPES: ClassVar[Mapping[str, float]] = {}
    TRAFFIC_CLASS: ClassVar[str | None] = None
    # Whether `launch` reads its forward's workspace (`forward_workspace`): kv_outer's l and
    # m, dense's P. The torch op keeps the forward's whole workspace where it does (dense's S
    # too), none where it does not
    READS_FORWARD_WORKSPACE: ClassVar[bool] = False

    def expected_slopes(self, options: dict) -> dict:
        """EXPECTED_SLOPES, for a backward whose expectations depend on its options."""
        return dict(self.EXPECTED_SLOPES)

    def ctas(self, p: Problem) -> int:
        """CTAs of the main kernel: how many tile chains run side by side (B H Tc)."""
        return p.bh * p.tc

    @abstractmethod
    def threads(self, p: Problem) -> int:
        """Threads of a CTA of the main kernel (on the shared backward tile:
        `microkernel.grad_tiles.GradTileBackward` says)."""

    @staticmethod
    def tensor_cores(p: Problem):
        """The tensor-core build (`microkernel.tensor_cores.TensorCores`) p's main kernels run,
        or None: CUDA cores, unless a backward order says otherwise."""
        return None

    def fast_tiles(self, p: Problem) -> tuple[int, int] | None:
        """(block_q, block_k) a gradient call that names no tiles tries first for this
        backward, where it was measured faster on them than on 64 x 64 at p's head dim,
        operands and options on this kind of device (`api_grad.grad_tiles`), else None."""
        return None

    def loop_nest(self) -> str:
        return textwrap.dedent(self.LOOP_NEST).strip("\n")

    def forward(self) -> Schedule:
        return get_schedule(self.name)

    def ledger_tensors(self) -> tuple[str, ...]:
        extra = {**BACKWARD_TENSORS, **self.TENSORS}
        return TENSORS + tuple(t for t in extra if t not in TENSORS)

    def ledger(self, per_head: dict, bh: int) -> Ledger:
        """A model's {tensor: {direction: n}} for one head as a Ledger over bh heads, listing
        every tensor of `ledger_tensors` (zero where the model moves none)."""
        return Ledger({t: per_head.get(t, {}) for t in self.ledger_tensors()}).scaled(bh)

    @abstractmethod
    def model(self, p: Problem) -> Ledger:
        """Exact HBM traffic of the backward pass alone, closed form."""

    @abstractmethod
    def walk(self, p: Problem) -> Counter:
        """The backward loop nest replayed in plain Python: {(tensor, direction): n} for one
        (batch, head), independent of `model`."""

    @abstractmethod
    def kernels(self, p: Problem, count: bool) -> list[Kernel]:
        """Every kernel `launch` runs for p, in launch order."""

    @abstractmethod
    def launch(self, p: Problem, q, k, v, o, do, lse, dq, dk, dv, counts, *, scale: float,
               count: bool, forward_workspace, workspace=None):
        """Run the backward kernels on device arrays shaped (bh, n, width): q, k, v, o, do
        in, dq, dk, dv out; `lse` and `forward_workspace` are what the forward left."""

    @abstractmethod
    def tiles_for_sram(self, m: int, d: int) -> tuple[int, int]:
        """(block_q, block_k) from an SRAM budget of `m` elements (Theorem 5's sweeps)."""

    def forward_saves(self) -> str:
        """What of the forward's this backward reads (for docs): "lse", "P", ..."""
        return "lse"

    def check(self, p: Problem) -> None:  # noqa: B027 - optional hook
        """Refuse what this backward's kernels cannot run (beyond the common checks)."""

    def check_kernels(self, p: Problem, count: bool) -> None:
        """`check`, then every kernel's shared memory against what a CTA may take (a build
        past it would not even load)."""
        self.check(p)
        for kern in self.kernels(p, count):
            if kern.shared_bytes > kern.shared_limit:
                raise ValueError(
                    f"block_k: {self.name}'s backward needs {kern.shared_bytes} bytes of "
                    f"shared memory per CTA in kernel {kern.name} for block_q={p.block_q}, "
                    f"block_k={p.block_k}, d={p.d}, dv={p.dv}; the limit is "
                    f"{kern.shared_limit} bytes: use smaller blocks")

    def allocate_workspace(self, p: Problem, empty=None) -> tuple:
        """Device arrays the backward keeps in HBM (allocated by `empty(shape, dtype)`,
        runtime.device_empty unless given)."""
        return ()

    def workspace_bytes(self, p: Problem) -> int:
        """HBM the backward allocates beyond q, k, v, o, do, dq, dk, dv (bytes)."""
        return 0

    def output_roundings(self, p: Problem) -> int:
        """How many times a gradient row is rounded to the input dtype before it is final."""
        return 1

    def __repr__(self) -> str:
        return f"<backward schedule {self.name}: {self.summary}>"
