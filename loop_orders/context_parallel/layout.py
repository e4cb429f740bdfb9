"""How the sequence is spread over P devices, and the checks made before any transfer.

Every context-parallel schedule takes and returns its tensors sharded along the sequence
(axis -2 of a (batch, heads, n, d) tensor), in one of two layouts:

    contiguous (causal=False): device r holds rows [r N/P, (r + 1) N/P)
    zig-zag    (causal=True):  the sequence is cut into 2P chunks of C = N / (2P) rows;
                               device r holds chunks r and 2P - 1 - r, in that order

Under the causal mask query chunk c needs key chunks 0 .. c (the last one half, on and below
the diagonal), so a contiguous shard would give device r work r + 1 chunk pairs: device P-1
would do P times device 0's. In the zig-zag layout device r holds one early and one late
chunk and does (r + 1) + (2P - r) = 2P + 1 half-pairs, the same on every device. Device r's
rows stay in increasing global order, so its own chunks under the causal mask are exactly a
causal call on its 2C local rows against its 2C local keys (the kernels' mask is top-left
aligned and the two chunks are equally long).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..api import _check_bool, _check_int  # the single-device API's checks and messages

# The schedules, in the order the registry lists them (`loop_orders.context_parallel`).
SCHEDULES = ("ring", "allgather_kv", "ulysses")
# Bytes of one element of the tensors that travel: the inputs' dtype, lse's float32.
LSE_BYTES = 4
ITEMSIZES = (2, 4)


@dataclass(frozen=True)
class CPProblem:
    """One context-parallel attention call: the global sizes and the device count P."""

    schedule: str
    world: int  # P, the devices sharing the sequence
    n: int  # N, the global sequence length (queries = keys)
    d: int
    dv: int
    batch: int
    heads: int
    itemsize: int  # bytes of an element of q, k, v and O
    causal: bool
    save_lse: bool

    @property
    def zigzag(self) -> bool:
        """Causal calls use the zig-zag layout (load balance); the others contiguous."""
        return self.causal

    @property
    def n_local(self) -> int:
        """Rows of the sequence each device holds: N / P."""
        return self.n // self.world

    @property
    def chunk(self) -> int:
        """Rows of one chunk: C = N / (2P) in the zig-zag layout, else N / P."""
        return self.n // (2 * self.world) if self.zigzag else self.n_local

    def chunks(self, rank: int) -> tuple[int, ...]:
        """The global chunks device `rank` holds, in local order."""
        return (rank, 2 * self.world - 1 - rank) if self.zigzag else (rank,)

    @property
    def heads_local(self) -> int:
        """Heads per device after Ulysses' all-to-all: H / P."""
        return self.heads // self.world

    @property
    def bh(self) -> int:
        return self.batch * self.heads


def make_problem(schedule: str, world: int, n: int, d: int, dv: int | None = None,
                 batch: int = 1, heads: int = 1, itemsize: int = 4, causal: bool = False,
                 save_lse: bool = False) -> CPProblem:
    """Check the global sizes for `schedule` over `world` devices (ValueError or TypeError
    naming the argument and what it needs) and return the CPProblem."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: unknown context-parallel schedule {schedule!r}; known: "
                         f"{', '.join(SCHEDULES)}")
    world = _check_int("world", world, 1)
    n = _check_int("n", n, 1)
    dv = d if dv is None else dv
    if itemsize not in ITEMSIZES:
        raise ValueError(f"itemsize: bytes per element must be one of {ITEMSIZES}, "
                         f"got {itemsize!r}")
    p = CPProblem(schedule=schedule, world=world, n=n, d=_check_int("d", d, 1),
                  dv=_check_int("dv", dv, 1), batch=_check_int("batch", batch, 1),
                  heads=_check_int("heads", heads, 1), itemsize=itemsize,
                  causal=_check_bool("causal", causal),
                  save_lse=_check_bool("save_lse", save_lse))
    parts = 2 * world if p.zigzag else world
    if n % parts:
        why = (f"causal (zig-zag layout) cuts it into 2P = {parts} chunks" if p.zigzag else
               f"it is cut into P = {parts} shards")
        raise ValueError(f"n: N = {n} must be divisible by {parts}: {why}")
    if schedule == "ulysses" and p.heads % world:
        raise ValueError(f"heads: ulysses shards the heads over the devices, so P = {world} "
                         f"must divide heads = {p.heads}")
    return p


def rows_of(p: CPProblem, rank: int) -> np.ndarray:
    """Global rows of the sequence device `rank` holds, in local order."""
    return np.concatenate([np.arange(c * p.chunk, (c + 1) * p.chunk) for c in p.chunks(rank)])


def _take_rows(x, rows: np.ndarray):
    """x[..., rows, :] for a NumPy array or a torch tensor (on its device)."""
    if isinstance(x, np.ndarray):
        return x[..., rows, :]
    import torch

    return x.index_select(-2, torch.as_tensor(rows, device=x.device))


def _sizes(world: int, n: int, causal: bool) -> CPProblem:
    """The layout's CPProblem for `world` devices and N = n (head sizes do not matter)."""
    return make_problem("ring", world, n, 1, causal=causal)


def shard(x, rank: int, world: int, causal: bool = False):
    """Device `rank`'s rows of a global (..., N, d) NumPy array or torch tensor, in the
    layout its schedules use (contiguous, or zig-zag when `causal`)."""
    p = _sizes(world, x.shape[-2], causal)
    if not 0 <= rank < world:
        raise ValueError(f"rank: got {rank}, allowed 0 <= rank < world = {world}")
    return _take_rows(x, rows_of(p, rank))


def unshard(shards, causal: bool = False):
    """The global (..., N, d) array from every device's shard, in rank order (`shard`'s
    inverse); NumPy arrays or torch tensors."""
    shards = list(shards)
    if isinstance(shards[0], np.ndarray):
        joined = np.concatenate(shards, axis=-2)
    else:
        import torch

        joined = torch.cat(shards, dim=-2)
    if not causal:
        return joined  # contiguous: rank order is the global order
    p = _sizes(len(shards), joined.shape[-2], causal)
    order = np.argsort(np.concatenate([rows_of(p, r) for r in range(p.world)]))
    return _take_rows(joined, order)
