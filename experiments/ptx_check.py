"""Compile every kernel's GPU build to PTX and SASS on a machine without a GPU.

    NUMBA_ENABLE_CUDASIM=0 CUDA_HOME=/usr/local/cuda python -m experiments.ptx_check [--out F]

Needs the CUDA toolkit's libNVVM and ptxas (CUDA_HOME) and the nvidia-cuda-nvrtc wheel, but
no driver: Numba's compile_ptx builds the PTX, `ptxas -arch=sm_90a -v` reports registers,
spills and stack. Every registered schedule's forward and backward kernels are built for a
few problems (the benchmark's tiles at d = 64 and 128, tails, causal, 16-bit, counted and
not), so a typing or lowering error on the GPU path (the shuffle row max, inline PTX, atomics)
shows up before any device time is spent. The launches are recorded, not run
(`runtime.recording_launches`), with zero-pointer array views standing in for device arrays.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import types as pytypes
from pathlib import Path

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
os.environ["LOOP_ORDERS_DEVICE_LIMITS"] = "hopper"  # no device to ask
os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")

from numba.cuda import dispatcher

# Device functions ask the current device for its compute capability; there is none here.
dispatcher.get_current_device = lambda: pytypes.SimpleNamespace(compute_capability=(9, 0))

import loop_orders as lo  # noqa: E402
from experiments.bench_runtime import layout_in_effect  # noqa: E402
from experiments.gpu_common import input_kind, runs  # noqa: E402
from loop_orders.core.schedule import grad_variants  # noqa: E402
from loop_orders.device import runtime  # noqa: E402
from loop_orders.warm import recorded_launches as recorded  # noqa: E402

PROBLEMS = [  # (n, d, dv, block_q, block_k, causal, dtype)
    (4096, 64, 64, 128, 64, False, "float32"),
    (4096, 128, 128, 128, 64, True, "float32"),  # q_outer: the warp-specialised kernel, causal
    (1024, 128, 128, 128, 64, True, "float32"),  # ... on persistent CTAs (q_outer's PERSISTENT)
    (4096, 128, 128, 128, 64, False, "float32"),  # ... and without a mask
    (1000, 64, 64, 64, 64, True, "float16"),
    (4096, 64, 64, 128, 64, False, "float16"),
    (4096, 128, 128, 128, 64, True, "float16"),
    (4096, 128, 128, 128, 128, False, "float16"),  # q_outer on Hopper: the TMA producer on
    (1024, 128, 128, 128, 128, True, "float16"),  # persistent CTAs (causal: 8 heads a group),
    (16384, 128, 128, 128, 128, False, "float16"),  # ... on a CTA a block (HOPPER_PERSISTENT)
    (77, 40, 24, 48, 40, True, "float32"),
    (4096, 64, 64, 128, 64, False, "bfloat16"),
    (77, 40, 24, 48, 40, True, "bfloat16"),
    (77, 36, 20, 48, 40, True, "float16"),  # d, dv not multiples of 8: plain tile loads
    (4096, 64, 64, 128, 64, False, "tf32"),  # float32 inputs at precision tf32
    (4096, 128, 128, 128, 64, True, "tf32"),
    (77, 38, 20, 48, 40, True, "tf32"),
    (4096, 64, 64, 128, 64, False, "tf32x3"),  # float32 inputs at precision tf32x3 (3xTF32)
    (4096, 128, 128, 128, 64, True, "tf32x3"),
    (77, 38, 20, 48, 40, True, "tf32x3"),
]
GRAD_TILES = {64: (64, 64), 128: (64, 64), 40: (32, 32), 36: (32, 32), 38: (32, 32)}


def backward_variants(sched) -> list:
    """One options dict per example value of each of the backward's options."""
    return [v.options for v in grad_variants() if v.schedule == sched.BACKWARD]


def backward_launches(sched, p, count: bool) -> list:
    """The recorded launches of p's backward alone (a gradient call's forward comes first)."""
    return recorded(sched, p, count, True)[len(sched.kernels(p, count)):]


def ptxas(ptx: str, cubin: Path | None = None) -> dict:
    """Registers, stack and spills from `ptxas -arch=sm_90a -v` on ptx; the built cubin is
    kept at `cubin` when given (for a disassembler)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        proc = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(src), "-o",
                               str(cubin or Path(tmp) / "k.cubin")], capture_output=True,
                              text=True)
    text = proc.stdout + proc.stderr
    if proc.returncode:
        raise RuntimeError(text)
    found = {name: int(m.group(1)) if (m := re.search(pattern, text)) else 0 for name, pattern in
             (("registers", r"Used (\d+) registers"), ("stack", r"(\d+) bytes stack frame"),
              ("spill_stores", r"(\d+) bytes spill stores"),
              ("spill_loads", r"(\d+) bytes spill loads"))}
    return found


def kernel_ptx(kernel, args) -> str:
    """The PTX of kernel compiled for a launch's args (their types), for sm_90a (what Numba
    builds on a Hopper: its wgmma needs the arch-specific target)."""
    from numba import cuda

    sig = tuple(runtime._numba_type(a) for a in args)
    options = {k: v for k, v in kernel.targetoptions.items() if k == "launch_bounds"}
    ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0, "a"), **options)
    return ptx


def ptx_body(ptx: str) -> str:
    """The PTX with what a refactor may change and the kernel cannot see taken out: comments,
    debug lines, mangled names and shared arrays' numbers (`_cudapy_smem_N` counts the
    process's compilations), each replaced by its order of first appearance in the code, and
    the module's declarations before the first function sorted (their order follows what the
    process compiled before). Two builds of the same kernel from moved or renamed Python, in
    processes that compiled different kernels first, compare equal."""
    lines = [line.split("//", 1)[0].rstrip() for line in ptx.splitlines()]
    lines = [line for line in lines if line and not line.lstrip().startswith((".file", ".loc"))]
    start = next((i for i, line in enumerate(lines)
                  if re.search(r"\.(entry|func)\b", line)), len(lines))
    names: dict = {}

    def rename(line: str) -> str:
        return re.sub(r"_Z\w+|_cudapy_smem_\d+",
                      lambda m: names.setdefault(m.group(0), f"N{len(names)}"), line)

    body = [rename(line) for line in lines[start:]]
    header = sorted(rename(line) for line in lines[:start])
    return "\n".join(header + body) + "\n"


def check(kernel, args, dump: Path | None = None) -> dict:
    ptx = kernel_ptx(kernel, args)
    if dump is not None:
        dump.write_text(ptx_body(ptx))
        return {"ptx_lines": ptx.count("\n")}
    return {"ptx_lines": ptx.count("\n"), "atomics": ptx.count("atom."),
            "ld_shared_v4": ptx.count("ld.shared.v4"), **ptxas(ptx)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument("--schedules", help="comma-separated subset")
    parser.add_argument("--dump", type=Path, help="write each kernel's PTX body (names "
                        "normalised, launch shape first) into this folder, skip ptxas: "
                        "compare two commits' folders with diff -r")
    args = parser.parse_args(argv)
    names = args.schedules.split(",") if args.schedules else lo.schedule_names()
    rows, seen, failures = [], set(), 0
    for name in names:
        sched = lo.get_schedule(name)
        for n, d, dv, bq, bk, causal, dtype in PROBLEMS:
            if not runs(sched, dtype):
                continue
            for count in (False, True):
                sizes = {"n_q": n, "d": d, "dv": dv, "causal": causal, **input_kind(dtype),
                         "batch": 2, "heads": 4}
                p = lo.make_problem(name, block_q=bq, block_k=bk, **sizes)
                launches = recorded(sched, p, count, False)
                forward = len(launches)  # the launches after these are the backward's
                if sched.BACKWARD:
                    for opt in backward_variants(sched):
                        g = lo.make_problem(name, block_q=GRAD_TILES[d][0],
                                            block_k=GRAD_TILES[d][1], options=opt, **sizes)
                        launches += backward_launches(sched, g, count)
                for index, (kernel, *launch, launch_args) in enumerate(launches):
                    key = (kernel, runtime._args_key(launch_args))
                    if key in seen:
                        continue
                    seen.add(key)
                    row = {"schedule": name, "kernel": kernel.py_func.__name__, "n": n,
                           "d": d, "dv": dv, "causal": causal, "dtype": dtype,
                           "count": count, "shared_bytes": launch[-1],
                           **({"tiles": f"{bq}x{bk}", "build": layout_in_effect(sched, p)}
                              if index < forward else
                              {"tiles": "x".join(map(str, GRAD_TILES[d])), "build": ""})}
                    dump = None
                    if args.dump:
                        args.dump.mkdir(parents=True, exist_ok=True)
                        dump = args.dump / (f"{name}-{n}-{d}-{dv}-{int(causal)}-{dtype}-"
                                            f"{int(count)}-{index}.ptx")
                    try:
                        row.update(check(kernel, launch_args, dump))
                        if dump is not None:
                            dump.write_text(f"// launch {launch}\n" + dump.read_text())
                    except Exception as exc:  # report every failure, then fail
                        failures += 1
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if args.out:
        from loop_orders.results import atomic_write_json, provenance

        atomic_write_json(args.out, {"provenance": provenance(ptxas="sm_90a", cc="9.0"),
                                     "kernels": rows})
    print(f"ptx_check: {len(rows)} kernels, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
