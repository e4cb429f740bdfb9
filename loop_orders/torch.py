"""A PyTorch op: attention in any loop order, forward and backward, that torch.compile traces.

    import loop_orders.torch as lot
    out = lot.attention(q, k, v, schedule="q_outer", causal=True)   # torch in, torch out
    out.sum().backward()                                            # q.grad, k.grad, v.grad
    with lot.counting() as calls:                                   # counted HBM traffic
        loss = model(x); loss.backward()
    calls[0].ledger, calls[0].pass_                                 # per forward / backward

    lot.scaled_dot_product_attention(q, k, v, is_causal=True, schedule="kv_outer")  # SDPA's
    with lot.use("kv_outer", block_q=32):      # an unmodified model's F.scaled_dot_product_
        loss = model(x); loss.backward()       # attention calls run in that loop order

q, k, v: (batch, heads, n, d) or (n, d) torch tensors, float32, float16 or bfloat16, on a CUDA
device (the kernels run on the tensors' memory, on torch's current stream, outputs allocated by
torch, no host copies) or, under the Numba CUDA simulator, on the CPU (through NumPy; tiny
sizes). torch is an optional dependency (`pip install -e ".[torch]"`).

Under torch.compile two `torch.library` custom ops carry it: `loop_orders::attention` (the
forward: O, lse, and what the schedule's backward reads besides, such as dense's S and P or
kv_outer's l and m, all allocated through torch) and `loop_orders::attention_backward` (dq, dk,
dv from those); `register_autograd` joins them, `register_fake` gives every output's shape, so
`torch.compile(model, fullgraph=True)` traces a model calling them without a graph break, and
a CUDA graph (`mode="reduce-overhead"`) can capture them. In eager mode the same two passes run
under a plain autograd.Function (`_EagerAttention`: the custom op's dispatch costs more host
time than a small call's own). The schedule and its arguments are op arguments; its options
are one string, `encode_options`: "dq=separate,splits=2" (the
`--option key=value` strings of the command line, sorted).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from . import api, varlen
from .api import _check_int, named_tiles
from .api_grad import GradCall, grad_problem, grad_tiles, prepare_grad
from .core.ledger import Ledger
from .core.mask import check_window
from .core.schedule import Problem, backward_of, get_schedule
from .device.arrays import numpy_to_torch_dtype


@dataclass
class Counted:
    """One counted pass inside `counting()`: which schedule and pass, its Problem, the
    measured Ledger and the model's."""

    schedule: str
    pass_: str  # "forward" or "backward"
    problem: Problem | tuple  # a varlen call's: its sequences' Problems
    ledger: Ledger
    model: Ledger


_collecting: list | None = None


@contextlib.contextmanager
def counting():
    """Run every pass of the op inside the block with its counted kernels, collecting a
    `Counted` record per forward and per backward pass (the list it yields). A pass is
    counted when it runs inside the block: a backward when `.backward()` runs there.

    Counted kernels copy their counters back after each pass, so they synchronise. The op
    asks whether a block is open when it runs, not when it was traced, so a model compiled by
    `torch.compile` (called inside the block; open the block outside the compiled function)
    is counted pass by pass as in eager mode. Not under CUDA graphs: a replay runs no Python
    and could collect nothing, so capturing the op inside this block raises RuntimeError;
    count the same model without `mode="reduce-overhead"`."""
    global _collecting
    previous, _collecting = _collecting, []
    try:
        yield _collecting
    finally:
        _collecting = previous


def _record(call: GradCall, pass_: str, ledger: Ledger | None, collected) -> None:
    if collected is None or ledger is None:
        return
    p = call.p if pass_ == "forward" else call.p_backward
    model = (call.sched if pass_ == "forward" else call.bwd).model(p)
    collected.append(Counted(call.sched.name, pass_, p, ledger, model))


def encode_options(options: dict | None) -> str:
    """A schedule's options as the op's string argument: sorted `key=value` pairs joined by
    commas ("" for none); each value as its `--option` string, which every option accepts."""
    if not options:
        return ""
    pairs = [f"{key}={value}" for key, value in sorted(options.items())]
    if any(pair.count("=") != 1 or "," in pair for pair in pairs):
        raise ValueError(f"options: names and values may not contain ',' or '=', got "
                         f"{options!r}")
    return ",".join(pairs)


def decode_options(text: str) -> dict | None:
    """`encode_options`' string back to a dict (values as strings; the schedule checks them)."""
    return dict(pair.split("=") for pair in text.split(",")) if text else None


def _tile(block: int) -> int | None:
    """An op's tile argument as the API takes it: 0 stands for None (chosen, `attention`)."""
    return None if block == 0 else block


def _call(q, k, v, schedule, options, causal, block_q, block_k, scale, window, pack_gqa,
          precision, count) -> GradCall:
    """The prepared call of these arguments, counted or not (`prepare_grad` keeps it)."""
    if count and q.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("counting(): a CUDA graph is being captured; its replays run no "
                           "Python, so their passes could not be counted: count without CUDA "
                           "graphs (mode='reduce-overhead')")
    return prepare_grad(q, k, v, None, schedule, _tile(block_q), _tile(block_k), causal, scale,
                        decode_options(options), count, False, tuple(window), pack_gqa,
                        precision)


def _forward_pass(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, schedule: str,
                  options: str, causal: bool, block_q: int, block_k: int, scale: float | None,
                  window: list[int], pack_gqa: bool, precision: str
                  ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The forward pass: O, lse, and the schedule's workspace where its backward reads it
    (`READS_FORWARD_WORKSPACE`; none otherwise: split_kv's partial outputs, which its
    unvisited splits leave unwritten, are neither kept nor compared by torch's checks)."""
    collected = _collecting
    call = _call(q, k, v, schedule, options, causal, block_q, block_k, scale, window,
                 pack_gqa, precision, collected is not None)
    saved = call.forward(q, k, v)
    _record(call, "forward", saved.counts, collected)
    kind = call.inputs.kind
    kept = [kind.finish(x) for x in saved.kept] if call.bwd.READS_FORWARD_WORKSPACE else []
    return kind.finish(saved.out), kind.finish(saved.lse), kept


_forward = torch.library.custom_op("loop_orders::attention", mutates_args=())(_forward_pass)


@_forward.register_fake
def _forward_shapes(q, k, v, schedule, options, causal, block_q, block_k, scale, window,
                    pack_gqa, precision):
    # The sizes as ints: a workspace's shape may depend on them beyond arithmetic (split_kv's
    # splits="auto"), so a dynamic-shape trace specialises on them, as the kernels do.
    (*lead, n_q, d), n_k, dv = map(int, q.shape), int(k.shape[-2]), int(v.shape[-1])
    sched = get_schedule(schedule)
    batch, heads = lead if lead else (1, 1)
    problem = grad_problem(sched, n_q, n_k, d, dv, batch, heads,
                           int(k.shape[-3]) if lead else None,
                           str(q.dtype).removeprefix("torch."), causal, decode_options(options),
                           tuple(window), pack_gqa, precision)
    tiles, count = (_tile(block_q), _tile(block_k)), _collecting is not None
    # the tiles the call will run with, chosen as `_call` chooses them (counted builds take
    # a little more shared memory)
    bwd = backward_of(sched)
    p = grad_tiles(sched, bwd, problem(*named_tiles(*tiles)), problem, *tiles, count, False)
    kept = sched.allocate_workspace(
        p, lambda shape, dtype: q.new_empty(shape, dtype=numpy_to_torch_dtype(dtype))
    ) if bwd.READS_FORWARD_WORKSPACE else ()
    return (q.new_empty((*q.shape[:-1], v.shape[-1])),
            q.new_empty(q.shape[:-1], dtype=torch.float32), list(kept))


def _backward_pass(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, kept: list[torch.Tensor],
                   schedule: str, options: str, causal: bool, block_q: int, block_k: int,
                   scale: float | None, window: list[int], pack_gqa: bool, precision: str
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The schedule's backward loop order: dq, dk, dv from the forward's outputs."""
    collected = _collecting
    call = _call(q, k, v, schedule, options, causal, block_q, block_k, scale, window,
                 pack_gqa, precision, collected is not None)
    dq, dk, dv, ledger = call.backward(call.resume(out, lse, kept), q, k, v, do)
    _record(call, "backward", ledger, collected)
    return dq, dk, dv


_backward = torch.library.custom_op("loop_orders::attention_backward",
                                    mutates_args=())(_backward_pass)


@_backward.register_fake
def _backward_shapes(do, q, k, v, out, lse, kept, *args):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _contiguous(x: torch.Tensor) -> torch.Tensor:
    """x, or a C-contiguous copy of it (asking first costs less host time than
    `Tensor.contiguous`'s dispatch on a tensor that already is)."""
    return x if x.is_contiguous() else x.contiguous()


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, *args = inputs
    out, lse, kept = output
    ctx.mark_non_differentiable(lse, *kept)
    ctx.save_for_backward(q, k, v, out, lse, *kept)
    ctx.args = tuple(args)


def _gradients(ctx, grad_out, _grad_lse, _grad_kept):
    q, k, v, out, lse, *kept = ctx.saved_tensors
    dq, dk, dv = _backward(_contiguous(grad_out), q, k, v, out, lse, kept, *ctx.args)
    return dq, dk, dv, *(None,) * len(ctx.args)


_forward.register_autograd(_gradients, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """Eager mode's path: the op's two passes under a plain autograd.Function. The custom
    op's dispatch (its checks of the outputs' aliasing, the Python autograd wrapper
    `register_autograd` installs) costs several times a small call's own host time
    (results/host_overhead.json); torch.compile traces the custom op instead."""

    @staticmethod
    def forward(ctx, q, k, v, *args):
        out, lse, kept = _forward_pass(q, k, v, *args)
        ctx.save_for_backward(q, k, v, out, lse, *kept)
        ctx.args = args
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, *kept = ctx.saved_tensors
        dq, dk, dv = _backward_pass(_contiguous(grad_out), q, k, v, out, lse, kept,
                                    *ctx.args)
        return dq, dk, dv, *(None,) * len(ctx.args)


class _VarlenAttention(torch.autograd.Function):
    """Packed variable-length sequences (`loop_orders.varlen`), eager mode: the forward's
    per-sequence workspaces stay on ctx as the call's own objects (not tensors a custom op
    could return), so torch.compile does not trace this path; out and lse are saved as
    tensors (no reference from ctx back to the output outside autograd's)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, *args):
        call = varlen.prepare_grad(q, k, v, None, cu_q, cu_k, *args[:-2],
                                   count=_collecting is not None, timed=False,
                                   window=args[-2], pack_gqa=False, precision=args[-1])
        saved = call.forward(q, k, v)
        _record_varlen(call, "forward", saved.counts)
        kind = call.packed.kind
        out, lse = kind.finish(saved.out), kind.finish(saved.lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kept = saved.kept
        ctx.args = (cu_q, cu_k, *args)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        do = grad_out.contiguous()
        cu_q, cu_k, *args = ctx.args
        call = varlen.prepare_grad(q, k, v, do, cu_q, cu_k, *args[:-2],
                                   count=_collecting is not None, timed=False,
                                   window=args[-2], pack_gqa=False, precision=args[-1])
        kind = call.packed.kind
        saved = varlen.VarlenSaved(out, kind.view(out), lse, kind.view(lse), ctx.kept, None,
                                   None)
        grads = call.backward(saved, q, k, v, do)
        _record_varlen(call, "backward", grads.counts)
        return grads.dq, grads.dk, grads.dv, *(None,) * (2 + len(args))


def _record_varlen(call, pass_: str, ledger: Ledger | None) -> None:
    """`_record` of a varlen pass: its Problem is the tuple of its sequences'."""
    if _collecting is not None and ledger is not None:
        model = varlen.varlen_traffic(call.sched, call.problems, pass_ == "backward")
        _collecting.append(Counted(call.sched.name, pass_, call.problems, ledger, model))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, schedule: str = "q_outer",
              causal: bool = False, block_q: int | None = None, block_k: int | None = None,
              options: dict | None = None, scale: float | None = None,
              window: tuple = (-1, -1), pack_gqa: bool = False,
              cu_seqlens_q: torch.Tensor | None = None,
              cu_seqlens_k: torch.Tensor | None = None, precision: str = "ieee") -> torch.Tensor:
    """softmax(scale q k^T) v in the loop order `schedule`, differentiable (the schedule's
    backward loop order computes the gradients; `options` may choose its variant, e.g.
    {"dq": "separate"}). `causal` (bottom-right aligned) and `window=(left, right)` as for
    `loop_orders.attention`; k and v may have fewer heads than q (grouped-query attention,
    per query head or with `pack_gqa` packed, as `loop_orders.attention`). Tiles left out
    are chosen as `loop_orders.attention_grad` chooses them (each pass its own:
    `api_grad.grad_tiles`); the op carries such a tile as 0. A call with nothing to differentiate
    (no input requiring grad, or under torch.no_grad) outside `counting()` and
    torch.compile is `loop_orders.attention`'s, its tiles chosen as that chooses them
    (on a Hopper GPU the measured fastest forward's). Arguments are checked as
    `loop_orders.attention_grad` checks them. Non-contiguous inputs are copied
    contiguous first (torch's copy, outside the ledgers). `precision` ("tf32", "tf32x3":
    float32 inputs) runs both passes on TF32 tensor cores, as `loop_orders.attention_grad`.

    With `cu_seqlens_q`, `cu_seqlens_k` (int32 prefix sums) q, k, v are packed sequences
    (total, heads, d), as `loop_orders.attention` takes them; eager mode only (under
    torch.compile: ValueError), no pack_gqa."""
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        if torch.compiler.is_compiling():
            raise ValueError("cu_seqlens_q: packed variable-length batches run in eager mode "
                             "only; call the op outside torch.compile (or mark the caller "
                             "torch.compiler.disable)")
        if pack_gqa:
            raise ValueError("pack_gqa: with cu_seqlens use pack_gqa=False (per query head)")
        return _VarlenAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(),
                                      cu_seqlens_q, cu_seqlens_k, schedule, block_q, block_k,
                                      causal, scale, options, tuple(check_window(window)),
                                      precision)
    compiling = torch.compiler.is_compiling()
    differentiable = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                                  or v.requires_grad)
    if not (compiling or differentiable or _collecting is not None):
        # nothing to differentiate or count: `loop_orders.attention`'s call, which keeps no
        # lse and costs the host less (its memory from torch's allocator: a CUDA graph may
        # capture it)
        return api.attention(_contiguous(q), _contiguous(k), _contiguous(v), schedule,
                             block_q, block_k, causal, scale, options=options,
                             precision=precision, window=window, pack_gqa=pack_gqa).out
    tiles = [0 if b is None else _check_int(name, b, 1) for name, b in
             (("block_q", block_q), ("block_k", block_k))]
    args = (_contiguous(q), _contiguous(k), _contiguous(v), schedule, encode_options(options),
            causal, *tiles, scale, list(check_window(window)), bool(pack_gqa), precision)
    if compiling:  # the custom op, which the compiler traces
        return _forward(*args)[0]
    if not differentiable:
        return _forward_pass(*args)[0]  # counted, nothing to differentiate: no autograd node
    return _EagerAttention.apply(*args)


def _refuse_unsupported(query, key, attn_mask, dropout_p, enable_gqa) -> None:
    """SDPA's arguments the kernels do not implement, refused before anything runs."""
    if attn_mask is not None:
        raise ValueError("attn_mask: loop_orders takes no mask tensor (is_causal=True is its "
                         "mask); use torch's scaled_dot_product_attention for other masks")
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p: got {dropout_p}; loop_orders has no dropout, only "
                         f"dropout_p=0.0 (e.g. model.eval(), or a model built without it)")
    if not enable_gqa and query.dim() >= 3 and query.shape[-3] != key.shape[-3]:
        raise ValueError(f"enable_gqa: {query.shape[-3]} query heads over {key.shape[-3]} "
                         f"key/value heads is grouped-query attention: pass enable_gqa=True "
                         f"(as SDPA asks)")


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, *,
                                 schedule="q_outer", block_q=None, block_k=None, pack_gqa=False,
                                 precision="ieee", **options):
    """`torch.nn.functional.scaled_dot_product_attention`'s signature, computed in the loop
    order `schedule` with tiles `block_q` x `block_k` and the schedule's `options` (as
    `attention`'s dict); with enable_gqa, fewer key/value heads than query heads run per
    query head, or packed with `pack_gqa`; float32 on TF32 tensor cores with `precision`
    ("tf32", "tf32x3", as `attention`). Refused with a ValueError naming the argument: a
    mask tensor, dropout_p != 0, fewer key/value heads without enable_gqa, is_causal with
    fewer or more keys than queries (SDPA aligns that mask top-left, FlashAttention
    bottom-right: we do not guess).
    Inputs of 3 or 5+ dimensions are folded to (batch, 1, n, d) and back."""
    _refuse_unsupported(query, key, attn_mask, dropout_p, enable_gqa)
    if is_causal and query.shape[-2] != key.shape[-2]:
        raise ValueError(f"is_causal: needs as many queries as keys, got {query.shape[-2]} "
                         f"and {key.shape[-2]}")
    args = dict(schedule=schedule, causal=is_causal, block_q=block_q, block_k=block_k,
                options=options or None, scale=scale, pack_gqa=pack_gqa, precision=precision)
    if query.dim() in (2, 4):
        return attention(query, key, value, **args)
    lead = query.shape[:-2]
    flat = [x.reshape(-1, 1, *x.shape[-2:]) for x in (query, key, value)]
    out = attention(*flat, **args)
    return out.reshape(*lead, *out.shape[-2:])


@contextlib.contextmanager
def use(schedule: str = "q_outer", *, block_q: int | None = None, block_k: int | None = None,
        precision: str = "ieee", **options):
    """Inside the block, `torch.nn.functional.scaled_dot_product_attention` is
    `scaled_dot_product_attention` in the loop order `schedule`: an unmodified model's
    attention (its calls of F.scaled_dot_product_attention, torch.nn.MultiheadAttention's
    too) runs our kernels, forward and backward, and `counting()` collects every pass. The
    original comes back on exit, also on an exception; blocks nest. The routing is a module
    attribute, so process-wide while the block is open (every thread's calls). It yields the
    routed function. The schedule and options are checked on entry. A name bound before the
    block (`from torch.nn.functional import
    scaled_dot_product_attention` in the model's module) is not routed. Arguments the
    kernels do not implement (a mask tensor, dropout) raise ValueError rather than fall back
    to torch: a counted run then means every pass was ours."""
    get_schedule(schedule).options_for(decode_options(encode_options(options)))

    def routed(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
        return scaled_dot_product_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
            schedule=schedule, block_q=block_q, block_k=block_k, precision=precision,
            **options)

    functional = torch.nn.functional
    previous = functional.scaled_dot_product_attention
    functional.scaled_dot_product_attention = routed
    try:
        yield routed
    finally:
        functional.scaled_dot_product_attention = previous
