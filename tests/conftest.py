from collections import OrderedDict

import numpy as np
import pytest

import loop_orders as lo
from loop_orders import api_grad
from loop_orders.core.schedule import backward_of
from loop_orders.device import runtime

gpu = pytest.mark.skipif(runtime.SIMULATOR, reason="needs a CUDA GPU (running on the simulator)")


@pytest.fixture
def rng(request):
    """Fresh random inputs each run; the seed is printed on failure to reproduce it."""
    seed = np.random.SeedSequence().entropy % 2**32
    print(f"input seed: {seed}")
    return np.random.default_rng(seed)


def random_qkv(rng, batch, heads, n, d, dv, dtype="float32", n_k=None, scale=1.0):
    n_k = n if n_k is None else n_k
    lead = (batch, heads) if batch else ()
    q = (scale * rng.standard_normal((*lead, n, d))).astype(dtype)
    k = (scale * rng.standard_normal((*lead, n_k, d))).astype(dtype)
    v = rng.standard_normal((*lead, n_k, dv)).astype(dtype)
    return q, k, v


SCHEDULES = lo.schedule_names()


@pytest.fixture
def fresh_calls():
    """Forget the calls `lo.attention` has prepared: a test that changes what the checks see
    (a memory limit, say) then meets them again, as a new process would. (A prepared call
    re-checks device memory only when it is big: api._Call.)"""
    lo.api._CALLS.clear()
    yield
    lo.api._CALLS.clear()


@pytest.fixture
def backward_tiles_16x8(monkeypatch):
    """q_outer's backward measured fastest on 16 x 8 (as on a GPU where its `fast_tiles`
    say so), and no gradient call prepared before: each pass of a call naming no tiles
    then runs its own tiles (the forward 64 x 64 clamped to N)."""
    bwd = backward_of(lo.get_schedule("q_outer"))
    monkeypatch.setattr(type(bwd), "fast_tiles", lambda self, p: (16, 8))
    monkeypatch.setattr(api_grad, "_CALLS", OrderedDict())
    return bwd
