"""loop_orders: exact attention in different loop orders, with exact HBM traffic counts.

    import loop_orders as lo
    lo.schedule_names()                    # the registered loop orders
    res = lo.attention(q, k, v, schedule="q_outer", block_q=64, block_k=64, count=True)
    res.out, res.counts                    # output (same kind of array as q), measured Ledger
    lo.predict_traffic("kv_outer", n=1024, d=64, block_q=64, block_k=64)   # model Ledger
    lo.schedule_options(name)              # a schedule's options and their defaults
"""

from . import (
    runtime,  # noqa: F401  (chooses GPU or simulator before numba.cuda loads)
    schedules,  # noqa: F401  (registers every schedule)
)
from .api import Result, attention, make_problem, predict_traffic
from .ledger import TENSORS, Ledger
from .reference import attention_reference, online_row
from .schedule import (
    Problem,
    Schedule,
    all_schedules,
    get_schedule,
    register,
    schedule_names,
    schedule_options,
)

__all__ = [
    "TENSORS", "Ledger", "Problem", "Result", "Schedule", "all_schedules", "attention",
    "attention_reference", "get_schedule", "make_problem", "online_row", "predict_traffic",
    "register", "schedule_names", "schedule_options",
]
__version__ = "0.1.0"
