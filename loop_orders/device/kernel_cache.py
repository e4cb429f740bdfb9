"""A disk cache of compiled kernels, so a new process does not compile them again.

A kernel is compiled for a (factory, compile-time constants, argument types) triple; the
compiled form (PTX and cubin, Numba's own serialisation of a compiled kernel, as its
`cache=True` uses) is pickled under a key that covers everything that changes the code:

    the factory's module and name and its arguments   (tile sizes, layout, flags, dtype ...)
    the argument types                                (dtypes, ranks, layouts)
    the source of every module of this package        (any code change misses the cache)
    the counter slots declared (`ledger.n_slots`)
    the device's compute capability; numba, numba-cuda, llvmlite and CUDA driver versions

Where: `$LOOP_ORDERS_CACHE_DIR`, else `~/.cache/loop_orders/kernels` (`XDG_CACHE_HOME`
respected); `loop-orders cache` shows it, `loop-orders cache --clear` empties it;
`LOOP_ORDERS_CACHE_DIR=off` turns the cache off. Two processes filling it at once are safe:
each entry is written to a temporary file and renamed into place, a reader sees a whole
entry or none, and an entry that fails to load is compiled again and replaced.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pickle
import tempfile
from importlib import metadata
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent  # loop_orders/
FORMAT = "loop_orders.kernel/1"


def cache_dir() -> Path | None:
    """Where compiled kernels are kept (None when the cache is off)."""
    chosen = os.environ.get("LOOP_ORDERS_CACHE_DIR")
    if chosen == "off":
        return None
    if chosen:
        return Path(chosen)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "loop_orders" / "kernels"


NO_KERNELS = ("context_parallel",)  # subpackages whose code reaches no kernel


@functools.cache
def source_hash() -> str:
    """sha256 of every module of the package that can change a kernel, in path order
    (`context_parallel` drives our kernels through the public API and builds none)."""
    digest = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] in NO_KERNELS:
            continue
        digest.update(str(path.relative_to(PACKAGE)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.cache
def _environment() -> tuple:
    from numba import cuda

    from ..core.ledger import n_slots

    versions = []
    for name in ("numba", "numba-cuda", "llvmlite"):
        try:
            versions.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            versions.append((name, None))
    device = cuda.get_current_device()
    try:
        driver = cuda.cudadrv.driver.driver.get_version()
    except (AttributeError, RuntimeError):
        driver = None
    return (FORMAT, source_hash(), n_slots(), tuple(device.compute_capability), driver,
            tuple(versions))


def environment() -> tuple:
    """What besides a build's own key its entry depends on (code, device, versions): what a
    compile worker without a device of its own is told (`warm`)."""
    return _environment()


def same_source(env: tuple) -> bool:
    """Whether `env` (another process's `environment()`) was worked out from the source this
    process has: a worker must not file a build of changed code under the old code's key."""
    return env[1] == source_hash()


def entry_path(factory_key: tuple, sig: tuple, env: tuple | None = None) -> Path | None:
    """Where the build's entry lives, for this process's environment or `env`."""
    directory = cache_dir()
    if directory is None:
        return None
    text = repr((factory_key, tuple(str(t) for t in sig), env or _environment()))
    return directory / f"{hashlib.sha256(text.encode()).hexdigest()}.pkl"


def load(factory_key: tuple, sig: tuple):
    """The compiled kernel stored for this key, or None (absent, unreadable or stale)."""
    path = entry_path(factory_key, sig)
    if path is None or not path.exists():
        return None
    from numba.cuda.dispatcher import _Kernel

    try:
        states = pickle.loads(path.read_bytes())
        compiled = _Kernel._rebuild(**states)
        cubins = len(compiled._codelibrary._cubin_cache)
        compiled._codelibrary.get_cufunc()  # loads the cubin now, not at the first launch
        linked = len(compiled._codelibrary._cubin_cache) == cubins  # none linked here
    except Exception:  # a damaged or foreign entry: compile again
        with contextlib.suppress(OSError):
            path.unlink()
        return None
    if not linked:  # a compile worker's PTX, linked here: kept with its cubin from now on
        # (a worker that linked it, `runtime.link_without_a_device`, left nothing to link)
        store(factory_key, sig, compiled)
    return compiled


def store(factory_key: tuple, sig: tuple, compiled, env: tuple | None = None) -> Path | None:
    """Write the compiled kernel under its key: with its cubin for this device, or, given
    the `env` of the process that will load it (a compile worker, which has no CUDA
    context), as PTX that the loading process links and stores again (`load`)."""
    path = entry_path(factory_key, sig, env)
    if path is None:
        return None
    if env is None:
        compiled._codelibrary.get_cufunc()  # the cubin is in the library before it is pickled
    try:
        data = pickle.dumps(compiled._reduce_states(), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # not serialisable: keep it in memory only
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old entry or this one
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def entries() -> list[Path]:
    directory = cache_dir()
    return sorted(directory.glob("*.pkl")) if directory and directory.exists() else []


def clear() -> int:
    """Remove every entry; returns how many there were."""
    removed = 0
    for path in entries():
        with contextlib.suppress(OSError):
            path.unlink()
            removed += 1
    return removed
