"""What every schedule computes: exact attention in float64 NumPy.

    O = softmax(scale * Q K^T + mask) V,   lse = log(sum(exp(scale * Q K^T + mask)))

`attention_reference` materialises the scores (it is the specification, not a schedule);
`online_row` is the online-softmax recurrence of the FlashAttention papers for one query row,
which the explainer walkthrough and the tests use to show that tiling is exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .core.mask import Mask, mask_of


def default_scale(d: int) -> float:
    return 1.0 / float(np.sqrt(d))


def visible_pairs(n_q: int, n_k: int, causal: bool = False, mask: Mask | None = None):
    """The (n_q, n_k) boolean matrix of the (query, key) pairs the mask shows: `mask` (a
    problem's `Problem.mask`, `core.mask`'s rule), else causal (bottom-right aligned) or none."""
    return (mask if mask is not None else mask_of(causal)).visible(n_q, n_k)


def _softmax_parts(scores):
    """(row_max, weights, row_sum) of masked scores: exp(scores - row_max) and its row sums,
    a row with no visible key (all -inf) taking row_max 0, weights 0 and row_sum 0."""
    row_max = scores.max(axis=-1, keepdims=True)
    row_max = np.where(np.isneginf(row_max), 0.0, row_max)
    weights = np.exp(scores - row_max)
    return row_max, weights, weights.sum(axis=-1, keepdims=True)


def attention_reference(q, k, v, *, scale: float | None = None, causal: bool = False,
                        mask: Mask | None = None):
    """Dense float64 attention over the last two axes; returns (out, lse).

    q: (..., n_q, d), k: (..., n_k, d), v: (..., n_k, dv). With `causal`, query row r attends
    keys c <= r + n_k - n_q (bottom-right aligned); `mask` (a problem's `Problem.mask`:
    causal, a window, `core.mask`) says which instead. lse is the natural-log normaliser of
    each row, shape (..., n_q); a row that sees no key gets output 0 and lse -inf.

    A masked key takes no part at all: a NaN or inf in a masked row of K or V does not reach
    the output (as in the kernels), while one in a visible row does.
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    n_q, n_k = q.shape[-2], k.shape[-2]
    visible = visible_pairs(n_q, n_k, causal, mask)
    scores = np.where(visible, scale * np.einsum("...qd,...kd->...qk", q, k), -np.inf)
    row_max, weights, row_sum = _softmax_parts(scores)
    out = _visible_matmul(weights / np.where(row_sum > 0, row_sum, 1.0), visible, v)
    with np.errstate(divide="ignore"):  # log 0 = -inf: a row that sees no key
        lse = (row_max + np.log(row_sum))[..., 0]
    return out, lse


def attention_grad_reference(q, k, v, do, *, scale: float | None = None, causal: bool = False,
                             mask: Mask | None = None):
    """Float64 gradients of O = softmax(scale Q K^T + mask) V for the output gradient do:
    (dq, dk, dv), by the standard formulas (the FlashAttention paper's Algorithm 3):

        P = softmax(scale Q K^T + mask);  dV = P^T dO;  dP = dO V^T
        dS = P o (dP - rowsum(dP o P));   dQ = scale dS K;  dK = scale dS^T Q

    (mask as `attention_reference`'s; a row that sees no key has P = 0 and no gradient).
    """
    q, k, v, do = (np.asarray(x, dtype=np.float64) for x in (q, k, v, do))
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    n_q, n_k = q.shape[-2], k.shape[-2]
    visible = visible_pairs(n_q, n_k, causal, mask)
    scores = np.where(visible, scale * np.einsum("...qd,...kd->...qk", q, k), -np.inf)
    _, p, row_sum = _softmax_parts(scores)
    p /= np.where(row_sum > 0, row_sum, 1.0)
    dv = np.einsum("...qk,...qd->...kd", p, do)
    dp = np.einsum("...qd,...kd->...qk", do, v)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    dq = scale * np.einsum("...qk,...kd->...qd", ds, k)
    dk = scale * np.einsum("...qk,...qd->...kd", ds, q)
    return dq, dk, dv


def _sequences(cu_seqlens_q, cu_seqlens_k):
    """(rows of q, rows of k) of each packed sequence: slices of the prefix sums."""
    cu_q, cu_k = (np.asarray(cu, dtype=np.int64) for cu in (cu_seqlens_q, cu_seqlens_k))
    return [(slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1]))
            for b in range(len(cu_q) - 1)]


def _heads_first(x, rows, group: int = 1):
    """Packed rows (total, heads, w) of one sequence as (heads * group, n, w) in float64,
    each head repeated `group` times (K/V over the query heads of their group)."""
    return np.repeat(np.asarray(x[rows], dtype=np.float64).transpose(1, 0, 2), group, axis=0)


def varlen_attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, *,
                               scale: float | None = None, causal: bool = False,
                               mask: Mask | None = None):
    """`attention_reference` of packed variable-length sequences (FlashAttention's varlen
    layout): q (total_q, H, d), k (total_k, H_kv, d), v (total_k, H_kv, dv), sequence b
    being rows cu_seqlens_q[b] : cu_seqlens_q[b + 1] of q and likewise of k, v; query head h
    reads K/V head h // (H / H_kv); the mask applies within each sequence (causal bottom-right
    aligned to its own lengths). Returns (out (total_q, H, dv), lse (H, total_q))."""
    heads, group = q.shape[1], q.shape[1] // k.shape[1]
    out = np.zeros((q.shape[0], heads, v.shape[2]))
    lse = np.full((heads, q.shape[0]), -np.inf)
    for rows_q, rows_k in _sequences(cu_seqlens_q, cu_seqlens_k):
        o, lse[:, rows_q] = attention_reference(
            _heads_first(q, rows_q), _heads_first(k, rows_k, group),
            _heads_first(v, rows_k, group), scale=scale, causal=causal, mask=mask)
        out[rows_q] = o.transpose(1, 0, 2)
    return out, lse


def varlen_grad_reference(q, k, v, do, cu_seqlens_q, cu_seqlens_k, *,
                          scale: float | None = None, causal: bool = False,
                          mask: Mask | None = None):
    """`attention_grad_reference` of packed sequences (layout as
    `varlen_attention_reference`'s, do like the output): (dq, dk, dv) in q's, k's, v's
    shapes, dk and dv summed over the query heads of each K/V head's group; keys of a
    sequence without queries get zero gradients."""
    heads_kv, group = k.shape[1], q.shape[1] // k.shape[1]
    dq, dk, dv = (np.zeros(x.shape) for x in (q, k, v))
    for rows_q, rows_k in _sequences(cu_seqlens_q, cu_seqlens_k):
        gq, gk, gv = attention_grad_reference(
            _heads_first(q, rows_q), _heads_first(k, rows_k, group),
            _heads_first(v, rows_k, group), _heads_first(do, rows_q), scale=scale,
            causal=causal, mask=mask)
        dq[rows_q] = gq.transpose(1, 0, 2)
        for grad, part in ((dk, gk), (dv, gv)):
            grad[rows_k] = part.reshape(heads_kv, group, *part.shape[1:]).sum(1).transpose(
                1, 0, 2)
    return dq, dk, dv


def _visible_matmul(w, visible, v):
    """sum over visible keys c of w[r, c] v[c]: masked keys never multiply V."""
    if visible.all() or np.isfinite(v).all():
        return np.einsum("...qk,...kd->...qd", w, v)
    # V has non-finite entries and a mask: sum term by term (small inputs only in practice)
    with np.errstate(invalid="ignore"):  # 0 * inf on masked terms, dropped just below
        terms = w[..., :, :, None] * v[..., None, :, :]
    return np.where(visible[:, :, None], terms, 0.0).sum(axis=-2)


FLOAT32_TOLERANCE = 1e-5
# Half a unit in the last place of each 16-bit input type: its relative rounding error
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}


def unit_roundoff(dtype) -> float:
    """The relative rounding error of one rounding to `dtype` (a name, or a NumPy dtype; uint16
    arrays carry bfloat16), 0 for float32, which the tolerances treat apart."""
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    return UNIT_ROUNDOFF.get({"uint16": "bfloat16"}.get(name, name), 0.0)


def relative_error(out, ref) -> float:
    """max |out - ref| / max |ref|: the error every schedule is checked with (the absolute
    error where ref is all zeros, as a gradient through a single key is)."""
    out, ref = np.asarray(out, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    scale = np.abs(ref).max()
    return float(np.abs(out - ref).max() / (scale if scale > 0 else 1.0))


def tolerance(dtype, roundings: int, v, ref) -> float:
    """Largest acceptable `relative_error` of a schedule's output.

    float32 inputs: 1e-5, grown as sqrt(N_k / 4096) past 4096 keys (the key sum accumulates
    float32 rounding like a random walk: about sqrt(N_k) 2^-24; measured 1.06e-5 at
    N_k = 131072 on the H200, results/bench_decode.csv).
    16-bit inputs: the reference sees the same rounded inputs, so the only extra error is
    rounding the output (or P) to 16 bits, at most u = 2^-11 (float16) or 2^-8 (bfloat16) of
    an element's magnitude each time. Every intermediate output row is a convex combination
    of V's rows, so one rounding costs at most u max|V|; a schedule that rounds O `roundings`
    times (kv_outer stores O after every K/V block) may lose `roundings` times that, relative
    to max|ref|.
    """
    base = FLOAT32_TOLERANCE * max(1.0, np.sqrt(np.shape(v)[-2] / 4096))
    u = unit_roundoff(dtype)
    if u == 0:
        return base
    v_max = float(np.abs(np.asarray(v, dtype=np.float64)).max())
    ref_max = float(np.abs(np.asarray(ref, dtype=np.float64)).max())
    # relative to max|ref|, or absolute where ref is all zeros (as `relative_error`)
    return base + roundings * u * v_max / (ref_max if ref_max > 0 else 1.0)


TF32_UNIT = 2.0**-10  # TF32 keeps 10 mantissa bits of float32; the hardware drops the rest
# The most a product of two float32 operands loses, relative to |a b|, at each tensor-core
# precision: "tf32" truncates both operands (2^-10 each); "tf32x3" splits each into a head
# rounded to TF32 (|tail| <= 2^-11 |x|) and a tail the hardware truncates (2^-10 of it) and
# drops tail x tail: 2 (1 + 2^-11) 2^-21 + 2^-22 < 1.25 2^-20.
PRODUCT_LOSS = {"tf32": 2 * TF32_UNIT + TF32_UNIT**2, "tf32x3": 1.25 * 2.0**-20}


def tf32_score_shift(q, k, *, scale: float | None = None, causal: bool = False,
                     precision: str = "tf32", mask: Mask | None = None) -> float:
    """The most a score can move at a TF32 `precision` ("tf32", "tf32x3"): each product
    loses at most PRODUCT_LOSS of itself, so |scale| PRODUCT_LOSS max_(r,c) sum_x
    |q_rx| |k_cx| (over the visible pairs under a mask). A row's lse moves by at most as
    much."""
    q, k = (np.asarray(x, dtype=np.float64) for x in (q, k))
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    worst = np.einsum("...qd,...kd->...qk", np.abs(q), np.abs(k))
    worst = np.where(visible_pairs(q.shape[-2], k.shape[-2], causal, mask), worst, 0.0)
    return abs(scale) * PRODUCT_LOSS[precision] * float(worst.max())


def tf32_tolerance(q, k, v, ref, *, scale: float | None = None, causal: bool = False,
                   precision: str = "tf32", mask: Mask | None = None) -> float:
    """Largest acceptable `relative_error` of a float32 call at a TF32 `precision`, a bound
    that follows from the rounding alone (it holds for any inputs, and is loose).

    A score moves by at most D = `tf32_score_shift`, so each softmax weight by a factor
    within exp(+-2 D), and the output by at most expm1(2 D) max|V|; each product P_rc V_cx
    loses PRODUCT_LOSS of itself, and a row's weights sum to 1 (PRODUCT_LOSS max|V| more).
    Relative to max|ref|, over float32's own.
    """
    v, ref = (np.asarray(x, dtype=np.float64) for x in (v, ref))
    shift = tf32_score_shift(q, k, scale=scale, causal=causal, precision=precision, mask=mask)
    ref_max = float(np.abs(ref).max())  # (absolute where ref is all zeros, as relative_error)
    ratio = float(np.abs(v).max()) / (ref_max if ref_max > 0 else 1.0)
    return tolerance("float32", 0, v, ref) + (math.expm1(2 * shift)
                                              + PRODUCT_LOSS[precision]) * ratio


def tf32_grad_tolerance(q, k, *, precision: str, scale: float | None = None,
                        causal: bool = False, mask: Mask | None = None) -> float:
    """Largest acceptable `relative_error` of a gradient of a float32 call at a TF32
    `precision`, where no cancellation shrinks it below its terms (as `grad_tolerance`).

    Each gradient is at most three products deep (S = Q K^T gives P; dP = dO V^T gives dS;
    then dS K, dS^T Q or P^T dO), each losing at most PRODUCT_LOSS of its terms, and P moves
    by at most a factor expm1(2 D) with the score shift D (`tf32_score_shift`): 3 (PRODUCT_LOSS
    + expm1(2 D)) of the terms' size, over float32's own."""
    shift = tf32_score_shift(q, k, scale=scale, causal=causal, precision=precision, mask=mask)
    return FLOAT32_TOLERANCE + 3 * (PRODUCT_LOSS[precision] + math.expm1(2 * shift))


def grad_tolerance(dtype, roundings: int) -> float:
    """Largest acceptable `relative_error` of a gradient (dQ, dK or dV) where no cancellation
    shrinks it below its terms (see `grad_tolerances` for the bound that holds for any inputs).

    float32: 1e-5. 16-bit: the reference sees the same rounded inputs; the gradients lose u
    (`unit_roundoff`) of their largest magnitude at each rounding to the input type
    (`roundings`: once, or Tc times for kv_outer's dQ, stored after every visit), and the
    backward reads O rounded so, so delta = rowsum(dO o O) carries about one more u:
    (roundings + 2) u.
    """
    u = unit_roundoff(dtype)
    if u == 0:
        return FLOAT32_TOLERANCE
    return FLOAT32_TOLERANCE + (roundings + 2) * u


@dataclass(frozen=True)
class GradTolerances:
    """The largest acceptable `relative_error` of each gradient, for one set of inputs."""

    dq: float
    dk: float
    dv: float


def grad_tolerances(q, k, v, do, refs, dtype, roundings: int, *, scale: float | None = None,
                    causal: bool = False, mask: Mask | None = None) -> GradTolerances:
    """`grad_tolerance`, grown where dQ or dK is small against the terms it sums.

    The backward reads O as stored in `dtype`, so delta_r = sum_x dO_rx O_rx is off by up to
    2 u sum_x |dO_rx| (P |V|)_rx (O's own rounding, and P rounded before P V on tensor cores).
    Through dS = P o (dP - delta) that moves dQ_r by up to scale |delta error_r| sum_c P_rc
    |K_c| and dK_c by scale sum_r P_rc |delta error_r| |Q_r|: absolute amounts that stay the
    size of the terms even when the gradient itself cancels to almost nothing (one query over
    a few keys of similar values), so they are taken relative to max |ref|. dV = P^T dO does
    not read delta.
    """
    base = grad_tolerance(dtype, roundings)
    u = unit_roundoff(dtype)
    if u == 0:
        return GradTolerances(base, base, base)
    q, k, v, do = (np.asarray(x, dtype=np.float64) for x in (q, k, v, do))
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    n_q, n_k = q.shape[-2], k.shape[-2]
    visible = visible_pairs(n_q, n_k, causal, mask)
    scores = np.where(visible, scale * np.einsum("...qd,...kd->...qk", q, k), -np.inf)
    _, p, row_sum = _softmax_parts(scores)
    p /= np.where(row_sum > 0, row_sum, 1.0)
    o_size = np.einsum("...qk,...kd->...qd", p, np.abs(v))
    delta_error = 2 * u * (np.abs(do) * o_size).sum(axis=-1)
    weighted = p * delta_error[..., None]
    dq_shift = abs(scale) * np.einsum("...qk,...kd->...qd", weighted, np.abs(k))
    dk_shift = abs(scale) * np.einsum("...qk,...qd->...kd", weighted, np.abs(q))

    def grown(shift, ref) -> float:
        ref_max = float(np.abs(ref).max())
        return base + (float(shift.max()) / ref_max if ref_max > 0 else float(shift.max()))

    return GradTolerances(grown(dq_shift, refs[0]), grown(dk_shift, refs[1]), base)


@dataclass(frozen=True)
class OnlineStep:
    """State of one query row after a key tile: running max m, denominator l, numerator a."""

    keys_seen: int
    m: float
    l: float  # noqa: E741 - the paper's name
    a: np.ndarray

    @property
    def partial_output(self) -> np.ndarray:
        """a / l: attention over the keys seen so far."""
        return self.a / self.l


def online_row(q_row, k, v, key_block: int, *, scale: float | None = None) -> list[OnlineStep]:
    """Run the online-softmax recurrence for one query row over key tiles of `key_block`.

    Start with m = -inf, l = 0, a = 0; for a tile of scores t and values V_t:
    m' = max(m, max t), alpha = exp(m - m') (0 before any key), l' = alpha l + sum exp(t - m'),
    a' = alpha a + exp(t - m') V_t. After the last tile a / l is the exact output row.
    """
    q_row, k, v = (np.asarray(x, dtype=np.float64) for x in (q_row, k, v))
    if key_block < 1:
        raise ValueError(f"key_block must be >= 1, got {key_block}")
    scale = default_scale(q_row.shape[-1]) if scale is None else float(scale)
    m, l, a = -np.inf, 0.0, np.zeros(v.shape[1])  # noqa: E741
    steps = []
    for start in range(0, len(k), key_block):
        t = scale * (k[start:start + key_block] @ q_row)
        m_new = max(m, float(t.max()))
        alpha = 0.0 if m == -np.inf else float(np.exp(m - m_new))
        p = np.exp(t - m_new)
        l = alpha * l + float(p.sum())  # noqa: E741
        a = alpha * a + p @ v[start:start + key_block]
        m = m_new
        steps.append(OnlineStep(min(start + key_block, len(k)), m, l, a.copy()))
    return steps
