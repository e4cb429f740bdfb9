"""Context-parallel schedules without a multi-GPU machine: one process per device with gloo
on CPU (the kernels on the Numba CUDA simulator), P = 2 and 4 at tiny shapes.

Each case's outputs (gathered from every device) against the float64 reference, every
device's counted interconnect bytes against the model computed here, its counted HBM
traffic against the HBM model of its rank; P = 1 against lo.attention itself; the checks
that refuse bad input before any transfer; the benchmark end to end under torchrun at P = 2.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import loop_orders as lo  # noqa: E402
import loop_orders.context_parallel as cp  # noqa: E402
from loop_orders import results  # noqa: E402
from loop_orders.reference import attention_reference, relative_error, tolerance  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
WORLD = 4  # processes spawned; groups of 2 (ranks 0-1, 2-3) and of 4 share them


class Case(NamedTuple):
    """One context-parallel call: which group runs it, the schedule and the global shape."""

    group: str  # "pair0" (ranks 0, 1), "pair1" (ranks 2, 3) or "all" (P = 4)
    schedule: str
    causal: bool
    batch: int
    heads: int
    n: int
    d: int
    dv: int
    dtype: str = "float32"
    local: str = "q_outer"
    block: int = 4
    save_lse: bool = True
    overlap: bool = True
    timed: bool = False

    @property
    def name(self) -> str:
        return "-".join(f"{f}={getattr(self, f)}" for f in self._fields)


GROUPS = {"pair0": (0, 1), "pair1": (2, 3), "all": (0, 1, 2, 3)}
# Odd head dims, dv != d, tails (blocks of 4 over 6 or 3 rows), batch and heads > 1.
CASES = [
    *(Case("pair0", s, causal, 2, 2, 12, 5, 3) for s in cp.schedule_names()
      for causal in (False, True)),
    Case("pair1", "ring", True, 1, 2, 8, 3, 4, timed=True),
    Case("pair1", "ring", False, 1, 2, 8, 3, 4, overlap=False, timed=True, save_lse=False),
    Case("pair1", "ulysses", True, 1, 4, 8, 3, 5, save_lse=False, timed=True),
    Case("pair1", "allgather_kv", True, 1, 1, 8, 8, 3, dtype="float16", local="dense"),
    Case("pair1", "ring", False, 1, 1, 8, 8, 8, dtype="float16", block=8),
    *(Case("all", s, True, 1, 4, 16, 3, 4) for s in cp.schedule_names()),
    *(Case("all", s, False, 1, 4, 12, 3, 4, save_lse=s != "ulysses", block=2)
      for s in cp.schedule_names()),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, inputs: dict, out_dir: str) -> None:
    """One device: join the groups, run every case of the groups it belongs to, store what
    each call returned (the parent checks it)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    groups = {name: dist.new_group(list(ranks)) if len(ranks) < world else None
              for name, ranks in GROUPS.items()}
    for case in CASES:
        if rank not in GROUPS[case.group]:
            continue
        members = GROUPS[case.group]
        local_rank, size = members.index(rank), len(members)
        q, k, v = (cp.shard(torch.from_numpy(x), local_rank, size, case.causal)
                   for x in inputs[case.name])
        res = cp.attention(q, k, v, case.schedule, group=groups[case.group],
                           causal=case.causal, save_lse=case.save_lse, count=True,
                           timed=case.timed, local_schedule=case.local,
                           block_q=case.block, block_k=case.block, overlap=case.overlap)
        stored = {"out": res.out.float().numpy(),
                  "lse": None if res.lse is None else res.lse.numpy(),
                  "counts": res.counts.to_dict(), "hbm_model": res.hbm_model.to_dict(),
                  "transfers": res.transfers, "model": res.model, "spans": res.spans,
                  "rank": res.rank, "world": res.problem.world}
        with open(Path(out_dir) / f"{case.name}.{local_rank}.pkl", "wb") as f:
            pickle.dump(stored, f)
    dist.barrier()
    dist.destroy_process_group()


def make_inputs(rng, case: Case):
    shape = (case.batch, case.heads, case.n)
    return tuple(rng.standard_normal((*shape, width)).astype(case.dtype)
                 for width in (case.d, case.d, case.dv))


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """Every case, run once by WORLD processes; (inputs, results per case and rank)."""
    seed = np.random.SeedSequence().entropy % 2**32
    print(f"input seed: {seed}")
    rng = np.random.default_rng(seed)
    inputs = {case.name: make_inputs(rng, case) for case in CASES}
    out_dir = tmp_path_factory.mktemp("cp")
    torch.multiprocessing.spawn(_worker, args=(WORLD, free_port(), inputs, str(out_dir)),
                                nprocs=WORLD)
    results = {}
    for case in CASES:
        size = len(GROUPS[case.group])
        results[case.name] = []
        for r in range(size):
            with open(out_dir / f"{case.name}.{r}.pkl", "rb") as f:
                results[case.name].append(pickle.load(f))
    return inputs, results


def _roundings(case: Case) -> int:
    """Times an output row is rounded to the input dtype: the local kernel's, plus the
    combine's final rounding (its weights are convex, so the parts' errors do not add)."""
    sched = lo.get_schedule(case.local)
    p = lo.make_problem(case.local, n_q=case.n, d=case.d, dv=case.dv, block_q=case.block,
                        block_k=case.block, causal=case.causal, dtype=case.dtype)
    return sched.output_roundings(p) + 1


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_output_against_reference(ran, case):
    inputs, results = ran
    q, k, v = inputs[case.name]
    per_rank = results[case.name]
    ref, ref_lse = attention_reference(q, k, v, causal=case.causal)
    out = cp.unshard([r["out"] for r in per_rank], case.causal)
    err = relative_error(out, ref)
    assert err <= tolerance(case.dtype, _roundings(case), v, ref), err
    if case.save_lse:
        lse = cp.unshard([r["lse"][..., None] for r in per_rank], case.causal)[..., 0]
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)
    else:
        assert all(r["lse"] is None for r in per_rank)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_interconnect_bytes_equal_model(ran, case):
    per_rank = ran[1][case.name]
    model = cp.interconnect_model(case.schedule, world=len(per_rank), n=case.n, d=case.d,
                                  dv=case.dv, batch=case.batch, heads=case.heads,
                                  itemsize=np.dtype(case.dtype).itemsize, causal=case.causal,
                                  save_lse=case.save_lse)
    assert model, "a schedule over P > 1 devices moves bytes"
    for r in per_rank:
        assert tuple(r["transfers"]) == model
        assert tuple(r["model"]) == model
    steps = {"ring": len(per_rank) - 1, "allgather_kv": 1, "ulysses": 2}[case.schedule]
    assert len(cp.per_step(model)) == steps


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hbm_counts_equal_model(ran, case):
    for r in ran[1][case.name]:
        model = cp.hbm_model(case.schedule, r["rank"], r["world"], case.n, case.d, case.dv,
                             case.batch, case.heads, case.causal, case.save_lse, case.local,
                             case.block, case.block, dtype=case.dtype)
        assert lo.Ledger.from_dict(r["counts"]) == model
        assert lo.Ledger.from_dict(r["hbm_model"]) == model


def test_timed_spans(ran):
    """Timed calls record each step's parts: ring overlapped (compute, wait), ring not
    (transfer, then compute), ulysses (scatter and compute, then gather)."""
    expect = {("ring", True): {0: {"compute", "wait", "step"}, 1: {"compute", "step"}},
              ("ring", False): {0: {"transfer", "compute", "step"}, 1: {"compute", "step"}},
              ("ulysses", True): {0: {"transfer", "compute", "step"}, 1: {"transfer", "step"}}}
    timed = [c for c in CASES if c.timed]
    assert len(timed) == len(expect)
    for case in timed:
        for r in ran[1][case.name]:
            got: dict = {}
            for span in r["spans"]:
                assert span.ms >= 0
                got.setdefault(span.step, set()).add(span.what)
            assert got == expect[case.schedule, case.overlap]


def test_zigzag_balances_causal_work():
    """Every device's kernels in the causal ring see the same number of query-key pairs:
    the zig-zag layout's point."""
    def pairs(rank, world, n):
        shapes = cp.ring.local_shapes(cp.make_problem("ring", world, n, 4, causal=True), rank)
        return sum(s.n_q * (s.n_q + 1) // 2 if s.causal else s.n_q * s.n_k for s in shapes)

    for world in (2, 3, 4):
        assert len({pairs(r, world, 24 * world) for r in range(world)}) == 1


@pytest.mark.parametrize("schedule", cp.schedule_names())
@pytest.mark.parametrize("causal", [False, True])
def test_one_device_is_lo_attention(rng, schedule, causal):
    """P = 1 (no process group): the same output, lse and HBM counts as lo.attention."""
    q, k, v = (torch.from_numpy(rng.standard_normal((1, 2, 8, w)).astype(np.float32))
               for w in (5, 5, 3))
    kwargs = {"causal": causal, "save_lse": True, "count": True, "block_q": 4, "block_k": 4}
    res = cp.attention(q, k, v, schedule, **kwargs)
    one = lo.attention(q, k, v, "q_outer", **kwargs)
    assert torch.equal(res.out, one.out) and torch.equal(res.lse, one.lse)
    assert res.counts == one.counts == res.hbm_model
    assert res.transfers == res.model == ()


def test_shard_unshard_roundtrip(rng):
    x = rng.standard_normal((2, 3, 16, 5))
    for world, causal in ((1, False), (4, False), (2, True), (4, True)):
        shards = [cp.shard(x, r, world, causal) for r in range(world)]
        assert np.array_equal(cp.unshard(shards, causal), x)
    assert list(cp.rows_of(cp.make_problem("ring", 2, 8, 1, causal=True), 0)) == [0, 1, 6, 7]


def test_models_by_hand():
    """The formulas at one shape: B = 1, H = 4, N = 16, d = 3, dv = 5, float16, P = 4."""
    kw = {"world": 4, "n": 16, "d": 3, "dv": 5, "heads": 4, "itemsize": 2}
    ring = cp.interconnect_model("ring", **kw)
    assert [(t.step, t.tensor, t.sent) for t in ring] == [
        (s, name, 4 * 4 * w * 2) for s in range(3) for name, w in (("k", 3), ("v", 5))]
    gather = cp.interconnect_model("allgather_kv", **kw)
    assert sum(t.sent for t in gather) == sum(t.sent for t in ring) == 3 * 4 * 4 * 8 * 2
    uly = cp.interconnect_model("ulysses", save_lse=True, **kw)
    assert {(t.step, t.tensor): t.received for t in uly} == {
        (0, "q"): 3 * 4 * 3 * 2, (0, "k"): 3 * 4 * 3 * 2, (0, "v"): 3 * 4 * 5 * 2,
        (1, "o"): 3 * 4 * 5 * 2, (1, "lse"): 3 * 4 * 4}


@pytest.mark.parametrize("call, message", [
    (lambda: cp.interconnect_model("ring", world=3, n=8, d=4), "n: N = 8 must be divisible by 3"),
    (lambda: cp.interconnect_model("ring", world=2, n=6, d=4, causal=True), "2P = 4 chunks"),
    (lambda: cp.interconnect_model("ulysses", world=4, n=8, d=4, heads=2), "heads:"),
    (lambda: cp.interconnect_model("tree", world=2, n=8, d=4), "schedule: unknown"),
    (lambda: cp.interconnect_model("ring", world=0, n=8, d=4), "world:"),
    (lambda: cp.interconnect_model("ring", world=2, n=8, d=4, itemsize=8), "itemsize:"),
    (lambda: cp.hbm_model("ring", 2, 2, 8, 4), "rank:"),
    (lambda: cp.shard(np.zeros((6, 2)), 0, 4), "n: N = 6"),
])
def test_models_refuse_bad_sizes(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_attention_refuses_before_any_transfer():
    """Without a process group: the checks that every device makes before its first
    transfer (a group would not change them)."""
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(TypeError, match="q: context-parallel attention takes torch"):
        cp.attention(q.numpy(), q, q)
    with pytest.raises(ValueError, match="n: N = 3 must be divisible by 2"):
        cp.attention(q, q, q, causal=True)
    with pytest.raises(ValueError, match="overlap: only ring"):
        cp.attention(q, q, q, "ulysses", overlap=False)
    with pytest.raises(ValueError, match="k: must hold as many rows"):
        cp.attention(q, torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4))
    wide = torch.randn(1, 1, 2, 300)
    with pytest.raises(ValueError, match="d: got 300, allowed 1 <= d <= 256"):
        cp.attention(wide, wide, wide)
    with pytest.raises(ValueError, match="local_schedule: unknown schedule 'nope'"):
        cp.attention(q, q, q, local_schedule="nope")


def test_bench_runs_under_torchrun(tmp_path):
    """experiments/bench_context_parallel.py end to end at P = 2 (gloo, --tiny): its results
    file, with provenance, counted bytes equal to the model at every step of every point."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "experiments.bench_context_parallel", "--tiny", "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = results.load(tmp_path / "context_parallel.simulator.json")
    assert data["complete"] and data["provenance"]["world_size"] == 2
    assert {r["key"]["schedule"] for r in data["records"]} == set(cp.schedule_names())
    for record in data["records"]:
        assert record["rel_error"] <= 1e-5 and record["efficiency"] > 0
        for step in record["steps"]:
            assert step["counted_sent"] == [step["model_sent"]] * 2
            assert step["counted_received"] == [step["model_received"]] * 2
        for device in record["hbm"]:
            assert lo.Ledger.from_dict(device["counted"]) == lo.Ledger.from_dict(
                device["model"])
    assert json.loads(json.dumps(data)) == data
