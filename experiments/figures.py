"""Regenerate every figure: run each experiment (resuming stored points), plot from its
results file, then rewrite the generated blocks of paper_notes.md.

    loop-orders figures [--quick]            # also: python -m experiments.figures
"""

from __future__ import annotations

import argparse
import sys
import time

from loop_orders.device import runtime

from . import common, explainer, gpu_figures, notes, theorem2, theorem5, traffic

EXPERIMENTS = [explainer, traffic, theorem2, theorem5, gpu_figures]


def regenerate(ctx: common.Context) -> list:
    written = []
    print(f"backend: {runtime.device_name()}; results -> {ctx.results_dir}; "
          f"figures -> {ctx.figures_dir}" + (" (quick)" if ctx.quick else ""))
    for module in EXPERIMENTS:
        t0 = time.perf_counter()
        module.run(ctx)
        paths = module.plot(ctx)
        written += paths
        print(f"{module.NAME}: {', '.join(str(p) for p in paths)} "
              f"({time.perf_counter() - t0:.1f} s)")
    written.append(notes.update(ctx))
    print(f"notes: {written[-1]}")
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="loop-orders figures",
                                     description=__doc__.split("\n\n")[0])
    common.add_options(parser)
    args = parser.parse_args(argv)
    try:  # a damaged results file raises ResultsError, a ValueError: one line, status 2
        regenerate(common.context_from_args(args))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
