"""The micro-kernel's thread-layout policy (microkernel.thread_layout) as on a GPU."""

import pytest

from loop_orders import microkernel
from loop_orders.microkernel import Layout, thread_layout


@pytest.fixture
def on_gpu(monkeypatch):
    """Pretend shuffles exist (the policy only; no kernel is compiled here)."""
    monkeypatch.setattr(microkernel, "SIMULATOR", False)
    monkeypatch.delenv("LOOP_ORDERS_LAYOUT", raising=False)


def test_policy_follows_the_measured_order(on_gpu):
    assert thread_layout(64, 64, 128) == Layout(1, 2)  # 64 registers of q and acc
    assert thread_layout(128, 128, 64) == Layout(2, 4)  # two rows per thread at d = 128
    assert thread_layout(64, 64, 8) == Layout(1, 4)  # (1, 2) would be 16 threads: no warp
    assert thread_layout(6, 6, 4) == Layout(2, 1)  # d not in 4-wide chunks per part
    assert thread_layout(5, 3, 1) == Layout(1, 1)


def test_every_layout_is_whole_warps_and_splits_head_dims(on_gpu):
    for d in (8, 16, 32, 64, 128, 256):
        for block_q in (16, 32, 64, 128, 256, 512):
            lay = thread_layout(d, d, block_q)
            if lay.tpr > 1:
                assert lay.threads(block_q) % 32 == 0 and d % (4 * lay.tpr) == 0
            assert block_q % lay.rpt == 0 and lay.threads(block_q) <= 1024


def test_forced_layout_is_used_or_refused(on_gpu, monkeypatch):
    monkeypatch.setenv("LOOP_ORDERS_LAYOUT", "2,2")
    assert thread_layout(64, 64, 128) == Layout(2, 2)
    assert Layout(2, 2).registers(64, 64) == 255 and Layout(1, 2).registers(64, 64) == 128
    with pytest.raises(ValueError, match="LOOP_ORDERS_LAYOUT=2,2 does not fit d=128"):
        thread_layout(128, 128, 64)


def test_simulator_never_splits_rows(monkeypatch):
    monkeypatch.setattr(microkernel, "SIMULATOR", True)
    monkeypatch.delenv("LOOP_ORDERS_LAYOUT", raising=False)
    assert thread_layout(64, 64, 128).tpr == 1
