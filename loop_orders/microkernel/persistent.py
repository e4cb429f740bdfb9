"""Persistent CTAs: as many CTAs as SMs, each folding work items (query blocks of a batch x
head) in turn, drawing the next from a counter in HBM while it folds the one before, so that
the SMs finish together and a CTA's start and end (its barriers set up, its first tiles
waited for, its last written) are paid once an SM rather than once a block:

    w = blockIdx.x                                   # a CTA's first item: its index
    while w < items:
        fold item w (query block i of batch x head bh)
        w = gridDim.x + atomic_add(tickets, 1)       # the next: the counter's, past the grid's

q_outer's warp-specialised float32 kernel (`q_outer_ws_persistent`) and its Hopper kernel with a
TMA producer (`q_outer_tma_persistent`) run so.
"""

from __future__ import annotations

import math
from functools import cache
from typing import NamedTuple

import numpy as np
from numba import int32

from ..device.runtime import (
    SIMULATOR,
    cuda,
    current_stream,
    device_zeros,
    inlined,
    is_recording,
    multiprocessor_count,
)
from .tiles import grouped_block_device

# CTAs on the simulator: fewer than its tests' query blocks, so that CTAs fold several
SIMULATED_CTAS = 2


def persistent_grid(grid: tuple) -> tuple[int]:
    """The persistent kernel's grid for the work items of `grid` (a CTA per query block and
    batch x head): a CTA an SM (its buffer takes an SM's shared memory), fewer where items
    are fewer."""
    slots = SIMULATED_CTAS if SIMULATOR else multiprocessor_count()
    return (min(math.prod(grid), slots),)


_tickets: dict = {}


def tickets():
    """The work-item counter of persistent launches on the current stream (and device): one
    int32 in HBM, zero between launches. A launch's CTAs draw from it (the kernel's `publish`)
    and the last draw sets it back to zero; launches on one stream run in turn, and each
    stream has its own. While launches are recorded (`runtime.recording_launches`), a host
    stand-in."""
    if is_recording():
        return np.zeros(1, np.int32)  # typed as the counter is; never launched
    key = (0 if SIMULATOR else cuda.get_current_device().id, current_stream())
    held = _tickets.get(key)
    if held is None:
        held = _tickets[key] = device_zeros(1, np.int32)
    elif SIMULATOR:
        held[0] = 0  # a simulated launch can stop part-way (its budget) and the process go on
    return held


class Items(NamedTuple):
    """A persistent CTA's work items: the first by its index, the next from `tickets`."""

    item_of: object
    publish: object
    draw: object


@cache
def make_items(BR: int, CAUSAL: bool, GROUP_HEADS: int = 0) -> Items:
    """Work items as `tiles.block_grid` orders query blocks (its twin: `tiles.make_block_of`;
    GROUP_HEADS: a causal grid's heads that many at a time, `tiles.grouped_block`)."""
    @inlined
    def item_of(w, q):
        """Query block and batch x head of work item w (int32), or block -1 past the last
        item: heaviest first when causal (the last query blocks of every head, as
        `tiles.block_grid`, or of each group of heads), else each head's blocks in turn."""
        n_bh, n_blocks = int32(q.shape[0]), int32((q.shape[1] + BR - 1) // BR)
        if w >= n_bh * n_blocks:
            return int32(-1), int32(0)
        if CAUSAL and GROUP_HEADS:
            i, bh = grouped_block_device(w, n_blocks, n_bh, int32(GROUP_HEADS))
            return int32(i), int32(bh)
        if CAUSAL:
            return int32(n_blocks - 1 - w // n_bh), int32(w % n_bh)
        return int32(w % n_blocks), int32(w // n_blocks)

    @inlined
    def publish(drawn, tickets, q, next_item, slot):
        """The work item of the counter's value `drawn` into next_item[slot], next_item[slot +
        1] (block -1: none left): item gridDim.x + drawn. A CTA draws (raises the counter by
        one) once an item it folds, as many draws as items: the last sets the counter back to
        zero for the stream's next launch."""
        i, bh = draw_item(drawn, tickets, q)
        next_item[slot] = i
        next_item[slot + 1] = bh

    @inlined
    def draw_item(drawn, tickets, q):
        """The work item of the counter's value `drawn` (see publish), the counter set back to
        zero by the last draw."""
        if drawn == int32(q.shape[0] * ((q.shape[1] + BR - 1) // BR)) - 1:
            tickets[0] = 0
        return item_of(int32(drawn + int32(cuda.gridDim.x)), q)

    @inlined
    def draw(tickets, q):
        """This CTA's next work item: one draw from the counter (one thread calls it)."""
        return draw_item(cuda.atomic.add(tickets, 0, 1), tickets, q)

    return Items(item_of, publish, draw)
