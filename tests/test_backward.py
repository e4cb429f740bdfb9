"""Every backward schedule (and option) against the float64 gradients, with counters ==
model == brute-force walk exactly; the API's and CLI's contracts for the backward pass."""

import dataclasses
import json

import numpy as np
import pytest
from conftest import random_qkv
from hypothesis import given, settings
from hypothesis import strategies as st

import loop_orders as lo
from loop_orders.cli import main
from loop_orders.core.schedule import backward_of, get_backward, grad_variants, per_head_ledger
from loop_orders.microkernel.tensor_cores import TensorCores
from loop_orders.reference import (
    attention_grad_reference,
    grad_tolerance,
    relative_error,
    tf32_grad_tolerance,
)

# every schedule with a backward pass, every example value of its backward's options
VARIANTS = [(v.schedule, v.options) for v in grad_variants(forwards=True)]
IDS = [v.label.replace(" ", "-") for v in grad_variants(forwards=True)]

# (batch, heads, n, d, dv, block_q, block_k, causal, dtype): tails of both block sizes, N
# smaller than a block, odd d, dv != d, causal, batch and heads > 1, float16.
CASES = [
    (1, 1, 6, 2, 2, 2, 2, False, "float32"),
    (1, 2, 13, 5, 3, 4, 3, True, "float32"),
    (2, 1, 10, 4, 6, 16, 16, False, "float32"),
    (1, 1, 9, 3, 2, 1, 4, True, "float32"),
    (1, 1, 21, 8, 8, 8, 5, True, "float16"),
]


def case_id(case):
    b, h, n, d, dv, bq, bk, causal, dtype = case
    return f"B{b}H{h}N{n}d{d}dv{dv}-{bq}x{bk}{'-causal' if causal else ''}-{dtype}"


def test_the_backward_orders_are_registered():
    assert lo.backward_schedule_names() == ["dense", "kv_outer", "q_outer"]
    assert lo.schedule_options("q_outer") == {"dq": "atomic"}


def test_q_outers_backward_names_its_measured_tiles_on_a_hopper_gpu(monkeypatch):
    """FAST_TILES by operands, dQ option and head dim, on tensor cores of a Hopper GPU (stood
    in for here); none on the simulator, on other GPUs, on CUDA cores or where no sweep
    measured."""
    from loop_orders.schedules.q_outer import backward as q_outer_backward

    bwd = backward_of(lo.get_schedule("q_outer"))

    def tiles(dtype="float16", d=64, dq="atomic", precision="ieee"):
        p = lo.make_problem("q_outer", n_q=4096, d=d, block_q=64, block_k=64, dtype=dtype,
                            precision=precision, options={"dq": dq}, save_lse=True)
        return bwd.fast_tiles(p)

    assert tiles() is None  # the simulator: not a speed
    monkeypatch.setattr(q_outer_backward, "SIMULATOR", False)
    monkeypatch.setattr(q_outer_backward, "has_wgmma", lambda: False)
    assert tiles() is None  # not a Hopper GPU: not measured there
    monkeypatch.setattr(q_outer_backward, "has_wgmma", lambda: True)
    assert tiles() == tiles("bfloat16", 128) == tiles(dq="separate") == (64, 128)
    assert tiles(d=128, dq="separate") is None and tiles(d=96) is None
    assert tiles("float32", 128, precision="tf32x3") == (32, 64)
    assert tiles("float32", 128, precision="tf32") is None and tiles("float32", 128) is None


@pytest.mark.parametrize("options", [{"dq": "atomic"}, {"dq": "separate"}])
def test_a_call_naming_no_tiles_runs_its_backward_on_the_backwards_tiles(
        backward_tiles_16x8, options, rng):
    """Gradients right, the forward counted on its tiles and the backward on its own
    (`Problem.for_backward`), each equal to its model; tiles named keep both passes on
    them."""
    bwd, n, d, dv = backward_tiles_16x8, 21, 5, 3
    q, k, v = random_qkv(rng, 1, 2, n, d, dv)
    do = rng.standard_normal((1, 2, n, dv)).astype(np.float32)
    g = lo.attention_grad(q, k, v, do, causal=True, options=options, count=True)
    pb = g.problem.for_backward()
    assert (g.problem.block_q, g.problem.block_k, g.problem.backward_tiles) == (n, n, (16, 8))
    assert (pb.block_q, pb.block_k, pb.backward_tiles) == (16, 8, ())
    assert "backward_tiles=16x8" in g.problem.describe()
    refs = attention_grad_reference(q, k, v, do, causal=True)
    for got, ref in zip((g.dq, g.dk, g.dv), refs, strict=True):
        assert relative_error(got, ref) <= grad_tolerance("float32", bwd.output_roundings(pb))
    assert g.counts_forward == lo.get_schedule("q_outer").model(g.problem)
    assert g.counts_backward == bwd.model(pb) != bwd.model(dataclasses.replace(pb, block_q=n,
                                                                               block_k=n))
    named = lo.attention_grad(q, k, v, do, causal=True, options=options, block_q=16,
                              block_k=16, count=True)
    assert named.problem.backward_tiles == () and named.problem.for_backward() is named.problem
    assert named.counts_backward == bwd.model(named.problem)


def test_each_pass_falls_back_to_tiles_that_fit_it_alone(monkeypatch):
    """Where the backward's tiles do not fit at a head dim and the forward's do, only the
    backward moves to smaller ones (a joint choice would shrink the forward too). Checks
    only: nothing runs."""
    from loop_orders import api_grad

    monkeypatch.setenv("LOOP_ORDERS_SIMULATOR_BUDGET_S", "1e9")
    sched = lo.get_schedule("q_outer")
    bwd = backward_of(sched)
    problem = api_grad.grad_problem(sched, 512, 512, 256, 256, 1, 1, None, "float32", False,
                                    None, (-1, -1), False)
    p = api_grad.grad_tiles(sched, bwd, problem(64, 64), problem, None, None, False, False)
    assert (p.block_q, p.block_k) == (64, 64)
    assert p.backward_tiles and p.backward_tiles[0] * p.backward_tiles[1] < 64 * 64
    with pytest.raises(ValueError, match="block_k"):  # named: refused, not moved
        api_grad.grad_tiles(sched, bwd, problem(64, 64), problem, 64, 64, False, False)


@pytest.mark.parametrize("schedule, options", VARIANTS, ids=IDS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_gradients_and_counts(schedule, options, case, rng):
    b, h, n, d, dv, bq, bk, causal, dtype = case
    q, k, v = random_qkv(rng, b, h, n, d, dv, dtype)
    do = rng.standard_normal((b, h, n, dv)).astype(dtype)
    g = lo.attention_grad(q, k, v, do, schedule=schedule, block_q=bq, block_k=bk,
                          causal=causal, options=options, count=True)
    ref_out, ref_lse = lo.attention_reference(q, k, v, causal=causal)
    refs = attention_grad_reference(q, k, v, do, causal=causal)
    bwd = backward_of(lo.get_schedule(schedule))
    roundings = bwd.output_roundings(g.problem.for_backward())
    for name, got, ref in zip(("dq", "dk", "dv"), (g.dq, g.dk, g.dv), refs, strict=True):
        assert got.shape == ref.shape and got.dtype == np.dtype(dtype), name
        assert relative_error(got, ref) <= grad_tolerance(dtype, roundings), name
    np.testing.assert_allclose(g.lse, ref_lse, rtol=1e-5, atol=1e-5)
    assert relative_error(g.out, ref_out) <= 1e-5 or dtype == "float16"
    assert g.counts_backward == bwd.model(g.problem.for_backward())
    assert g.counts_forward == lo.get_schedule(schedule).model(g.problem)
    assert g.problem.save_lse  # the forward keeps lse for the backward


@st.composite
def problems(draw, schedule, options):
    n = draw(st.integers(1, 60))
    causal = draw(st.booleans())
    n_k = draw(st.one_of(st.just(n), st.integers(1, 60)))  # bottom-right causal when apart
    side = st.one_of(st.just(-1), st.integers(0, 70))  # a window side, -1: unbounded
    return lo.make_problem(
        schedule, n_q=n, n_k=n_k, d=draw(st.integers(1, 9)), dv=draw(st.integers(1, 9)),
        block_q=draw(st.integers(1, 70)), block_k=draw(st.integers(1, 70)),
        batch=draw(st.integers(1, 2)), heads=draw(st.integers(1, 2)), causal=causal,
        save_lse=True, options=options,
        window=draw(st.one_of(st.just((-1, -1)), st.tuples(side, side))))


@pytest.mark.parametrize("schedule, options", VARIANTS, ids=IDS)
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_backward_model_equals_brute_force_walk(schedule, options, data):
    p = data.draw(problems(schedule, options))
    bwd = backward_of(lo.get_schedule(schedule))
    assert bwd.model(p) == per_head_ledger(bwd.walk(p), p.bh)


@pytest.mark.parametrize("name", lo.backward_schedule_names())
def test_flash_backwards_move_less_than_dense_and_scale_with_m(name):
    """At N = 4096 every flash backward moves less than dense's; doubling Bc halves the
    Q-side reloads of the K/V-outer loop."""
    bwd = get_backward(name)
    small = lo.predict_traffic(name, n=4096, d=64, block_q=64, block_k=64, backward=True)
    dense = lo.predict_traffic("dense", n=4096, d=64, block_q=64, block_k=64, backward=True)
    if bwd.TRAFFIC_CLASS == "flash":
        assert small.total < dense.total
        large = lo.predict_traffic(name, n=4096, d=64, block_q=64, block_k=128, backward=True)
        assert large.read("q") * 2 == small.read("q")


@pytest.mark.parametrize("precision", ["tf32x3", "tf32"])
@pytest.mark.parametrize("variant", grad_variants(), ids=lambda v: v.label)
def test_tf32_backward_runs_on_tensor_cores(variant, precision, rng):
    """float32 at precision tf32 / tf32x3: the backward's five products on TF32 tensor cores
    (tails, causal n_q > n_k, dv != d), within the TF32 gradient bound of float64, and the
    same traffic as float32 FMA."""
    n_q, n_k, d, dv = 21, 13, 12, 8
    q, _, _ = random_qkv(rng, 1, 2, n_q, d, dv)
    _, k, v = random_qkv(rng, 1, 2, n_k, d, dv)
    do = rng.standard_normal((1, 2, n_q, dv)).astype(np.float32)
    g = lo.attention_grad(q, k, v, do, schedule=variant.schedule, block_q=16, block_k=16,
                          causal=True, options=variant.options, count=True,
                          precision=precision)
    bwd = backward_of(lo.get_schedule(variant.schedule))
    assert bwd.tensor_cores(g.problem.for_backward()) == TensorCores(precision)
    refs = attention_grad_reference(q, k, v, do, mask=g.problem.mask)
    tol = tf32_grad_tolerance(q, k, precision=precision, mask=g.problem.mask)
    for got, ref in zip((g.dq, g.dk, g.dv), refs, strict=True):
        assert relative_error(got, ref) <= tol
    assert g.counts_backward == lo.predict_traffic(
        variant.schedule, n=n_q, n_k=n_k, d=d, dv=dv, heads=2, block_q=16, block_k=16,
        causal=True, options=variant.options, backward=True)
    ieee = dataclasses.replace(g.problem, precision="ieee")
    assert bwd.tensor_cores(ieee) is None  # the default stays exact float32 FMA


def test_backward_errors_before_launch(rng, monkeypatch):
    from loop_orders.device import runtime

    q, k, v = random_qkv(rng, 1, 2, 8, 4, 4)
    do = rng.standard_normal((1, 2, 8, 4)).astype(np.float32)

    def reached(*args, **kwargs):
        raise AssertionError("reached the device before the input was refused")

    for name in ("to_device", "device_empty", "device_zeros"):
        monkeypatch.setattr(runtime, name, reached)
    cases = [
        ({"do": do[..., :3]}, ValueError, r"do: must have the output's shape \(1, 2, 8, 4\)"),
        ({"do": do.astype(np.float16)}, TypeError, "do: dtype must match q's"),
        ({"do": do.tolist()}, TypeError, "do: expected an array"),
        ({"options": {"dq": "sometimes"}}, ValueError, "options: dq of q_outer: got "
                                                       "'sometimes'; allowed 'atomic'"),
        ({"options": {"dq": "atomic", "x": 1}}, ValueError, "unknown option 'x' for q_outer"),
        ({"schedule": "nope"}, ValueError, "unknown schedule 'nope'"),
        ({"block_q": 0}, ValueError, "block_q: got 0"),
    ]
    for kwargs, exc, pattern in cases:
        args = {"q": q, "k": k, "v": v, "do": do, "schedule": "q_outer", **kwargs}
        with pytest.raises(exc, match=pattern):
            lo.attention_grad(**args)


def test_forward_accepts_backward_options_and_ignores_them(rng):
    q, k, v = random_qkv(rng, 1, 1, 9, 4, 4)
    plain = lo.attention(q, k, v, schedule="q_outer", block_q=4, block_k=4, count=True)
    other = lo.attention(q, k, v, schedule="q_outer", block_q=4, block_k=4, count=True,
                         options={"dq": "separate"})
    np.testing.assert_array_equal(plain.out, other.out)
    assert plain.counts == other.counts


@pytest.mark.parametrize("schedule, options", VARIANTS, ids=IDS)
def test_cli_traffic_backward_json(schedule, options, capsys):
    argv = ["traffic", "--backward", "--schedule", schedule, "--n", "7", "--d", "3",
            "--block-q", "2", "--block-k", "3", "--causal", "--measure", "--json"]
    for key, value in (options or {}).items():
        argv += ["--option", f"{key}={value}"]
    assert main(argv) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["backward"] is True and record["model"] == record["measured"]
    expected = lo.predict_traffic(schedule, n=7, d=3, block_q=2, block_k=3, causal=True,
                                  save_lse=True, backward=True, options=options)
    assert record["model"] == expected.to_dict()
    assert {"do", "dq", "dk", "dv"} <= set(record["model"])


def test_cli_backward_of_a_schedule_without_one(capsys, monkeypatch):
    sched = lo.get_schedule("q_outer")
    monkeypatch.setattr(type(sched), "BACKWARD", None)
    assert main(["traffic", "--backward", "--schedule", "q_outer", "--n", "4", "--d", "2"]) == 2
    assert "q_outer has no backward pass" in capsys.readouterr().err


def test_deterministic_order_gives_identical_gradients(rng):
    """dq=separate has no atomics: two runs give bit-identical gradients."""
    q, k, v = random_qkv(rng, 1, 1, 12, 4, 4)
    do = rng.standard_normal((1, 1, 12, 4)).astype(np.float32)
    runs = [lo.attention_grad(q, k, v, do, block_q=4, block_k=4, options={"dq": "separate"})
            for _ in range(2)]
    for name in ("dq", "dk", "dv"):
        np.testing.assert_array_equal(getattr(runs[0], name), getattr(runs[1], name))
