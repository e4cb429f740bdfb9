"""Property-based fuzz: random shapes, tilings and options, every registered schedule.

For each drawn case (n_q and n_k apart or not, causal or not, a sliding window or none),
every schedule's output matches the float64 reference (under the problem's own mask) within
the usual
tolerance (TF32's bound at precision "tf32", 3xTF32's at "tf32x3") and its measured counters
equal its model exactly. The shapes stay tiny so the Numba CUDA simulator can run them; CI
runs a fixed, derandomised set of examples. A larger, random run (see README "Tests"):

    LOOP_ORDERS_FUZZ_EXAMPLES=500 .venv/bin/python -m pytest -q tests/test_fuzz.py
"""

import os

import numpy as np
import pytest
from conftest import random_qkv
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import loop_orders as lo
from loop_orders.reference import relative_error, tf32_score_shift, tf32_tolerance, tolerance

CI_EXAMPLES = 100
EXAMPLES = int(os.environ.get("LOOP_ORDERS_FUZZ_EXAMPLES", CI_EXAMPLES))
# A drawn case the simulator's estimate puts above this many seconds is refused up front
# (allowed, as any refusal): tiny blocks on tensor cores (float16 kv_outer at 1 x 1 tiles)
# would take minutes each, and CI's time stays bounded.
CASE_BUDGET_S = "10"


@pytest.fixture(autouse=True)
def case_budget():
    """LOOP_ORDERS_SIMULATOR_BUDGET_S for this module's tests (set and restored around each
    test, since hypothesis runs every example inside one test call)."""
    before = os.environ.get("LOOP_ORDERS_SIMULATOR_BUDGET_S")
    os.environ["LOOP_ORDERS_SIMULATOR_BUDGET_S"] = before or CASE_BUDGET_S
    yield
    if before is None:
        del os.environ["LOOP_ORDERS_SIMULATOR_BUDGET_S"]

# Tiny enough for the simulator (one Python thread per CUDA thread).
MAX_N, MAX_D, MAX_BLOCK = 24, 9, 16


@st.composite
def cases(draw):
    causal = draw(st.booleans())
    n = draw(st.integers(1, MAX_N))
    n_k = draw(st.one_of(st.just(n), st.integers(1, MAX_N)))
    side = st.one_of(st.just(-1), st.integers(0, MAX_N))  # -1: unbounded
    return {
        "window": draw(st.one_of(st.just((-1, -1)), st.tuples(side, side))),
        "batch": draw(st.integers(1, 2)),
        "heads": draw(st.integers(1, 2)),
        "n": n,
        "n_k": n_k,
        "d": draw(st.integers(1, MAX_D)),
        "dv": draw(st.integers(1, MAX_D)),
        "block_q": draw(st.integers(1, MAX_BLOCK)),
        "block_k": draw(st.integers(1, MAX_BLOCK)),
        "causal": causal,
        "save_lse": draw(st.booleans()),
        "dtype": (dtype := draw(st.sampled_from(["float32", "float16"]))),
        # float32 on TF32 tensor cores in a quarter of the float32 cases, as TF32 or 3xTF32
        # (the schedules with TENSOR_CORES; the others, and the backward, stay exact)
        "precision": draw(st.sampled_from(["ieee"] * 6 + ["tf32", "tf32x3"]))
        if dtype == "float32" else "ieee",
        "seed": draw(st.integers(0, 2**32 - 1)),
        # per schedule, one value of each option from the option's examples
        "options": {s.name: {key: draw(st.sampled_from(opt.examples))
                             for key, opt in s.OPTIONS.items() if opt.examples}
                    for s in lo.all_schedules()},
    }


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          derandomize=EXAMPLES == CI_EXAMPLES, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_every_schedule_matches_reference_and_model(case):
    c = case
    rng = np.random.default_rng(c["seed"])
    q, _, _ = random_qkv(rng, c["batch"], c["heads"], c["n"], c["d"], c["dv"], c["dtype"])
    _, k, v = random_qkv(rng, c["batch"], c["heads"], c["n_k"], c["d"], c["dv"], c["dtype"])
    mask = None  # the problems' mask (every schedule's the same)
    for name in lo.schedule_names():
        sched = lo.get_schedule(name)
        precision = c["precision"] if sched.TENSOR_CORES else "ieee"
        p = lo.make_problem(name, n_q=c["n"], n_k=c["n_k"], d=c["d"], dv=c["dv"],
                            batch=c["batch"], heads=c["heads"], block_q=c["block_q"],
                            block_k=c["block_k"], causal=c["causal"],
                            save_lse=c["save_lse"], dtype=c["dtype"], options=c["options"][name],
                            precision=precision, window=c["window"])
        if mask is None:
            mask = p.mask
            ref, ref_lse = lo.attention_reference(q, k, v, mask=mask)
        try:
            lo.api.check_launch(sched, p, count=True)
        except ValueError:
            continue  # refused up front, with a message: allowed (not a wrong number)
        res = lo.attention(q, k, v, schedule=name, block_q=c["block_q"],
                           block_k=c["block_k"], causal=c["causal"], save_lse=c["save_lse"],
                           options=c["options"][name], count=True, precision=precision,
                           window=c["window"])
        assert res.out.shape == ref.shape and res.out.dtype == np.dtype(c["dtype"]), name
        assert np.isfinite(res.out).all(), name
        if precision != "ieee":
            tol = tf32_tolerance(q, k, v, ref, mask=mask, precision=precision)
            # over all pairs, masked or not
            lse_tol = tf32_score_shift(q, k, precision=precision) + 1e-5
        else:
            tol = tolerance(c["dtype"], sched.output_roundings(res.problem), v, ref)
            lse_tol = 1e-5
        assert relative_error(res.out, ref) <= tol, name
        if c["save_lse"]:
            np.testing.assert_allclose(res.lse, ref_lse, rtol=1e-5, atol=lse_tol,
                                       err_msg=name)
        assert res.counts == sched.model(res.problem), name


def test_fuzz_budget_is_fixed_in_ci():
    """CI runs exactly CI_EXAMPLES derandomised examples unless the env var asks for more."""
    if "LOOP_ORDERS_FUZZ_EXAMPLES" in os.environ:
        pytest.skip("a larger fuzz run was requested")
    assert EXAMPLES == CI_EXAMPLES
    if "LOOP_ORDERS_FUZZ_BACKWARD_EXAMPLES" not in os.environ:
        assert BACKWARD_EXAMPLES == CI_BACKWARD_EXAMPLES


CI_BACKWARD_EXAMPLES = 12
BACKWARD_EXAMPLES = int(os.environ.get("LOOP_ORDERS_FUZZ_BACKWARD_EXAMPLES",
                                       CI_BACKWARD_EXAMPLES))


@settings(max_examples=BACKWARD_EXAMPLES, deadline=None, database=None,
          derandomize=BACKWARD_EXAMPLES == CI_BACKWARD_EXAMPLES, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_every_backward_matches_reference_and_model(case):
    """Each backward schedule (each value of its options) on the drawn case: gradients
    within tolerance of the float64 ones, counters == model exactly."""
    from loop_orders.core.schedule import get_backward, grad_variants
    from loop_orders.reference import attention_grad_reference, grad_tolerances

    c = case
    rng = np.random.default_rng(c["seed"])
    q, _, _ = random_qkv(rng, c["batch"], c["heads"], c["n"], c["d"], c["dv"], c["dtype"])
    _, k, v = random_qkv(rng, c["batch"], c["heads"], c["n_k"], c["d"], c["dv"], c["dtype"])
    do = rng.standard_normal(q.shape[:-1] + (c["dv"],)).astype(c["dtype"])
    refs = None  # under the problems' mask (every schedule's the same)
    for variant in grad_variants():
        name, options = variant.schedule, variant.options
        bwd = get_backward(name)
        sched = lo.get_schedule(name)
        p = lo.make_problem(name, n_q=c["n"], n_k=c["n_k"], d=c["d"], dv=c["dv"],
                            batch=c["batch"], heads=c["heads"], block_q=c["block_q"],
                            block_k=c["block_k"], causal=c["causal"], save_lse=True,
                            dtype=c["dtype"], options=options, window=c["window"])
        if refs is None:
            refs = attention_grad_reference(q, k, v, do, mask=p.mask)
        try:
            lo.api.check_launch(sched, p, count=True)
            lo.api_grad.check_backward(sched, bwd, p, True, True)
        except ValueError:
            continue  # refused up front, with a message: allowed (not a wrong number)
        g = lo.attention_grad(q, k, v, do, schedule=name, block_q=c["block_q"],
                              block_k=c["block_k"], causal=c["causal"], options=options,
                              count=True, window=c["window"])
        tol = grad_tolerances(q, k, v, do, refs, c["dtype"],
                              bwd.output_roundings(g.problem.for_backward()), mask=p.mask)
        for got, ref, bound in zip((g.dq, g.dk, g.dv), refs, (tol.dq, tol.dk, tol.dv),
                                   strict=True):
            assert relative_error(got, ref) <= bound, (name, options)
        assert g.counts_backward == bwd.model(g.problem.for_backward()), (name, options)
