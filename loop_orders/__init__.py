"""loop_orders: exact attention in different loop orders, with exact HBM traffic counts.

    import loop_orders as lo
    lo.schedule_names()                    # the registered loop orders
    res = lo.attention(q, k, v, schedule="q_outer", block_q=64, block_k=64, count=True)
    res.out, res.counts                    # output (same kind of array as q), measured Ledger
    lo.predict_traffic("kv_outer", n=1024, d=64, block_q=64, block_k=64)   # model Ledger
    lo.schedule_options(name)              # a schedule's options and their defaults
    g = lo.attention_grad(q, k, v, do, schedule="q_outer", count=True)  # + the backward
    g.dq, g.dk, g.dv, g.counts_backward
"""

from .device import runtime  # noqa: F401  (chooses GPU or simulator before numba loads)

# isort: split
from . import (
    schedules,  # noqa: F401  (registers every schedule, forward and backward)
    varlen,  # noqa: F401  (lo.attention's cu_seqlens: puts itself in api.VARLEN)
)
from .api import Result, attention, make_problem, predict_traffic
from .api_grad import GradResult, attention_grad
from .core.ledger import TENSORS, Ledger
from .core.schedule import (
    Problem,
    Schedule,
    all_schedules,
    backward_schedule_names,
    get_schedule,
    register,
    schedule_names,
    schedule_options,
)
from .reference import attention_reference, online_row

__all__ = [
    "TENSORS", "GradResult", "Ledger", "Problem", "Result", "Schedule", "all_schedules",
    "attention", "attention_grad", "attention_reference", "backward_schedule_names",
    "get_schedule", "make_problem", "online_row", "predict_traffic", "register",
    "schedule_names", "schedule_options",
]
__version__ = "0.1.0"
