import numpy as np
import pytest

import loop_orders as lo
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
