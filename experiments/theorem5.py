"""Theorem 5 scaling: the backward pass's HBM traffic vs SRAM budget M, sequence length N and
head dim d, for every backward order (and each value of its options).

Theorem 5 of the FlashAttention paper: the backward pass of standard attention makes
Theta(N d + N^2) HBM accesses, FlashAttention's Theta(N^2 d^2 / M). Each backward order sizes
its tiles from M (`tiles_for_sram`); the sweeps and fits are Theorem 2's
(experiments/theorem2.py, whose `Study` this runs for the backward pass); the measured points
are the counted backward kernels (`lo.attention_grad(..., count=True)`), checked against the
float64 gradients first. Writes results/theorem5.<backend>.json and
theorem5_slopes.<backend>.json; figure figures/theorem5.png.

    python -m experiments.theorem5 [--quick] [--results-dir DIR] [--figures-dir DIR]
"""

from __future__ import annotations

import sys

from . import common, theorem2

NAME = "theorem5"
BACKWARD = theorem2.Study("theorem5", "theorem5_slopes", True, "Theorem 5")


def run(ctx: common.Context):
    return theorem2.run(ctx, BACKWARD)


def plot(ctx: common.Context) -> list:
    return theorem2.plot(ctx, BACKWARD)


def main(argv=None) -> int:
    common.run_experiment(sys.modules[__name__], argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
