"""Ledger: how many elements of each tensor a schedule moves through HBM, per direction.

A read is an element loaded from global memory into the SM (shared memory or registers); a
write is an element stored to global memory. Counts are elements, summed over batch x heads.
The kernels fill a flat int64 counter array laid out by :func:`slot`; the traffic models build
the same :class:`Ledger` in closed form, so the two can be compared as exact integers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

TENSORS = ("q", "k", "v", "o", "s", "p", "l", "m", "lse")
DIRECTIONS = ("read", "write")
N_SLOTS = len(TENSORS) * len(DIRECTIONS)

# Tensors that are always kept in float32 (statistics and dense intermediates); q, k, v, o have
# the input dtype.
FLOAT32_TENSORS = frozenset({"s", "p", "l", "m", "lse"})


def slot(tensor: str, direction: str) -> int:
    """Index of (tensor, direction) in a kernel's flat counter array."""
    return 2 * TENSORS.index(tensor) + DIRECTIONS.index(direction)


def element_bytes(tensor: str, input_itemsize: int) -> int:
    """Bytes per element of `tensor` when q, k, v, o have `input_itemsize` bytes."""
    return 4 if tensor in FLOAT32_TENSORS else input_itemsize


@dataclass(frozen=True)
class Ledger:
    """Per-tensor read and write element counts (Python ints, never overflow)."""

    counts: Mapping[str, Mapping[str, int]] = field(default_factory=dict)

    def __post_init__(self):
        unknown = set(self.counts) - set(TENSORS)
        if unknown:
            raise ValueError(f"unknown tensor(s) {sorted(unknown)}; known: {list(TENSORS)}")
        full = {t: {d: int(self.counts.get(t, {}).get(d, 0)) for d in DIRECTIONS} for t in TENSORS}
        object.__setattr__(self, "counts", full)

    @classmethod
    def from_array(cls, array) -> Ledger:
        """Build from a kernel's flat counter array (see :func:`slot`)."""
        flat = np.asarray(array, dtype=np.int64).reshape(-1)
        if flat.size != N_SLOTS:
            raise ValueError(f"counter array has {flat.size} slots, expected {N_SLOTS}")
        return cls({t: {d: int(flat[slot(t, d)]) for d in DIRECTIONS} for t in TENSORS})

    @classmethod
    def from_dict(cls, data: Mapping[str, Mapping[str, int]]) -> Ledger:
        return cls(data)

    def read(self, tensor: str) -> int:
        return self.counts[tensor]["read"]

    def write(self, tensor: str) -> int:
        return self.counts[tensor]["write"]

    def tensor_total(self, tensor: str) -> int:
        return self.read(tensor) + self.write(tensor)

    @property
    def reads(self) -> int:
        return sum(self.read(t) for t in TENSORS)

    @property
    def writes(self) -> int:
        return sum(self.write(t) for t in TENSORS)

    @property
    def total(self) -> int:
        return self.reads + self.writes

    def bytes(self, input_itemsize: int = 4) -> int:
        """Total bytes moved when q, k, v, o have `input_itemsize` bytes per element."""
        return sum(self.tensor_total(t) * element_bytes(t, input_itemsize) for t in TENSORS)

    def to_dict(self) -> dict[str, dict[str, int]]:
        return {t: dict(self.counts[t]) for t in TENSORS}

    def __add__(self, other: Ledger) -> Ledger:
        return Ledger({t: {d: self.counts[t][d] + other.counts[t][d] for d in DIRECTIONS}
                       for t in TENSORS})

    def __sub__(self, other: Ledger) -> Ledger:
        return Ledger({t: {d: self.counts[t][d] - other.counts[t][d] for d in DIRECTIONS}
                       for t in TENSORS})

    def scaled(self, factor: int) -> Ledger:
        return Ledger({t: {d: self.counts[t][d] * factor for d in DIRECTIONS} for t in TENSORS})

    def __str__(self) -> str:
        rows = [f"{'tensor':>6} {'read':>14} {'write':>14}"]
        rows += [f"{t:>6} {self.read(t):>14,} {self.write(t):>14,}"
                 for t in TENSORS if self.tensor_total(t)]
        rows.append(f"{'total':>6} {self.reads:>14,} {self.writes:>14,}   = {self.total:,}")
        return "\n".join(rows)
