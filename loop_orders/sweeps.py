"""The calls of a sweep as `warm` jobs (`loop-orders warm`): each on the tiles named, or on
those a call naming none runs (a gradient call's passes each on their own)."""

from __future__ import annotations

import contextlib
import itertools

from .api import attention_tiles, make_problem, named_tiles
from .api_grad import grad_problem, grad_tiles
from .core.schedule import Problem, backward_of, get_schedule
from .warm import Job


def call_problem(sched, n: int, d: int, dv, dtype: str, causal: bool, block_q, block_k,
                 count: bool, grad: bool) -> Problem:
    """The Problem of a call at length n on the tiles named, or (None) on those a call naming
    none runs: `lo.attention`'s, or a gradient call's (`grad`: lse saved, each pass its own
    tiles, `api_grad.grad_tiles`). Tiles the API refuses are kept (`warm_cache` drops the
    job)."""
    def forward(block_q: int, block_k: int) -> Problem:
        return make_problem(sched, n_q=n, d=d, dv=dv, block_q=block_q, block_k=block_k,
                            causal=causal, dtype=dtype)

    problem = grad_problem(sched, n, n, d, dv, 1, 1, None, dtype, causal, None, (-1, -1),
                           False) if grad else forward
    p = problem(*named_tiles(block_q, block_k))
    with contextlib.suppress(ValueError):
        if grad:
            return grad_tiles(sched, backward_of(sched), p, problem, block_q, block_k, count,
                              False, simulator_budget=False)
        return attention_tiles(sched, p, problem, block_q, block_k, count, False,
                               simulator_budget=False)
    return p


def sweep_jobs(schedules, ds, dtypes, *, n: int = 1024, causal=(False, True), dv=None,
               block_q: int | None = None, block_k: int | None = None, counted=(False,),
               backward: bool = False) -> list[Job]:
    """The jobs of a sweep: every schedule x head dim x dtype x causal x counted, at length n
    (any length the tiles fit gives the same kernels), on the tiles named or those a call
    naming none runs (`call_problem`); with `backward`, a gradient call's."""
    jobs = []
    for name, d, dtype, is_causal, count in itertools.product(schedules, ds, dtypes, causal,
                                                               counted):
        sched = get_schedule(name)
        grad = backward and bool(sched.BACKWARD)
        jobs.append(Job(name, call_problem(sched, n, d, dv, dtype, is_causal, block_q, block_k,
                                           count, grad), count, grad))
    return jobs
