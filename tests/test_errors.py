"""Bad input is refused before any launch, naming the argument; the CLI exits 2 in one line."""

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
    with pytest.raises(ValueError, match="schedule.*known schedules: dense, kv_outer, q_outer"):
        lo.attention(*qkv, schedule="nope")


@pytest.mark.parametrize("kwargs, exc, pattern", [
    ({"block_q": 0}, ValueError, "block_q: got 0"),
    ({"block_k": -3}, ValueError, "block_k: got -3"),
    ({"block_q": 2.5}, TypeError, "block_q: must be an integer"),
    ({"block_k": True}, TypeError, "block_k: must be an integer"),
    ({"block_q": 5000}, ValueError, "block_q: got 5000, allowed 1 <= block_q <= 512"),
    ({"scale": float("nan")}, ValueError, "scale"),
    ({"scale": 0.0}, ValueError, "scale"),
    ({"causal": "yes"}, TypeError, "causal"),
])
def test_bad_options(qkv, kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        lo.attention(*qkv, schedule="q_outer", **kwargs)


def test_bad_shapes_and_dtypes(qkv):
    q, k, v = qkv
    cases = [
        ((q[0, 0], k, v), ValueError, "same number of dimensions"),
        ((q[0, 0, 0], k[0, 0, 0], v[0, 0, 0]), ValueError, "q: expected shape"),
        ((q, k[:, :1], v[:, :1]), ValueError, "batch and heads"),
        ((q, k[..., :3], v), ValueError, "k: head dim d"),
        ((q, k, v[:, :, :5]), ValueError, "v: must have as many rows"),
        ((q.astype(np.float64), k, v), TypeError, "q: dtype float64 is not supported"),
        ((q, k.astype(np.float16), v), TypeError, "dtypes must match"),
        ((q.tolist(), k, v), TypeError, "q: expected an array"),
    ]
    for args, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            lo.attention(*args, schedule="q_outer")


def test_causal_needs_square(rng):
    q, _, _ = random_qkv(rng, 1, 1, 4, 4, 4)
    _, k, v = random_qkv(rng, 1, 1, 6, 4, 4)
    with pytest.raises(ValueError, match="causal: needs as many queries as keys"):
        lo.attention(q, k, v, causal=True)


@pytest.mark.parametrize("schedule", ["q_outer", "kv_outer"])
def test_shared_memory_refused_with_need_and_limit(schedule, rng):
    q, k, v = random_qkv(rng, 1, 1, 4, 128, 128)
    with pytest.raises(ValueError, match=r"block_k: .* needs 65536 bytes .* limit is 49152"):
        lo.attention(q, k, v, schedule=schedule, block_k=64)


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
    (["run", "--schedule", "q_outer", "--n", "8", "--d", "128", "--block-k", "64"], "block_k"),
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
