"""Theorem 2 of FlashAttention, Proposition 3, the Saha–Ye lower bound, and power-law fits.

Sizes are in elements: N sequence length, d head dim, M the SRAM budget.

* Algorithm 1, line 1 sizes its blocks from M: Bc = ceil(M / 4d), Br = min(Bc, d)
  (`flash_block_sizes`; each schedule's own `tiles_for_sram` may choose differently).
* Theorem 2: standard attention makes Theta(N d + N^2) HBM accesses (`standard_traffic`),
  FlashAttention Theta(N^2 d^2 / M) (`flash_traffic`), for d <= M <= N d (`theorem2_range`).
* Proposition 3: no exact-attention algorithm makes o(N^2 d^2 / M) accesses for all M in
  [d, N d].
* Saha and Ye (2024), "The I/O complexity of attention, or how optimal is FlashAttention?":
  any algorithm needs Omega(min(N^2 d / sqrt(M), N^2 d^2 / M)) accesses
  (`saha_ye_lower_bound`). For M >= d^2 the second term is the smaller one, so FlashAttention
  is optimal there; for M < d^2 (`flash_optimal` is False) the bound is lower than FA's traffic.

The Theta(.) forms are returned without constants: experiments scale them to the data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def flash_block_sizes(m: int, d: int) -> tuple[int, int]:
    """(Br, Bc) of Algorithm 1, line 1: Bc = ceil(M / 4d), Br = min(ceil(M / 4d), d)."""
    if m < 1 or d < 1:
        raise ValueError(f"m, d: need M >= 1 and d >= 1, got M={m}, d={d}")
    bc = _ceil_div(m, 4 * d)
    return min(bc, d), bc


def theorem2_range(n: int, d: int) -> tuple[int, int]:
    """The SRAM sizes Theorem 2 covers: d <= M <= N d."""
    return d, n * d


def in_theorem2_range(n: int, d: int, m: int) -> bool:
    low, high = theorem2_range(n, d)
    return low <= m <= high


def standard_traffic(n, d):
    """Theorem 2, standard attention: Theta(N d + N^2)."""
    n, d = np.asarray(n, dtype=float), np.asarray(d, dtype=float)
    return n * d + n**2


def flash_traffic(n, d, m):
    """Theorem 2, FlashAttention: Theta(N^2 d^2 / M)."""
    n, d, m = (np.asarray(x, dtype=float) for x in (n, d, m))
    return n**2 * d**2 / m


def saha_ye_lower_bound(n, d, m):
    """Saha–Ye: Omega(min(N^2 d / sqrt(M), N^2 d^2 / M)) for any exact attention algorithm."""
    n, d, m = (np.asarray(x, dtype=float) for x in (n, d, m))
    return np.minimum(n**2 * d / np.sqrt(m), n**2 * d**2 / m)


def flash_optimal(d, m):
    """Where FlashAttention meets the Saha–Ye bound: M >= d^2."""
    return np.asarray(m) >= np.asarray(d) ** 2


@dataclass(frozen=True)
class PowerLawFit:
    """y ~ C x^slope fitted on log-log axes by least squares."""

    slope: float
    stderr: float
    intercept: float
    r_squared: float
    points: int

    def predict(self, x):
        return np.exp(self.intercept) * np.asarray(x, dtype=float) ** self.slope

    def to_dict(self) -> dict:
        return {"slope": self.slope, "stderr": self.stderr, "intercept": self.intercept,
                "r_squared": self.r_squared, "points": self.points}

    def __str__(self) -> str:
        return f"{self.slope:.3f} ± {self.stderr:.3f} ({self.points} points)"


def fit_power_law(x, y) -> PowerLawFit:
    """Least-squares slope of log y against log x (scipy.stats.linregress) and its std. error.

    Needs at least three points with x, y > 0 and x not all equal; with an exact power law the
    stderr is 0 (up to rounding).
    """
    from scipy.stats import linregress

    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"x, y: need two 1-d arrays of one length, got {x.shape}, {y.shape}")
    if len(x) < 3:
        raise ValueError(f"x: need at least 3 points to fit a slope with an error, got {len(x)}")
    if np.any(x <= 0) or np.any(y <= 0):
        raise ValueError("x, y: a log-log fit needs positive values")
    if np.ptp(np.log(x)) == 0:
        raise ValueError("x: all values are equal; no slope to fit")
    fit = linregress(np.log(x), np.log(y))
    stderr = float(fit.stderr) if math.isfinite(fit.stderr) else 0.0
    return PowerLawFit(float(fit.slope), stderr, float(fit.intercept), float(fit.rvalue**2),
                       len(x))
