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
import ctypes
import functools
import itertools
import math
import os
import sys
import threading
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

SIMULATOR: bool = os.environ["NUMBA_ENABLE_CUDASIM"] == "1"
BACKEND = "simulator" if SIMULATOR else "gpu"


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


def _yield_while_polling() -> None:
    """Let the simulator's block manager hand over the GIL while it polls.

    The manager waits for a CTA's threads in a busy loop (`is_alive` and the barrier flags of
    every thread, over and over) that holds the GIL for whole switch intervals, so each
    barrier and each warp exchange (`intrinsics`) waits on it. Yielding at each `is_alive`
    halves the time of a simulated kernel (0.69 s against 1.36 s for a small kv_outer).
    """
    import threading
    import time

    from numba.cuda.simulator.kernel import BlockThread

    def is_alive(self):
        time.sleep(0)  # give the GIL to the CTA's threads
        return threading.Thread.is_alive(self)

    BlockThread.is_alive = is_alive


if SIMULATOR:
    _fix_simulator_shared_race()
    _yield_while_polling()

# Static shared memory a CTA may declare without opting in to more (bytes).
SHARED_BYTES_LIMIT = 48 * 1024
# Shared memory a CTA may use after opting in (dynamic shared memory), on the H100/H200;
# the simulator stands in for that GPU. On a GPU the device's own limit is used.
HOPPER_OPTIN_SHARED_BYTES = 232448
MAX_THREADS_PER_BLOCK = 1024
MAX_GRID_Y = 65535
# Streaming multiprocessors of the H100/H200, which the simulator stands in for; resident
# threads, CTAs and shared memory per SM (Hopper).
HOPPER_MULTIPROCESSORS = 132
THREADS_PER_SM = 2048
CTAS_PER_SM = 32
SHARED_BYTES_PER_SM = 233472

# `cuda.shared.array(0, dtype)` (dynamic shared memory) needs a NumPy dtype under the simulator
# and a Numba type on the GPU.
SHARED_F32 = np.dtype(np.float32) if SIMULATOR else numba.float32
# 16-byte aligned shared tiles let the compiler use 4-wide shared loads (the simulator
# refuses any alignment argument).
SHARED_ALIGN = None if SIMULATOR else 16


def inlined(fn):
    """`fn` as a device function inlined into every caller: on a GPU by LLVM (numba-cuda's
    `forceinline`, NVVM's alwaysinline) rather than by Numba itself (`inline="always"`), which
    types the callee again at every call site, so builds compile several times faster
    (results/tuning_history/micro_kernel.md). Every device function takes it but those
    returning an array they make (the shared-memory tiles), which Numba must inline, and the
    few large step functions holding local arrays. The simulator calls it."""
    if SIMULATOR:
        return cuda.jit(device=True)(fn)
    return cuda.jit(device=True, forceinline=True)(fn)


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


def _hopper_stand_in() -> bool:
    """Whether device limits are the H100/H200's rather than asked of a device: on the
    simulator, and with LOOP_ORDERS_DEVICE_LIMITS=hopper (compiling without a GPU)."""
    return SIMULATOR or os.environ.get("LOOP_ORDERS_DEVICE_LIMITS") == "hopper"


@functools.cache
def dynamic_shared_limit() -> int:
    """Bytes of shared memory one CTA may use with the opt-in (see `launch`)."""
    if _hopper_stand_in():
        return HOPPER_OPTIN_SHARED_BYTES
    return int(cuda.get_current_device().MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)


@functools.cache
def has_wgmma() -> bool:
    """Whether kernels here may use Hopper's sm_90a instructions (wgmma): on an H100/H200,
    and where the simulator (which emulates them) or a compile without a GPU stands in."""
    return _hopper_stand_in() or compute_capability()[:2] == (9, 0)


@functools.cache
def multiprocessor_count() -> int:
    """SMs of the GPU (of the H100/H200 the simulator stands in for)."""
    if _hopper_stand_in():
        return HOPPER_MULTIPROCESSORS
    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


def resident_ctas(threads: int, shared_bytes: int, registers: int) -> int:
    """CTAs of `threads` threads, `shared_bytes` of shared memory and `registers` registers
    per thread that one SM holds at once (Hopper's limits; 1 KB of shared memory per CTA is
    the system's)."""
    by_shared = SHARED_BYTES_PER_SM // (shared_bytes + 1024)
    return max(1, min(CTAS_PER_SM, THREADS_PER_SM // threads, by_shared,
                      65536 // (threads * registers)))


def _is_array(a) -> bool:
    """A kernel argument passed as an array (NumPy scalars have strides too, but are not)."""
    return hasattr(a, "strides") and not isinstance(a, np.generic)


def _args_key(args) -> tuple:
    """What decides which compiled overload serves these arguments: each array's dtype,
    shape and strides (so its Numba layout), each scalar's type. Cheap to build, unlike the
    Numba types themselves."""
    return tuple((a.dtype, a.shape, a.strides) if _is_array(a) else type(a) for a in args)


# --- Compiled kernels: made once per process, kept on disk across processes ---------------

_FACTORY_KEYS: dict = {}


def kernel_factory(make):
    """Decorator for a kernel factory (a function of compile-time constants returning a
    `cuda.jit` kernel): calls are cached, and the kernel remembers which factory and
    arguments made it, which is what the disk cache of compiled kernels keys on."""
    made = functools.cache(make)

    @functools.wraps(make)
    def factory(*args):
        kernel = made(*args)
        _FACTORY_KEYS.setdefault(kernel, (make.__module__, make.__qualname__, args))
        return kernel

    return factory


def c_strides(shape, itemsize: int) -> tuple:
    """Byte strides of a C-contiguous array of this shape."""
    strides, step = [], itemsize
    for extent in reversed(shape):
        strides.append(step)
        step *= extent
    return tuple(reversed(strides))


def _numba_type(a):
    """The Numba type a kernel parameter is compiled for (arrays by dtype, rank, layout)."""
    from numba import types
    from numba.np import numpy_support

    if _is_array(a):
        layout = "C" if tuple(a.strides) == c_strides(a.shape, a.dtype.itemsize) else "A"
        return types.Array(numpy_support.from_dtype(a.dtype), len(a.shape), layout)
    return numba.typeof(a)


def _compile(kernel, args, shared_bytes: int):
    """The kernel compiled for these arguments (from the disk cache when it holds it),
    allowed `shared_bytes` of dynamic shared memory. Above 48 KB CUDA needs the function
    attribute MAX_DYNAMIC_SHARED_SIZE_BYTES, which Numba has no public API for: we set it on
    the compiled function as Numba's own `set_shared_memory_carveout` sets its attribute."""
    from numba.cuda.cudadrv.driver import binding, driver

    compiled = _built(kernel, tuple(_numba_type(a) for a in args))
    # The 48 KB line is on static + dynamic shared memory together (the counters' flush
    # is static): dense's P V at 128 x 16 tiles and d = 96 takes exactly 48 KB dynamic, and
    # counted, failed to launch without the attribute. A build launched with several sizes
    # keeps the largest.
    if shared_bytes + compiled.shared_mem_per_block > SHARED_BYTES_LIMIT:
        cufunc = compiled._codelibrary.get_cufunc()
        allowed = _DYNAMIC_SHARED.get(cufunc, 0)
        if shared_bytes > allowed:
            attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            driver.cuKernelSetAttribute(attr, shared_bytes, cufunc.handle, cufunc.device.id)
            _DYNAMIC_SHARED[cufunc] = shared_bytes
    return compiled


def _built(kernel, sig: tuple):
    """`kernel` compiled for the argument types `sig`: this process's build, else the disk
    cache's (once the worker compiling it, if any, is done: `compiling_elsewhere`), else
    compiled here and stored there."""
    from . import kernel_cache

    compiled = _BUILT.get((kernel, sig))
    if compiled is None:
        worker = _COMPILING.pop((kernel, sig), None)
        if worker is not None:
            worker()  # a compile worker's build: on disk once it is done (or it failed)
        factory_key = _FACTORY_KEYS.get(kernel)
        compiled = kernel_cache.load(factory_key, sig) if factory_key else None
        if compiled is None:
            compiled = kernel.compile(sig)
            if factory_key:
                kernel_cache.store(factory_key, sig, compiled)
        _BUILT[kernel, sig] = compiled
    return compiled


_DYNAMIC_SHARED: dict = {}  # compiled function -> the dynamic shared bytes it is allowed
_BUILT: dict = {}  # (kernel, argument types) -> its build compiled or loaded in this process


_COMPILING: dict = {}  # (kernel, argument types) -> waits for the process compiling it


def compiling_elsewhere(kernel, sig: tuple, wait) -> None:
    """Say that another process is compiling `kernel` for the argument types `sig` into the
    disk cache (`warm.compile_ahead`'s workers): the first launch that needs the build calls
    `wait()` before it loads the build from the disk cache (or, where the worker failed,
    compiles it here)."""
    _COMPILING[kernel, sig] = wait


def is_compiling_elsewhere(kernel, args) -> bool:
    """Whether a `compiling_elsewhere` build of `kernel` for these arguments is awaited."""
    return build_key(kernel, args) in _COMPILING


def compute_capability() -> tuple:
    """The current device's compute capability as Numba keys what it builds for the device:
    (major, minor, "a") from 9.0 on (its kernels are built for the arch-specific target,
    compute_90a), else (major, minor, "")."""
    major, minor = tuple(cuda.get_current_device().compute_capability)[:2]
    return major, minor, "a" if (major, minor) >= (9, 0) else ""


def factory_key(kernel) -> tuple | None:
    """(module, factory name, compile-time constants) of a factory-made kernel, else None."""
    return _FACTORY_KEYS.get(kernel)


def kernel_of(key: tuple):
    """The kernel a `factory_key` names, made again by its factory (in a compile worker)."""
    import importlib

    module, qualname, args = key
    factory = importlib.import_module(module)
    for part in qualname.split("."):
        factory = getattr(factory, part)
    return factory(*args)


def compile_without_a_device(kernel, sig: tuple, cc: tuple):
    """`kernel` compiled to PTX for these argument types and the device whose
    `compute_capability()` is `cc`, with no CUDA context (a compile worker's; it links the
    PTX to a cubin only where the linker needs no context, `link_without_a_device`, else the
    process that loads the build links it). Numba asks the current device for
    its compute capability as it compiles a kernel, and its context for the target it keys
    the PTX under (`cc`, "a" included) as it turns its LLVM into PTX: in this process both
    are told from now on, so the loading process finds the PTX under its own key."""
    import types as pytypes

    from numba.cuda import codegen, dispatcher

    device = pytypes.SimpleNamespace(compute_capability=tuple(cc[:2]))
    dispatcher.get_current_device = lambda: device
    codegen.CUDACodeLibrary._ensure_cc = lambda self, asked: cc if asked is None else asked
    return dispatcher._Kernel(kernel.py_func, sig, **kernel.targetoptions)


def link_without_a_device(compiled, cc: tuple) -> bool:
    """Link a `compile_without_a_device` build's PTX to its cubin for `cc` here, where the
    linker needs no CUDA context (cuda.core's nvJitLink backend, the one every process then
    links with): the process that loads the build loads the cubin instead of linking it
    while its first call waits (about a second for a large kernel). False, nothing done,
    where only the driver's linker is there (it needs a context)."""
    if linker_backend() != "nvJitLink":
        return False
    compiled._codelibrary.get_cubin(cc)  # kept in the library, pickled with it
    return True


def linker_backend() -> str:
    """What links PTX to cubins in this process (cuda.core's `Linker`): "nvJitLink" or
    "driver"."""
    import warnings

    try:
        from cuda.core import Linker
    except ImportError:
        from cuda.core.experimental import Linker
    with warnings.catch_warnings():  # the driver fallback's warning: the answer is enough
        warnings.simplefilter("ignore")
        return getattr(Linker, "which_backend", lambda: "driver")()


def build_key(kernel, args) -> tuple:
    """What one build of `kernel` is compiled for: the kernel and its arguments' types."""
    return kernel, tuple(_numba_type(a) for a in args)


def is_built(kernel, args) -> bool:
    """Whether this process has `kernel` compiled (or loaded) for these arguments' types."""
    return build_key(kernel, args) in _BUILT


def is_cached(kernel, args) -> bool:
    """Whether the disk cache holds `kernel` compiled for these arguments (`loop_orders.warm`
    compiles the rest ahead)."""
    from . import kernel_cache

    factory_key = _FACTORY_KEYS.get(kernel)
    if factory_key is None:
        return False
    path = kernel_cache.entry_path(factory_key, tuple(_numba_type(a) for a in args))
    return path is not None and path.exists()


class _Launcher:
    """One compiled kernel's launch with its parameters kept in a ctypes block: a call only
    writes the arrays' data pointers and the scalars into it and calls cuLaunchKernel.

    Numba passes an array as meminfo, parent, nitems, itemsize, data, shape..., strides...
    (numba-cuda's `_Kernel._prepare_args`); shapes and strides are part of the lookup key,
    so only the pointers change from call to call."""

    def __init__(self, compiled, args):
        self.compiled = compiled
        self.function = ctypes.c_void_p(int(compiled._codelibrary.get_cufunc().handle))
        self._launch = _driver_launch()
        cells, self.pointers, self.scalars = [], [], []
        for i, (a, ty) in enumerate(zip(args, compiled.argument_types, strict=True)):
            if _is_array(a):
                size = int(np.prod(a.shape, dtype=np.int64))
                cells += [ctypes.c_int64(0), ctypes.c_int64(0), ctypes.c_int64(size),
                          ctypes.c_int64(a.dtype.itemsize)]
                data = ctypes.c_uint64(0)
                cells.append(data)
                self.pointers.append((i, data))
                cells += [ctypes.c_int64(x) for x in (*a.shape, *a.strides)]
            else:
                ctype = {"float32": ctypes.c_float, "float64": ctypes.c_double,
                         "int64": ctypes.c_int64, "int32": ctypes.c_int32,
                         "uint32": ctypes.c_uint32}[str(ty)]
                cell = ctype(0)
                cells.append(cell)
                self.scalars.append((i, cell))
        self._cells = cells  # the parameter block points into these
        self.pointer_cells = [cell for _, cell in self.pointers]
        self.scalar_cells = [cell for _, cell in self.scalars]
        self.params = (ctypes.c_void_p * len(cells))(*(ctypes.addressof(c) for c in cells))
        self.address = ctypes.addressof(self.params)
        self.lock = threading.Lock()  # `launch_with`'s

    def __call__(self, grid, block, shared_bytes: int, stream: int, args) -> None:
        self.launch_with([data_pointer(args[i]) for i, _ in self.pointers],
                         [args[i] for i, _ in self.scalars], grid, block, shared_bytes, stream)

    def launch_with(self, addresses, scalars, grid, block, shared_bytes: int,
                    stream: int) -> None:
        """cuLaunchKernel with these array addresses and scalars written into the block
        (under `lock`: the ctypes call lets other threads run while the driver reads it)."""
        with self.lock:
            for cell, address in zip(self.pointer_cells, addresses, strict=True):
                cell.value = address
            for cell, value in zip(self.scalar_cells, scalars, strict=True):
                cell.value = value
            self._start(grid, block, shared_bytes, stream)

    def _start(self, grid, block, shared_bytes: int, stream: int) -> None:
        gx, gy, gz = grid
        err = self._launch(self.function, gx, gy, gz, block, 1, 1, shared_bytes, stream,
                           self.address, None)
        if err:
            from numba.cuda.cudadrv.driver import binding

            raise RuntimeError(f"cuLaunchKernel of {self.compiled.entry_name} failed: "
                               f"{binding.CUresult(err)!r}")


@functools.cache
def _driver_launch():
    """The driver's cuLaunchKernel called through ctypes: the cuda-python binding converts
    and checks each argument (microseconds a launch); the parameter block is ours already."""
    fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
    fn.argtypes = [ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def data_pointer(a) -> int:
    """Device address of an array: a kernel's argument (a DeviceView or a Numba array) or
    a tape's slot (those, a torch tensor, any __cuda_array_interface__ object); how to read
    it is worked out once per type (host time per call)."""
    read = _ADDRESS_OF.get(type(a))
    if read is None:
        read = _ADDRESS_OF[type(a)] = _address_reader(a)
    return read(a)


_ADDRESS_OF: dict = {}  # array type -> how to read an address off it


def _address_reader(a):
    if hasattr(a, "ptr") and not callable(a.ptr):
        return lambda x: x.ptr  # arrays.DeviceView
    if callable(getattr(a, "data_ptr", None)):
        return type(a).data_ptr  # torch
    if hasattr(a, "device_ctypes_pointer"):
        return lambda x: x.device_ctypes_pointer.value or 0  # Numba
    return lambda x: x.__cuda_array_interface__["data"][0]


_launchers: dict = {}
_stream = threading.local()  # this thread's stream, taping and recording


@contextlib.contextmanager
def recording_launches():
    """Inside the block, `launch` records (kernel, grid, block, shared bytes, args) in the
    list it yields instead of launching, in this thread (experiments/ptx_check.py compiles
    them without a GPU; `warm` compiles them ahead)."""
    previous, recorded = getattr(_stream, "recording", None), []
    _stream.recording = recorded
    try:
        yield recorded
    finally:
        _stream.recording = previous


@contextlib.contextmanager
def on_stream(handle: int):
    """Launch the kernels inside the block on CUDA stream `handle` (0: the default)."""
    previous = getattr(_stream, "handle", 0)
    _stream.handle = handle
    try:
        yield
    finally:
        _stream.handle = previous


def is_recording() -> bool:
    """Whether `launch` records this thread's launches now (`recording_launches`) instead of
    running them."""
    return getattr(_stream, "recording", None) is not None


def current_stream() -> int:
    return getattr(_stream, "handle", 0)


def set_stream(handle: int) -> int:
    """Make `handle` the launches' stream; returns the previous one (on_stream, without a
    context manager's cost)."""
    previous = getattr(_stream, "handle", 0)
    _stream.handle = handle
    return previous


def launch(kernel, grid, block, shared_bytes: int, *args) -> None:
    """kernel[grid, block](*args) with `shared_bytes` of dynamic shared memory per CTA, on
    the stream of `on_stream`.

    On a GPU this launches the compiled kernel itself through `_Launcher`, looked up by
    `_args_key`: Numba's dispatcher would work out the arguments' Numba types on every
    launch, and its launch path converts every argument (tens of microseconds of host time
    per launch; results/host_overhead.json)."""
    recording = getattr(_stream, "recording", None)
    if recording is not None:
        recording.append((kernel, grid, block, shared_bytes, args))
        return
    if SIMULATOR:
        kernel[grid, block, 0, shared_bytes](*args)
        return
    key = (kernel, shared_bytes, _args_key(args))
    launcher = _launchers.get(key)
    if launcher is None:
        launcher = _launchers[key] = _Launcher(_compile(kernel, args, shared_bytes), args)
    grid = grid if isinstance(grid, tuple) else (grid,)
    grid = grid + (1,) * (3 - len(grid))
    launcher(grid, block, shared_bytes, current_stream(), args)
    taping = getattr(_stream, "taping", None)
    if taping is not None:
        taping.append((launcher, grid, block, shared_bytes, args))


# --- Taped launches: a call's launches, recorded once, launched again with new arrays ------

# A kernel may be chosen by its arrays' alignment (16-byte copies, `cuda_cores.launch_kernel`),
# so a tape serves only arrays whose addresses agree with its recording's modulo this.
TAPE_ALIGNMENT = 16


def _extent(a) -> int:
    """Bytes from an array's first element to the end of its last: a tape slot's `nbytes`
    (C-contiguous arrays; a DeviceView's counts its strides), else from its
    __cuda_array_interface__ (C-contiguous: checked for inputs)."""
    nbytes = getattr(a, "nbytes", None)
    if nbytes is not None:
        return int(nbytes)
    iface = a.__cuda_array_interface__
    return math.prod(iface["shape"]) * np.dtype(iface["typestr"]).itemsize


def derived(array, rebuild, sources):
    """Say that `array`, a launch's parameter, derives from the call's arrays `sources`
    (anything `data_pointer` reads) alone: rebuild(addresses) makes the one for arrays of the
    same shapes at those addresses (a tensor map's, `tensor_map.maps_for`), so that a `Tape`
    can replay the launch on another call's arrays. Returns the array."""
    taping = getattr(_stream, "derived", None)
    if taping is not None:
        taping[data_pointer(array)] = (rebuild, tuple(data_pointer(a) for a in sources))
    return array


class Tape:
    """The launches one call of a key made, each as its launcher, launch shape, scalars and,
    for each array parameter, which of the call's arrays (its slot) it points into and at
    what byte offset, or for one derived from them (`derived`) how to make it again from
    theirs; `replay` launches them again on another call's arrays of the same key. What a
    schedule's launch works out in Python (kernels, grids, views of its arrays) depends on
    the key alone, and on the arrays only through their addresses' alignment, which
    `pointers` checks."""

    __slots__ = ("steps", "residues", "context")

    def __init__(self, steps: tuple, residues: tuple, context):
        self.steps, self.context = steps, context
        self.residues = list(residues)  # compared with a call's as one list (host time)

    @classmethod
    def of(cls, recorded: list, slots: tuple, context, derivations=None) -> Tape | None:
        """The tape of `recorded` launches over the call's arrays `slots`, or None where an
        array parameter points into none of them and was not derived from them
        (`derivations`: `derived`'s record), or two of them overlap (q passed as k too: a
        replay could not tell them apart). A parameter's source: (slot, byte offset), or
        (rebuild, its sources' (slot, offset)s) for a derived one."""
        bases = [data_pointer(a) for a in slots]
        ends = [base + _extent(a) for base, a in zip(bases, slots, strict=True)]
        spans = sorted(zip(bases, ends, strict=True))
        if any(nxt[0] < prev[1] for prev, nxt in itertools.pairwise(spans)):
            return None

        def source(ptr):
            slot = next((j for j, (base, end) in enumerate(zip(bases, ends, strict=True))
                         if base <= ptr < max(end, base + 1)), None)
            return None if slot is None else (slot, ptr - bases[slot])

        steps = []
        for launcher, grid, block, shared, args in recorded:
            sources = []
            for i, _ in launcher.pointers:
                ptr = data_pointer(args[i])
                found = source(ptr)
                if found is None and ptr in (derivations or {}):
                    rebuild, inputs = derivations[ptr]
                    found = (rebuild, tuple(source(p) for p in inputs))
                    found = None if None in found[1] else found
                if found is None:
                    return None
                sources.append(found)
            scalars = tuple(args[i] for i, _ in launcher.scalars)
            plain = all(isinstance(where, int) for where, _ in sources)
            steps.append((launcher, grid, block, shared,
                          (_Offsets if plain else tuple)(sources), scalars))
        return cls(tuple(steps), tuple(b % TAPE_ALIGNMENT for b in bases), context)

    def pointers(self, slots: tuple, context) -> list | None:
        """The slots' addresses, or None if this tape cannot serve them (an address of
        another alignment, or another kernel-choosing `context`)."""
        if context is not self.context:
            return None
        bases = [data_pointer(a) for a in slots]
        if [b % TAPE_ALIGNMENT for b in bases] != self.residues:
            return None
        return bases

    def replay(self, bases: list, stream: int) -> None:
        for launcher, grid, block, shared, sources, scalars in self.steps:
            if type(sources) is _Offsets:  # every parameter a slot's address plus an offset
                addresses = [bases[slot] + offset for slot, offset in sources]
            else:
                addresses = [_address(source, bases) for source in sources]
            launcher.launch_with(addresses, scalars, grid, block, shared, stream)


class _Offsets(tuple):
    """A taped launch's sources when each is a (slot, byte offset): `replay` adds them up
    inline (host time per call) instead of asking `_address` for each."""


def _address(source, bases: list) -> int:
    """A taped parameter's address on these slots' addresses (`Tape.of`'s sources)."""
    where, offset = source
    if isinstance(where, int):
        return bases[where] + offset
    return data_pointer(where([bases[slot] + off for slot, off in offset]))


# Recordings in a row that made no tape (a launch reading an array the call did not name, such
# as the persistent kernel's work counter) after which a key stops recording: its Python runs
UNTAPED_TRIES = 2


class Taped:
    """One call key's launches on the GPU: `run` makes them through the schedule's Python the
    first time, recording a `Tape`, and replays the tape after (the host time of a call is
    then its checks, allocations and cuLaunchKernel). Under the simulator, or while
    launches are recorded for compiling (`recording_launches`), it always runs them."""

    __slots__ = ("tape", "untaped")

    def __init__(self):
        self.tape: Tape | None = None
        self.untaped = 0  # recordings in a row that made no tape

    def run(self, stream: int, slots: tuple, launches, context=None) -> None:
        """`launches()` on `stream`, whose array parameters all point into `slots` (the
        call's arrays: inputs, outputs, workspace), or its tape's replay; `context`: what
        besides the key chooses kernels (a tuning override), compared by identity."""
        if SIMULATOR or is_recording():
            launch_on(stream, launches)
            return
        tape = self.tape
        if tape is not None:
            bases = tape.pointers(slots, context)
            if bases is not None:
                tape.replay(bases, stream)
                return
        if self.untaped >= UNTAPED_TRIES:
            launch_on(stream, launches)
            return
        previous, taping = set_stream(stream), []
        _stream.taping, _stream.derived = taping, {}
        try:
            launches()
            derivations = _stream.derived
        finally:
            _stream.taping = _stream.derived = None
            set_stream(previous)
        tape = Tape.of(taping, slots, context, derivations)
        if tape is None:  # the key's earlier tape, if any, still serves its own alignment
            self.untaped += 1
        else:
            self.tape, self.untaped = tape, 0


def launched_builds(kernel) -> list:
    """The compiled builds of `kernel` launched so far (compiled here or loaded from the disk
    cache), one per argument types: Numba's compiled kernels (regs_per_thread,
    local_mem_per_thread, inspect_asm())."""
    return [launcher.compiled for (kern, *_), launcher in _launchers.items() if kern is kernel]


def launched_resources(kernel) -> dict[str, int]:
    """The most registers and local memory bytes per thread over the builds of `kernel`
    launched so far: {} if none was."""
    builds = launched_builds(kernel)
    if not builds:
        return {}
    return {"regs": max(b.regs_per_thread for b in builds),
            "local_bytes": max(b.local_mem_per_thread for b in builds)}


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
    return BACKEND


def device_name() -> str:
    if SIMULATOR:
        return "Numba CUDA simulator"
    if _hopper_stand_in():
        return "no device (H100/H200 limits assumed: LOOP_ORDERS_DEVICE_LIMITS=hopper)"
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


def release_memory() -> None:
    """Free what is no longer referenced now: Numba defers freeing device arrays, and torch
    caches what it freed; between the points of a sweep both would pile up."""
    import gc

    gc.collect()
    if SIMULATOR:
        return
    cuda.current_context().deallocations.clear()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


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


def launch_on(stream: int, launches) -> None:
    """`launches()` with its kernels on `stream` (under the simulator inside `launching()`):
    a call's host path, with no context manager on the GPU (each costs microseconds)."""
    if SIMULATOR:
        with on_stream(stream), launching():
            launches()
        return
    previous = set_stream(stream)
    try:
        launches()
    finally:
        set_stream(previous)


class Timer:
    """Elapsed milliseconds (`ms`) of the launches inside the `with` block when `timed`
    (else `ms` is None and nothing waits for the GPU).

    CUDA events on `stream` on the GPU; a host clock around the (synchronous) launches
    under the simulator, which has no events. Coarse timing only: benchmarks use
    experiments/ scripts.
    """

    def __init__(self, timed: bool = True, stream: int = 0):
        self.timed, self.stream, self.ms = timed, stream, None

    def __enter__(self):
        if not self.timed:
            return self
        if SIMULATOR:
            import time

            self._t0 = time.perf_counter()
        else:
            self._stream = cuda.external_stream(self.stream) if self.stream else 0
            self._start, self._stop = cuda.event(), cuda.event()
            self._start.record(self._stream)
        return self

    def __exit__(self, *exc):
        if not self.timed or exc[0] is not None:
            return False
        if SIMULATOR:
            import time

            self.ms = (time.perf_counter() - self._t0) * 1e3
        else:
            self._stop.record(self._stream)
            self._stop.synchronize()
            self.ms = cuda.event_elapsed_time(self._start, self._stop)
        return False
