"""The differentiable PyTorch op (loop_orders.torch), torch.compile over it, its SDPA
signature and model routing: on the CPU under the simulator (tiny sizes), on CUDA tensors on a
GPU (also tests/test_gpu.py; the CUDA-graph and inductor tests here are GPU-only); skipped
where torch is not installed."""

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402, N812
from conftest import gpu  # noqa: E402

import loop_orders as lo  # noqa: E402
import loop_orders.torch as lot  # noqa: E402
from loop_orders.device import runtime  # noqa: E402

DEVICE = "cpu" if runtime.SIMULATOR else "cuda"
SDPA = F.scaled_dot_product_attention  # torch's own
VARIANTS = [("q_outer", None), ("q_outer", {"dq": "separate"}), ("kv_outer", None),
            ("dense", None), ("split_kv", {"splits": 2})]


def leaves(shape, dtype=torch.float32, n=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen, dtype=dtype).to(DEVICE).requires_grad_()
            for _ in range(n)]


@pytest.mark.parametrize("schedule, options", VARIANTS,
                         ids=[f"{s}-{o}" for s, o in VARIANTS])
@pytest.mark.parametrize("causal", [False, True])
def test_op_matches_torch_autograd_of_sdpa(schedule, options, causal):
    """Output and gradients against torch's own attention in float64 (not the same code:
    torch differentiates its math), on fresh random inputs with tails (N = 11, Br = 4,
    Bc = 3) and dv != d."""
    q, k, _ = leaves((2, 2, 11, 5))
    (v,) = leaves((2, 2, 11, 3), n=1, seed=1)
    (w,) = leaves((2, 2, 11, 3), n=1, seed=2)  # a weight so that d(loss)/d(out) is not 1
    out = lot.attention(q, k, v, schedule=schedule, causal=causal, block_q=4, block_k=3,
                        options=options)
    assert isinstance(out, torch.Tensor) and out.device.type == DEVICE
    assert out.requires_grad and out.dtype == torch.float32
    (out * w.detach()).sum().backward()
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    expect = torch.nn.functional.scaled_dot_product_attention(*ref, is_causal=causal)
    (expect * w.detach().double()).sum().backward()
    assert torch.allclose(out.double(), expect, atol=1e-6, rtol=1e-5)
    for got, want in zip((q, k, v), ref, strict=True):
        err = (got.grad.double() - want.grad).abs().max() / want.grad.abs().max()
        assert err <= 1e-5, (schedule, float(err))


@pytest.mark.parametrize("precision", ["tf32x3", "tf32"])
def test_precision_reaches_both_passes_of_the_op(precision):
    """float32 at a TF32 precision: forward and backward on TF32 tensor cores through the op,
    within the TF32 bounds of torch's float64 attention (tails, dv != d)."""
    from loop_orders.reference import tf32_grad_tolerance, tf32_tolerance

    q, k = leaves((1, 2, 21, 12), n=2)
    (v,) = leaves((1, 2, 21, 8), n=1, seed=1)
    (w,) = leaves((1, 2, 21, 8), n=1, seed=2)
    out = lot.attention(q, k, v, causal=True, block_q=16, block_k=16, precision=precision)
    (out * w.detach()).sum().backward()
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    expect = torch.nn.functional.scaled_dot_product_attention(*ref, is_causal=True)
    (expect * w.detach().double()).sum().backward()
    host = [x.detach().cpu().numpy() for x in (q, k, v)]
    err = float((out.double() - expect).abs().max() / expect.abs().max())
    assert err <= tf32_tolerance(*host, expect.detach().cpu().numpy(), causal=True,
                                 precision=precision)
    tol = tf32_grad_tolerance(host[0], host[1], precision=precision, causal=True)
    for got, want in zip((q, k, v), ref, strict=True):
        assert float((got.grad.double() - want.grad).abs().max() / want.grad.abs().max()) <= tol


def test_counting_collects_each_pass_and_equals_the_model():
    q, k, v = leaves((1, 2, 9, 4))
    with lot.counting() as calls:
        out = lot.attention(q, k, v, schedule="kv_outer", block_q=4, block_k=4)
        out.sum().backward()
        lot.attention(q, k, v, schedule="q_outer", block_q=4, block_k=4)
    assert [(c.schedule, c.pass_) for c in calls] == [
        ("kv_outer", "forward"), ("kv_outer", "backward"), ("q_outer", "forward")]
    assert all(c.ledger == c.model for c in calls)
    bwd = calls[1]
    assert bwd.ledger.read("dq") > 0 and bwd.model == lo.predict_traffic(
        "kv_outer", n=9, d=4, heads=2, block_q=4, block_k=4, save_lse=True, backward=True)
    out = lot.attention(q, k, v)  # outside the block: not counted
    assert len(calls) == 3


def test_counting_sees_each_pass_on_its_own_tiles(backward_tiles_16x8):
    """A call naming no tiles, its backward measured fastest on others: torch.compile's
    fake kernels give the shapes, and each pass is counted against its own Problem."""
    q, k, v = leaves((1, 2, 21, 5))
    with lot.counting() as calls:
        out = torch.compile(lot.attention, backend="aot_eager", fullgraph=True)(q, k, v)
        out.sum().backward()
    assert [(c.pass_, c.problem.block_q, c.problem.block_k) for c in calls] == [
        ("forward", 21, 21), ("backward", 16, 8)]
    assert all(c.ledger == c.model for c in calls)
    expect = [x.detach().double().requires_grad_() for x in (q, k, v)]
    F.scaled_dot_product_attention(*expect).sum().backward()
    for got, ref in zip((q, k, v), expect, strict=True):
        torch.testing.assert_close(got.grad.double(), ref.grad, rtol=1e-4, atol=1e-5)


def test_two_dimensional_inputs_and_a_custom_scale():
    q, k, v = leaves((7, 4))
    out = lot.attention(q, k, v, scale=0.3)
    out.sum().backward()
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    s = (ref[0] @ ref[1].T * 0.3).softmax(-1)
    (s @ ref[2]).sum().backward()
    assert out.shape == (7, 4)
    assert torch.allclose(q.grad.double(), ref[0].grad, atol=1e-6)


def test_a_call_with_nothing_to_differentiate_is_loop_orders_attention():
    """Under torch.no_grad (or on inputs needing no grad) the op is `lo.attention`'s call:
    the same output to the bit, no autograd node, a transposed (non-contiguous) input taken,
    and `lo.attention`'s errors; the same call with grad gives the same output within
    float32 rounding."""
    q, k, v = leaves((1, 2, 9, 8), seed=3)
    kt = k.detach().transpose(-1, -2).contiguous().transpose(-1, -2)  # strides of a transpose
    with torch.no_grad():
        out = lot.attention(q, kt, v, schedule="kv_outer", causal=True, block_q=4)
        with pytest.raises(ValueError, match="block_k"):
            lot.attention(q, k, v, block_k=0)
    want = lo.attention(*(x.detach() for x in (q, k, v)), schedule="kv_outer", causal=True,
                        block_q=4).out
    assert not kt.is_contiguous() and out.grad_fn is None and torch.equal(out, want)
    with_grad = lot.attention(q, k, v, schedule="kv_outer", causal=True, block_q=4)
    assert with_grad.grad_fn is not None
    assert torch.allclose(with_grad.detach(), out, atol=1e-6)


@pytest.mark.parametrize("schedule, options", VARIANTS,
                         ids=[f"{s}-{o}" for s, o in VARIANTS])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_tensors_forward_and_backward(schedule, options, dtype):
    """float16 and bfloat16 tensors (NumPy has no bfloat16: torch carries it) through every
    loop order, forward (tensor cores where the schedule has them) and backward, with tails,
    an odd d and dv != d: outputs and gradients in the input dtype, against float64 within
    the 16-bit tolerances (`reference.tolerance`, `grad_tolerance`)."""
    from loop_orders.core.schedule import backward_of
    from loop_orders.reference import grad_tolerance, relative_error, tolerance

    tdt = getattr(torch, dtype)
    q, k = leaves((1, 2, 11, 5), dtype=tdt, n=2)
    (v,) = leaves((1, 2, 11, 3), dtype=tdt, n=1, seed=1)
    (w,) = leaves((1, 2, 11, 3), n=1, seed=2)
    with lot.counting() as calls:
        out = lot.attention(q, k, v, schedule=schedule, causal=True, block_q=4, block_k=3,
                            options=options)
        (out.float() * w.detach()).sum().backward()
    assert out.dtype == tdt and all(x.grad.dtype == tdt for x in (q, k, v))
    assert all(c.ledger == c.model for c in calls) and len(calls) == 2
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    expect = torch.nn.functional.scaled_dot_product_attention(*ref, is_causal=True)
    (expect * w.detach().double()).sum().backward()
    p = calls[0].problem
    sched = lo.get_schedule(schedule)

    def host(x):
        return x.detach().double().cpu()

    assert relative_error(host(out), host(expect)) <= tolerance(
        dtype, sched.output_roundings(p), host(v), host(expect))
    for got, want in zip((q, k, v), ref, strict=True):
        err = relative_error(host(got.grad), host(want.grad))
        assert err <= grad_tolerance(dtype, backward_of(sched).output_roundings(p)), err


def test_bfloat16_needs_torch_tensors():
    """NumPy has no bfloat16 and uint16 is not taken for it: a clear refusal."""
    import numpy as np

    bits = np.ones((4, 4), np.uint16)
    with pytest.raises(TypeError, match="q: dtype uint16 is not supported"):
        lo.attention(bits, bits, bits)


def test_a_non_contiguous_output_gradient_is_taken():
    """out.sum() gives an expanded (stride 0) gradient: the op copies it contiguous."""
    q, k, v = leaves((1, 2, 6, 4))
    lot.attention(q, k, v, block_q=4, block_k=4).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


# --- the torch.library op: torch.compile, CUDA graphs -------------------------------------

@pytest.mark.parametrize("schedule, options", [("kv_outer", ""),
                                               ("split_kv", "dq=separate,splits=2")])
def test_the_op_passes_torch_library_opcheck(schedule, options):
    """torch's own checks of a custom op: schema, fake (shape) kernel of every output (the
    workspace too) against the real one, autograd registration, a dynamic-shape trace."""
    q, k, v = leaves((1, 2, 6, 4))
    torch.library.opcheck(lot._forward, (q, k, v, schedule, options, True, 4, 4, None,
                                          [-1, -1], False, "ieee"))
    (gq,) = leaves((1, 4, 6, 4), n=1)  # grouped-query: 4 query heads over 2 K/V heads
    torch.library.opcheck(lot._forward, (gq, k, v, schedule, options, False, 4, 4, None,
                                          [-1, -1], True, "tf32x3"))
    assert lot.decode_options(lot.encode_options({"splits": 2, "dq": "separate"})) == {
        "dq": "separate", "splits": "2"}


@pytest.mark.parametrize("schedule, kept", [("kv_outer", 2), ("dense", 2), ("q_outer", 0),
                                            ("split_kv", 0)])
def test_the_op_keeps_only_the_workspace_its_backward_reads(schedule, kept):
    """The forward op returns the workspace only where the backward reads it (kv_outer's l,
    m; dense's S, P): split_kv's partial outputs, some never written, are not outputs."""
    q, k, v = leaves((1, 2, 6, 4))
    args = (q, k, v, schedule, "", True, 4, 4, None, [-1, -1], False, "ieee")
    assert len(lot._forward(*args)[2]) == kept
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = [mode.from_tensor(x) for x in (q, k, v)]
        assert len(lot._forward(*fake, *args[3:])[2]) == kept


def test_torch_compile_traces_the_op_in_one_graph_and_counting_sees_every_pass():
    """fullgraph=True (a graph break would raise) through dynamo and AOTAutograd on the fake
    kernels (backend aot_eager: inductor's C++ build is too slow for CI; the GPU tests compile
    with inductor): outputs and gradients as in eager mode, and counting() inside which the
    compiled function runs collects the same passes, each equal to its model."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    q, k, v = leaves((1, 2, 8, 4))
    (w,) = leaves((1, 2, 8, 4), n=1, seed=3)

    def two_layers(q, k, v):
        h = lot.attention(q, k, v, schedule="kv_outer", causal=True, block_q=4, block_k=4)
        out = lot.attention(h.tanh(), k, v, schedule="split_kv", block_q=4, block_k=4,
                            options={"splits": 2, "dq": "separate"})
        return (out * w.detach()).sum()

    backend = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(two_layers, fullgraph=True, backend=backend)
    runs = []
    for fn in (compiled, two_layers):
        with lot.counting() as calls:
            fn(q, k, v).backward()
        runs.append((calls, [x.grad.clone() for x in (q, k, v)]))
        for x in (q, k, v):
            x.grad = None
    (calls, grads), (eager_calls, eager_grads) = runs
    assert backend.frame_count == 1
    ops = [n.target for n in backend.graphs[0].graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.loop_orders.attention.default) == 2
    assert [(c.schedule, c.pass_) for c in calls] == [(c.schedule, c.pass_)
                                                      for c in eager_calls] == [
        ("kv_outer", "forward"), ("split_kv", "forward"), ("split_kv", "backward"),
        ("kv_outer", "backward")]
    assert [c.ledger for c in calls] == [c.ledger for c in eager_calls]
    assert all(c.ledger == c.model for c in calls)
    for got, want in zip(grads, eager_grads, strict=True):
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)


def gpt2_on(device, shape=None):
    from experiments.model_traffic import TINY, batch, gpt2

    shape = shape or TINY
    return shape, gpt2(shape).to(device), *batch(shape, device)


@gpu
def test_torch_compile_fullgraph_with_inductor_on_cuda():
    """The GPT-2-shaped stack routed through q_outer and compiled whole by inductor:
    the loss and gradients of eager mode's routed step, and counting() still collects."""
    from experiments.model_traffic import Shape, predicted, train_step

    torch._dynamo.reset()
    shape, model, idx, targets = gpt2_on("cuda", Shape(layers=2, heads=4, head_dim=64,
                                                       seq=256, batch=2, vocab=128))
    with lot.use("q_outer"):
        loss, grads = train_step(model, idx, targets)
        model.compile(fullgraph=True)  # in place: the parameters keep their names
        with lot.counting() as calls:
            got, got_grads = train_step(model, idx, targets)
    assert abs(got - loss) <= 1e-5 * abs(loss)
    for name, ref in grads.items():
        assert (got_grads[name] - ref).abs().max() <= 1e-4 * ref.abs().max(), name
    forward = [c.ledger for c in calls if c.pass_ == "forward"]
    assert len(forward) == shape.layers and all(c.ledger == c.model for c in calls)
    assert sum(forward[1:], forward[0]) == predicted(shape, "q_outer", None, False)


@gpu
def test_cuda_graphs_reduce_overhead_replay_the_op():
    """mode="reduce-overhead": the op allocates through torch and launches on its current
    stream, so inductor's CUDA graphs take the whole step (no skip) and replays give eager
    mode's loss and gradients."""
    from torch._dynamo.utils import counters

    from experiments.model_traffic import Shape, train_step

    torch._dynamo.reset()
    counters.clear()
    _, model, idx, targets = gpt2_on("cuda", Shape(layers=2, heads=4, head_dim=64, seq=256,
                                                   batch=2, vocab=128))
    with lot.use("kv_outer"):
        loss, grads = train_step(model, idx, targets)
        model.compile(mode="reduce-overhead", fullgraph=True)
        for _ in range(4):  # warm-up, recording, replays
            torch.compiler.cudagraph_mark_step_begin()
            got, got_grads = train_step(model, idx, targets)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    assert abs(got - loss) <= 1e-5 * abs(loss)
    for name, ref in grads.items():
        assert (got_grads[name] - ref).abs().max() <= 1e-4 * ref.abs().max(), name


@gpu
def test_a_cuda_graph_captures_the_op_and_counting_refuses_a_capture():
    """torch.cuda.graph captures the forward (its launches on the capture stream, its
    outputs from the graph's pool); a replay on new inputs gives the eager output. Inside
    counting() a capture is refused: its replays would count nothing."""
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda") for _ in range(3))
    lot.attention(q, k, v, schedule="q_outer", causal=True)  # warm-up: kernels compiled
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lot.attention(q, k, v, schedule="q_outer", causal=True)
    for x in (q, k, v):
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    expect = lot.attention(q, k, v, schedule="q_outer", causal=True)
    assert torch.equal(out, expect)
    with lot.counting() as calls, pytest.raises(RuntimeError, match="CUDA graph"), \
            torch.cuda.graph(torch.cuda.CUDAGraph()):
        lot.attention(q, k, v, schedule="q_outer", causal=True)
    assert calls == []


# --- SDPA's signature and model routing ---------------------------------------------------

@pytest.mark.parametrize("shape, kwargs", [((1, 2, 8, 4), {"is_causal": True,
                                                           "enable_gqa": True}),
                                           ((2, 8, 4), {"scale": 0.3}), ((8, 4), {})])
def test_sdpa_signature_gives_torchs_sdpa(shape, kwargs):
    """4-D, 3-D (folded to heads of one) and 2-D inputs, is_causal, scale, enable_gqa with
    equal heads, against torch's SDPA in float64; output and gradients."""
    q, k, v = leaves(shape)
    out = lot.scaled_dot_product_attention(q, k, v, schedule="kv_outer", block_q=4, block_k=4,
                                           **kwargs)
    out.sum().backward()
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    expect = F.scaled_dot_product_attention(*ref, **kwargs)
    expect.sum().backward()
    assert out.shape == expect.shape
    assert torch.allclose(out.double(), expect, atol=1e-6, rtol=1e-5)
    assert torch.allclose(k.grad.double(), ref[1].grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("pack_gqa", [False, True])
def test_sdpa_grouped_query_heads_give_torchs_sdpa(pack_gqa):
    """enable_gqa with 4 query heads over 2 K/V heads, per query head and packed: output and
    gradients (dk, dv summed over each K/V head's query heads) as torch's SDPA in float64."""
    (q,) = leaves((1, 4, 8, 4), n=1)
    k, v = leaves((1, 2, 8, 4), n=2, seed=5)
    out = lot.scaled_dot_product_attention(q, k, v, enable_gqa=True, schedule="q_outer",
                                           block_q=4, block_k=4, pack_gqa=pack_gqa)
    out.sum().backward()
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    expect = F.scaled_dot_product_attention(*ref, enable_gqa=True)
    expect.sum().backward()
    assert torch.allclose(out.double(), expect, atol=1e-6, rtol=1e-5)
    for got, want in zip((q, k, v), ref, strict=True):
        assert got.grad.shape == want.grad.shape
        assert torch.allclose(got.grad.double(), want.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kwargs, name", [
    ({"attn_mask": torch.ones(8, 8, dtype=torch.bool)}, "attn_mask"),
    ({"dropout_p": 0.1}, "dropout_p"), ({"enable_gqa": False}, "enable_gqa"),
    ({"is_causal": True}, "is_causal")])
def test_sdpa_refuses_what_the_kernels_do_not_implement(kwargs, name):
    """A mask tensor, dropout, fewer key/value heads without enable_gqa (as SDPA refuses),
    causal over n_q != n_k: a ValueError naming the argument, before any pass runs."""
    (q,) = leaves((1, 4, 8, 4), n=1)
    k, v = leaves((1, 2 if name == "enable_gqa" else 4, 6 if name == "is_causal" else 8, 4),
                  n=2)
    with lot.counting() as calls, pytest.raises(ValueError, match=f"^{name}: "):
        lot.scaled_dot_product_attention(q, k, v, **kwargs)
    assert calls == []


def test_use_routes_an_unmodified_models_sdpa_and_counts_every_pass():
    """The GPT-2-shaped stack (experiments/model_traffic.py, torch alone, calling
    F.scaled_dot_product_attention): its training step under use(...) gives plain torch's
    loss and gradients, and counting() collects each layer's forward and backward, summing
    to the model's prediction."""
    from experiments.model_traffic import predicted, train_step

    shape, model, idx, targets = gpt2_on(DEVICE)
    loss, grads = train_step(model, idx, targets)
    with lot.use("split_kv", block_q=4, block_k=4, splits=2, dq="separate"), \
            lot.counting() as calls:
        routed_loss, routed_grads = train_step(model, idx, targets)
    assert F.scaled_dot_product_attention is SDPA
    assert [c.pass_ for c in calls] == ["forward"] * shape.layers + ["backward"] * shape.layers
    assert abs(routed_loss - loss) <= 1e-5 * abs(loss)
    for name, ref in grads.items():
        assert (routed_grads[name] - ref).abs().max() <= 1e-5 * ref.abs().max(), name
    for pass_ in ("forward", "backward"):
        mine = [c.ledger for c in calls if c.pass_ == pass_]
        assert all(c.ledger == c.model for c in calls)
        assert sum(mine[1:], mine[0]) == predicted(
            shape, "split_kv", {"splits": 2, "dq": "separate"}, pass_ == "backward")


def test_use_restores_torchs_sdpa_on_exit_on_errors_and_when_nested():
    q, k, v = leaves((1, 2, 8, 4))
    with pytest.raises(ValueError, match="attn_mask"), lot.use("dense"):
        assert F.scaled_dot_product_attention is not SDPA
        F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.bool))
    assert F.scaled_dot_product_attention is SDPA
    with lot.use("dense") as outer:
        with lot.use("kv_outer", block_q=4):
            assert F.scaled_dot_product_attention not in (SDPA, outer)
        assert F.scaled_dot_product_attention is outer
    assert F.scaled_dot_product_attention is SDPA
    with pytest.raises(ValueError, match="schedule: unknown schedule 'nope'"), lot.use("nope"):
        pass
    with pytest.raises(ValueError, match="options: unknown option 'splits' for q_outer"), \
            lot.use("q_outer", splits=2):
        pass
    assert F.scaled_dot_product_attention is SDPA
