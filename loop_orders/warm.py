"""Compile kernels ahead, many at once, into the disk cache of compiled kernels.

A kernel is compiled for its compile-time constants (tiles, head dims, dtype, mask, counted or
not) and its arguments' types, never for n or the batch: one compile serves every length.
Compiling is single-threaded host work (Numba's typing and lowering, NVVM, ptxas), seconds a
kernel, so a sweep's or a training script's first calls would compile one kernel after
another. `warm` records the launches a call would make (`runtime.recording_launches`, with
zero-pointer views for arrays: nothing runs), drops the kernels the disk cache already holds,
and compiles the rest, each build once, in worker processes at once (`device.kernel_cache`
takes concurrent writers); later calls, in this process or any other, load them.

    loop-orders warm --schedules q_outer kv_outer --d 64 128 --dtypes float16 --backward
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import time
from typing import NamedTuple

import numpy as np

from .core.ledger import n_slots
from .core.schedule import Problem, backward_of, get_schedule
from .device import kernel_cache, runtime
from .device.arrays import DeviceView, c_strides
from .microkernel import tuning


class Job(NamedTuple):
    """One call to compile for: its schedule, its problem, counted or not, whether its
    backward pass is compiled too, and the `tuning.tuned` override it runs under (name,
    value pairs: a sweep's row; none for the default choice)."""

    schedule: str
    problem: Problem
    count: bool = False
    backward: bool = False
    tuned: tuple = ()


def view(shape, dtype) -> DeviceView:
    """A zero-pointer device array view: for recording and compiling launches, never run."""
    dtype = np.dtype(dtype)
    return DeviceView(0, shape, c_strides(shape, dtype.itemsize), dtype)


def recorded_launches(sched, p: Problem, count: bool, backward: bool) -> list:
    """The launches (kernel, grid, block, shared bytes, args) a forward (and backward) call
    of p makes, recorded with `view` arrays instead of run."""
    dt = p.kernel_dtype
    q, k = view((p.bh, p.n_q, p.d), dt), view((p.bh_kv, p.n_k, p.d), dt)
    v, o = view((p.bh_kv, p.n_k, p.dv), dt), view((p.bh, p.n_q, p.dv), dt)
    lse, counts = view((p.bh, p.n_q), np.float32), view((n_slots(),), np.int64)
    with runtime.recording_launches() as launches:
        workspace = sched.allocate_workspace(p, view)
        sched.launch(p, q, k, v, o, lse, counts, scale=0.125, count=count, workspace=workspace)
        if backward:
            bwd, pb = backward_of(sched), p.for_backward()
            # dK, dV per query head (summed per K/V head afterwards under grouping)
            bwd.launch(pb, q, k, v, o, o, lse, view(q.shape, dt), view((p.bh, p.n_k, p.d), dt),
                       view((p.bh, p.n_k, p.dv), dt), counts, scale=0.125, count=count,
                       forward_workspace=workspace, workspace=bwd.allocate_workspace(pb, view))
    return launches


def job_launches(job: Job) -> list:
    """`recorded_launches` of the job's call, under its tuning override if it names one
    (else under the caller's: a call inside a `tuning.tuned` block compiles what it runs)."""
    override = tuning.tuned(**dict(job.tuned)) if job.tuned else contextlib.nullcontext()
    with override:
        return recorded_launches(get_schedule(job.schedule), job.problem, job.count,
                                 job.backward)


def _all_cached(job: Job) -> bool:
    """Whether the disk cache holds every kernel build of the job already."""
    launches = job_launches(job)
    return all(runtime.is_cached(kernel, args) for kernel, _, _, _, args in launches)


def _accepted(job: Job) -> Job | None:
    """The job as the API would run it: None if it refuses the forward, without its backward
    if it refuses that (a build it refuses may not even load: shared memory past the
    device's limit)."""
    from .api import check_launch

    sched = get_schedule(job.schedule)
    try:
        check_launch(sched, job.problem, job.count, host_inputs=False, simulator_budget=False)
    except (ValueError, TypeError):
        return None
    if job.backward:
        try:
            backward_of(sched).check_kernels(job.problem.for_backward(), job.count)
        except (ValueError, TypeError):
            return job._replace(backward=False)
    return job


def _builds(jobs: list) -> list:
    """(factory key, argument types) of each kernel build of `jobs` that the disk cache
    lacks, each build once: calls at several lengths, counted calls beside uncounted ones,
    or a forward call beside its gradient call share builds, and handed out by job several
    workers would compile one build at the same time (a fuzz's 494 builds went to workers as
    1258). Kernels no factory made are left out: they cannot be cached."""
    seen, builds = set(), []
    for job in jobs:
        for kernel, _, _, _, args in job_launches(job):
            key = runtime.build_key(kernel, args)
            made_by = runtime.factory_key(kernel)
            if made_by and key not in seen and not runtime.is_cached(kernel, args):
                seen.add(key)
                builds.append((made_by, key[1]))
    return builds


def _compile_build(build: tuple) -> int:
    """In a worker process: compile one build, (factory key, argument types, compute
    capability, cache environment), to PTX without a CUDA context, link it to its cubin
    where the linker needs no context (`runtime.link_without_a_device`; else the process
    that loads it links it: `kernel_cache.load`) and store it in the disk cache; 1 when
    done. A build
    that fails is reported and skipped (0): the call that needs it compiles it again and
    raises there, where its caller sees it."""
    made_by, sig, cc, env = build
    if not kernel_cache.same_source(env):
        print(f"warm: {made_by[1]}{made_by[2]}: the package's source changed since the build "
              f"was asked for; not compiled", file=sys.stderr, flush=True)
        return 0
    try:
        compiled = runtime.compile_without_a_device(runtime.kernel_of(made_by), sig, cc)
        runtime.link_without_a_device(compiled, cc)  # its cubin too, where that needs no GPU
        kernel_cache.store(made_by, sig, compiled, env)
        return 1
    except Exception as exc:  # reported; the sweep goes on
        print(f"warm: {made_by[1]}{made_by[2]} for {sig}: {exc}", file=sys.stderr,
              flush=True)
        return 0


def _for_workers(builds: list) -> list:
    """`builds` with what a worker without a device needs besides: this device's compute
    capability and the disk cache's environment (the key of the process that loads them)."""
    cc, env = runtime.compute_capability(), kernel_cache.environment()
    return [(made_by, sig, cc, env) for made_by, sig in builds]


def warm_cache(jobs: list, workers: int = 8) -> int:
    """Compile the kernels of `jobs` (`Job`s) into the disk cache in `workers` processes at
    once, each build missing from the cache once (`_builds`), a worker taking the next build
    as it finishes one (a build takes from about a second to a minute); returns the builds
    compiled. Nothing to do on the simulator (it compiles nothing) or with the cache off."""
    if runtime.SIMULATOR or kernel_cache.cache_dir() is None:
        return 0
    builds = _builds([job for job in map(_accepted, dict.fromkeys(jobs)) if job is not None])
    if not builds:
        return 0
    with mp.get_context("spawn").Pool(min(workers, len(builds))) as pool:
        return sum(pool.imap_unordered(_compile_build, _for_workers(builds)))


def compile_ahead(job: Job) -> int:
    """The first call of a new shape compiles its kernels at once rather than one after
    another as its passes reach them: when two or more of the job's kernel builds are
    neither on disk nor built in this process, each but the first is compiled in a fresh
    Python process (`python -c`, so a script without a `__main__` guard is safe; it compiles
    to PTX with no CUDA context, `_compile_build`) while this process compiles the first,
    and returns then: the call's first pass runs while the workers still compile, and the
    first launch of a worker's build waits for its worker and loads the build from the disk
    cache (`runtime.compiling_elsewhere`). Returns the builds compiled here or handed to a
    worker. Nothing on the simulator, with the cache off, or with
    LOOP_ORDERS_COMPILE_AHEAD=0; a worker's build that failed is compiled at its launch,
    and raises there if it fails again."""
    if (runtime.SIMULATOR or kernel_cache.cache_dir() is None
            or os.environ.get("LOOP_ORDERS_COMPILE_AHEAD", "1") == "0"):
        return 0
    launches = job_launches(job)
    missing = {}  # build -> its first launch (a kernel may launch twice with the same types)
    for i, (kernel, _, _, _, args) in enumerate(launches):
        if not (runtime.is_built(kernel, args) or runtime.is_cached(kernel, args)
                or runtime.is_compiling_elsewhere(kernel, args)):
            missing.setdefault(runtime.build_key(kernel, args), i)
    if len(missing) < 2:
        return 0  # one build: compiling it here, at its launch, is as fast
    (_, first), *rest = missing.items()  # (build key, its launch index)
    rest = [(kernel, sig) for (kernel, sig), _ in rest if runtime.factory_key(kernel)]
    builds = _for_workers([(runtime.factory_key(kernel), sig) for kernel, sig in rest])
    for (kernel, sig), build in zip(rest, builds, strict=True):
        proc = subprocess.Popen([sys.executable, "-c", _WORKER], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        proc.stdin.write(pickle.dumps(build))
        proc.stdin.close()
        runtime.compiling_elsewhere(kernel, sig, proc.wait)
    kernel, _, _, shared, args = launches[first]
    runtime._compile(kernel, args, shared)  # this process's build, as the workers compile
    return 1 + len(builds)


_WORKER = "import loop_orders.warm as w; w._compile_one()"


def _compile_one() -> None:
    """A `compile_ahead` worker: a build pickled on stdin (`_compile_build`'s); exits 1 if it
    failed."""
    sys.exit(0 if _compile_build(pickle.loads(sys.stdin.buffer.read())) else 1)


def warm(jobs: list, workers: int = 8, say=print) -> int:
    """`warm_cache` with a line saying what it did; returns the builds compiled."""
    t0 = time.time()
    done = warm_cache(jobs, workers)
    say(f"warm: {done} kernel builds for {len(set(jobs))} calls in {time.time() - t0:.1f} s "
        f"({workers} processes) into {kernel_cache.cache_dir()}")
    return done
