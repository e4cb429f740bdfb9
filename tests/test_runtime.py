import sys
import threading

import numpy as np
import pytest

from loop_orders.device import runtime


def _threads_disagree(array_fn, n_threads=32):
    """Do n_threads racing threads of one CTA get different arrays from one call site?"""
    from numba.cuda.simulator.kernelapi import FakeCUDAShared

    shared = FakeCUDAShared(0)
    got = [None] * n_threads
    start = threading.Barrier(n_threads)

    def thread(t):
        start.wait()
        got[t] = array_fn(shared, 8, np.float32)

    workers = [threading.Thread(target=thread, args=(t,)) for t in range(n_threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return len({id(a) for a in got}) > 1


@pytest.mark.skipif(not runtime.SIMULATOR, reason="a simulator-only fix")
def test_simulator_threads_of_a_cta_share_one_shared_array():
    """Regression: upstream's simulator can give racing threads different shared arrays."""
    from numba.cuda.simulator.kernelapi import FakeCUDAShared

    fixed = FakeCUDAShared.array
    cells = (cell.cell_contents for cell in fixed.__closure__)
    upstream = dict(zip(fixed.__code__.co_freevars, cells, strict=True))["upstream"]
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        # The harness does catch the race in upstream (about 1 trial in 8 here) ...
        assert any(_threads_disagree(upstream) for _ in range(3000))
        # ... and never in the fixed allocation.
        assert not any(_threads_disagree(fixed) for _ in range(300))
    finally:
        sys.setswitchinterval(previous)


def test_backend_is_reported():
    assert runtime.backend_name() == ("simulator" if runtime.SIMULATOR else "gpu")
    assert isinstance(runtime.device_name(), str)


def test_launch_key_tells_apart_what_selects_a_compiled_kernel():
    """Arrays differing in dtype or layout (C-contiguous or not), or scalars of another type,
    must not share `runtime.launch`'s cached compiled kernel; equal ones must."""
    a = np.zeros((2, 3, 4), np.float32)
    key = runtime._args_key
    assert key((a, np.float32(1))) == key((np.ones((2, 3, 4), np.float32), np.float32(2)))
    assert key((a,)) != key((a.astype(np.float16),))
    assert key((a,)) != key((np.zeros((2, 4, 3), np.float32).transpose(0, 2, 1),))
    assert key((a, np.float32(1))) != key((a, 1.0))



def test_a_call_key_tells_apart_the_tuning_override_it_was_prepared_under():
    """A call prepared under one `tuning` override (which chooses its kernels) is not
    reused under another: `api.call_key` holds the override; the same override, the same
    key."""
    from loop_orders.api import call_key
    from loop_orders.microkernel import tuning

    q = np.zeros((1, 1, 8, 4), np.float32)
    args = (q, q, q)

    def key():
        return call_key("q_outer", args, (None, None, False), {"dq": "atomic"})

    plain = key()
    with tuning.tuned(q_stages=1):
        one = key()
        assert key() == one
    assert one != plain and key() == plain

class _FakeLauncher:
    """A `runtime._Launcher` stand-in: which of its parameters are arrays and which
    scalars, and the launches it was asked for (grid, block, shared bytes, stream, the
    addresses and scalars written)."""

    def __init__(self, args):
        self.pointers = [(i, None) for i, a in enumerate(args) if runtime._is_array(a)]
        self.scalars = [(i, None) for i, a in enumerate(args) if not runtime._is_array(a)]
        self.started = []

    def launch_with(self, addresses, scalars, grid, block, shared, stream):
        self.started.append((grid, block, shared, stream, list(addresses),
                             [float(x) for x in scalars]))


def test_a_launcher_writes_addresses_and_scalars_into_its_parameter_cells():
    """`_Launcher.launch_with` (no GPU here: its compiled kernel and cuLaunchKernel stood in
    for) writes each address and scalar into its cell of the parameter block, in parameter
    order, then starts the launch with the grid, block, shared bytes and stream asked."""
    import ctypes
    import threading

    launcher = object.__new__(runtime._Launcher)
    launcher.pointers = [(0, ctypes.c_uint64(0)), (2, ctypes.c_uint64(0))]
    launcher.scalars = [(1, ctypes.c_float(0)), (3, ctypes.c_int32(0))]
    launcher.pointer_cells = [cell for _, cell in launcher.pointers]
    launcher.scalar_cells = [cell for _, cell in launcher.scalars]
    launcher.lock = threading.Lock()
    started = []
    launcher._start = lambda *args: started.append(
        (args, [c.value for _, c in launcher.pointers], [c.value for _, c in launcher.scalars]))
    launcher.launch_with([4096, 8192], [0.5, 7], (3, 2, 1), 128, 1024, 5)
    assert started == [(((3, 2, 1), 128, 1024, 5), [4096, 8192], [0.5, 7])]


def _view(ptr, shape, dtype=np.float32):
    from loop_orders.device.arrays import DeviceView

    return DeviceView(ptr, shape, runtime.c_strides(shape, np.dtype(dtype).itemsize), dtype)


def test_a_tape_replays_its_launches_on_other_arrays_at_the_same_offsets():
    """A recorded call's array parameters are found in its slots (a view 64 bytes into its
    output too); a replay writes the new slots' addresses at the same offsets and the
    recorded scalars back, and refuses addresses of another alignment or another context."""
    q, out = _view(1 << 20, (4, 8)), _view(2 << 20, (4, 8))
    args = (q, _view((2 << 20) + 64, (16,)), np.float32(0.5))
    launcher = _FakeLauncher(args)
    context = object()
    tape = runtime.Tape.of([(launcher, (2, 1, 1), 128, 0, args)], (q, out), context)
    assert tape is not None
    tape.replay(tape.pointers((_view(5 << 20, (4, 8)), _view(7 << 20, (4, 8))), context), 9)
    grid, block, shared, stream, pointers, scalars = launcher.started[-1]
    assert (grid, block, shared, stream) == ((2, 1, 1), 128, 0, 9)
    assert pointers == [5 << 20, (7 << 20) + 64] and scalars == [0.5]
    assert tape.pointers((_view((5 << 20) + 4, (4, 8)), _view(7 << 20, (4, 8))), context) \
        is None  # q 4 bytes off: a kernel chosen by alignment may differ
    assert tape.pointers((_view(5 << 20, (4, 8)), _view(7 << 20, (4, 8))), object()) is None


def test_no_tape_where_slots_overlap_or_a_parameter_points_elsewhere():
    """q passed as k too (a replay could not tell them apart), or an array the call did not
    name (memory a schedule allocated itself): the call is not taped."""
    q = _view(1 << 20, (4, 8))
    args = (q, np.float32(1.0))
    assert runtime.Tape.of([(_FakeLauncher(args), (1, 1, 1), 32, 0, args)], (q, q), None) \
        is None
    stray = (_view(9 << 20, (4, 8)), np.float32(1.0))
    assert runtime.Tape.of([(_FakeLauncher(stray), (1, 1, 1), 32, 0, stray)], (q,), None) \
        is None


def test_a_tape_rebuilds_a_derived_parameter_from_its_sources_on_replay():
    """An array derived from the call's arrays (a TMA kernel's tensor maps, `runtime.
    derived`) is taped as its rebuild from its sources' offsets: a replay makes it again from
    the new call's addresses and launches with it; one whose source is not among the call's
    arrays leaves the call untaped."""
    q, k = _view(1 << 20, (4, 8)), _view(2 << 20, (4, 8))
    made = []

    def rebuild(addresses):
        made.append(list(addresses))
        return _view(100 << 20 | len(made) << 8, (16,), np.uint64)

    maps = _view(99 << 20, (16,), np.uint64)
    args = (q, k, maps, np.float32(0.5))
    launcher = _FakeLauncher(args)
    derivations = {99 << 20: (rebuild, (1 << 20, (2 << 20) + 32))}  # k 32 bytes on
    tape = runtime.Tape.of([(launcher, (1, 1, 1), 32, 0, args)], (q, k), None, derivations)
    assert tape is not None
    tape.replay([5 << 20, 6 << 20], 0)
    assert made == [[5 << 20, (6 << 20) + 32]]
    assert launcher.started[-1][4] == [5 << 20, 6 << 20, 100 << 20 | 1 << 8]
    elsewhere = {99 << 20: (rebuild, (9 << 20,))}
    assert runtime.Tape.of([(launcher, (1, 1, 1), 32, 0, args)], (q, k), None,
                           elsewhere) is None


def test_taped_keeps_a_tape_that_serves_and_stops_recording_what_it_cannot_tape(monkeypatch):
    """A key's first GPU call records (its Python runs), later ones replay; calls whose
    recording makes no tape (a parameter in no array of the call, at another alignment)
    leave the tape for the alignment it serves, and after UNTAPED_TRIES such recordings the
    key runs its Python without recording."""
    monkeypatch.setattr(runtime, "SIMULATOR", False)
    q, stray = _view(1 << 20, (4, 8)), _view(9 << 20, (4, 8))
    launcher = _FakeLauncher((q, np.float32(1.0)))
    ran = []

    def launches(arr):
        def run():  # as `runtime.launch` does: launch, and record while taping
            ran.append(arr)
            taping = getattr(runtime._stream, "taping", None)
            if taping is not None:
                taping.append((launcher, (1, 1, 1), 32, 0, (arr, np.float32(1.0))))
        return run

    taped = runtime.Taped()
    taped.run(0, (q,), launches(q))
    taped.run(0, (_view(3 << 20, (4, 8)),), launches(q))
    assert taped.tape is not None and len(ran) == 1 and len(launcher.started) == 1
    odd = _view((1 << 20) + 4, (4, 8))  # another alignment: the schedule's Python again
    for _ in range(runtime.UNTAPED_TRIES + 1):
        taped.run(0, (odd,), launches(stray))
    assert len(ran) == 1 + runtime.UNTAPED_TRIES + 1
    assert taped.untaped == runtime.UNTAPED_TRIES and taped.tape is not None
    taped.run(0, (_view(5 << 20, (4, 8)),), launches(q))  # the first alignment: replayed
    assert len(ran) == 1 + runtime.UNTAPED_TRIES + 1 and launcher.started[-1][4] == [5 << 20]
