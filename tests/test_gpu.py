"""Realistic sizes on a real GPU (skipped under the simulator): outputs, gradients, counters,
arrays of every kind, the launch path and the torch op on CUDA tensors."""

import numpy as np
import pytest
from conftest import SCHEDULES, gpu, random_qkv

import loop_orders as lo
from loop_orders.api import backward_traffic
from loop_orders.core.schedule import backward_of, grad_variants
from loop_orders.microkernel import tuning
from loop_orders.reference import (
    attention_grad_reference,
    grad_tolerance,
    relative_error,
    tolerance,
)


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d, block_q", [(64, 128), (128, 128), (128, 64)])
def test_q_outer_float32_at_the_benchmarks_tiles(d, block_q, causal, rng):
    """The benchmark's builds of the FMA path (128 x 64 tiles: the tuned 8 x 8 thread tile,
    staggered cp.async K/V, at d = 64; at d = 128 the warp-specialised kernel, causal on
    persistent CTAs at this N; 64 x 64 at d = 128: P_ij^T in K_j's place, two CTAs an SM),
    with tail blocks: float32 accuracy, lse, and the counted build equal to the model."""
    q, k, v = random_qkv(rng, 2, 3, 1000, d, d)
    res = lo.attention(q, k, v, schedule="q_outer", block_q=block_q, block_k=64,
                       causal=causal, save_lse=True, count=True)
    ref, ref_lse = lo.attention_reference(q, k, v, causal=causal)
    assert relative_error(res.out, ref) <= 1e-5
    np.testing.assert_allclose(res.lse, ref_lse, rtol=1e-5, atol=1e-4)
    assert res.counts == lo.get_schedule("q_outer").model(res.problem)


@gpu
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_realistic_size(schedule, causal, dtype, rng):
    b, h, n, d = 2, 4, 1024, 64
    q, k, v = random_qkv(rng, b, h, n, d, d, dtype)
    res = lo.attention(q, k, v, schedule=schedule, block_q=64, block_k=64, causal=causal,
                       save_lse=True, count=True, timed=True)
    ref, ref_lse = lo.attention_reference(q, k, v, causal=causal)
    roundings = lo.get_schedule(schedule).output_roundings(res.problem)
    err = relative_error(res.out, ref)
    print(f"{schedule} causal={causal} {dtype}: relative error {err:.2e}, {res.ms:.2f} ms")
    assert err <= tolerance(dtype, roundings, v, ref)
    np.testing.assert_allclose(res.lse, ref_lse, rtol=1e-5, atol=1e-4)
    assert res.counts == lo.get_schedule(schedule).model(res.problem)


@gpu
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tail_blocks_and_odd_dims_at_scale(schedule, rng):
    q, k, v = random_qkv(rng, 3, 5, 777, 72, 40)
    res = lo.attention(q, k, v, schedule=schedule, block_q=48, block_k=40, causal=True,
                       count=True)
    ref, _ = lo.attention_reference(q, k, v, causal=True)
    assert relative_error(res.out, ref) <= 1e-5
    assert res.counts == lo.get_schedule(schedule).model(res.problem)


@gpu
def test_tensor_cores_refuse_inputs_that_are_not_16_byte_aligned(rng):
    """cp.async copies 16-byte rows: a contiguous float16 view that starts 2 bytes into its
    buffer is refused before launch with the reason; the aligned copy runs."""
    torch = pytest.importorskip("torch")
    n, d = 64, 64
    base = torch.randn(n * d + 1, device="cuda", dtype=torch.float16)
    q = base[1:].view(1, 1, n, d)
    with pytest.raises(ValueError, match="q: the tensor-core kernels need its data 16-byte"):
        lo.attention(q, q, q, schedule="q_outer")
    out = lo.attention(q.clone(), q.clone(), q.clone(), schedule="q_outer").out
    assert torch.isfinite(out).all()


@gpu
@pytest.mark.parametrize("causal", [False, True])
def test_q_outer_warp_specialised_on_whole_tiles(causal, rng):
    """d = 128 at N a multiple of the tiles: the warp-specialised kernel built without the
    tails' code (Specialised.even; causal, the diagonal by row groups), unrolled as q_outer's
    SPECIALISED says for the mask (a CTA a query block: past PERSISTENT's N), float32
    accuracy, lse, counts == model."""
    from loop_orders.schedules.q_outer.warp_specialised import Specialised

    q, k, v = random_qkv(rng, 2, 3, 4096, 128, 128)
    res = lo.attention(q, k, v, schedule="q_outer", block_q=128, block_k=64, causal=causal,
                       save_lse=True, count=True)
    sched = lo.get_schedule("q_outer")
    unrolling = sched.SPECIALISED[(128, 64, 128, 128, causal)]
    assert sched.layout(res.problem) == Specialised(128, *unrolling, even=True)
    ref, ref_lse = lo.attention_reference(q, k, v, causal=causal)
    assert relative_error(res.out, ref) <= 1e-5
    np.testing.assert_allclose(res.lse, ref_lse, rtol=1e-5, atol=1e-4)
    assert res.counts == sched.model(res.problem)


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1000, 1024])
def test_q_outer_warp_specialised_ctas_fold_several_blocks(n, causal, monkeypatch, rng):
    """The warp-specialised kernel's persistent CTAs (q_outer's PERSISTENT causal; forced
    without the mask) on 640 query blocks, about 5 a CTA: each draws its next block from the
    stream's counter while it folds one in, and the S warps start the next block's Q_i and
    S_i0 under the P V warps' last tile. With tails (N = 1000) and built without the tails'
    code (N = 1024); twice in a row, so that the second launch finds the counter the first set
    back (else it would skip blocks and leave their rows of O unwritten); float32 accuracy,
    lse, counts == model."""
    from loop_orders.microkernel.persistent import persistent_grid, tickets

    sched = lo.get_schedule("q_outer")
    _, (chunks, keys, peel) = sched.PERSISTENT[(128, 64, 128, 128, True)]
    if not causal:
        forced = f"ws,{chunks},{keys},{int(peel)},1"
        monkeypatch.setattr(tuning, "CURRENT", tuning.Tuning(layout=forced))
    q, k, v = random_qkv(rng, 2, 40, n, 128, 128)
    ref, ref_lse = lo.attention_reference(q, k, v, causal=causal)
    for _ in range(2):
        res = lo.attention(q, k, v, schedule="q_outer", block_q=128, block_k=64,
                           causal=causal, save_lse=True, count=True)
        assert sched.layout(res.problem).persistent
        assert relative_error(res.out, ref) <= 1e-5
        np.testing.assert_allclose(res.lse, ref_lse, rtol=1e-5, atol=1e-4)
        assert res.counts == sched.model(res.problem)
        assert tickets().copy_to_host()[0] == 0
    assert 4 * persistent_grid((res.problem.tr, res.problem.bh))[0] < res.problem.tr * 80


@gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_float32_keys_not_16_byte_aligned_take_the_plain_loads(causal, d, rng):
    """q_outer's float32 kernels copy K and V rows with cp.async (staggered loads at d = 64,
    the warp-specialised kernel at d = 128, which also stores O_i 16 bytes at a time); a k, v
    or o that starts 4 bytes into its buffer gets the shared micro-kernel with plain loads
    instead, with the same output and counts, at 128 x 64 tiles and a tail."""
    torch = pytest.importorskip("torch")
    from numba import cuda

    n = 1000
    base = torch.randn(3 * n * d + 1, device="cuda", dtype=torch.float32)
    q, k, v = (base[1 + i * n * d: 1 + (i + 1) * n * d].view(1, 1, n, d) for i in range(3))
    tiles = {"block_q": 128, "block_k": 64}
    got = [lo.attention(*x, schedule="q_outer", causal=causal, count=True, **tiles)
           for x in ((q, k, v), (q.clone(), k.clone(), v.clone()))]
    ref, _ = lo.attention_reference(*(x.cpu().numpy() for x in (q, k, v)), causal=causal)
    sched = lo.get_schedule("q_outer")
    for res in got:
        assert relative_error(res.out.cpu().numpy(), ref) <= 1e-5
        assert res.counts == sched.model(res.problem)
    # aligned inputs, an output 4 bytes into its buffer (a launch of one's own: the API
    # allocates its outputs aligned)
    o_base = torch.full((n * d + 1,), float("nan"), device="cuda")
    p = got[1].problem
    arrays = [cuda.as_cuda_array(x.view(1, n, d)) for x in (q.clone(), k.clone(), v.clone(),
                                                            o_base[1:])]
    sched.launch(p, *arrays, cuda.device_array((1, 1), np.float32),
                 cuda.device_array(1, np.int64), scale=d ** -0.5, count=False)
    assert relative_error(o_base[1:].view(1, 1, n, d).cpu().numpy(), ref) <= 1e-5


def _backward_variants():
    return [(v.schedule, v.options) for v in grad_variants()]


@gpu
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("schedule, options", _backward_variants())
def test_gradients_at_scale(schedule, options, causal, dtype, rng):
    """Every backward order at N = 1000 (tails), d = 64, against float64 gradients; counters
    == model."""
    b, h, n, d = 1, 4, 1000, 64
    q, k, v = random_qkv(rng, b, h, n, d, d, dtype)
    do = rng.standard_normal((b, h, n, d)).astype(dtype)
    g = lo.attention_grad(q, k, v, do, schedule=schedule, block_q=64, block_k=64,
                          causal=causal, options=options, count=True, timed=True)
    refs = attention_grad_reference(q, k, v, do, causal=causal)
    bwd = backward_of(lo.get_schedule(schedule))
    errs = [relative_error(got, ref) for got, ref in zip((g.dq, g.dk, g.dv), refs, strict=True)]
    print(f"{schedule} {options} causal={causal} {dtype}: dq dk dv errors "
          f"{', '.join(f'{e:.2e}' for e in errs)}; {g.ms:.2f} ms forward + backward")
    assert max(errs) <= grad_tolerance(dtype, bwd.output_roundings(g.problem.for_backward()))
    assert g.counts_backward == bwd.model(g.problem.for_backward())


@gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_16_bit_outputs_beside_sdpa(schedule, causal, dtype):
    """torch CUDA tensors in float16 and bfloat16 (tensor cores), N = 1000 (tail blocks):
    the output's error against SDPA in float64 within 2x SDPA's own error in the same dtype
    (the issue's target) per two roundings: SDPA rounds P and O once each, as q_outer and
    dense do; kv_outer rounds O after every K/V block (`output_roundings`), and its bound
    grows in proportion; counters == model."""
    torch = pytest.importorskip("torch")
    gen = torch.Generator(device="cuda").manual_seed(1)
    tdt = getattr(torch, dtype)
    q, k, v = (torch.randn(2, 4, 1000, 64, device="cuda", generator=gen).to(tdt)
               for _ in range(3))
    res = lo.attention(q, k, v, schedule=schedule, causal=causal, count=True)
    assert res.out.dtype == tdt and res.out.device == q.device
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ref = sdpa(q.double(), k.double(), v.double(), is_causal=causal)
    theirs = float((sdpa(q, k, v, is_causal=causal).double() - ref).abs().max()
                   / ref.abs().max())
    ours = float((res.out.double() - ref).abs().max() / ref.abs().max())
    roundings = lo.get_schedule(schedule).output_roundings(res.problem)
    print(f"{schedule} causal={causal} {dtype}: ours {ours:.2e}, SDPA {theirs:.2e}, "
          f"{roundings} roundings")
    assert ours <= 2 * theirs * max(1.0, roundings / 2)
    assert res.counts == lo.get_schedule(schedule).model(res.problem)


@gpu
@pytest.mark.parametrize("products", ["wgmma-tma", "wgmma-persistent"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d, block_k", [(64, 64), (128, 128)])
def test_hopper_tma_producer_beside_sdpa(d, block_k, causal, dtype, products):
    """q_outer's kernel with a producer warpgroup copying by TMA (tuning products
    "wgmma-tma", Hopper only), and on persistent CTAs ("wgmma-persistent"): N_q = 1000,
    N_k = 777 (tails, bottom-right causal), within 2x SDPA's own error in the same dtype;
    counters == model; the persistent launches' counter back at zero."""
    torch = pytest.importorskip("torch")
    from loop_orders.device import runtime
    from loop_orders.microkernel import tuning
    from loop_orders.microkernel.persistent import tickets

    if runtime.compute_capability()[:2] != (9, 0):
        pytest.skip("TMA and setmaxnreg need a Hopper GPU")
    gen = torch.Generator(device="cuda").manual_seed(2)
    tdt = getattr(torch, dtype)
    sched = lo.get_schedule("q_outer")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    mask = torch.ones(1000, 777, dtype=torch.bool, device="cuda").tril(777 - 1000) \
        if causal else None
    for call in ("counted", "first", "replayed"):  # the second uncounted call: its tape
        q, k, v = (torch.randn(2, 4, n, d, device="cuda", generator=gen).to(tdt)
                   for n in (1000, 777, 777))
        with tuning.tuned(products=products):
            res = lo.attention(q, k, v, schedule="q_outer", causal=causal, block_q=128,
                               block_k=block_k, count=call == "counted")
            build = str(sched.layout(res.problem))
        assert ".tma" in build and (".persistent" in build) == (products == "wgmma-persistent")
        ref = sdpa(q.double(), k.double(), v.double(), attn_mask=mask)
        theirs = sdpa(q, k, v, attn_mask=mask).double()
        seen = ref.abs().amax(dim=-1, keepdim=True) > 0  # rows that see a key (others: NaN)
        scale = ref.abs().max()
        ours = float(((res.out.double() - ref) * seen).nan_to_num().abs().max() / scale)
        theirs = float(((theirs - ref) * seen).nan_to_num().abs().max() / scale)
        print(f"q_outer {build} d={d} causal={causal} {dtype} {call}: ours {ours:.2e}, SDPA "
              f"{theirs:.2e}")
        assert ours <= 2 * theirs
        if call == "counted":
            assert res.counts == sched.model(res.problem)
    if products == "wgmma-persistent":
        assert tickets().copy_to_host()[0] == 0


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_a_call_naming_no_tiles_runs_the_measured_hopper_build(d, causal):
    """On a Hopper GPU a float16 q_outer call that names no tiles runs the tiles and build
    HOPPER_TILES and HOPPER_BUILDS name at N = 1000 (128 x 64 waited at d = 64, 64 x 64
    waited when causal; 128 x 128 with the TMA producer on persistent CTAs at d = 128, its
    causal grid by groups of eight heads), within 2x plain PyTorch's same-dtype error against
    a float32 reference (FlashAttention's rule); dense's matmuls there run on wgmma."""
    torch = pytest.importorskip("torch")
    from loop_orders.device import runtime

    if runtime.compute_capability()[:2] != (9, 0):
        pytest.skip("the Hopper builds need a Hopper GPU")

    def plain(q, k, v):  # FlashAttention's reference: every step in the inputs' dtype
        s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        if causal:  # as many queries as keys: the diagonal
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool,
                                         device=s.device).triu(1), float("-inf"))
        return torch.softmax(s, dim=-1) @ v

    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, 4, 1000, d, device="cuda", generator=gen).half()
               for _ in range(3))
    ref = plain(q.float(), k.float(), v.float()).double()  # float32, as FlashAttention's
    theirs = plain(q, k, v).double()
    for name in ("q_outer", "dense"):
        sched = lo.get_schedule(name)
        res = lo.attention(q, k, v, schedule=name, causal=causal, count=True)
        build = str(sched.layout(res.problem))
        tiles = (res.problem.block_q, res.problem.block_k)
        if name == "q_outer":
            assert tiles == {(64, False): (128, 64), (64, True): (64, 64),
                             (128, False): (128, 128), (128, True): (128, 128)}[d, causal]
            assert build == {64: "wgmma.f16x2", 128: "wgmma.f16x2.pipelined.tma.persistent"
                             + (".heads8" if causal else "")}[d]
        else:
            assert tiles == (64, 64) and build == "wgmma.f16"
        err = float((res.out.double() - ref).abs().max())
        print(f"{name} d={d} {tiles} {build}: error {err:.2e}, plain PyTorch's "
              f"{float((theirs - ref).abs().max()):.2e}")
        assert err <= 2 * float((theirs - ref).abs().max())
        assert res.counts == sched.model(res.problem)


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("schedule", [s for s in SCHEDULES if lo.get_schedule(s).TENSOR_CORES])
def test_tf32_at_scale_beside_torch(schedule, causal, rng):
    """precision="tf32" at N = 1000 (tails), d = 64: within the bound TF32's rounding gives,
    not float32-exact, counters == model; torch's own TF32 attention (the math backend with
    TF32 matmuls) printed beside it."""
    torch = pytest.importorskip("torch")
    from loop_orders.reference import tf32_tolerance

    q, k, v = random_qkv(rng, 1, 4, 1000, 64, 64)
    res = lo.attention(q, k, v, schedule=schedule, causal=causal, count=True,
                       precision="tf32")
    ref, _ = lo.attention_reference(q, k, v, causal=causal)
    ours = relative_error(res.out, ref)
    allowed = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            theirs = relative_error(torch.nn.functional.scaled_dot_product_attention(
                *(torch.from_numpy(x).cuda() for x in (q, k, v)), is_causal=causal).cpu(),
                ref)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
    print(f"{schedule} causal={causal} tf32: ours {ours:.2e}, torch math TF32 {theirs:.2e}")
    assert 1e-6 < ours <= tf32_tolerance(q, k, v, ref, causal=causal)
    assert res.counts == lo.get_schedule(schedule).model(res.problem)


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("schedule", [s for s in SCHEDULES if lo.get_schedule(s).TENSOR_CORES])
def test_tf32x3_at_scale_beside_sdpa_efficient(schedule, d, causal, rng):
    """precision="tf32x3" at N = 1000 (tails): float32's accuracy from TF32 tensor cores,
    within the tolerance our float32 FMA path is held to (TF32 alone is at 1e-3), with torch
    SDPA's float32 efficient backend (3xTF32 too) on the same inputs printed beside it (ours
    measured 0.4-4.7e-6 against its 0.2-2.2e-6, results/gpu_logs/pytest_gpu_abc56f9.log);
    counters == model."""
    torch = pytest.importorskip("torch")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from loop_orders.reference import FLOAT32_TOLERANCE

    q, k, v = random_qkv(rng, 1, 4, 1000, d, d)
    res = lo.attention(q, k, v, schedule=schedule, causal=causal, count=True,
                       precision="tf32x3")
    ref, _ = lo.attention_reference(q, k, v, causal=causal)
    ours = relative_error(res.out, ref)
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        theirs = relative_error(torch.nn.functional.scaled_dot_product_attention(
            *(torch.from_numpy(x).cuda() for x in (q, k, v)), is_causal=causal).cpu(), ref)
    print(f"{schedule} d={d} causal={causal} tf32x3: ours {ours:.2e}, SDPA efficient "
          f"{theirs:.2e}")
    assert ours <= FLOAT32_TOLERANCE
    assert res.counts == lo.get_schedule(schedule).model(res.problem)


@gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("schedule, options", _backward_variants())
def test_gradients_beside_torch_autograd(schedule, options, dtype):
    """On CUDA tensors through the torch op: gradients against torch autograd of SDPA in
    float64, and within 2x torch's own error in the same dtype (16-bit)."""
    torch = pytest.importorskip("torch")
    import loop_orders.torch as lot

    gen = torch.Generator(device="cuda").manual_seed(0)
    tdt = getattr(torch, dtype)
    q, k, v, w = (torch.randn(2, 4, 512, 64, device="cuda", generator=gen, dtype=tdt)
                  for _ in range(4))
    grads = {}
    for name, fn, cast in (
            ("ours", lambda a, b, c: lot.attention(a, b, c, schedule=schedule, causal=True,
                                                   options=options), tdt),
            ("torch", lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(
                a, b, c, is_causal=True), tdt),
            ("float64", lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(
                a, b, c, is_causal=True), torch.float64)):
        xs = [x.detach().to(cast).requires_grad_() for x in (q, k, v)]
        (fn(*xs) * w.to(cast)).sum().backward()
        grads[name] = [x.grad.double() for x in xs]
    for i, label in enumerate(("dq", "dk", "dv")):
        ref = grads["float64"][i]
        ours = float((grads["ours"][i] - ref).abs().max() / ref.abs().max())
        theirs = float((grads["torch"][i] - ref).abs().max() / ref.abs().max())
        print(f"{schedule} {options} {dtype} {label}: ours {ours:.2e}, torch {theirs:.2e}")
        assert ours <= (1e-5 if dtype == "float32" else 2 * theirs + 1e-4)


@gpu
def test_every_kind_of_array_gives_the_same_kind_back(rng):
    """NumPy, Numba, torch (CUDA), CuPy (when installed) and a bare
    __cuda_array_interface__ object: the same numbers; torch and CuPy outputs on their
    device; torch's current stream used."""
    from loop_orders.device import runtime

    q, k, v = random_qkv(rng, 1, 2, 256, 64, 64)
    want = lo.attention(q, k, v).out
    dev = [runtime.to_device(x) for x in (q, k, v)]
    got = lo.attention(*dev).out
    assert hasattr(got, "copy_to_host")
    np.testing.assert_array_equal(got.copy_to_host(), want)
    torch = pytest.importorskip("torch")
    tq, tk, tv = (torch.from_numpy(x).cuda() for x in (q, k, v))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out = lo.attention(tq, tk, tv).out
    stream.synchronize()
    assert isinstance(out, torch.Tensor) and out.is_cuda
    np.testing.assert_array_equal(out.cpu().numpy(), want)

    class Bare:
        def __init__(self, t):
            self.t, self.shape, self.dtype = t, tuple(t.shape), np.float32
            self.__cuda_array_interface__ = t.__cuda_array_interface__

    bare = lo.attention(Bare(tq), Bare(tk), Bare(tv)).out
    np.testing.assert_array_equal(bare.copy_to_host(), want)
    try:
        import cupy
    except ImportError:
        return
    cq, ck, cv = (cupy.asarray(x) for x in (q, k, v))
    out = lo.attention(cq, ck, cv).out
    assert isinstance(out, cupy.ndarray)
    np.testing.assert_array_equal(cupy.asnumpy(out), want)


@gpu
def test_the_parameter_block_launch_matches_numbas_own(rng):
    """runtime.launch passes the arguments itself (a ctypes block, cuLaunchKernel): the same
    output as Numba's dispatcher launching the same kernel."""
    from loop_orders.device import runtime

    sched = lo.get_schedule("q_outer")
    q, k, v = random_qkv(rng, 2, 2, 300, 64, 64)
    p = lo.make_problem("q_outer", n_q=300, d=64, batch=2, heads=2, block_q=32, block_k=32)
    dq, dk, dv = (runtime.to_device(x.reshape(4, 300, 64)) for x in (q, k, v))
    outs = []
    for direct in (True, False):
        out = runtime.device_empty((4, 300, 64), np.float32)
        lse = runtime.device_empty((1, 1), np.float32)
        counts = runtime.device_zeros(1, np.int64)
        if direct:
            sched.launch(p, dq, dk, dv, out, lse, counts, scale=0.125, count=False)
        else:
            kern = sched.kernels(p, False)[0]
            lay = sched.layout(p)
            kern.fn[(p.tr, p.bh), lay.threads(32, 32), 0, sched.dynamic_shared_bytes(p)](
                dq, dk, dv, out, lse, counts, np.float32(0.125 * lo.microkernel.tiles.LOG2E))
        outs.append(out.copy_to_host())
    np.testing.assert_array_equal(outs[0], outs[1])


@gpu
@pytest.mark.parametrize("count", [False, True])
def test_a_buffer_of_exactly_48_kb_launches_counted(count, rng):
    """Issue 50's crash: dense's P V on tensor cores at 128 x 16 tiles and d = 96 takes exactly
    48 KB of dynamic shared memory; counted, the counters' static shared memory put the
    total over the line where CUDA wants the opt-in, and the launch failed."""
    q, k, v = random_qkv(rng, 3, 3, 1519, 96, 96, "float16")
    res = lo.attention(q, k, v, schedule="dense", block_q=128, block_k=16, causal=True,
                       count=count)
    ref, _ = lo.attention_reference(q, k, v, causal=True)
    assert relative_error(res.out, ref) <= tolerance("float16", 1, v, ref)


@gpu
def test_compile_ahead_fills_an_empty_cache_with_a_calls_kernels(tmp_path):
    """In a fresh process with an empty kernel cache, a new float16 forward + backward call's
    builds compile at once (`warm.compile_ahead`, worker processes beside this one's), the
    call that follows gives the right gradients (its launches wait for the workers' builds),
    and all of them land on disk."""
    import json
    import os
    import subprocess
    import sys

    script = """
import json, numpy as np, loop_orders as lo
from loop_orders import sweeps, warm
from loop_orders.reference import attention_grad_reference, relative_error
(job,) = sweeps.sweep_jobs(["q_outer"], [64], ["float16"], causal=(True,), backward=True)
built = warm.compile_ahead(job)
rng = np.random.default_rng(7)
q, k, v, do = (rng.standard_normal((1, 2, 300, 64)).astype(np.float16) for _ in range(4))
g = lo.attention_grad(q, k, v, do, causal=True)
refs = attention_grad_reference(*(x.astype(np.float64) for x in (q, k, v, do)), causal=True)
errors = [relative_error(x, r) for x, r in zip((g.dq, g.dk, g.dv), refs)]
print(json.dumps({"built": built, "errors": errors, "cached": warm._all_cached(job)}))
"""
    env = {**os.environ, "LOOP_ORDERS_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, check=True)
    found = json.loads(proc.stdout.splitlines()[-1])
    assert found["built"] >= 3 and found["cached"]
    assert max(found["errors"]) < 2e-2


def _plain_varlen(q, k, v, do, cu_q, cu_k, causal, dtype):
    """Plain PyTorch attention of packed sequences in `dtype` (scores, softmax and P V in
    it, as FlashAttention's reference without upcasting; causal bottom-right aligned), and
    its gradients for the output gradient do: (out, dq, dk, dv)."""
    import torch

    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    group = q.shape[1] // k.shape[1]
    outs = []
    for b in range(len(cu_q) - 1):
        rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        qb = leaves[0][rows_q].transpose(0, 1)
        kb, vb = (x[rows_k].transpose(0, 1).repeat_interleave(group, 0) for x in leaves[1:])
        n_q, n_k = qb.shape[1], kb.shape[1]
        s = (qb @ kb.transpose(1, 2)) * q.shape[-1] ** -0.5
        seen = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device)
        if causal:
            seen = torch.arange(n_k, device=q.device)[None] <= \
                torch.arange(n_q, device=q.device)[:, None] + n_k - n_q
        p = torch.softmax(s.masked_fill(~seen, float("-inf")), dim=-1)
        p = torch.where(seen.any(-1, keepdim=True), p, 0.0).to(dtype)
        outs.append((p @ vb).transpose(0, 1))
    out = torch.cat(outs)
    out.backward(do.to(dtype))
    return [out.detach().double()] + [x.grad.double() for x in leaves]


@gpu
@pytest.mark.parametrize("dtype, d", [("float16", 64), ("bfloat16", 128)])
@pytest.mark.parametrize("variant", grad_variants(forwards=True), ids=lambda v: v.label)
def test_varlen_through_the_torch_op_by_flash_attentions_rule(variant, dtype, d):
    """Packed sequences of unequal lengths (113 queries over 203 keys, none over 7, 1023 over
    1024, 256 over 512), causal, 4 query heads over 2 K/V heads, through the torch op on
    CUDA tensors: out, dq, dk, dv within 2x plain PyTorch's same-dtype error against a
    float32 reference (FlashAttention's rule); each pass's counted ledger == its model."""
    torch = pytest.importorskip("torch")
    import loop_orders.torch as lot

    n_q, n_k = [113, 0, 1023, 256], [203, 7, 1024, 512]
    cu_q, cu_k = ([0, *np.cumsum(n).tolist()] for n in (n_q, n_k))
    gen = torch.Generator(device="cuda").manual_seed(5)
    tdt = getattr(torch, dtype)
    q = torch.randn(cu_q[-1], 4, d, device="cuda", generator=gen).to(tdt)
    k, v = (torch.randn(cu_k[-1], 2, d, device="cuda", generator=gen).to(tdt)
            for _ in range(2))
    do = torch.randn(cu_q[-1], 4, d, device="cuda", generator=gen).to(tdt)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with lot.counting() as passes:
        out = lot.attention(*leaves, schedule=variant.schedule, options=variant.options,
                            causal=True, cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32),
                            cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32))
        out.backward(do)
    ours = [out.detach().double()] + [x.grad.double() for x in leaves]
    ref = _plain_varlen(q, k, v, do, cu_q, cu_k, True, torch.float32)
    plain = _plain_varlen(q, k, v, do, cu_q, cu_k, True, tdt)
    for label, a, r, p in zip(("out", "dq", "dk", "dv"), ours, ref, plain, strict=True):
        err, theirs = float((a - r).abs().max()), float((p - r).abs().max())
        print(f"{variant.label} {dtype} d={d} {label}: ours {err:.2e}, plain {theirs:.2e}")
        assert err <= 2 * theirs, label
    assert [p.pass_ for p in passes] == ["forward", "backward"]
    assert all(p.ledger == p.model for p in passes)
    # no reference cycle through the autograd context (on CUDA tensors the kernels' view of
    # the output is owned by the output itself): it goes with its last name
    import weakref

    again = lot.attention(*leaves, schedule=variant.schedule, options=variant.options,
                          causal=True, cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32),
                          cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32))
    gone = weakref.ref(again)
    del again
    assert gone() is None


@gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [32, 64, 128])
def test_query_blocks_that_see_no_key_write_zeros(d, dtype):
    """Causal with 512 queries over 256 keys: query blocks 0 .. 3 see no key and must write
    O = 0 (lse -inf) even though they visit no K/V tile (Q_i's cp.async copies, which the
    K/V loop otherwise waits for, land where O_i is staged: fa_grid's five failed cells at
    b525e99). torch's allocator is handed NaN-filled memory first, so rows left unwritten
    show too."""
    torch = pytest.importorskip("torch")
    gen = torch.Generator(device="cuda").manual_seed(d)
    tdt = getattr(torch, dtype)
    q = torch.randn(2, 3, 512, d, device="cuda", generator=gen).to(tdt)
    k, v = (torch.randn(2, 3, 256, d, device="cuda", generator=gen).to(tdt) for _ in range(2))
    for _ in range(3):
        poison = torch.full((2, 3, 512, d), float("nan"), device="cuda", dtype=tdt)
        del poison
        res = lo.attention(q, k, v, schedule="q_outer", causal=True, save_lse=True)
        assert torch.equal(res.out[:, :, :256], torch.zeros_like(res.out[:, :, :256]))
        assert torch.isneginf(res.lse[:, :, :256]).all()
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, 256:].float(), k.float(), v.float(), is_causal=True)
        assert float((res.out[:, :, 256:].float() - ref).abs().max()) < 2e-2


@gpu
@pytest.mark.parametrize("schedule, options", _backward_variants())
def test_repeated_calls_replay_the_first_calls_launches(schedule, options, rng):
    """A key's later calls launch its first call's tape (`runtime.Taped`) on their own
    arrays: a second forward + backward on fresh float16 torch tensors (tails, causal,
    grouped K/V heads) is right against float64, counted and not, and an input of another
    alignment (`TAPE_ALIGNMENT`) takes the schedule's Python again."""
    torch = pytest.importorskip("torch")
    from loop_orders.api_grad import prepare_grad

    b, h, h_kv, n, d = 1, 4, 2, 300, 64

    def inputs():
        q, k, v = (torch.from_numpy(x).cuda() for x in random_qkv(rng, b, h, n, d, d,
                                                                  "float16"))
        k, v = k[:, :h_kv].contiguous(), v[:, :h_kv].contiguous()
        return q, k, v, torch.randn_like(q)

    for count in (False, True):
        args = dict(schedule=schedule, options=options, causal=True, count=count)
        lo.attention_grad(*inputs(), **args)  # the key's first call: recorded
        call = prepare_grad(*inputs(), schedule, None, None, True, None, options, count,
                            False)
        assert call.taped_forward.tape is not None and call.taped_backward.tape is not None
        q, k, v, do = inputs()
        g = lo.attention_grad(q, k, v, do, **args)
        host = [x.float().cpu().numpy() for x in (q, k, v, do)]
        # grouped heads: the reference on each query head's K/V copy, dK and dV summed back
        group = h // h_kv
        hq, hk, hv, hdo = host[0], *(np.repeat(x, group, axis=1) for x in host[1:3]), host[3]
        dq_ref, dk_ref, dv_ref = attention_grad_reference(hq, hk, hv, hdo, causal=True)
        refs = (dq_ref, *(x.reshape(b, h_kv, group, n, d).sum(axis=2) for x in (dk_ref, dv_ref)))
        assert relative_error(g.out.float().cpu().numpy(),
                              lo.attention_reference(hq, hk, hv, causal=True)[0]) <= 2e-3
        for got, ref in zip((g.dq, g.dk, g.dv), refs, strict=True):
            assert relative_error(got.float().cpu().numpy(), ref) <= 1e-2
        if count:
            bwd = backward_of(lo.get_schedule(schedule))
            assert g.counts_backward == backward_traffic(bwd, g.problem)
    # an output gradient 2 bytes into its buffer: another alignment, the schedule's Python
    # (16-bit tiles are copied 16 bytes at a time: refused, before anything runs)
    q, k, v, do = inputs()
    odd = torch.empty(do.numel() + 1, dtype=do.dtype, device="cuda")[1:].view_as(do)
    odd.copy_(do)
    try:
        g = lo.attention_grad(q, k, v, odd, schedule=schedule, options=options, causal=True)
    except ValueError as exc:
        assert "aligned" in str(exc)
    else:
        host = [x.float().cpu().numpy() for x in (q, k, v, do)]
        group = h // h_kv
        want = attention_grad_reference(host[0], *(np.repeat(x, group, axis=1)
                                                   for x in host[1:3]), host[3], causal=True)
        assert relative_error(g.dq.float().cpu().numpy(), want[0]) <= 1e-2
