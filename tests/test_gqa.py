"""Grouped-query and multi-query attention: k, v with H_kv heads under H_q query heads, query
head h reading K/V head h // (H_q / H_kv), per query head and packed (`pack_gqa`).

Every schedule, forward and backward, against the float64 reference with K/V repeated over
each group (dk, dv summed over the group), counters == model exactly; the models say
packing reads K/V H_q / H_kv times less at decode; what cannot run is refused naming why.
"""

import numpy as np
import pytest

import loop_orders as lo
from loop_orders.core.schedule import grad_variants
from loop_orders.reference import (
    attention_grad_reference,
    attention_reference,
    relative_error,
    tolerance,
)

B, H, H_KV, N_Q, N_K, D, DV, BLOCK = 1, 4, 2, 7, 9, 4, 3, 4
G = H // H_KV
CASES = [(False, (-1, -1), False), (True, (-1, -1), False), (False, (3, 1), False),
         (False, (-1, -1), True)]  # (causal, window, pack_gqa)
IDS = ["none", "causal", "window", "packed"]


def inputs(dtype="float32", seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, N_Q, D)).astype(dtype)
    k = rng.standard_normal((B, H_KV, N_K, D)).astype(dtype)
    v = rng.standard_normal((B, H_KV, N_K, DV)).astype(dtype)
    do = rng.standard_normal((B, H, N_Q, DV)).astype(dtype)
    return q, k, v, do


def repeated(x):
    """K or V over the query heads of each group, in float64 (the reference's view)."""
    return np.repeat(x.astype(np.float64), G, axis=1)


@pytest.mark.parametrize("schedule", lo.schedule_names())
@pytest.mark.parametrize("causal, window, pack_gqa", CASES, ids=IDS)
def test_forward_per_head_and_packed(schedule, causal, window, pack_gqa):
    q, k, v, _ = inputs()
    res = lo.attention(q, k, v, schedule=schedule, block_q=BLOCK, block_k=BLOCK,
                       causal=causal, window=window, count=True, pack_gqa=pack_gqa)
    mask = lo.make_problem(schedule, n_q=N_Q, n_k=N_K, d=D, block_q=BLOCK, block_k=BLOCK,
                           causal=causal, window=window).mask
    ref, _ = attention_reference(q.astype(np.float64), repeated(k), repeated(v), mask=mask)
    assert res.out.shape == (B, H, N_Q, DV)
    assert relative_error(res.out, ref) <= tolerance("float32", 0, v, ref)
    assert res.counts == lo.get_schedule(schedule).model(res.problem)
    assert res.counts == lo.predict_traffic(schedule, N_Q, D, DV, B, H, BLOCK, BLOCK, causal,
                                            n_k=N_K, window=window, kv_heads=H_KV,
                                            pack_gqa=pack_gqa)


@pytest.mark.parametrize("variant", grad_variants(forwards=True), ids=lambda v: v.label)
@pytest.mark.parametrize("causal, window, pack_gqa", [CASES[1], CASES[3]],
                         ids=["causal", "packed"])
def test_backward_per_head_and_packed(variant, causal, window, pack_gqa):
    """dk, dv have K/V's heads: per query head the parts are summed over the group (counted:
    `group_sum`), packed the group runs as one block; the backward ledger equals
    predict_traffic(backward=True)."""
    q, k, v, do = inputs(seed=1)
    g = lo.attention_grad(q, k, v, do, schedule=variant.schedule, options=variant.options,
                          block_q=BLOCK, block_k=BLOCK, causal=causal, window=window,
                          count=True, pack_gqa=pack_gqa)
    mask = lo.make_problem(variant.schedule, n_q=N_Q, n_k=N_K, d=D, block_q=BLOCK,
                           block_k=BLOCK, causal=causal).mask
    dq, dk, dv = attention_grad_reference(q.astype(np.float64), repeated(k), repeated(v),
                                          do.astype(np.float64), mask=mask)
    refs = (dq, dk.reshape(B, H_KV, G, N_K, D).sum(2), dv.reshape(B, H_KV, G, N_K, DV).sum(2))
    for got, ref in zip((g.dq, g.dk, g.dv), refs, strict=True):
        assert got.shape == ref.shape
        assert relative_error(got, ref) <= 1e-5
    assert g.counts_backward == lo.predict_traffic(
        variant.schedule, N_Q, D, DV, B, H, BLOCK, BLOCK, causal, n_k=N_K,
        options=variant.options, backward=True, kv_heads=H_KV, pack_gqa=pack_gqa)


def test_float16_per_head_backward_on_tensor_cores():
    """The tensor-core backward reads K/V head h // G too (float16, causal)."""
    q, k, v, do = inputs("float16", seed=2)
    g = lo.attention_grad(q, k, v, do, schedule="q_outer", block_q=16, block_k=16,
                          causal=True, count=True)
    mask = lo.make_problem("q_outer", n_q=N_Q, n_k=N_K, d=D, block_q=16, block_k=16,
                           causal=True).mask
    dq, dk, dv = attention_grad_reference(q.astype(np.float64), repeated(k), repeated(v),
                                          do.astype(np.float64), mask=mask)
    refs = (dq, dk.reshape(B, H_KV, G, N_K, D).sum(2), dv.reshape(B, H_KV, G, N_K, DV).sum(2))
    for got, ref in zip((g.dq, g.dk, g.dv), refs, strict=True):
        assert relative_error(got, ref) <= 5e-3
    assert g.counts_backward == lo.predict_traffic("q_outer", N_Q, D, DV, B, H, 16, 16, True,
                                                   n_k=N_K, backward=True, kv_heads=H_KV)


@pytest.mark.parametrize("schedule", ["q_outer", "split_kv"])
def test_packing_reads_kv_once_per_group_at_decode(schedule):
    """Decode (n_q = 1, causal), H_q = 32 over H_kv = 8, d = 128: per query head K/V is read
    32 times, packed 8 times (each K/V head once), 4x less; O written once either way
    (split_kv's Q reads follow its split count, which packing changes)."""
    args = dict(schedule=schedule, n=1, d=128, heads=32, kv_heads=8, block_q=64, block_k=64,
                causal=True, n_k=8192)
    per_head, packed = lo.predict_traffic(**args), lo.predict_traffic(**args, pack_gqa=True)
    for tensor, length in (("k", 128), ("v", 128)):
        assert per_head.read(tensor) == 32 * 8192 * length
        assert packed.read(tensor) == 8 * 8192 * length
    assert per_head.write("o") == packed.write("o") == 32 * 128


def test_refusals_name_what_is_wrong():
    q, k, v, _ = inputs()
    with pytest.raises(ValueError, match="4 query heads, 3 K/V heads"):
        lo.attention(q, np.ones((B, 3, N_K, D), "float32"), np.ones((B, 3, N_K, DV), "float32"))
    with pytest.raises(ValueError, match="^k, v: "):
        lo.attention(q, k, v[:, :1])
    with pytest.raises(ValueError, match="^k, v: .*0 K/V heads"):
        lo.attention(q, k[:, :0], v[:, :0])
    with pytest.raises(ValueError, match="^pack_gqa: .*window=\\(3, 1\\)"):
        lo.attention(q, k, v, window=(3, 1), pack_gqa=True)
    with pytest.raises(ValueError, match="^pack_gqa: .*causal=True"):
        lo.attention(q, k, v, causal=True, pack_gqa=True)
    with pytest.raises(ValueError, match="^kv_heads: .*3 query heads and 2 K/V heads"):
        lo.predict_traffic("q_outer", 8, 4, heads=3, kv_heads=2)


def test_bfloat16_group_sums_widen_the_parts():
    """bfloat16 parts are summed as numbers, not as their bits (torch tensors: NumPy has no
    bfloat16): the per-head backward against the float64 reference."""
    torch = pytest.importorskip("torch")
    q, k, v, do = (torch.from_numpy(x).bfloat16() for x in inputs(seed=3))
    g = lo.attention_grad(q, k, v, do, schedule="kv_outer", block_q=BLOCK, block_k=BLOCK)
    host = [x.double().numpy() for x in (q, k, v, do)]
    _, dk, dv = attention_grad_reference(host[0], np.repeat(host[1], G, 1),
                                         np.repeat(host[2], G, 1), host[3])
    assert relative_error(g.dk.double().numpy(), dk.reshape(B, H_KV, G, N_K, D).sum(2)) <= 0.05
    assert relative_error(g.dv.double().numpy(), dv.reshape(B, H_KV, G, N_K, DV).sum(2)) <= 0.05
