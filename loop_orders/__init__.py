"""loop_orders: exact attention in different loop orders, with exact HBM traffic counts.

    import loop_orders as lo
    lo.schedule_names()                    # ['dense', 'kv_outer', 'q_outer']
    res = lo.attention(q, k, v, schedule="q_outer", block_q=64, block_k=64, count=True)
    res.out, res.counts                    # output, measured Ledger
    lo.predict_traffic("kv_outer", n=1024, d=64, block_q=64, block_k=64)   # model Ledger
"""

from . import (
    runtime,  # noqa: F401  (chooses GPU or simulator before numba.cuda loads)
    schedules,  # noqa: F401  (registers every schedule)
)
from .api import Result, attention, make_problem, predict_traffic
from .ledger import TENSORS, Ledger
from .reference import attention_reference, online_row
from .schedule import Problem, Schedule, all_schedules, get_schedule, register, schedule_names

__all__ = [
    "TENSORS", "Ledger", "Problem", "Result", "Schedule", "all_schedules", "attention",
    "attention_reference", "get_schedule", "make_problem", "online_row", "predict_traffic",
    "register", "schedule_names",
]
__version__ = "0.1.0"
