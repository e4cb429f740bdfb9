"""The `loop-orders` command (also `python -m loop_orders`).

    loop-orders schedules [--loop-nest]
    loop-orders traffic --schedule kv_outer --n 6 --d 2 --block-q 2 --block-k 2 [--measure] [--json]
    loop-orders run --schedule q_outer --n 64 --d 16 [--causal] [--dtype D] [--precision P]
    loop-orders figures [--quick] [--results-dir DIR] [--figures-dir DIR]
    loop-orders cache [--clear]
    loop-orders warm --schedules q_outer kv_outer --d 64 128 --dtypes float16 [--backward]

`--option key=value` (repeatable) sets a schedule option (`loop-orders schedules` lists them).
Bad input ends with one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from .core.schedule import PRECISIONS, SUPPORTED_DTYPES


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, status 2 (argparse prints usage too otherwise)
        raise UsageError(f"{self.prog}: {message}")


class UsageError(Exception):
    pass


def _option(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    return key.strip(), value.strip()


def _lengths(text: str) -> np.ndarray:
    """A --cu-seqlens value: comma-separated prefix sums, as int32."""
    try:
        return np.array([int(x) for x in text.split(",")], dtype=np.int32)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as "
                                         f"0,5,17, got {text!r}") from None


def _add_problem_args(parser: argparse.ArgumentParser, varlen: bool = False) -> None:
    parser.add_argument("--schedule", required=True, help="registered schedule name")
    parser.add_argument("--n", type=int, required=not varlen,
                        help="sequence length N (queries)" + (
                            "; not with --cu-seqlens-q" if varlen else ""))
    parser.add_argument("--n-k", type=int, default=None, help="keys (default: N)")
    parser.add_argument("--d", type=int, required=True, help="head dim of q and k")
    parser.add_argument("--dv", type=int, default=None, help="head dim of v (default: d)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--kv-heads", type=int, default=None,
                        help="K/V heads (grouped-query attention; default: --heads)")
    parser.add_argument("--pack-gqa", action="store_true",
                        help="grouped-query attention packed: a group's query rows as one "
                             "block (K/V read once per group)")
    parser.add_argument("--block-q", type=int, default=64, help="Br, query rows per block")
    parser.add_argument("--block-k", type=int, default=64, help="Bc, keys per block")
    parser.add_argument("--causal", action="store_true",
                        help="bottom-right aligned: query i sees keys j <= i + n_k - n")
    parser.add_argument("--window", type=int, nargs=2, metavar=("LEFT", "RIGHT"),
                        default=(-1, -1),
                        help="sliding window: query i sees keys i + n_k - n - LEFT .. "
                             "i + n_k - n + RIGHT (-1: unbounded; default -1 -1, none)")
    parser.add_argument("--save-lse", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=list(SUPPORTED_DTYPES),
                        help="input dtype (bfloat16 inputs are torch tensors: needs torch)")
    parser.add_argument("--precision", default="ieee", choices=list(PRECISIONS),
                        help="float32 inputs on TF32 tensor cores: tf32 (10 mantissa "
                        "bits an operand), tf32x3 (3xTF32, about float32's accuracy); "
                        "default ieee: exact FMA")
    parser.add_argument("--option", type=_option, action="append", default=[],
                        metavar="KEY=VALUE", help="a schedule option (repeatable)")
    parser.add_argument("--seed", type=int, default=None, help="input seed (default: fresh)")
    if varlen:
        for side in ("q", "k"):
            parser.add_argument(f"--cu-seqlens-{side}", type=_lengths, default=None,
                                metavar="0,N1,N1+N2,...",
                                help=f"a packed batch: prefix sums of the sequences' "
                                     f"{'queries' if side == 'q' else 'keys'} (varlen)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="loop-orders", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("schedules", help="list the registered schedules and their options")
    p.add_argument("--loop-nest", action="store_true", help="print each loop nest too")

    p = sub.add_parser("traffic", help="HBM traffic of one schedule: model, and measured")
    _add_problem_args(p, varlen=True)
    p.add_argument("--backward", action="store_true",
                   help="the backward pass alone (its schedule's backward loop order)")
    p.add_argument("--measure", action="store_true",
                   help="also run the counted kernel (GPU if present, else the simulator)")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = sub.add_parser("run", help="run a schedule on random inputs and check it")
    _add_problem_args(p)
    p.add_argument("--repeat", type=int, default=3, help="timed launches (median reported)")

    sub.add_parser("figures", add_help=False,
                       help="rerun the experiments (resuming) and redraw figures/ "
                            "(python -m experiments.figures; --help lists its options)")

    p = sub.add_parser("cache", help="where compiled kernels are kept; --clear empties it")
    p.add_argument("--clear", action="store_true", help="remove every compiled kernel")

    p = sub.add_parser("warm", help="compile a sweep's kernels ahead, in parallel, into the "
                                    "cache (every length of a shape uses the same kernels)")
    p.add_argument("--schedules", nargs="+", default=["q_outer"], metavar="NAME")
    p.add_argument("--d", type=int, nargs="+", default=[64], help="head dims of q and k")
    p.add_argument("--dv", type=int, default=None, help="head dim of v (default: d)")
    p.add_argument("--dtypes", nargs="+", default=["float16"], choices=list(SUPPORTED_DTYPES))
    p.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    p.add_argument("--block-q", type=int, default=None,
                   help="Br, query rows per block (default: as a call naming no tiles)")
    p.add_argument("--block-k", type=int, default=None,
                   help="Bc, keys per block (default: as a call naming no tiles)")
    p.add_argument("--n", type=int, default=1024,
                   help="a length the tiles fit (blocks are clamped to shorter ones)")
    p.add_argument("--backward", action="store_true",
                   help="a gradient call's kernels: its forward's (lse saved) and backward's")
    p.add_argument("--counted", action="store_true", help="the counted builds too")
    p.add_argument("--jobs", type=int, default=None, help="processes (default: CPUs, <= 16)")
    return parser


def _experiments_dir():
    """The repository this package was installed from (editable install), if it has
    experiments/ beside the package."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    return root if (root / "experiments" / "figures.py").is_file() else None


def cmd_figures(rest: list[str]) -> int:
    """`python -m experiments.figures` with the arguments given: the experiments import the
    package, never the reverse, so they run as a script of the repository."""
    import os
    import subprocess

    root = _experiments_dir()
    if root is None:
        raise ValueError("figures: experiments/ not found next to the loop_orders package; "
                         "run it from a clone of the repository installed with "
                         "`pip install -e .`")
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "experiments.figures", *rest],
                          env={**os.environ, "PYTHONPATH": path}).returncode


def _random_array(args, rng, shape, device: bool = False):
    """Unit normal entries in args.dtype: a NumPy array (on the device with `device`), or for
    bfloat16, which NumPy lacks, a torch tensor (on the GPU with `device` when there is one)."""
    from .device import runtime

    x = rng.standard_normal(shape).astype(np.float32)
    if args.dtype != "bfloat16":
        x = x.astype(args.dtype)
        return runtime.to_device(x) if device else x
    import torch

    t = torch.from_numpy(x).bfloat16()
    return t.cuda() if device and not runtime.SIMULATOR else t


def _random_inputs(args, rng, device: bool = False):
    dv = args.d if args.dv is None else args.dv
    n_k = args.n if args.n_k is None else args.n_k
    kv_heads = args.heads if args.kv_heads is None else args.kv_heads
    return tuple(_random_array(args, rng, (args.batch, heads, n, width), device)
                 for heads, n, width in ((args.heads, args.n, args.d), (kv_heads, n_k, args.d),
                                         (kv_heads, n_k, dv)))


def _host(x) -> np.ndarray:
    """Any array the CLI made or got back, as a NumPy array of its values (bfloat16 widened
    to float32)."""
    from .device import runtime

    if type(x).__module__.startswith("torch"):
        return x.detach().float().cpu().numpy()
    return runtime.to_host(x) if runtime.is_device_array(x) else np.asarray(x)


def _options(args) -> dict:
    return dict(args.option)


def _problem(args):
    from .api import make_problem

    return make_problem(args.schedule, n_q=args.n, n_k=args.n_k, d=args.d, dv=args.dv,
                        batch=args.batch, heads=args.heads, block_q=args.block_q,
                        block_k=args.block_k, causal=args.causal, save_lse=args.save_lse,
                        dtype=args.dtype, options=_options(args), precision=args.precision,
                        window=tuple(args.window), kv_heads=args.kv_heads,
                        pack_gqa=args.pack_gqa)


def _header(p, schedule: str, backward: bool = False) -> str:
    """p described with the options of the pass that runs (a forward pass leaves out the
    options only its backward reads, such as dq)."""
    from dataclasses import replace

    from .core.schedule import get_schedule

    own = get_schedule(schedule).OPTIONS
    return p.describe() if backward else replace(
        p, options=tuple((k, v) for k, v in p.options if k in own)).describe()


def cmd_schedules(args) -> int:
    from .core.schedule import all_schedules, get_backward

    for sched in all_schedules():
        print(f"{sched.name:10s} {sched.summary}")
        options = dict(sched.OPTIONS)
        if sched.BACKWARD:
            print(f"{'':10s} backward: {get_backward(sched.BACKWARD).summary}")
            options.update(get_backward(sched.BACKWARD).OPTIONS)
        for key, opt in options.items():
            scope = " (backward)" if opt.backward else ""
            print(f"{'':10s} --option {key}={opt.default}{scope}: {opt.help}; {opt.allowed}")
        if args.loop_nest:
            print("\n".join("    " + line for line in sched.loop_nest().splitlines()) + "\n")
    return 0


def _measure(args, p):
    """The counted kernels' ledger (forward, or the backward pass alone)."""
    from .api import attention

    q, k, v = _random_inputs(args, np.random.default_rng(args.seed))
    kwargs = {"schedule": args.schedule, "block_q": args.block_q, "block_k": args.block_k,
              "causal": args.causal, "window": tuple(args.window), "options": _options(args),
              "count": True, "pack_gqa": args.pack_gqa, "precision": p.precision}
    if args.backward:
        from .api_grad import attention_grad

        do = _random_array(args, np.random.default_rng(args.seed),
                           tuple(q.shape[:-1]) + (v.shape[-1],))
        return attention_grad(q, k, v, do, **kwargs).counts_backward
    return attention(q, k, v, save_lse=p.save_lse, **kwargs).counts


def _varlen_traffic(args) -> int:
    """`traffic` of a packed batch: the sum of its sequences' models, and measured."""
    from .api import attention, predict_traffic
    from .api_grad import attention_grad
    from .device import runtime

    if args.n is not None or args.n_k is not None or args.batch != 1:
        raise ValueError("n: with --cu-seqlens-q the lengths come from the prefix sums; "
                         "leave out --n, --n-k and --batch")
    if args.cu_seqlens_q is None or args.cu_seqlens_k is None:
        raise ValueError("cu_seqlens: give both --cu-seqlens-q and --cu-seqlens-k")
    cu = {"cu_seqlens_q": args.cu_seqlens_q, "cu_seqlens_k": args.cu_seqlens_k}
    kw = {"schedule": args.schedule, "block_q": args.block_q, "block_k": args.block_k,
          "causal": args.causal, "window": tuple(args.window), "options": _options(args),
          "pack_gqa": args.pack_gqa, "precision": args.precision, **cu}
    dv = args.d if args.dv is None else args.dv
    kv_heads = args.heads if args.kv_heads is None else args.kv_heads
    model = predict_traffic(n=None, d=args.d, dv=dv, heads=args.heads, kv_heads=kv_heads,
                            backward=args.backward, save_lse=args.save_lse or args.backward,
                            dtype=args.dtype, **kw)
    print(f"{'backward of ' if args.backward else ''}{args.schedule}: "
          f"{len(args.cu_seqlens_q) - 1} packed sequences, queries "
          f"{np.diff(args.cu_seqlens_q).tolist()}, keys {np.diff(args.cu_seqlens_k).tolist()}")
    print(f"model (elements, the sequences' sum):\n{model}")
    if not args.measure:
        return 0
    rng = np.random.default_rng(args.seed)
    total_q, total_k = int(args.cu_seqlens_q[-1]), int(args.cu_seqlens_k[-1])
    q, k, v, do = (_random_array(args, rng, shape) for shape in (
        (total_q, args.heads, args.d), (total_k, kv_heads, args.d), (total_k, kv_heads, dv),
        (total_q, args.heads, dv)))
    measured = (attention_grad(q, k, v, do, count=True, **kw).counts_backward if args.backward
                else attention(q, k, v, count=True, save_lse=args.save_lse, **kw).counts)
    verdict = "equal to the model" if measured == model else "DIFFERS from the model"
    print(f"measured on {runtime.backend_name()} ({verdict}):\n{measured}")
    return 0 if measured == model else 1


def cmd_traffic(args) -> int:
    from .api import backward_traffic
    from .core.schedule import backward_of, get_schedule
    from .device import runtime

    if args.cu_seqlens_q is not None or args.cu_seqlens_k is not None:
        return _varlen_traffic(args)
    if args.n is None:
        raise ValueError("n: --n is required (or --cu-seqlens-q and --cu-seqlens-k)")
    p = _problem(args)
    sched = get_schedule(args.schedule)
    model = backward_traffic(backward_of(sched), p) if args.backward else sched.model(p)
    measured = _measure(args, p) if args.measure else None
    if args.json:
        record = {"schedule": args.schedule, "n": p.n_q, "d": p.d, "dv": p.dv,
                  "batch": p.batch, "heads": p.heads, "block_q": p.block_q,
                  "block_k": p.block_k, "causal": p.causal, "save_lse": p.save_lse}
        if p.window != (-1, -1):
            record["window"] = list(p.window)
        if args.n_k is not None:
            record["n_k"] = p.n_k
        if p.group > 1 or args.pack_gqa:
            record["kv_heads"], record["pack_gqa"] = p.kv_heads, args.pack_gqa
        options = sched.resolved_options(p)
        if args.backward:
            own = backward_of(sched).OPTIONS
            options.update({k: v for k, v in p.options if k in own})
        if options:
            record["options"] = options
        if args.backward:
            record["backward"] = True
        record["model"] = model.to_dict()
        if measured is not None:
            record["measured"] = measured.to_dict()
            record["backend"] = runtime.backend_name()
        print(json.dumps(record))
        return 0
    what = "backward of " if args.backward else ""
    print(f"{what}{args.schedule}: {_header(p, args.schedule, args.backward)}")
    print(f"model (elements):\n{model}")
    print(f"model bytes: {model.bytes(p.itemsize):,}")
    if measured is not None:
        verdict = "equal to the model" if measured == model else "DIFFERS from the model"
        print(f"measured on {runtime.backend_name()} ({verdict}):\n{measured}")
        return 0 if measured == model else 1
    return 0


def cmd_run(args) -> int:
    from .api import attention
    from .core.schedule import get_schedule
    from .device import runtime
    from .reference import (
        attention_reference,
        relative_error,
        tf32_score_shift,
        tf32_tolerance,
        tolerance,
    )

    p = _problem(args)
    if args.repeat < 1:
        raise ValueError(f"repeat: got {args.repeat}, allowed repeat >= 1")
    dq, dk, dv = _random_inputs(args, np.random.default_rng(args.seed), device=True)
    q, k, v = (_host(x) for x in (dq, dk, dv))
    times, res = [], None
    for _ in range(args.repeat):
        res = attention(dq, dk, dv, schedule=args.schedule, block_q=args.block_q,
                        block_k=args.block_k, causal=args.causal, save_lse=p.save_lse,
                        options=_options(args), timed=True, precision=p.precision,
                        window=tuple(args.window), pack_gqa=args.pack_gqa)
        times.append(res.ms)
    out = _host(res.out)
    group = q.shape[1] // k.shape[1]  # grouped-query attention: K/V head h // group
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    ref, ref_lse = attention_reference(q, k, v, mask=p.mask)  # the problem's mask
    err = relative_error(out, ref)
    tc = p.precision != "ieee"  # float32 on TF32 tensor cores: their rounding's bound
    tol = (tf32_tolerance(q, k, v, ref, mask=p.mask, precision=p.precision) if tc else
           tolerance(p.dtype, get_schedule(args.schedule).output_roundings(p), v, ref))
    ok = err <= tol
    print(f"{args.schedule} on {runtime.device_name()}: {_header(p, args.schedule)}")
    for name, (asked, used) in (res.clamped or {}).items():
        print(f"{name}: {asked} is larger than the problem, clamped to {used}")
    print(f"max relative error vs float64 reference: {err:.3e} "
          f"({'ok' if ok else 'FAILED'}, tolerance {tol:.1e})")
    if p.save_lse:
        lse = _host(res.lse)
        seen = np.isfinite(ref_lse)  # -inf where a row sees no key: the kernel's must be too
        lse_err = float(np.abs(lse - ref_lse)[seen].max(initial=0.0))
        if not np.array_equal(lse[~seen], ref_lse[~seen]):
            lse_err = np.inf
        lse_tol = 1e-5 * max(1.0, float(np.abs(ref_lse[seen]).max(initial=0.0)))
        if tc:
            lse_tol += tf32_score_shift(q, k, mask=p.mask, precision=p.precision)
        lse_ok = lse_err <= lse_tol
        print(f"max |lse - reference|: {lse_err:.3e} ({'ok' if lse_ok else 'FAILED'})")
        ok = ok and lse_ok
    ms = float(np.median(times))
    if runtime.SIMULATOR:
        print(f"time: {ms:.1f} ms median of {args.repeat} on the simulator (no GPU timing)")
    else:
        flops = 2 * p.bh * int(p.mask.visible(p.n_q, p.n_k).sum()) * (p.d + p.dv)
        print(f"time: {ms:.3f} ms median of {args.repeat} ({flops / ms / 1e9:.3f} TFLOP/s)")
    return 0 if ok else 1


def cmd_cache(args) -> int:
    from .device import kernel_cache, runtime

    where = kernel_cache.cache_dir()
    if where is None:
        print("the kernel cache is off (LOOP_ORDERS_CACHE_DIR=off)")
        return 0
    if args.clear:
        print(f"removed {kernel_cache.clear()} compiled kernels from {where}")
        return 0
    found = kernel_cache.entries()
    size = sum(p.stat().st_size for p in found)
    print(f"{where}: {len(found)} compiled kernels, {size / 2**20:.1f} MiB "
          f"(loop-orders cache --clear empties it)")
    if runtime.SIMULATOR:
        print("this process runs the Numba CUDA simulator, which compiles nothing: it neither "
              "reads nor fills this cache (GPU processes do)")
    return 0


def cmd_warm(args) -> int:
    import os

    from .device import runtime
    from .sweeps import sweep_jobs
    from .warm import warm

    jobs = sweep_jobs(args.schedules, args.d, args.dtypes, n=args.n, dv=args.dv,
                      causal={"no": (False,), "yes": (True,), "both": (False, True)}[args.causal],
                      block_q=args.block_q, block_k=args.block_k,
                      counted=(False, True) if args.counted else (False,),
                      backward=args.backward)
    if runtime.SIMULATOR:
        print(f"{len(jobs)} calls checked; the simulator compiles nothing, so there is "
              f"nothing to warm (GPU processes fill the cache)")
        return 0
    warm(jobs, workers=args.jobs or min(16, os.cpu_count() or 1))
    return 0


COMMANDS = {"schedules": cmd_schedules, "traffic": cmd_traffic, "run": cmd_run,
            "cache": cmd_cache, "warm": cmd_warm}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["figures"]:  # its options are the experiments' own
            return cmd_figures(argv[1:])
        args = build_parser().parse_args(argv)
        return COMMANDS[args.command](args)
    except (UsageError, ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
