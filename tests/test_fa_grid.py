"""FlashAttention's test grid by FlashAttention's error rule (`experiments/fa_grid.py`):
out, dq, dk, dv through the torch op within 2x plain PyTorch's same-dtype error against a
float32 reference; unequal and odd lengths, causal bottom-right aligned. The whole grid on a
GPU (one test per head dim); a corner of it at small sizes under the simulator."""

import pytest
from conftest import gpu

from loop_orders.device import runtime

torch = pytest.importorskip("torch")
fa_grid = pytest.importorskip("experiments.fa_grid")


@pytest.mark.skipif(not runtime.SIMULATOR, reason="the GPU runs the full grid below")
@pytest.mark.parametrize("n_q, n_k", [(13, 21), (21, 13)])
@pytest.mark.parametrize("causal", [False, True])
def test_small_cells_on_the_simulator(n_q, n_k, causal):
    row = fa_grid.check_cell("q_outer", n_q, n_k, 32, "float16", causal, device="cpu",
                             batch=1, heads=1)
    assert row["outcome"] == "ok", row


@gpu
@pytest.mark.parametrize("d", fa_grid.DIMS)
def test_flash_attention_grid_on_the_gpu(d):
    """Every cell of the grid at this head dim: 0 refused, 0 failed."""
    bad = [(c, row) for i, c in enumerate(fa_grid.cells(dims=[d]))
           if (row := fa_grid.check_cell("q_outer", **c, seed=i))["outcome"] != "ok"]
    assert not bad, bad[:3]
