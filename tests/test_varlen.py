"""Packed variable-length batches: q (total_q, H, d), k, v (total_k, H_kv, .) with int32
prefix sums cu_seqlens_q, cu_seqlens_k (FlashAttention's varlen convention).

Every backward variant (and so every schedule's forward) against the float64 reference
sequence by sequence, with a sequence without queries, one with more queries than keys
(causal rows that see nothing), tail blocks, grouped-query heads and dv != d; the counters
equal predict_traffic with the same cu_seqlens, which is the sum of the sequences' models;
what cannot run is refused naming the argument.
"""

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import loop_orders as lo
from loop_orders.core.mask import mask_of
from loop_orders.core.schedule import grad_variants
from loop_orders.device import runtime
from loop_orders.reference import (
    relative_error,
    tolerance,
    varlen_attention_reference,
    varlen_grad_reference,
)

H, H_KV, D, DV = 2, 1, 8, 4
N_Q, N_K = [3, 0, 9, 5], [5, 2, 7, 5]  # no queries in sequence 1; more queries than keys in 2
CU_Q, CU_K = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (N_Q, N_K))
MASKS = [(False, (-1, -1)), (True, (-1, -1)), (False, (2, 1)), (True, (3, -1))]
BLOCK_Q, BLOCK_K = 8, 4
CI_VARLEN_EXAMPLES = 8  # drawn packed batches in CI (LOOP_ORDERS_FUZZ_VARLEN_EXAMPLES: more)
VARLEN_EXAMPLES = int(os.environ.get("LOOP_ORDERS_FUZZ_VARLEN_EXAMPLES", CI_VARLEN_EXAMPLES))


def packed_inputs(dtype="float32", d=D, dv=DV, seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(CU_Q[-1], H, d), (CU_K[-1], H_KV, d), (CU_K[-1], H_KV, dv), (CU_Q[-1], H, dv)]
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


@pytest.mark.parametrize("index", range(len(grad_variants(forwards=True))),
                         ids=[v.label for v in grad_variants(forwards=True)])
def test_varlen_forward_and_backward_match_the_reference_and_the_model(index):
    """Each variant under one mask of MASKS (in turn): out, lse, dq, dk, dv within float32's
    tolerance of float64; forward and backward counters == predict_traffic(cu_seqlens)."""
    variant = grad_variants(forwards=True)[index]
    causal, window = MASKS[index % len(MASKS)]
    q, k, v, do = packed_inputs(seed=index)
    kw = dict(schedule=variant.schedule, options=variant.options, block_q=BLOCK_Q,
              block_k=BLOCK_K, causal=causal, window=window, cu_seqlens_q=CU_Q,
              cu_seqlens_k=CU_K)
    g = lo.attention_grad(q, k, v, do, count=True, **kw)
    mask = mask_of(causal, window)
    out, lse = varlen_attention_reference(q, k, v, CU_Q, CU_K, mask=mask)
    grads = varlen_grad_reference(q, k, v, do, CU_Q, CU_K, mask=mask)
    assert g.out.shape == out.shape and g.lse.shape == lse.shape == (H, CU_Q[-1])
    assert relative_error(g.out, out) <= tolerance("float32", 0, v, out)
    seen = np.isfinite(lse)  # rows that see no key: lse -inf
    assert np.array_equal(np.isfinite(g.lse), seen)
    assert np.abs(g.lse[seen] - lse[seen]).max() <= 1e-5
    for got, ref in zip((g.dq, g.dk, g.dv), grads, strict=True):
        assert got.shape == ref.shape
        assert relative_error(got, ref) <= 1e-5
    predict = dict(d=D, dv=DV, heads=H, kv_heads=H_KV, block_q=BLOCK_Q, block_k=BLOCK_K,
                   causal=causal, window=window, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K)
    assert g.counts_forward == lo.predict_traffic(variant.schedule, None, save_lse=True,
                                                  options=variant.options, **predict)
    assert g.counts_backward == lo.predict_traffic(variant.schedule, None, backward=True,
                                                   options=variant.options, **predict)
    assert len(g.problems) == sum(n > 0 for n in N_Q)


def test_a_varlen_call_naming_no_tiles_runs_its_backward_on_the_backwards_tiles(
        backward_tiles_16x8):
    """q_outer's backward measured fastest on 16 x 8: with cu_seqlens each sequence's
    backward runs it, clamped to its lengths, the forward 64 x 64 clamped; gradients within
    float32's tolerance, the backward counted == its sequences' models on those tiles."""
    bwd = backward_tiles_16x8
    n_q, n_k = [21, 0, 9, 30], [17, 2, 7, 30]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (n_q, n_k))
    rng = np.random.default_rng(3)
    q, k, v, do = (rng.standard_normal(s).astype(np.float32) for s in (
        (cu_q[-1], H, D), (cu_k[-1], H_KV, D), (cu_k[-1], H_KV, DV), (cu_q[-1], H, DV)))
    g = lo.attention_grad(q, k, v, do, causal=True, count=True, cu_seqlens_q=cu_q,
                          cu_seqlens_k=cu_k)
    assert [(p.block_q, p.block_k, p.backward_tiles) for p in g.problems] == [
        (21, 17, (16, 8)), (9, 7, ()), (30, 30, (16, 8))]  # 16 x 8 clamped to 9 x 7: its own
    grads = varlen_grad_reference(q, k, v, do, cu_q, cu_k, mask=mask_of(True, (-1, -1)))
    for got, ref in zip((g.dq, g.dk, g.dv), grads, strict=True):
        assert relative_error(got, ref) <= 1e-5
    ours = sum((lo.api.backward_traffic(bwd, p) for p in g.problems), lo.Ledger({}))
    assert g.counts_backward == ours != lo.predict_traffic(
        "q_outer", None, backward=True, d=D, dv=DV, heads=H, kv_heads=H_KV, causal=True,
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def test_varlen_float16_forward_on_tensor_cores_with_torch_tensors():
    """float16 on the tensor-core forward, torch tensors and torch cu_seqlens in, torch out;
    counted == predicted."""
    torch = pytest.importorskip("torch")
    q, k, v, _ = (torch.from_numpy(x) for x in packed_inputs("float16", d=16, dv=16))
    cu_q, cu_k = torch.from_numpy(CU_Q), torch.from_numpy(CU_K)
    res = lo.attention(q, k, v, schedule="q_outer", causal=True, block_q=16, block_k=16,
                       cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, count=True)
    out, _ = varlen_attention_reference(q.numpy(), k.numpy(), v.numpy(), CU_Q, CU_K,
                                        causal=True)
    assert isinstance(res.out, torch.Tensor) and res.out.dtype == torch.float16
    assert relative_error(res.out.double().numpy(), out) <= tolerance("float16", 1, v.numpy(),
                                                                      out)
    assert res.counts == lo.predict_traffic("q_outer", None, 16, heads=H, kv_heads=H_KV,
                                            block_q=16, block_k=16, causal=True,
                                            cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K)


def test_varlen_traffic_is_the_sum_of_the_sequences_models():
    """No padding moves: a packed batch's predicted traffic is its sequences' (a sequence
    without queries moves nothing)."""
    cu_q = np.array([0, 100, 100, 1124], np.int32)
    cu_k = np.array([0, 300, 364, 1388], np.int32)
    for schedule in lo.schedule_names():
        packed = lo.predict_traffic(schedule, None, 64, heads=4, causal=True,
                                    cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        each = [lo.predict_traffic(schedule, nq, 64, heads=4, causal=True, n_k=nk)
                for nq, nk in ((100, 300), (1024, 1024))]
        assert packed == each[0] + each[1]


def test_varlen_refusals_name_the_argument():
    q, k, v, _ = packed_inputs()
    call = dict(cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K)
    with pytest.raises(TypeError, match="^cu_seqlens_q: .*int32"):
        lo.attention(q, k, v, cu_seqlens_q=CU_Q.astype(np.int64), cu_seqlens_k=CU_K)
    with pytest.raises(ValueError, match="^cu_seqlens_k: .*end at the packed rows"):
        lo.attention(q, k, v, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K - 1)
    with pytest.raises(ValueError, match="^cu_seqlens_q: .*never decrease"):
        lo.attention(q, k, v, cu_seqlens_q=CU_Q[::-1].copy(), cu_seqlens_k=CU_K)
    with pytest.raises(ValueError, match="^cu_seqlens_k: must give as many sequences"):
        lo.attention(q, k, v, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K[[0, 1, -1]])
    no_keys = np.array([0, 0, 2, 7, 12], np.int32)  # sequence 0: 3 queries, no keys
    with pytest.raises(ValueError, match="^cu_seqlens_k: sequence 0 has 3 queries and no"):
        lo.attention(q, k[:12], v[:12], cu_seqlens_q=CU_Q, cu_seqlens_k=no_keys)
    with pytest.raises(ValueError, match="^q, k, v: with cu_seqlens expected packed shapes"):
        lo.attention(q[None], k[None], v[None], **call)
    with pytest.raises(ValueError, match="^pack_gqa: "):
        lo.attention(q, k, v, pack_gqa=True, **call)
    with pytest.raises(ValueError, match="cu_seqlens"):
        lo.predict_traffic("q_outer", 16, D, **call)
    with pytest.raises(ValueError, match="^pack_gqa: "):
        lo.predict_traffic("q_outer", None, D, heads=H, kv_heads=H_KV, pack_gqa=True, **call)
    none = np.zeros(5, np.int32)  # four sequences, none with a query
    with pytest.raises(ValueError, match="^cu_seqlens_q: no sequence has a query"):
        lo.attention(q[:0], k, v, cu_seqlens_q=none, cu_seqlens_k=CU_K)


def test_varlen_through_the_torch_op_with_counting():
    """The torch op with cu_seqlens: out and the gradients equal lo.attention_grad's on the
    same arrays, and counting() records each pass's ledger equal to its model."""
    torch = pytest.importorskip("torch")
    import loop_orders.torch as lot

    q, k, v, do = (torch.from_numpy(x) for x in packed_inputs(seed=7))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with lot.counting() as passes:
        out = lot.attention(*leaves, schedule="kv_outer", causal=True, block_q=BLOCK_Q,
                            block_k=BLOCK_K, cu_seqlens_q=torch.from_numpy(CU_Q),
                            cu_seqlens_k=torch.from_numpy(CU_K))
        out.backward(do)
    g = lo.attention_grad(q, k, v, do, schedule="kv_outer", causal=True, block_q=BLOCK_Q,
                          block_k=BLOCK_K, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K)
    assert torch.equal(out.detach(), g.out)
    for leaf, grad in zip(leaves, (g.dq, g.dk, g.dv), strict=True):
        assert torch.equal(leaf.grad, grad)
    assert [p.pass_ for p in passes] == ["forward", "backward"]
    assert all(p.ledger == p.model for p in passes)


@st.composite
def varlen_cases(draw):
    """A packed batch: 1-3 sequences of 0-12 queries over 1-12 keys, grouped heads or not, a
    mask, a variant of some backward order, tiles, dtype."""
    n_seq = draw(st.integers(1, 3))
    n_q = draw(st.lists(st.integers(0, 12), min_size=n_seq, max_size=n_seq))
    n_k = draw(st.lists(st.integers(1, 12), min_size=n_seq, max_size=n_seq))
    kv_heads = draw(st.integers(1, 2))
    side = st.one_of(st.just(-1), st.integers(0, 12))
    return {"n_q": n_q, "n_k": n_k, "kv_heads": kv_heads,
            "heads": kv_heads * draw(st.integers(1, 2)), "d": draw(st.integers(1, 9)),
            "dv": draw(st.integers(1, 9)), "causal": draw(st.booleans()),
            "window": draw(st.one_of(st.just((-1, -1)), st.tuples(side, side))),
            "variant": draw(st.sampled_from(grad_variants(forwards=True))),
            "block_q": draw(st.integers(1, 16)), "block_k": draw(st.integers(1, 16)),
            "seed": draw(st.integers(0, 2**32 - 1))}


@pytest.mark.skipif(not runtime.SIMULATOR, reason="on a GPU every drawn case compiles kernels "
                    "of its own (minutes); test_gpu's varlen test runs there")
@settings(max_examples=VARLEN_EXAMPLES, deadline=None, database=None,
          derandomize=VARLEN_EXAMPLES == CI_VARLEN_EXAMPLES, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=varlen_cases())
def test_varlen_fuzz(case):
    """Drawn packed batches (sequences without queries among them): out, dq, dk, dv within
    float32's tolerance of the float64 reference; both ledgers == predict_traffic."""
    c = case
    assume(sum(c["n_q"]) > 0)  # a batch without queries is refused (test_varlen_refusals_...)
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
                  for n in (c["n_q"], c["n_k"]))
    rng = np.random.default_rng(c["seed"])
    q, do = (rng.standard_normal((cu_q[-1], c["heads"], w)).astype(np.float32)
             for w in (c["d"], c["dv"]))
    k, v = (rng.standard_normal((cu_k[-1], c["kv_heads"], w)).astype(np.float32)
            for w in (c["d"], c["dv"]))
    variant = c["variant"]
    kw = dict(schedule=variant.schedule, options=variant.options, block_q=c["block_q"],
              block_k=c["block_k"], causal=c["causal"], window=c["window"])
    try:
        g = lo.attention_grad(q, k, v, do, count=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                              **kw)
    except ValueError as exc:  # refused up front: only the simulator's budget may refuse
        assert "simulator" in str(exc), exc
        return
    mask = mask_of(c["causal"], c["window"])
    out, _ = varlen_attention_reference(q, k, v, cu_q, cu_k, mask=mask)
    grads = varlen_grad_reference(q, k, v, do, cu_q, cu_k, mask=mask)
    for got, ref in zip((g.out, g.dq, g.dk, g.dv), (out, *grads), strict=True):
        assert relative_error(got, ref) <= 1e-5
    shapes = dict(d=c["d"], dv=c["dv"], heads=c["heads"], kv_heads=c["kv_heads"],
                  cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert g.counts_forward == lo.predict_traffic(n=None, save_lse=True, **shapes, **kw)
    assert g.counts_backward == lo.predict_traffic(n=None, backward=True, **shapes, **kw)
