"""Ledger: how many elements of each tensor a schedule moves through HBM, per direction.

A read is an element loaded from global memory into the SM (shared memory or registers); a
write is an element stored to global memory. Counts are elements, summed over batch x heads.
The kernels fill a flat int64 counter array laid out by :func:`slot`; the traffic models build
the same :class:`Ledger` in closed form, so the two can be compared as exact integers.

The tensor set is open. The common tensors (`TENSORS`: q k v o s p l m lse) are always
listed; a schedule that keeps other data in HBM declares each tensor once with its element
type (`declare_tensor`, which `schedule.register` calls for a schedule's `TENSORS`), and the
counter slots, byte counts and JSON take it from then on. Element types: "input" (the dtype of
q, k, v) or "float32".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

TENSORS = ("q", "k", "v", "o", "s", "p", "l", "m", "lse")
DIRECTIONS = ("read", "write")
ELEMENT_TYPES = ("input", "float32")

# name -> element type, in declaration order (a tensor's counter slots follow that order, so
# the slots of a tensor never move once declared).
_DECLARED: dict[str, str] = {"q": "input", "k": "input", "v": "input", "o": "input",
                             "s": "float32", "p": "float32", "l": "float32", "m": "float32",
                             "lse": "float32"}
_SLOTS: dict[tuple[str, str], int] = {}


def _index_slots() -> None:
    _SLOTS.clear()
    for i, name in enumerate(_DECLARED):
        for j, direction in enumerate(DIRECTIONS):
            _SLOTS[name, direction] = len(DIRECTIONS) * i + j


_index_slots()


def declare_tensor(name: str, element: str) -> None:
    """Make `name` a tensor that ledgers and counters know, with elements of type `element`
    ("input": the dtype of q, k, v; "float32"). Declaring a known tensor again with the same
    type is a no-op; with another type it is an error."""
    if element not in ELEMENT_TYPES:
        raise ValueError(f"tensor {name!r}: element type must be one of {ELEMENT_TYPES}, "
                         f"got {element!r}")
    if not name.isidentifier():
        raise ValueError(f"tensor {name!r}: a tensor name must be an identifier")
    known = _DECLARED.get(name)
    if known is not None and known != element:
        raise ValueError(f"tensor {name!r} is already declared with elements of type {known!r}")
    if known is None:
        _DECLARED[name] = element
        _index_slots()


def declared_tensors() -> tuple[str, ...]:
    """Every tensor declared so far, common ones first."""
    return tuple(_DECLARED)


def n_slots() -> int:
    """Slots of the flat counter array: one per declared tensor and direction."""
    return len(DIRECTIONS) * len(_DECLARED)


def slot(tensor: str, direction: str) -> int:
    """Index of (tensor, direction) in a kernel's flat counter array."""
    try:
        return _SLOTS[tensor, direction]
    except KeyError:
        raise ValueError(f"unknown tensor or direction {(tensor, direction)}; tensors: "
                         f"{list(_DECLARED)}, directions: {list(DIRECTIONS)}") from None


def element_bytes(tensor: str, input_itemsize: int) -> int:
    """Bytes per element of `tensor` when q, k, v have `input_itemsize` bytes."""
    return 4 if _DECLARED[tensor] == "float32" else input_itemsize


@dataclass(frozen=True)
class Ledger:
    """Per-tensor read and write element counts (Python ints, never overflow).

    `counts` always holds the common tensors (TENSORS) and every other tensor it was given;
    a tensor it does not hold counts as zero, so two ledgers compare equal when every tensor
    moves the same number of elements in each direction.
    """

    counts: Mapping[str, Mapping[str, int]] = field(default_factory=dict)

    def __post_init__(self):
        unknown = set(self.counts) - set(_DECLARED)
        if unknown:
            raise ValueError(f"unknown tensor(s) {sorted(unknown)}; known: {list(_DECLARED)} "
                             f"(a schedule declares its own in its TENSORS)")
        names = [t for t in _DECLARED if t in TENSORS or t in self.counts]
        full = {t: {d: int(self.counts.get(t, {}).get(d, 0)) for d in DIRECTIONS} for t in names}
        object.__setattr__(self, "counts", full)

    @classmethod
    def from_array(cls, array, tensors: Iterable[str] = ()) -> Ledger:
        """Build from a kernel's flat counter array (see :func:`slot`). The ledger lists the
        common tensors, `tensors`, and any other tensor with a non-zero count."""
        flat = np.asarray(array, dtype=np.int64).reshape(-1)
        if flat.size != n_slots():
            raise ValueError(f"counter array has {flat.size} slots, expected {n_slots()}")
        keep = set(TENSORS) | set(tensors)
        return cls({t: {d: int(flat[slot(t, d)]) for d in DIRECTIONS} for t in _DECLARED
                    if t in keep or any(flat[slot(t, d)] for d in DIRECTIONS)})

    @classmethod
    def from_dict(cls, data: Mapping[str, Mapping[str, int]]) -> Ledger:
        return cls(data)

    @property
    def tensors(self) -> tuple[str, ...]:
        return tuple(self.counts)

    def _get(self, tensor: str, direction: str) -> int:
        held = self.counts.get(tensor)
        if held is None:
            if tensor not in _DECLARED:
                raise KeyError(f"unknown tensor {tensor!r}; known: {list(_DECLARED)}")
            return 0
        return held[direction]

    def read(self, tensor: str) -> int:
        return self._get(tensor, "read")

    def write(self, tensor: str) -> int:
        return self._get(tensor, "write")

    def tensor_total(self, tensor: str) -> int:
        return self.read(tensor) + self.write(tensor)

    @property
    def reads(self) -> int:
        return sum(c["read"] for c in self.counts.values())

    @property
    def writes(self) -> int:
        return sum(c["write"] for c in self.counts.values())

    @property
    def total(self) -> int:
        return self.reads + self.writes

    def bytes(self, input_itemsize: int = 4) -> int:
        """Total bytes moved when q, k, v have `input_itemsize` bytes per element."""
        return sum(self.tensor_total(t) * element_bytes(t, input_itemsize) for t in self.counts)

    def to_dict(self) -> dict[str, dict[str, int]]:
        return {t: dict(c) for t, c in self.counts.items()}

    def _combine(self, other: Ledger, sign: int) -> Ledger:
        names = [t for t in _DECLARED if t in self.counts or t in other.counts]
        return Ledger({t: {d: self._get(t, d) + sign * other._get(t, d) for d in DIRECTIONS}
                       for t in names})

    def __add__(self, other: Ledger) -> Ledger:
        return self._combine(other, 1)

    def __sub__(self, other: Ledger) -> Ledger:
        return self._combine(other, -1)

    def __eq__(self, other) -> bool:
        if not isinstance(other, Ledger):
            return NotImplemented
        names = set(self.counts) | set(other.counts)
        return all(self._get(t, d) == other._get(t, d) for t in names for d in DIRECTIONS)

    def __hash__(self) -> int:
        return hash(tuple(sorted((t, c["read"], c["write"]) for t, c in self.counts.items()
                                 if c["read"] or c["write"])))

    def scaled(self, factor: int) -> Ledger:
        return Ledger({t: {d: c[d] * factor for d in DIRECTIONS}
                       for t, c in self.counts.items()})

    def __str__(self) -> str:
        rows = [f"{'tensor':>8} {'read':>14} {'write':>14}"]
        rows += [f"{t:>8} {c['read']:>14,} {c['write']:>14,}"
                 for t, c in self.counts.items() if c["read"] or c["write"]]
        rows.append(f"{'total':>8} {self.reads:>14,} {self.writes:>14,}   = {self.total:,}")
        return "\n".join(rows)
