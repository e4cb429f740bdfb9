"""Packed variable-length batches (FlashAttention's varlen convention): every sequence its own
problem, on views of the packed arrays.

    q (total_q, H, d), k (total_k, H_kv, d), v (total_k, H_kv, dv): a batch's sequences one
    after another, no padding; cu_seqlens_q, cu_seqlens_k: int32 prefix sums of length
    batch + 1 (sequence b's queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1, its
    keys likewise); out (total_q, H, dv), lse (H, total_q) float32, dq, dk, dv like q, k, v.

    for each sequence b with queries:                  # its own launches, in turn
        p_b = Problem(batch 1, H heads, n_q(b), n_k(b)), the call's tiles
        q_b = rows cu_seqlens_q[b] .. of q, viewed as (H, n_q(b), d)   # no copy
        k_b, v_b, out_b, lse_b (and the backward's do_b, dq_b, dk_b, dv_b) likewise
        the schedule's kernels on them, counting into one set of counters

A view's rows are H d elements apart (not d): the kernels compile for strided arrays
(Numba's "A" layout, indexed by their strides; `intrinsics.cp_async16` steps rows by them).
Masks are per sequence, causal bottom-right aligned within each, as FlashAttention's varlen
is. No padding is read or written, so a call's traffic is the sum of its sequences' models
(`varlen_traffic`), which the counters equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from . import api
from .api_grad import GradResult, backward_memory, check_grad_launch, grad_tiles
from .core.ledger import Ledger, n_slots
from .core.schedule import Problem, Schedule, backward_of, get_schedule
from .device import arrays, runtime
from .microkernel.group_sum import launch_group_sums


class Sequence(NamedTuple):
    """One sequence of a packed batch: its first row and length in q and in k, v."""

    start_q: int
    n_q: int
    start_k: int
    n_k: int


@dataclass(frozen=True)
class Sequences:
    """Where each sequence starts and how long it is, in q's rows and in k's."""

    starts_q: tuple
    n_q: tuple
    starts_k: tuple
    n_k: tuple

    def with_queries(self) -> list[Sequence]:
        """The sequences with queries (the others have nothing to compute), in order."""
        return [Sequence(*parts) for parts in zip(self.starts_q, self.n_q, self.starts_k,
                                                  self.n_k, strict=True) if parts[1]]


@dataclass(frozen=True)
class Packed:
    """What a varlen call's arrays look like: kinds, heads, widths, dtype, and each sequence's
    first row and length in q and in k/v."""

    kinds: tuple
    heads: int
    kv_heads: int
    d: int
    dv: int
    dtype: str
    seqs: Sequences

    @property
    def kind(self) -> arrays.Kind:
        return self.kinds[0]

    @property
    def host(self) -> bool:
        return any(kind.host for kind in self.kinds)

    @property
    def total_q(self) -> int:
        return self.seqs.starts_q[-1] + self.seqs.n_q[-1]

    @property
    def total_k(self) -> int:
        return self.seqs.starts_k[-1] + self.seqs.n_k[-1]


def check_cu_seqlens(name: str, cu, total: int | None) -> np.ndarray:
    """cu as a NumPy int32 array of prefix sums 0 = cu[0] <= cu[1] <= ... <= cu[-1] = total
    (any end when total is None), or a TypeError/ValueError naming it."""
    if hasattr(cu, "detach"):  # a torch tensor, on the host or the GPU
        cu = cu.detach().cpu().numpy()
    elif hasattr(cu, "copy_to_host"):
        cu = cu.copy_to_host()
    if not isinstance(cu, np.ndarray) or cu.dtype != np.int32 or cu.ndim != 1:
        what = (f"{cu.dtype} array of {cu.ndim} dimensions" if isinstance(cu, np.ndarray)
                else type(cu).__name__)
        raise TypeError(f"{name}: expected a 1-D int32 array (NumPy or torch) of length "
                        f"batch + 1, got {what}")
    end = cu[-1] if total is None and len(cu) else total
    if len(cu) < 2 or cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] != end:
        raise ValueError(f"{name}: must start at 0, never decrease and end at the packed "
                         f"rows ({end}), with at least one sequence; got {cu.tolist()}")
    return cu


def check_sequences(cu_seqlens_q, cu_seqlens_k, total_q=None, total_k=None) -> Sequences:
    """Both prefix sums checked (`check_cu_seqlens`), as many sequences in each, some query
    in the batch, and keys for every sequence with queries."""
    cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q)
    cu_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k)
    if len(cu_q) != len(cu_k):
        raise ValueError(f"cu_seqlens_k: must give as many sequences as cu_seqlens_q "
                         f"({len(cu_q) - 1}), got {len(cu_k) - 1}")
    n_q, n_k = np.diff(cu_q), np.diff(cu_k)
    if not n_q.any():
        raise ValueError(f"cu_seqlens_q: no sequence has a query (nothing to compute), got "
                         f"{cu_q.tolist()}")
    keyless = np.flatnonzero((n_q > 0) & (n_k == 0))
    if keyless.size:
        b = int(keyless[0])
        raise ValueError(f"cu_seqlens_k: sequence {b} has {n_q[b]} queries and no keys")
    return Sequences(*(tuple(int(x) for x in part) for part in (cu_q[:-1], n_q, cu_k[:-1], n_k)))


def check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, **extra) -> Packed:
    """Shapes, dtypes, kinds and layouts of packed q, k, v (and of `extra` arrays shaped like
    the output, the backward's `do`), and their cu_seqlens."""
    named = (("q", q), ("k", k), ("v", v))
    kinds = {name: api._kind(name, x) for name, x in named}
    qs, ks, vs = (arrays.shape_of(x) for _, x in named)
    if not len(qs) == len(ks) == len(vs) == 3:
        raise ValueError(f"q, k, v: with cu_seqlens expected packed shapes (total_q, heads, d), "
                         f"(total_k, kv_heads, d), (total_k, kv_heads, dv), got q{qs} k{ks} "
                         f"v{vs}")
    if not (ks[:2] == vs[:2] and ks[1] and qs[1] % ks[1] == 0):
        raise ValueError(f"k, v: as many rows and heads as each other, K/V heads equal to q's "
                         f"or dividing them (grouped-query attention), got q{qs} k{ks} v{vs}")
    if ks[2] != qs[2]:
        raise ValueError(f"k: head dim d must equal q's ({qs[2]}), got k{ks}")
    dtype = api.check_arrays(named, kinds, qs[:2] + (vs[2],), extra)
    seqs = check_sequences(cu_seqlens_q, cu_seqlens_k, qs[0], ks[0])
    return Packed(tuple(kinds.values()), qs[1], ks[1], qs[2], vs[2], dtype, seqs)


def check_unpacked(pack_gqa) -> None:
    """Packed grouped-query heads are refused with cu_seqlens."""
    if pack_gqa:
        raise ValueError("pack_gqa: packing a group's query rows takes (batch, heads, n, d) "
                         "inputs; with cu_seqlens use pack_gqa=False (per query head)")


def sequence_problems(sched: Schedule, packed: Packed, block_q, block_k, check,
                      choose=None, **kw) -> tuple[Problem, ...]:
    """Each sequence's Problem (batch 1, its lengths; `kw` as for `api.make_problem`), on
    the tiles named, or chosen for the sequence of the most (query, key) pairs (shared
    memory depends on the tiles, not on n) by `choose(first, problem, block_q, block_k)`:
    `api.fitting_tiles` with `check` unless given (a gradient call's `api_grad.grad_tiles`,
    each pass its own: `Problem.backward_tiles`); `check(p)` accepts each, or refuses. As in
    any call, a tile longer than a sequence is clamped to it: a sequence shorter than the
    tiles runs (and compiles) kernels of its own size."""
    def problem(n_q: int, n_k: int, bq: int, bk: int) -> Problem:
        return api.make_problem(sched, n_q=n_q, n_k=n_k, d=packed.d, dv=packed.dv, batch=1,
                                heads=packed.heads, kv_heads=packed.kv_heads, block_q=bq,
                                block_k=bk, dtype=packed.dtype, **kw)

    check_unpacked(kw.get("pack_gqa"))
    largest = max(packed.seqs.with_queries(), key=lambda seq: seq.n_q * seq.n_k)
    longest = largest.n_q, largest.n_k
    first = problem(*longest, *api.named_tiles(block_q, block_k))
    choose = choose or (lambda p, make, bq, bk: api.fitting_tiles(p, make, bq, bk, check))
    chosen = choose(first, lambda bq, bk: problem(*longest, bq, bk), block_q, block_k)
    tiles, backward = (chosen.block_q, chosen.block_k), chosen.for_backward()
    problems = tuple(problem(nq, nk, *tiles).with_backward_tiles(backward.block_q,
                                                                 backward.block_k)
                     for _, nq, _, nk in packed.seqs.with_queries())
    for p in problems:
        check(p)
    return problems


def check_total(sched: Schedule, problems, parts, backward: bool = False) -> None:
    """The whole call's device memory (`parts(p)`: bytes by part for one sequence, summed)
    and simulator budget, which no one sequence's check sees."""
    total = sum(sum(parts(p).values()) for p in problems)
    limit, where = runtime.memory_limit()
    if total > limit:
        raise ValueError(f"cu_seqlens_q: {sched.name} needs {total:,} bytes of device memory "
                         f"for {len(problems)} sequences; the limit is {limit:,} bytes "
                         f"({where}): use fewer or shorter sequences")
    if runtime.SIMULATOR:
        api.check_simulator_seconds(
            sum(api.simulated_seconds(sched, p, backward) for p in problems),
            f"{sched.name} over {len(problems)} sequences")


def varlen_traffic(sched: Schedule, problems, backward: bool = False) -> Ledger:
    """A varlen call's traffic: the sum of its sequences' models (no padding moves)."""
    total = Ledger({})
    for p in problems:
        total = total + (api.backward_traffic(backward_of(sched), p) if backward
                         else sched.model(p))
    return total


def predict_traffic(schedule: str, cu_seqlens_q, cu_seqlens_k, d: int, dv=None, heads=1,
                    kv_heads=None, block_q=64, block_k=64, backward=False,
                    **kw) -> Ledger:
    """`lo.predict_traffic` of a varlen batch: each sequence's model, summed."""
    sched = get_schedule(schedule)
    seqs = check_sequences(cu_seqlens_q, cu_seqlens_k)
    check_unpacked(kw.get("pack_gqa"))
    problems = [api.make_problem(sched, n_q=nq, n_k=nk, d=d, dv=dv, heads=heads,
                                 kv_heads=kv_heads, block_q=block_q, block_k=block_k, **kw)
                for nq, nk in zip(seqs.n_q, seqs.n_k, strict=True) if nq]
    return varlen_traffic(sched, problems, backward)


@dataclass
class VarlenCall:
    """One varlen call's checks done: the schedule, each sequence's Problem, the arrays."""

    sched: Schedule
    packed: Packed
    problems: tuple
    scale: float
    count: bool
    timed: bool

    @property
    def dtype(self):
        return self.problems[0].kernel_dtype

    def _rows(self, x, at: tuple):
        """x (packed rows) as the kernels' view of each sequence, in `with_queries` order."""
        return [arrays.sequence_rows(x, start, n) for start, n in at]

    def views(self, q, k, v, *outputs_like_q):
        """Per sequence: (q_b, k_b, v_b, each of `outputs_like_q`'s rows), as the kernels
        see them; q, k, v are the caller's arrays, the outputs device views of packed
        arrays with q's rows."""
        kinds = self.packed.kinds
        seqs = self.packed.seqs.with_queries()
        at_q = [(seq.start_q, seq.n_q) for seq in seqs]
        at_k = [(seq.start_k, seq.n_k) for seq in seqs]
        devs = [kinds[i].view(x) for i, x in enumerate((q, k, v))]
        rows = [self._rows(devs[0], at_q), self._rows(devs[1], at_k),
                self._rows(devs[2], at_k)]
        rows += [self._rows(x, at_q) for x in outputs_like_q]
        return list(zip(*rows, strict=True)), at_q, at_k

    def counters(self, like):
        if self.count:
            return runtime.device_zeros(n_slots(), np.int64)
        return self.packed.kind.empty(like, (1,), np.int64)[1]

    def ledger(self, counts, tensors) -> Ledger | None:
        return Ledger.from_array(runtime.to_host(counts), tensors) if self.count else None


class VarlenForward(VarlenCall):
    """`attention` with cu_seqlens: each sequence's launches on views of the packed arrays."""

    def __call__(self, q, k, v, save_lse: bool) -> api.Result:
        pk, kind = self.packed, self.packed.kind
        out, out_dev = kind.empty(q, (pk.total_q, pk.heads, pk.dv), self.dtype)
        lse = lse_dev = None
        if save_lse:
            lse, lse_dev = kind.empty(q, (pk.heads, pk.total_q), np.float32)
        counts = self.counters(q)
        no_lse = None if save_lse else runtime.device_empty((1, 1), np.float32)
        per_seq, at_q, _ = self.views(q, k, v, out_dev)

        def launches():
            for p, (qb, kb, vb, ob), (start, n) in zip(self.problems, per_seq, at_q,
                                                       strict=True):
                lse_b = arrays.sequence_columns(lse_dev, start, n) if save_lse else no_lse
                self.sched.launch(p, qb, kb, vb, ob, lse_b, counts, scale=self.scale,
                                  count=self.count)

        with runtime.Timer(self.timed, kind.stream(q)) as timer:
            runtime.launch_on(kind.stream(q), launches)
        return api.Result(out=kind.finish(out), lse=kind.finish(lse) if save_lse else None,
                          counts=self.ledger(counts, self.sched.ledger_tensors()),
                          problem=None, schedule=self.sched.name, backend=runtime.BACKEND,
                          ms=timer.ms, problems=self.problems)


@dataclass
class VarlenSaved:
    """A varlen forward's results kept for its backward: out and lse (the caller's arrays
    and the kernels' views), each sequence's workspace, the counted forward ledger."""

    out: object
    out_dev: object
    lse: object
    lse_dev: object
    kept: list
    counts: Ledger | None
    ms: float | None


@dataclass
class VarlenGrads:
    """A varlen backward's dq, dk, dv (the caller's kind of array) and counted ledger."""

    dq: object
    dk: object
    dv: object
    counts: Ledger | None
    ms: float | None


class VarlenGrad(VarlenCall):
    """`attention_grad` with cu_seqlens: the forward (lse saved), then the backward, each
    sequence on views of the packed arrays; the torch op runs the two passes apart."""

    def _empty(self, like):
        return lambda shape, dtype: self.packed.kind.empty(like, shape, dtype)[1]

    def forward(self, q, k, v) -> VarlenSaved:
        pk, kind = self.packed, self.packed.kind
        out, out_dev = kind.empty(q, (pk.total_q, pk.heads, pk.dv), self.dtype)
        lse, lse_dev = kind.empty(q, (pk.heads, pk.total_q), np.float32)
        counts = self.counters(q)
        per_seq, at_q, _ = self.views(q, k, v, out_dev)
        kept = [self.sched.allocate_workspace(p, self._empty(q)) for p in self.problems]

        def launches():
            for p, (qb, kb, vb, ob), at, kept_b in zip(self.problems, per_seq, at_q, kept,
                                                       strict=True):
                self.sched.launch(p, qb, kb, vb, ob, arrays.sequence_columns(lse_dev, *at),
                                  counts, scale=self.scale, count=self.count,
                                  workspace=kept_b)

        with runtime.Timer(self.timed, kind.stream(q)) as timer:
            runtime.launch_on(kind.stream(q), launches)
        return VarlenSaved(out, out_dev, lse, lse_dev, kept,
                           self.ledger(counts, self.sched.ledger_tensors()), timer.ms)

    def backward(self, saved: VarlenSaved, q, k, v, do) -> VarlenGrads:
        pk, kind = self.packed, self.packed.kind
        bwd = backward_of(self.sched)
        empty = self._empty(q)
        # dK, dV of a sequence without queries are zeros no kernel writes
        kv_alloc = kind.zeros if 0 in pk.seqs.n_q else kind.empty
        grads = [kind.empty(q, (pk.total_q, pk.heads, pk.d), self.dtype),
                 *(kv_alloc(q, (pk.total_k, pk.kv_heads, width), self.dtype)
                   for width in (pk.d, pk.dv))]
        counts = self.counters(q)
        per_seq, at_q, at_k = self.views(q, k, v, saved.out_dev, arrays.kind_of(do).view(do),
                                         grads[0][1])
        dk_rows, dv_rows = (self._rows(grad[1], at_k) for grad in grads[1:])

        def launches():
            for i, p in enumerate(self.problems):
                pb = p.for_backward()
                qb, kb, vb, ob, dob, dqb = per_seq[i]
                # per query head under grouping: each head's dK, dV parts, summed below
                parts = ([empty((p.bh, p.n_k, width), self.dtype) for width in (p.d, p.dv)]
                         if p.group > 1 else [dk_rows[i], dv_rows[i]])
                bwd.launch(pb, qb, kb, vb, ob, dob,
                           arrays.sequence_columns(saved.lse_dev, *at_q[i]), dqb, *parts,
                           counts, scale=self.scale, count=self.count,
                           forward_workspace=saved.kept[i],
                           workspace=bwd.allocate_workspace(pb, empty))
                if p.group > 1:
                    launch_group_sums(p, *parts, dk_rows[i], dv_rows[i], counts, self.count)

        with runtime.Timer(self.timed, kind.stream(q)) as timer:
            runtime.launch_on(kind.stream(q), launches)
        dq, dk, dv = (kind.finish(user) for user, _ in grads)
        return VarlenGrads(dq, dk, dv, self.ledger(counts, bwd.ledger_tensors()), timer.ms)

    def __call__(self, q, k, v, do) -> GradResult:
        saved = self.forward(q, k, v)
        grads = self.backward(saved, q, k, v, do)
        kind = self.packed.kind
        ms = None if saved.ms is None else saved.ms + grads.ms
        return GradResult(out=kind.finish(saved.out), lse=kind.finish(saved.lse),
                          dq=grads.dq, dk=grads.dk, dv=grads.dv, counts_forward=saved.counts,
                          counts_backward=grads.counts, problem=None,
                          schedule=self.sched.name, backward=backward_of(self.sched).name,
                          backend=runtime.backend_name(), ms=ms, problems=self.problems)


def _scale(scale, d: int) -> float:
    return api._check_scale(1.0 / math.sqrt(d) if scale is None else scale)


def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, schedule, block_q, block_k, causal,
              scale, save_lse, count, options, timed, precision, window,
              pack_gqa) -> api.Result:
    """`lo.attention` with cu_seqlens (its checks in the same order)."""
    sched = get_schedule(schedule)
    packed = check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k)
    count, timed = api._check_bool("count", count), api._check_bool("timed", timed)

    def check(p: Problem) -> None:
        api.check_launch(sched, p, count, packed.host, simulator_budget=False)

    problems = sequence_problems(sched, packed, block_q, block_k, check, causal=causal,
                                 save_lse=save_lse, options=options, precision=precision,
                                 window=window, pack_gqa=pack_gqa)
    check_total(sched, problems, lambda p: api.memory_need(sched, p, count, packed.host))
    call = VarlenForward(sched, packed, problems, _scale(scale, packed.d), count, timed)
    return call(q, k, v, bool(save_lse))


def prepare_grad(q, k, v, do, cu_seqlens_q, cu_seqlens_k, schedule, block_q, block_k,
                 causal, scale, options, count, timed, window, pack_gqa,
                 precision="ieee") -> VarlenGrad:
    """`attention_grad`'s checks, in its order, and the call ready to run (do may be None:
    the torch op checks the forward's arguments before any output gradient exists)."""
    sched = get_schedule(schedule)
    bwd = backward_of(sched)
    packed = check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k,
                          **({} if do is None else {"do": do}))
    count, timed = api._check_bool("count", count), api._check_bool("timed", timed)

    def check(p: Problem) -> None:
        check_grad_launch(sched, bwd, p, count, packed.host, simulator_budget=False)

    def choose(first: Problem, problem, bq, bk) -> Problem:
        # the forward on `attention`'s tiles with cu_seqlens, the backward on its own
        return grad_tiles(sched, bwd, first, problem, bq, bk, count, packed.host,
                          simulator_budget=False, forward_fast=False)

    problems = sequence_problems(sched, packed, block_q, block_k, check, choose,
                                 causal=causal, save_lse=True, options=options,
                                 window=window, pack_gqa=pack_gqa, precision=precision)
    check_total(sched, problems, lambda p: {
        **api.memory_need(sched, p, count, packed.host),
        **{f"backward {k}": v for k, v in
           backward_memory(bwd, p.for_backward(), count, packed.host).items()}},
        backward=True)
    return VarlenGrad(sched, packed, problems, _scale(scale, packed.d), count, timed)


def attention_grad(q, k, v, do, cu_seqlens_q, cu_seqlens_k, schedule, block_q, block_k,
                   causal, scale, options, count, timed, window, pack_gqa,
                   precision="ieee") -> GradResult:
    """`lo.attention_grad` with cu_seqlens."""
    return prepare_grad(q, k, v, do, cu_seqlens_q, cu_seqlens_k, schedule, block_q, block_k,
                        causal, scale, options, count, timed, window, pack_gqa,
                        precision)(q, k, v, do)


api.VARLEN.update(attention=attention, attention_grad=attention_grad,
                  predict_traffic=predict_traffic)
