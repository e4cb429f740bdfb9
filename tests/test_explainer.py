"""The seed explainer's example: N=6, d=dv=2, query blocks of 2 rows (240 vs 96 transfers)."""

import numpy as np
import pytest

import loop_orders as lo
from loop_orders.reference import online_row, relative_error

Q = np.array([[1, 0], [0, 1], [1, 1], [-1, 0], [0, -1], [1, -1]], dtype=np.float32)
K = np.array([[-1, 0], [0, 1], [2, 0], [1, 1], [3, -1], [-1, 2]], dtype=np.float32)
V = np.array([[1, 0], [0, 2], [-1, 1], [2, -1], [0.5, 3], [-2, 0.5]], dtype=np.float32)
SEED_TOTAL = {"dense": 240, "q_outer": 96}  # the numbers the seed explainer prints


@pytest.mark.parametrize("schedule", sorted(SEED_TOTAL))
@pytest.mark.parametrize("block_k", [1, 2, 3, 4, 7])
def test_seed_totals_for_any_key_block(schedule, block_k):
    """The seed's totals do not depend on the key block size (query blocks of 2 rows)."""
    model = lo.predict_traffic(schedule, n=6, d=2, block_q=2, block_k=block_k)
    res = lo.attention(Q, K, V, schedule=schedule, block_q=2, block_k=block_k, count=True)
    assert model.total == SEED_TOTAL[schedule]
    assert res.counts == model


@pytest.mark.parametrize("schedule", [s.name for s in lo.all_schedules() if s.WORKED_EXAMPLE])
def test_worked_example_of_every_schedule(schedule):
    """Each schedule's hand-worked total (WORKED_EXAMPLE, derived in its module docstring):
    model and counted kernels on the seed's vectors."""
    sched = lo.get_schedule(schedule)
    kwargs, total = sched.WORKED_EXAMPLE
    p = lo.make_problem(schedule, **kwargs)
    assert sched.model(p).total == total
    res = lo.attention(Q, K, V, schedule=schedule, block_q=p.block_q, block_k=p.block_k,
                       options=kwargs.get("options"), count=True)
    assert res.counts == sched.model(p)
    ref, _ = lo.attention_reference(Q, K, V)
    assert relative_error(res.out, ref) <= 1e-5


def test_the_seed_schedules_have_their_worked_example():
    for name, total in SEED_TOTAL.items():
        assert lo.get_schedule(name).WORKED_EXAMPLE[1] == total


def test_ledger_per_tensor():
    dense = lo.predict_traffic("dense", n=6, d=2, block_q=2, block_k=2)
    tiled = lo.predict_traffic("q_outer", n=6, d=2, block_q=2, block_k=2)
    for ledger in (dense, tiled):
        assert (ledger.read("q"), ledger.read("k"), ledger.read("v"), ledger.write("o")) == (
            12, 36, 36, 12)
    assert [dense.counts[t] for t in ("s", "p")] == [{"read": 36, "write": 36}] * 2


@pytest.mark.parametrize("block_k", [1, 2, 3, 4, 7])
def test_online_recurrence_matches_dense_row(block_k):
    ref, _ = lo.attention_reference(Q, K, V)
    steps = online_row(Q[0], K, V, block_k)
    assert steps[-1].keys_seen == 6
    np.testing.assert_allclose(steps[-1].partial_output, ref[0], rtol=1e-12, atol=1e-12)
