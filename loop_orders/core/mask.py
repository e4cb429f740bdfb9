"""Which keys a query row sees: the one rule of the mask, for kernels, models, walks and the
reference alike.

Query row i of N_q sees key j of N_k iff

    diag_i - left <= j <= diag_i + right,      diag_i = i + N_k - N_q

(FlashAttention's `window_size = (left, right)`, bottom-right aligned as FlashAttention >= 2.1
aligns causal attention; -1 leaves a side unbounded). Causal is right = 0: query i sees keys
j <= i + N_k - N_q, which with N_q = N_k is j <= i. No mask is (-1, -1). A row's visible keys
are one interval [lo_i, hi_i) of [0, N_k), empty for rows that see no key (causal with
N_q > N_k: the first N_q - N_k rows); lo_i and hi_i never decrease with i, so the keys the
rows of a query block see are [lo of its first row, hi of its last row).

`key_span` is the rule itself, plain integer arithmetic with no dependency: the kernels jit it
as a device function (`microkernel.tiles.key_span_device`; `left` and `right` compile-time
constants, so an unbounded side compiles away) and the host calls it as it is. The block
ranges (`kv_block_range`, `q_block_range`) follow from it and are jitted the same way. A new
mask (varlen bounds, ...) changes this file: the kernels take their [first, end) from here.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

UNBOUNDED = -1


class Mask(NamedTuple):
    """A mask as the kernels compile it: how many keys before (`left`) and after (`right`) a
    row's diagonal key it sees, -1 for all. Hashable and printable, so it keys compiled
    kernels as the causal flag did."""

    left: int = UNBOUNDED
    right: int = UNBOUNDED

    @property
    def bounded(self) -> bool:
        """Whether some row may see fewer than all keys (anything but no mask)."""
        return self.left >= 0 or self.right >= 0

    def row_keys(self, row: int, n_q: int, n_k: int) -> tuple[int, int]:
        """[lo, hi) of the keys query `row` sees (hi <= lo: none)."""
        return key_span(row + n_k - n_q, 0, n_k, self.left, self.right)

    def visible(self, n_q: int, n_k: int) -> np.ndarray:
        """The (n_q, n_k) boolean matrix of visible (row, key) pairs (for the reference)."""
        keys = np.arange(n_k)
        out = np.zeros((n_q, n_k), dtype=bool)
        for r in range(n_q):
            lo, hi = self.row_keys(r, n_q, n_k)
            out[r] = (keys >= lo) & (keys < hi)
        return out

    def sees(self, rows: range, keys: range, n_q: int, n_k: int) -> bool:
        """Does any query in `rows` see any key in `keys`? Row by row (for walks)."""
        for r in rows:
            lo, hi = self.row_keys(r, n_q, n_k)
            if max(lo, keys[0]) < min(hi, keys[-1] + 1):
                return True
        return False


NO_MASK = Mask()


def check_window(window) -> tuple[int, int]:
    """`window` as a (left, right) pair of ints >= -1, or a ValueError naming it."""
    try:
        left, right = (int(w) for w in window)
        ok = all(int(w) == w and not isinstance(w, bool) for w in window)
    except (TypeError, ValueError):
        ok = False
    if not ok or left < UNBOUNDED or right < UNBOUNDED:
        raise ValueError(f"window: got {window!r}, allowed (left, right) with integers "
                         f">= -1 (-1: unbounded; (-1, -1): no window)")
    return left, right


def mask_of(causal: bool, window=(UNBOUNDED, UNBOUNDED)) -> Mask:
    """The Mask of a call: its window, with causal bounding the right side at 0 (as
    FlashAttention's causal sets window_size[1] = 0)."""
    left, right = window
    if causal:
        right = 0
    return Mask(left, right)


def key_span(diag, key0, n_keys, left, right):
    """[first, end) of the keys key0 .. key0 + n_keys - 1, counted from key0, that a query row
    whose diagonal key (row + N_k - N_q) is `diag` sees under the window (left, right); an
    empty span when end <= first. The mask's one rule (module docstring); the kernels' device
    twin is this same function, jitted."""
    first = 0
    end = n_keys
    if left >= 0:
        first = min(n_keys, max(0, diag - left - key0))
    if right >= 0:
        end = min(n_keys, max(0, diag + right + 1 - key0))
    return first, end


def kv_block_range(row0, n_rows, n_q, n_k, block_k, left, right):
    """[first, end) of the K/V blocks of block_k keys that the query rows row0 .. row0 +
    n_rows - 1 see (first == end: none): from the first row's lo to the last row's hi."""
    shift = n_k - n_q
    lo = key_span(row0 + shift, 0, n_k, left, right)[0]
    hi = key_span(row0 + n_rows - 1 + shift, 0, n_k, left, right)[1]
    first = lo // block_k
    end = (hi + block_k - 1) // block_k
    if hi <= lo:
        end = first
    return first, end


def q_block_range(key0, n_keys, n_q, n_k, block_q, left, right):
    """[first, end) of the query blocks of block_q rows that see some key of key0 .. key0 +
    n_keys - 1 (first == end: none): row r sees key j iff j - right <= r + N_k - N_q <=
    j + left, so the rows from key0 - right to key0 + n_keys - 1 + left (in diagonal terms)."""
    shift = n_k - n_q
    lo = 0
    hi = n_q
    if right >= 0:
        lo = min(n_q, max(0, key0 - right - shift))
    if left >= 0:
        hi = min(n_q, max(0, key0 + n_keys + left - shift))
    first = lo // block_q
    end = (hi + block_q - 1) // block_q
    if hi <= lo:
        end = first
    return first, end
