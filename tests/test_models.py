"""Closed-form models against independent brute-force walks of each loop nest."""

import pytest
from conftest import SCHEDULES
from hypothesis import given, settings
from hypothesis import strategies as st

import loop_orders as lo
from loop_orders.core.schedule import per_head_ledger


def options_of(draw, sched):
    """One drawn value of each of the schedule's options (from the option's examples)."""
    return {name: draw(st.sampled_from(opt.examples)) for name, opt in sched.OPTIONS.items()
            if opt.examples}


@st.composite
def problems(draw, sched):
    n = draw(st.integers(1, 80))
    causal = draw(st.booleans())
    n_k = draw(st.one_of(st.just(n), st.integers(1, 80)))  # bottom-right causal when apart
    side = st.one_of(st.just(-1), st.integers(0, 90))  # a window side, -1: unbounded
    return lo.make_problem(
        sched, n_q=n, n_k=n_k, d=draw(st.integers(1, 9)), dv=draw(st.integers(1, 9)),
        block_q=draw(st.integers(1, 90)), block_k=draw(st.integers(1, 90)),
        batch=draw(st.integers(1, 3)), heads=draw(st.integers(1, 3)), causal=causal,
        save_lse=draw(st.booleans()), options=options_of(draw, sched),
        window=draw(st.one_of(st.just((-1, -1)), st.tuples(side, side))))


@pytest.mark.parametrize("schedule", SCHEDULES)
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_model_equals_brute_force_walk(schedule, data):
    sched = lo.get_schedule(schedule)
    p = data.draw(problems(sched))
    assert sched.model(p) == per_head_ledger(sched.walk(p), p.bh)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_blocks_larger_than_the_problem_are_clamped_and_move_the_same(schedule):
    """Clamping Br to N_q and Bc to N_k changes no count (so the model holds unclamped)."""
    sched = lo.get_schedule(schedule)
    p = lo.make_problem(schedule, n_q=7, n_k=9, d=3, block_q=64, block_k=32)
    assert (p.block_q, p.block_k) == (7, 9)
    unclamped = lo.Problem(n_q=7, n_k=9, d=3, dv=3, block_q=64, block_k=32, options=p.options)
    assert sched.model(unclamped) == sched.model(p)
    assert per_head_ledger(sched.walk(unclamped), 1) == sched.model(p)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_causal_never_moves_more_than_full(schedule):
    for n, bq, bk in [(64, 16, 16), (100, 7, 13), (33, 64, 1)]:
        full = lo.predict_traffic(schedule, n=n, d=8, block_q=bq, block_k=bk)
        causal = lo.predict_traffic(schedule, n=n, d=8, block_q=bq, block_k=bk, causal=True)
        assert causal.total <= full.total


def test_flash_orders_beat_dense_and_scale_as_theorem_2():
    """At large N the tiled orders move less than dense; doubling Bc halves kv_outer's Q reads."""
    n, d = 4096, 64
    dense = lo.predict_traffic("dense", n=n, d=d, block_q=64, block_k=64).total
    for sched in lo.all_schedules():
        if sched.TRAFFIC_CLASS == "flash":
            assert lo.predict_traffic(sched.name, n=n, d=d, block_q=64, block_k=64).total < dense
    small = lo.predict_traffic("kv_outer", n=n, d=d, block_q=64, block_k=64)
    large = lo.predict_traffic("kv_outer", n=n, d=d, block_q=64, block_k=128)
    assert large.read("q") * 2 == small.read("q")


def test_model_counts_exceed_int32_without_overflow():
    ledger = lo.predict_traffic("dense", n=65536, d=128, batch=8, heads=16, block_q=64,
                                block_k=64)
    assert ledger.read("s") == 8 * 16 * 65536**2 > 2**31
    assert isinstance(ledger.total, int)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tiles_for_sram(schedule):
    sched = lo.get_schedule(schedule)
    for m, d in [(1024, 16), (4096, 64), (100_000, 128), (64, 64)]:
        bq, bk = sched.tiles_for_sram(m, d)
        assert bq >= 1 and bk >= 1
        assert min(bq, bk) <= d
        assert max(bq, bk) == -(-m // (4 * d))
