"""The `loop-orders` command (also `python -m loop_orders`).

    loop-orders schedules [--loop-nest]
    loop-orders traffic --schedule kv_outer --n 6 --d 2 --block-q 2 --block-k 2 [--measure] [--json]
    loop-orders run --schedule q_outer --n 256 --d 64 [--causal] [--dtype float16]
    loop-orders figures [--quick] [--results-dir DIR] [--figures-dir DIR]

Bad input ends with one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, status 2 (argparse prints usage too otherwise)
        raise UsageError(f"{self.prog}: {message}")


class UsageError(Exception):
    pass


def _add_problem_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--schedule", required=True, help="registered schedule name")
    parser.add_argument("--n", type=int, required=True, help="sequence length N (queries = keys)")
    parser.add_argument("--d", type=int, required=True, help="head dim of q and k")
    parser.add_argument("--dv", type=int, default=None, help="head dim of v (default: d)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--block-q", type=int, default=64, help="Br, query rows per block")
    parser.add_argument("--block-k", type=int, default=64, help="Bc, keys per block")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--save-lse", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    parser.add_argument("--seed", type=int, default=None, help="input seed (default: fresh)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="loop-orders", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("schedules", help="list the registered schedules")
    p.add_argument("--loop-nest", action="store_true", help="print each loop nest too")

    p = sub.add_parser("traffic", help="HBM traffic of one schedule: model, and measured")
    _add_problem_args(p)
    p.add_argument("--measure", action="store_true",
                   help="also run the counted kernel (GPU if present, else the simulator)")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = sub.add_parser("run", help="run a schedule on random inputs and check it")
    _add_problem_args(p)
    p.add_argument("--repeat", type=int, default=3, help="timed launches (median reported)")

    p = sub.add_parser("figures", help="rerun the experiments (resuming) and redraw figures/")
    if _experiments_dir() is not None:
        _experiments().common.add_options(p)  # --quick, --results-dir, --figures-dir, ...
    return parser


def _experiments_dir():
    """experiments/ of the repository this package was installed from (editable install)."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    found = root / "experiments"
    return root if (found / "figures.py").is_file() else None


def _experiments():
    root = _experiments_dir()
    if root is None:
        raise ValueError("figures: experiments/ not found next to the loop_orders package; "
                         "run it from a clone of the repository installed with "
                         "`pip install -e .`")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    import experiments.common
    import experiments.figures

    return experiments


def cmd_figures(args) -> int:
    exp = _experiments()  # a damaged results file raises ResultsError, a ValueError: one line
    exp.figures.regenerate(exp.common.context_from_args(args))
    return 0


def _random_inputs(args, rng):
    dv = args.d if args.dv is None else args.dv
    shape = (args.batch, args.heads, args.n)
    q = rng.standard_normal((*shape, args.d)).astype(args.dtype)
    k = rng.standard_normal((*shape, args.d)).astype(args.dtype)
    v = rng.standard_normal((*shape, dv)).astype(args.dtype)
    return q, k, v


def _problem(args):
    from .api import make_problem

    return make_problem(args.schedule, n_q=args.n, d=args.d, dv=args.dv, batch=args.batch,
                        heads=args.heads, block_q=args.block_q, block_k=args.block_k,
                        causal=args.causal, save_lse=args.save_lse, dtype=args.dtype)


def cmd_schedules(args) -> int:
    from .schedule import all_schedules

    for sched in all_schedules():
        print(f"{sched.name:10s} {sched.summary}")
        if args.loop_nest:
            print("\n".join("    " + line for line in sched.loop_nest().splitlines()) + "\n")
    return 0


def cmd_traffic(args) -> int:
    from . import runtime
    from .api import attention
    from .schedule import get_schedule

    p = _problem(args)
    model = get_schedule(args.schedule).model(p)
    measured = None
    if args.measure:
        q, k, v = _random_inputs(args, np.random.default_rng(args.seed))
        measured = attention(q, k, v, schedule=args.schedule, block_q=p.block_q,
                             block_k=p.block_k, causal=p.causal, save_lse=p.save_lse,
                             count=True).counts
    if args.json:
        record = {"schedule": args.schedule, "n": p.n_q, "d": p.d, "dv": p.dv,
                  "batch": p.batch, "heads": p.heads, "block_q": p.block_q,
                  "block_k": p.block_k, "causal": p.causal, "save_lse": p.save_lse,
                  "model": model.to_dict()}
        if measured is not None:
            record["measured"] = measured.to_dict()
            record["backend"] = runtime.backend_name()
        print(json.dumps(record))
        return 0
    print(f"{args.schedule}: {p.describe()}")
    print(f"model (elements):\n{model}")
    print(f"model bytes: {model.bytes(p.itemsize):,}")
    if measured is not None:
        verdict = "equal to the model" if measured == model else "DIFFERS from the model"
        print(f"measured on {runtime.backend_name()} ({verdict}):\n{measured}")
        return 0 if measured == model else 1
    return 0


def cmd_run(args) -> int:
    from . import runtime
    from .api import attention
    from .reference import attention_reference, relative_error, tolerance
    from .schedule import get_schedule

    p = _problem(args)
    if args.repeat < 1:
        raise ValueError(f"repeat: got {args.repeat}, allowed repeat >= 1")
    q, k, v = _random_inputs(args, np.random.default_rng(args.seed))
    dq, dk, dv = (runtime.to_device(x) for x in (q, k, v))
    times, res = [], None
    for _ in range(args.repeat):
        res = attention(dq, dk, dv, schedule=args.schedule, block_q=p.block_q,
                        block_k=p.block_k, causal=p.causal)
        times.append(res.ms)
    out = runtime.to_host(res.out)
    ref, _ = attention_reference(q, k, v, causal=p.causal)
    err = relative_error(out, ref)
    tol = tolerance(p.dtype, get_schedule(args.schedule).output_roundings(p), v, ref)
    ok = err <= tol
    flops = 4 * p.bh * p.n_q * p.n_k * p.d // (2 if p.causal else 1)
    ms = float(np.median(times))
    print(f"{args.schedule} on {runtime.device_name()}: {p.describe()}")
    print(f"max relative error vs float64 reference: {err:.3e} "
          f"({'ok' if ok else 'FAILED'}, tolerance {tol:.1e})")
    print(f"time: {ms:.3f} ms median of {args.repeat} ({flops / ms / 1e9:.3f} TFLOP/s)")
    return 0 if ok else 1


COMMANDS = {"schedules": cmd_schedules, "traffic": cmd_traffic, "run": cmd_run,
            "figures": cmd_figures}


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return COMMANDS[args.command](args)
    except (UsageError, ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
