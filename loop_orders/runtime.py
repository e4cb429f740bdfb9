"""Where kernels run and how arrays get there.

Backend: a real CUDA GPU when one is present, else the Numba CUDA simulator. The choice is made
once, before numba.cuda is first imported, because Numba reads NUMBA_ENABLE_CUDASIM at import.
Set NUMBA_ENABLE_CUDASIM=1 (simulator) or =0 (GPU) yourself to override the detection.

numpy >= 2.5 removed `np.row_stack`, which numba-cuda 0.30.4 still touches when it compiles
its first GPU kernel. Our pyproject pins numpy < 2.5; for environments that already ship a
newer numpy (the H200 image has 2.5.2) `_numpy_compat` restores the alias, documented in
README.md. The simulator never needs it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from pathlib import Path

import numpy as np


def _gpu_present() -> bool:
    """A CUDA driver device node exists (no CUDA call: numba.cuda is not imported yet)."""
    return any(Path("/dev").glob("nvidia[0-9]*")) or Path("/dev/dxg").exists()


if "NUMBA_ENABLE_CUDASIM" not in os.environ:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0" if _gpu_present() else "1"
# Small grids are deliberate here (kv_outer has one CTA per head; tests use tiny shapes).
os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")


def _numpy_compat() -> None:
    if not hasattr(np, "row_stack"):
        np.row_stack = np.vstack  # numba-cuda 0.30.4 vs numpy >= 2.5 (see module docstring)


_numpy_compat()

import numba  # noqa: E402  (must follow the backend choice above)
from numba import cuda  # noqa: E402
from numba.cuda.errors import normalize_kernel_dimensions  # noqa: E402

SIMULATOR: bool = os.environ["NUMBA_ENABLE_CUDASIM"] == "1"


def _fix_simulator_shared_race() -> None:
    """Make the simulator's shared-array allocation atomic.

    numba-cuda 0.30.4's simulator gives each CUDA thread a Python thread; the first thread to
    reach `cuda.shared.array` on a line creates the block's array, checking then setting a
    dict without a lock. Two threads that interleave there get different arrays, so the CTA
    silently stops sharing memory (we saw lost counter updates). Same keys as upstream: the
    calling file and line.
    """
    import threading

    from numba.core import types
    from numba.cuda.simulator.kernelapi import FakeCUDAShared
    from numba.np import numpy_support

    upstream = FakeCUDAShared.array
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:
            return upstream(self, shape, dtype, alignment)  # dynamic: one buffer, no race
        caller = sys._getframe(1)
        key = (caller.f_code.co_filename, caller.f_lineno)
        with lock:
            found = self._allocations.get(key)
            if found is None:
                if isinstance(dtype, types.Type):
                    dtype = numpy_support.as_dtype(dtype)
                found = self._allocations[key] = np.empty(shape, dtype)
        return found

    FakeCUDAShared.array = array


if SIMULATOR:
    _fix_simulator_shared_race()

# Static shared memory a CTA may declare without opting in to more (bytes).
SHARED_BYTES_LIMIT = 48 * 1024
# Shared memory a CTA may use after opting in (dynamic shared memory), on the H100/H200;
# the simulator stands in for that GPU. On a GPU the device's own limit is used.
HOPPER_OPTIN_SHARED_BYTES = 232448
MAX_THREADS_PER_BLOCK = 1024
MAX_GRID_Y = 65535

# `cuda.shared.array(0, dtype)` (dynamic shared memory) needs a NumPy dtype under the simulator
# and a Numba type on the GPU.
SHARED_F32 = np.dtype(np.float32) if SIMULATOR else numba.float32
# 16-byte aligned shared tiles let the compiler use 4-wide shared loads (the simulator
# refuses any alignment argument).
SHARED_ALIGN = None if SIMULATOR else 16


def kernel_options(threads: int, registers: int = 128) -> dict:
    """`cuda.jit` options for a kernel of `threads` threads per CTA (none on the simulator).

    Launch bounds ask for as many CTAs per SM as fit when each thread may use `registers`
    registers (65536 per SM), which is the compiler's register cap. No fastmath: its
    no-inf/no-NaN assumptions would break the -inf running max and NaN propagation; the one
    fast instruction the kernels want, exp2 flushing subnormals, is `intrinsics.exp2`.
    """
    if SIMULATOR:
        return {}
    return {"launch_bounds": (threads, max(1, 65536 // (threads * registers)))}


@functools.cache
def dynamic_shared_limit() -> int:
    """Bytes of shared memory one CTA may use with the opt-in (see `launch`)."""
    if SIMULATOR:
        return HOPPER_OPTIN_SHARED_BYTES
    return int(cuda.get_current_device().MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)


def _args_key(args) -> tuple:
    """What decides which compiled overload serves these arguments: each array's dtype,
    shape and strides (so its Numba layout), each scalar's type. Cheap to build, unlike the
    Numba types themselves."""
    return tuple((a.dtype, a.shape, a.strides) if hasattr(a, "strides") else type(a)
                 for a in args)


_compiled: dict = {}


def _compile(kernel, args, shared_bytes: int):
    """The kernel compiled for these arguments, allowed `shared_bytes` of dynamic shared
    memory. Above 48 KB CUDA needs the function attribute MAX_DYNAMIC_SHARED_SIZE_BYTES,
    which Numba has no public API for: we set it on the compiled function as Numba's own
    `set_shared_memory_carveout` sets its attribute."""
    from numba.cuda.cudadrv.driver import binding, driver

    compiled = kernel.compile(tuple(kernel.typeof_pyval(a) for a in args))
    if shared_bytes > SHARED_BYTES_LIMIT:
        cufunc = compiled._codelibrary.get_cufunc()
        attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        driver.cuKernelSetAttribute(attr, shared_bytes, cufunc.handle, cufunc.device.id)
    return compiled


def _default_stream():
    from numba.cuda.cudadrv.driver import _to_core_stream

    return _to_core_stream(0)


def launch(kernel, grid, block, shared_bytes: int, *args) -> None:
    """kernel[grid, block](*args) with `shared_bytes` of dynamic shared memory per CTA.

    On a GPU this launches the compiled kernel itself (numba-cuda's `_Kernel.launch`, as
    its dispatcher does), looked up by `_args_key`: the dispatcher would work out the
    arguments' Numba types on every launch, host time that falls inside a benchmark's CUDA
    events unless launches are queued back to back (host_us in
    results/gpu_logs/ab_variants_2026-11-30.txt)."""
    if SIMULATOR:
        kernel[grid, block, 0, shared_bytes](*args)
        return
    key = (kernel, shared_bytes, _args_key(args))
    compiled = _compiled.get(key)
    if compiled is None:
        compiled = _compiled[key] = _compile(kernel, args, shared_bytes)
    compiled.launch(args, *normalize_kernel_dimensions(grid, block), _default_stream(),
                    shared_bytes)


def _host_available_bytes() -> int:
    """Host memory the OS says is available (MemAvailable), else free pages, else 4 GiB."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 4 << 30


def memory_limit() -> tuple[int, str]:
    """(bytes one call may allocate on the device, where that number comes from).

    On the GPU: the free device memory now. Under the simulator device arrays are host NumPy
    arrays, so: half of the host memory that is available (the other half for the reference
    check and everything else the process holds).
    """
    if SIMULATOR:
        return _host_available_bytes() // 2, "half the available host memory (simulator)"
    free, _total = cuda.current_context().get_memory_info()
    return int(free), f"free device memory on {device_name()}"


def backend_name() -> str:
    return "simulator" if SIMULATOR else "gpu"


def device_name() -> str:
    if SIMULATOR:
        return "Numba CUDA simulator"
    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else str(name)


def is_device_array(x) -> bool:
    return hasattr(x, "__cuda_array_interface__")


def to_device(x):
    """A Numba device array viewing or holding `x` (NumPy arrays are copied to the device)."""
    if hasattr(x, "copy_to_host"):
        return x
    if not SIMULATOR and cuda.is_cuda_array(x):
        return cuda.as_cuda_array(x)
    return cuda.to_device(np.ascontiguousarray(x))


def device_empty(shape, dtype):
    return cuda.device_array(shape, dtype=dtype)


def device_zeros(shape, dtype):
    return cuda.to_device(np.zeros(shape, dtype=dtype))


def to_host(x) -> np.ndarray:
    return x.copy_to_host() if hasattr(x, "copy_to_host") else np.asarray(x)


def synchronize() -> None:
    cuda.synchronize()


@contextlib.contextmanager
def launching():
    """Wrap kernel launches. Under the simulator, shorten the interpreter's thread switch
    interval meanwhile: the simulator runs one Python thread per CUDA thread and polls them
    from the main thread, and a short interval makes it about ten times faster."""
    if not SIMULATOR:
        yield
        return
    previous = sys.getswitchinterval()
    sys.setswitchinterval(5e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


class Timer:
    """Elapsed milliseconds of the launches inside the `with` block.

    CUDA events on the GPU; a host clock around a synchronised region under the simulator
    (which has no events). Use for coarse timing only; benchmarks use experiments/ scripts.
    """

    def __enter__(self):
        if SIMULATOR:
            import time

            self._t0 = time.perf_counter()
        else:
            self._start, self._stop = cuda.event(), cuda.event()
            self._start.record()
        return self

    def __exit__(self, *exc):
        if SIMULATOR:
            import time

            self.ms = (time.perf_counter() - self._t0) * 1e3
        else:
            self._stop.record()
            self._stop.synchronize()
            self.ms = cuda.event_elapsed_time(self._start, self._stop)
        return False
