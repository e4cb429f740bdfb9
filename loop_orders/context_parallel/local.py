"""A device's own work: calls of our single-device kernels (`lo.attention`), and the exact
combine of their partial results.

`LocalAttention` runs the local loop order (any registered schedule: q_outer by default,
with its Br = block_q, Bc = block_k) on this device's tensors and sums the HBM traffic its
counted kernels report; `LocalShape` is one such call in closed form, which the schedules'
HBM models are built from (`LocalAttention.model`: the local schedule's own exact model).

`Accumulator` combines the partial results (O_s, lse_s) of calls that saw disjoint sets of
keys, the device-level online-softmax update, exactly as split_kv's combine kernel does:

    lse = logaddexp(lse_a, lse_s)                      # log(exp(lse_a) + exp(lse_s))
    O   = exp(lse_a - lse) O_a + exp(lse_s - lse) O_s  # weights summing to 1

in float32 torch ops on the tensors' device (not a kernel of ours: its HBM traffic, like
torch's copies of slices, is outside our counters; the counted ledger is the kernels'). A
single part is returned as the kernel wrote it, so a one-call schedule (P = 1) gives exactly
the single-device output.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import api
from ..core.ledger import Ledger
from .layout import CPProblem


class LocalShape(NamedTuple):
    """One local call: n_q queries against n_k keys for `heads` heads."""

    n_q: int
    n_k: int
    causal: bool
    save_lse: bool
    heads: int


class Part(NamedTuple):
    """One local call's result: O_s (input dtype) and lse_s (float32, or None)."""

    out: torch.Tensor
    lse: torch.Tensor | None


class LocalAttention:
    """`lo.attention` with this device's fixed settings, its counted ledgers summed."""

    def __init__(self, schedule: str = "q_outer", block_q: int = 64, block_k: int = 64,
                 options: dict | None = None, scale: float = 1.0, count: bool = False):
        self.schedule, self.block_q, self.block_k = schedule, block_q, block_k
        self.options, self.scale, self.count = options, scale, count
        self.counts = Ledger() if count else None

    def __call__(self, q, k, v, causal: bool, save_lse: bool) -> Part:
        res = api.attention(q, k, v, schedule=self.schedule, block_q=self.block_q,
                            block_k=self.block_k, causal=causal, scale=self.scale,
                            save_lse=save_lse, count=self.count, options=self.options)
        if self.count:
            self.counts = self.counts + res.counts
        return Part(res.out, res.lse)

    def _problem(self, p: CPProblem, shape: LocalShape, dtype: str):
        return api.make_problem(self.schedule, n_q=shape.n_q, n_k=shape.n_k, d=p.d, dv=p.dv,
                                batch=p.batch, heads=shape.heads, block_q=self.block_q,
                                block_k=self.block_k, causal=shape.causal,
                                save_lse=shape.save_lse, dtype=dtype, options=self.options)

    def check(self, p: CPProblem, shapes, dtype: str, host_inputs: bool) -> None:
        """Every check `lo.attention` would make on these calls, before any transfer."""
        sched = api.get_schedule(self.schedule)
        for shape in set(shapes):
            api.check_launch(sched, self._problem(p, shape, dtype), self.count, host_inputs)

    def model(self, p: CPProblem, shapes, dtype: str = "float32") -> Ledger:
        """The local schedule's exact HBM model, summed over the calls."""
        sched = api.get_schedule(self.schedule)
        total = Ledger()
        for shape in shapes:
            total = total + sched.model(self._problem(p, shape, dtype))
        return total


class Accumulator:
    """O and lse of this device's query rows, combined from the parts added so far. The
    first part must cover every row; later ones may cover a range of rows (`rows`)."""

    def __init__(self):
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None
        self.parts = 0

    def add(self, part: Part, rows: slice = slice(None)) -> None:
        self.parts += 1
        if self.parts == 1:
            self.out, self.lse = part.out, part.lse
            return
        if self.parts == 2:  # from here on in float32, in place
            self.out = self.out.float()
        o_a, lse_a = self.out[..., rows, :], self.lse[..., rows]
        lse = torch.logaddexp(lse_a, part.lse)
        w_a, w_s = torch.exp(lse_a - lse), torch.exp(part.lse - lse)
        self.out[..., rows, :] = w_a[..., None] * o_a + w_s[..., None] * part.out.float()
        self.lse[..., rows] = lse

    def result(self, dtype: torch.dtype) -> Part:
        """O in the inputs' dtype (rounded once, from float32) and lse."""
        return Part(self.out.to(dtype), self.lse)


class Device:
    """One device's side of a context-parallel call: the problem, its rank and link, its
    local kernels and its timeline (what a schedule's `run` works with)."""

    def __init__(self, problem: CPProblem, link, local: LocalAttention, timeline,
                 overlap: bool = True):
        self.problem, self.link, self.local = problem, link, local
        self.timeline, self.overlap = timeline, overlap
        self.rank = link.rank

    def attend(self, q, k, v, causal: bool, save_lse: bool) -> Part:
        """One local call on contiguous copies of the views it is given (torch's copy where
        a view is not contiguous: outside the counters, like the combine)."""
        return self.local(q.contiguous(), k.contiguous(), v.contiguous(), causal, save_lse)
