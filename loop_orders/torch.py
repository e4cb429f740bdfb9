"""A differentiable PyTorch op: attention in any loop order, forward and backward.

    import loop_orders.torch as lot
    out = lot.attention(q, k, v, schedule="q_outer", causal=True)   # torch in, torch out
    out.sum().backward()                                            # q.grad, k.grad, v.grad
    with lot.counting() as calls:                                   # counted HBM traffic
        loss = model(x); loss.backward()
    calls[0].ledger, calls[0].pass_                                 # per forward / backward

q, k, v: (batch, heads, n, d) or (n, d) torch tensors, float32, float16 or bfloat16, on a CUDA
device (the kernels run on the tensors' memory, on torch's current stream, no host copies) or, under
the Numba CUDA simulator, on the CPU (through NumPy; tiny sizes). The forward runs the
schedule's forward kernels and keeps what its backward reads (lse; dense's P, kv_outer's l
and m) in torch-allocated memory until the backward runs the schedule's backward kernels.
torch is an optional dependency (`pip install -e ".[torch]"`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .api_grad import GradCall, prepare_grad
from .core.ledger import Ledger
from .core.schedule import Problem


@dataclass
class Counted:
    """One counted pass inside `counting()`: which schedule and pass, its Problem, the
    measured Ledger and the model's."""

    schedule: str
    pass_: str  # "forward" or "backward"
    problem: Problem
    ledger: Ledger
    model: Ledger


_collecting: list | None = None


@contextlib.contextmanager
def counting():
    """Run every `attention` call inside the block with its counted kernels, collecting a
    `Counted` record per forward and per backward pass (the list it yields). Counted
    kernels copy their counters back after each pass, so they synchronise."""
    global _collecting
    previous, _collecting = _collecting, []
    try:
        yield _collecting
    finally:
        _collecting = previous


def _record(call: GradCall, pass_: str, ledger: Ledger | None, collected) -> None:
    if collected is None or ledger is None:
        return
    model = (call.sched if pass_ == "forward" else call.bwd).model(call.p)
    collected.append(Counted(call.sched.name, pass_, call.p, ledger, model))


class _LoopOrderAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, schedule, causal, block_q, block_k, options, scale, window):
        collected = _collecting
        call = prepare_grad(q, k, v, None, schedule, block_q, block_k, causal, scale,
                            dict(options) if options else None, collected is not None, False,
                            window)
        saved = call.forward(q, k, v)
        _record(call, "forward", saved.counts, collected)
        ctx.call, ctx.saved, ctx.collected = call, saved, collected
        ctx.save_for_backward(q, k, v)
        return call.inputs.kind.finish(saved.out)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        dq, dk, dv, ledger = ctx.call.backward(ctx.saved, q, k, v, grad_out.contiguous())
        _record(ctx.call, "backward", ledger, ctx.collected)
        return dq, dk, dv, None, None, None, None, None, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, schedule: str = "q_outer",
              causal: bool = False, block_q: int = 64, block_k: int = 64,
              options: dict | None = None, scale: float | None = None,
              window: tuple = (-1, -1)) -> torch.Tensor:
    """softmax(scale q k^T) v in the loop order `schedule`, differentiable (the schedule's
    backward loop order computes the gradients; `options` may choose its variant, e.g.
    {"dq": "separate"}). `causal` (bottom-right aligned) and `window=(left, right)` as for
    `loop_orders.attention`. Arguments are checked as `loop_orders.attention_grad` checks
    them."""
    frozen = tuple(sorted(options.items())) if options else None
    return _LoopOrderAttention.apply(q, k, v, schedule, causal, block_q, block_k, frozen,
                                     scale, tuple(window))
