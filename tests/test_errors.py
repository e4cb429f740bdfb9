"""Bad input is refused before any launch, naming the argument; the CLI exits 2 in one line."""

import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import random_qkv

import loop_orders as lo
from loop_orders.cli import main


@pytest.fixture
def qkv(rng):
    return random_qkv(rng, 1, 2, 8, 4, 4)


def test_unknown_schedule_lists_known(qkv):
    with pytest.raises(ValueError, match="schedule.*known schedules: " +
                       ", ".join(lo.schedule_names())):
        lo.attention(*qkv, schedule="nope")


@pytest.mark.parametrize("sched", [s for s in lo.all_schedules() if s.OPTIONS],
                         ids=lambda s: s.name)
def test_bad_schedule_options_refused_before_launch(qkv, no_launch, sched):
    key, opt = next(iter(sched.OPTIONS.items()))
    for options, pattern in (({key: object()}, rf"options: {key} of {sched.name}: got .*; "
                                                rf"allowed {re.escape(opt.allowed)}"),
                             ({key: True}, f"options: {key} of {sched.name}: got True"),
                             ({"no_such": 2}, f"options: unknown option 'no_such' for "
                                              f"{sched.name}; its options: {key}")):
        with pytest.raises(ValueError, match=pattern):
            lo.attention(*qkv, schedule=sched.name, block_q=4, block_k=4, options=options)


def test_options_given_to_a_schedule_without_any(qkv, no_launch):
    plain = next(s for s in lo.all_schedules() if not s.options_for({}))
    with pytest.raises(ValueError, match=f"unknown option 'x' for {plain.name}; its options: "
                                         "none"):
        lo.attention(*qkv, schedule=plain.name, options={"x": 2})


@pytest.mark.parametrize("window", [(-2, 0), (1,), (0, 1.5), "ab", (True, 0), None])
def test_bad_window_refused(window, rng):
    q, k, v = random_qkv(rng, 1, 1, 4, 4, 4)
    with pytest.raises(ValueError, match=r"window: got .* allowed \(left, right\)"):
        lo.attention(q, k, v, window=window)


@pytest.mark.parametrize("schedule", [s.name for s in lo.all_schedules() if s.uses_micro_kernel])
def test_shared_memory_refused_with_need_and_limit(schedule, rng):
    q, _, _ = random_qkv(rng, 1, 1, 4, 256, 256)
    _, k, v = random_qkv(rng, 1, 1, 128, 256, 256)
    limit = lo.get_schedule(schedule).kernels(
        lo.make_problem(schedule, n_q=4, n_k=128, d=256, block_q=4, block_k=128), False)[0
    ].shared_limit
    with pytest.raises(ValueError,
                       match=rf"block_k: .* needs (\d+) bytes .* limit is {limit}") as e:
        lo.attention(q, k, v, schedule=schedule, block_k=128)
    assert int(e.value.args[0].split(" needs ")[1].split()[0]) >= 4 * 128 * (256 + 256)


def test_head_dim_limit(rng):
    with pytest.raises(ValueError, match=r"d: got 300, allowed 1 <= d <= 256"):
        lo.predict_traffic("q_outer", n=8, d=300)


def test_dense_row_length_limit():
    p = lo.make_problem("dense", n_q=20000, d=8, block_q=8, block_k=8)
    with pytest.raises(ValueError, match="n_k: dense keeps one row of S"):
        lo.api.check_launch(lo.get_schedule("dense"), p, count=False)


@pytest.mark.parametrize("argv, pattern", [
    (["traffic", "--schedule", "nope", "--n", "6", "--d", "2"], "unknown schedule"),
    (["traffic", "--schedule", "dense", "--n", "6", "--d", "2", "--block-q", "0"], "block_q"),
    (["traffic", "--schedule", "dense", "--n", "x", "--d", "2"], "--n: invalid int"),
    (["run", "--schedule", "q_outer", "--n", "8", "--n-k", "128", "--d", "256", "--block-k",
      "128"], "block_k"),
    (["run", "--schedule", "q_outer", "--n", "8", "--d", "4", "--causal", "--repeat", "0"],
     "repeat"),
    (["traffic", "--n", "6", "--d", "2"], "--schedule"),
    (["frobnicate"], "invalid choice"),
])
def test_cli_bad_input_exits_2_with_one_line(argv, pattern, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert pattern in err


def test_cli_subprocess_has_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "loop_orders", "traffic", "--schedule",
                           "kv_outer", "--n", "6", "--d", "2", "--block-k", "-1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: block_k: got -1, allowed 1 <= block_k <= 512"]


# --- Every refusal happens before any copy or launch -----------------------------------------


@pytest.fixture
def no_launch(monkeypatch):
    """Fail loudly if anything reaches the device: copies, allocations or launches."""
    from loop_orders.device import runtime

    def reached(*args, **kwargs):
        raise AssertionError("reached the device before the input was refused")

    for name in ("to_device", "device_empty", "device_zeros"):
        monkeypatch.setattr(runtime, name, reached)
    for sched in lo.all_schedules():
        monkeypatch.setattr(sched, "launch", reached)


class _Interface:
    """A minimal __cuda_array_interface__ object (strides in bytes, None = C-contiguous)."""

    def __init__(self, shape, strides, typestr="<f4"):
        self.shape, self.dtype = shape, np.dtype(typestr)
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (0, False),
                                         "strides": strides, "version": 3}


def test_rank_shape_dtype_and_layout_refusals(qkv, no_launch):
    q, k, v = qkv
    cases = [
        ((q[0], k[0], v[0]), ValueError, r"q: expected shape .* got 3 dimensions"),
        ((q[None], k[None], v[None]), ValueError, r"q: expected shape .* got 5 dimensions"),
        ((q, k, v[0, 0]), ValueError, "same number of dimensions"),
        ((q, np.concatenate([k, k]), np.concatenate([v, v])), ValueError,
         "k, v: batch must match q.s, and K/V heads must equal"),
        ((q, k, v[:, :1]), ValueError, "k, v: batch must match q.s, and K/V heads must equal"),
        ((q[:, :, :0], k, v), ValueError, "n: got 0, allowed n >= 1"),
        ((q, k[:, :, :0], v[:, :, :0]), ValueError, "n_k: got 0"),
        ((q[..., :0], k[..., :0], v), ValueError, "d: got 0"),
        ((q, k, v[..., :0]), ValueError, "dv: got 0"),
        ((np.zeros((2, 300), np.float32),) * 3, ValueError, r"d: got 300, allowed 1 <= d <= 256"),
        ((q.astype(np.int32), k, v), TypeError, "q: dtype int32 is not supported"),
        ((q, k.astype(np.complex64), v), TypeError, "k: dtype complex64 is not supported"),
        ((q, k, v.astype(object)), TypeError, "v: dtype object is not supported"),
        ((q, k, v.astype(np.float16)), TypeError, "q, k, v: dtypes must match"),
        ((q, k, None), TypeError, "v: expected an array"),
        ((_Interface((8, 4), (4, 32)), k[0, 0], v[0, 0]), ValueError,
         "q: device arrays must be C-contiguous"),
        ((q[0, 0], _Interface((8, 4), (32, 4)), v[0, 0]), ValueError,
         "k: device arrays must be C-contiguous"),
    ]
    for args, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            lo.attention(*args, schedule="q_outer", block_q=4, block_k=4)


def test_non_contiguous_device_arrays_refused(qkv):
    from loop_orders.device import runtime

    dq, dk, dv = (runtime.to_device(x) for x in qkv)
    strided = runtime.to_device(np.concatenate([qkv[0]] * 2, axis=2))[:, :, ::2]
    assert strided.shape == dq.shape
    for args, name in (((strided, dk, dv), "q"), ((dq, strided, dv), "k"),
                       ((dq, dk, strided), "v")):
        with pytest.raises(ValueError, match=f"{name}: device arrays must be C-contiguous"):
            lo.attention(*args, schedule="kv_outer", block_q=4, block_k=4)


def test_numpy_strided_host_arrays_are_copied_not_refused(qkv):
    q, k, v = qkv
    wide = np.repeat(q, 2, axis=-1)[..., ::2]  # a non-contiguous view holding q
    np.testing.assert_array_equal(wide, q)
    res = lo.attention(wide, k, v, schedule="q_outer", block_q=4, block_k=4)
    ref = lo.attention(q, k, v, schedule="q_outer", block_q=4, block_k=4)
    np.testing.assert_array_equal(res.out, ref.out)


@pytest.mark.parametrize("kwargs, exc, pattern", [
    ({"block_q": np.float64(4.0)}, TypeError, "block_q: must be an integer"),
    ({"block_k": "4"}, TypeError, "block_k: must be an integer"),
    ({"block_k": 4.5}, TypeError, "block_k: must be an integer"),
    ({"block_q": -1}, ValueError, "block_q: got -1"),
    ({"block_k": 513}, ValueError, r"block_k: got 513, allowed 1 <= block_k <= 512"),
    ({"scale": float("inf")}, ValueError, "scale: must be a finite non-zero"),
    ({"scale": -float("inf")}, ValueError, "scale: must be a finite non-zero"),
    ({"scale": np.float32("nan")}, ValueError, "scale: must be a finite non-zero"),
    ({"scale": 1e-300}, ValueError, r"scale: got 1e-300; allowed .* <= \|scale\|"),
    ({"scale": 1e300}, ValueError, r"scale: got 1e\+300; allowed"),
    ({"scale": "0.5"}, ValueError, "scale: must be a finite non-zero real"),
    ({"scale": True}, ValueError, "scale: must be a finite non-zero real"),
    ({"scale": 1j}, ValueError, "scale: must be a finite non-zero real"),
    ({"save_lse": 1}, TypeError, "save_lse: must be True or False"),
    ({"count": "no"}, TypeError, "count: must be True or False"),
    ({"schedule": None}, ValueError, "schedule: unknown schedule None; known schedules"),
    ({"schedule": "Q_OUTER"}, ValueError, "schedule: unknown schedule 'Q_OUTER'"),
    ({"precision": "fp8"}, ValueError,
     r"precision: got 'fp8', allowed \['ieee', 'tf32', 'tf32x3'\]"),
])
def test_bad_options_refused_before_launch(qkv, no_launch, kwargs, exc, pattern):
    kwargs = {"schedule": "q_outer", "block_q": 4, "block_k": 4, **kwargs}
    with pytest.raises(exc, match=pattern):
        lo.attention(*qkv, **kwargs)


@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
def test_tf32_refused_for_a_schedule_without_tensor_cores(qkv, no_launch, monkeypatch,
                                                          precision):
    """A schedule that does not declare TENSOR_CORES (a plug-in's, say) refuses TF32."""
    monkeypatch.setattr(type(lo.get_schedule("split_kv")), "TENSOR_CORES", False)
    with pytest.raises(ValueError, match=f"precision: split_kv has no tensor-core path; "
                                         f"'{precision}' runs"):
        lo.attention(*qkv, schedule="split_kv", block_q=4, block_k=4, precision=precision)


@pytest.mark.parametrize("schedule", lo.schedule_names())
def test_numpy_integer_block_sizes_and_float32_scale_accepted(qkv, schedule):
    res = lo.attention(*qkv, schedule=schedule, block_q=np.int64(4), block_k=np.int32(3),
                       scale=np.float32(0.5), count=True)
    assert res.problem.block_q == 4 and type(res.problem.block_q) is int
    assert res.counts == lo.predict_traffic(schedule, n=8, d=4, batch=1, heads=2, block_q=4,
                                            block_k=3)


@pytest.mark.parametrize("argv, pattern", [
    ([], "the following arguments are required: command"),
    (["schedules", "--bogus"], "unrecognized arguments: --bogus"),
    (["traffic", "--schedule", "q_outer", "--n", "0", "--d", "2"], "n: got 0"),
    (["traffic", "--schedule", "q_outer", "--n", "6", "--d", "0"], "d: got 0"),
    (["traffic", "--schedule", "q_outer", "--n", "6", "--d", "300"], "d: got 300"),
    (["traffic", "--schedule", "q_outer", "--n", "6", "--d", "2", "--dv", "0"], "dv: got 0"),
    (["traffic", "--schedule", "q_outer", "--n", "6", "--d", "2", "--batch", "0"],
     "batch: got 0"),
    (["traffic", "--schedule", "q_outer", "--n", "6", "--d", "2", "--heads", "-2"],
     "heads: got -2"),
    (["traffic", "--schedule", "q_outer", "--n", "6", "--d", "2", "--block-k", "1.5"],
     "--block-k: invalid int value"),
    (["traffic", "--schedule", "q_outer", "--n", "6", "--d", "2", "--dtype", "float64"],
     "--dtype: invalid choice"),
    (["traffic", "--schedule", "q_outer", "--n", "6", "--n-k", "128", "--d", "256",
      "--block-k", "128", "--measure"], "block_k: q_outer needs"),
    (["run", "--schedule", "nope", "--n", "8", "--d", "4"], "unknown schedule"),
    (["run", "--schedule", "q_outer", "--n", "0", "--d", "4"], "n: got 0"),
    (["run", "--schedule", "q_outer", "--n", "8", "--d", "4", "--dtype", "int8"],
     "--dtype: invalid choice"),
    (["run", "--schedule", "q_outer", "--n", "8", "--d", "4", "--block-q", "0"], "block_q"),
    (["run", "--schedule", "dense", "--n", "20000", "--d", "4"], "n_k: dense keeps one row"),
    (["run", "--schedule", "q_outer", "--n", "8", "--d", "4", "--dtype", "float16",
      "--precision", "tf32"], "precision: 'tf32' is for float32 inputs"),
])
def test_cli_every_subcommand_exits_2_with_one_line(argv, pattern, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert pattern in err


@pytest.mark.parametrize("command", ["traffic", "run"])
def test_cli_memory_refusal_exits_2_with_one_line(command, capsys, monkeypatch, fresh_calls):
    from loop_orders.device import runtime

    monkeypatch.setattr(runtime, "memory_limit", lambda: (100, "a test limit"))
    argv = [command, "--schedule", "dense", "--n", "8", "--d", "4", "--block-q", "4",
            "--block-k", "4"] + (["--measure"] if command == "traffic" else ["--repeat", "1"])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "n: dense needs" in err and "the limit is 100 bytes (a test limit)" in err


def test_tiles_left_out_are_chosen_to_fit_and_named_ones_are_refused(monkeypatch):
    """With no tiles named, a pass whose 64 x 64 kernels need more shared memory than a CTA
    may take runs on the first of DEFAULT_TILES that fits (float32 at d = 160: the
    backward's 64 x 64 needs 300288 bytes, the forward's fit); named tiles that do not fit
    are refused, naming the tile. Checked without running (the simulator would take minutes
    at d = 160)."""
    from loop_orders import api, api_grad

    monkeypatch.setenv("LOOP_ORDERS_ALLOW_SLOW", "1")
    q = np.ones((1, 1, 128, 160), np.float32)
    call = api_grad.prepare_grad(q, q, q, q, "q_outer", None, None, True, None, None, False,
                                 False)
    backward = call.p.for_backward()
    assert (call.p.block_q, call.p.block_k) == api.DEFAULT_TILES[0]
    assert (backward.block_q, backward.block_k) in api.DEFAULT_TILES[1:]
    with pytest.raises(ValueError, match="^block_k: q_outer's backward needs 300288 bytes"):
        api_grad.prepare_grad(q, q, q, q, "q_outer", 64, 64, True, None, None, False, False)
    forward = api._prepare(q, q, q, "dense", None, None, False, None, False, False, None,
                           False, "ieee")
    assert forward.p.block_q * forward.p.block_k < 64 * 64
    with pytest.raises(ValueError, match="^block_k: dense needs"):
        api._prepare(q, q, q, "dense", 64, 64, False, None, False, False, None, False, "ieee")
    fits = api._prepare(q[..., :64], q[..., :64], q[..., :64], "dense", None, None, False,
                        None, False, False, None, False, "ieee")
    assert (fits.p.block_q, fits.p.block_k) == (64, 64)


def test_backward_tiles_are_checked_and_clamped_to_the_lengths():
    """A backward's own tiles: refused outside 1 .. MAX_BLOCK_Q/K (naming them), clamped to
    N_q, N_k as `make_problem` clamps, left unset where they are the forward's."""
    p = lo.make_problem("q_outer", n_q=10, d=4, block_q=8, block_k=8, save_lse=True)
    with pytest.raises(ValueError, match="^backward_tiles: got 0 x 8"):
        p.with_backward_tiles(0, 8)
    clamped = p.with_backward_tiles(64, 4)
    assert clamped.backward_tiles == (10, 4)
    assert (clamped.for_backward().block_q, clamped.for_backward().block_k) == (10, 4)
    assert p.with_backward_tiles(8, 8) == p and p.for_backward() is p
