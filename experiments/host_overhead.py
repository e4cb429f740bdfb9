"""Host time of a call and of a first call: what a user's loop pays beside the kernels.

    python -m experiments.host_overhead [--out DIR]          # on a GPU (torch there)

1. Per-call host time of `lo.attention` at a tiny shape (B = H = 1, N = 64, d = 64, q_outer)
   for every kind of array (NumPy in and out, Numba device arrays, torch CUDA tensors, CuPy
   arrays when CuPy is there), beside torch SDPA's on the same tensors: the wall time of
   CALLS calls in a row over CALLS (the GPU finishes each tiny kernel before the host has
   the next one ready, so this is the host's time). The torch op too (loop_orders.torch:
   forward, forward + backward, a CUDA graph's replay), each beside SDPA's same call.
2. At N = 1024 (B = 4, H = 16, d = 64), without a mask and causal: the kernel alone, the
   public call on torch tensors and torch SDPA (efficient), each timed back to back between
   CUDA events.
3. Cold start and compiled kernels on disk: `import loop_orders` alone in a fresh process;
   a fresh process's imports (torch, then loop_orders) and first float16 forward + backward
   through the torch op at a shape no process has seen (it compiles), then another fresh
   process's first call at that shape (it loads from the cache), the first call again with
   its kernels compiled one after another (LOOP_ORDERS_COMPILE_AHEAD=0: no
   `warm.compile_ahead`), two processes filling an empty cache at once (both right, the
   entries whole), and a fresh process's cold start taken apart (`COLD_PARTS`).
4. With --profile, cProfile of the tiny calls' host paths (host_profile.txt).

Writes host_overhead.json with provenance.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CALLS, WARMUP = 2000, 50
FIRST_CALL = """
import json, sys, time
t0 = time.perf_counter()
import numpy as np, torch
t1 = time.perf_counter()
import loop_orders as lo
import loop_orders.torch as lot
t2 = time.perf_counter()
q, k, v = (torch.randn(2, 4, 512, 64, device="cuda", dtype=torch.float16, requires_grad=True)
           for _ in range(3))
torch.cuda.synchronize()
t3 = time.perf_counter()
out = lot.attention(q, k, v, schedule="q_outer", causal=True)
torch.cuda.synchronize()
t4 = time.perf_counter()
out.float().sum().backward()
torch.cuda.synchronize()
t5 = time.perf_counter()
ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
print(json.dumps({"import_torch_s": t1 - t0, "import_s": t2 - t1, "first_forward_s": t4 - t3,
                  "first_call_s": t5 - t3, "max_abs_error": float((out - ref).abs().max())}))
"""
# A fresh process's cold start taken apart: its imports, the CUDA context, then each kernel
# build of the first call's forward + backward compiled one after another (Numba's typing,
# lowering and NVVM), linked into a cubin (the driver's JIT, in this process's context) and
# written to the disk cache; then the longest build compiled by a `warm.compile_ahead`
# worker process (with no CUDA context) and its entry loaded and linked here.
COLD_PARTS = """
import json, time
t = [time.perf_counter()]
import loop_orders
from loop_orders.core.schedule import get_schedule
from loop_orders.device import kernel_cache, runtime
from loop_orders.sweeps import call_problem
from loop_orders.warm import recorded_launches
t.append(time.perf_counter())
from numba import cuda
cuda.current_context()
t.append(time.perf_counter())
parts = {"import_s": t[1] - t[0], "cuda_context_s": t[2] - t[1], "builds": []}
sched = get_schedule("q_outer")
# the first call's gradient problem, each pass on the tiles it chooses (no tiles named)
p = call_problem(sched, 512, 64, 64, "float16", True, None, None, False, True)
seen = set()
for kernel, _, _, shared, args in recorded_launches(sched, p, False, True):
    key = runtime.build_key(kernel, args)
    if key in seen:
        continue
    seen.add(key)
    t0 = time.perf_counter()
    compiled = kernel.compile(key[1])
    t1 = time.perf_counter()
    compiled._codelibrary.get_cufunc()
    t2 = time.perf_counter()
    kernel_cache.store(runtime._FACTORY_KEYS[kernel], key[1], compiled)
    t3 = time.perf_counter()
    parts["builds"].append({"kernel": kernel.py_func.__name__, "compile_s": t1 - t0,
                            "link_s": t2 - t1, "store_s": t3 - t2})
# the longest build again, as `warm.compile_ahead` hands it to a worker process (no CUDA
# context there), into an empty cache; then its entry loaded and linked here
import os, pickle, subprocess, sys, tempfile
from loop_orders import warm
longest = max(parts["builds"], key=lambda b: b["compile_s"])["kernel"]
kernel, sig = next(key for key in seen if key[0].py_func.__name__ == longest)
made_by = runtime.factory_key(kernel)
with tempfile.TemporaryDirectory() as tmp:
    os.environ["LOOP_ORDERS_CACHE_DIR"] = tmp
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", warm._WORKER], input=pickle.dumps(
        warm._for_workers([(made_by, sig)])[0]), capture_output=True)
    t1 = time.perf_counter()
    loaded = kernel_cache.load(made_by, sig)
    t2 = time.perf_counter()
parts["worker"] = {"kernel": longest, "exit": proc.returncode, "worker_s": t1 - t0,
                   "load_and_link_s": t2 - t1, "loaded": loaded is not None,
                   "stderr": proc.stderr.decode()[-500:]}
print(json.dumps(parts))
"""
IMPORT_ALONE = "import time; t = time.perf_counter(); import loop_orders; " \
    "print(time.perf_counter() - t)"


def per_call_us(fn, calls=CALLS) -> float:
    import torch

    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def tiny_calls() -> dict:
    import torch

    import loop_orders as lo
    from loop_orders.device import runtime

    rng = np.random.default_rng(0)
    host = [rng.standard_normal((1, 1, 64, 64), dtype=np.float32) for _ in range(3)]
    tq, tk, tv = (torch.from_numpy(x).cuda() for x in host)
    nq, nk, nv = (runtime.to_device(x) for x in host)
    want = lo.attention(*host).out
    kinds = {"numpy": host, "numba": (nq, nk, nv), "torch": (tq, tk, tv)}
    try:
        import cupy

        kinds["cupy"] = tuple(cupy.asarray(x) for x in host)
    except ImportError:
        pass
    out = {}
    for kind, args in kinds.items():
        got = lo.attention(*args).out
        got = got.cpu().numpy() if kind == "torch" else got if kind == "numpy" else (
            got.copy_to_host() if kind == "numba" else cupy.asnumpy(got))
        assert np.array_equal(got, want), kind
        out[f"lo.attention {kind}"] = per_call_us(lambda a=args: lo.attention(*a))
    out["torch sdpa"] = per_call_us(
        lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv))
    return {**out, **torch_op_calls(tq, tk, tv)}


def torch_op_calls(q, k, v) -> dict:
    """The torch op's host time per call at the tiny shape: forward (no autograd), forward and
    backward, and a CUDA graph's replay of the forward, each beside SDPA's same call."""
    from torch.nn import functional

    import loop_orders.torch as lot

    sdpa = functional.scaled_dot_product_attention
    out = {"loop_orders.torch.attention": per_call_us(lambda: lot.attention(q, k, v)),
           "torch sdpa (again)": per_call_us(lambda: sdpa(q, k, v))}
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out["loop_orders.torch.attention forward+backward"] = per_call_us(
        lambda: lot.attention(*leaves).sum().backward(), calls=CALLS // 4)
    out["torch sdpa forward+backward"] = per_call_us(
        lambda: functional.scaled_dot_product_attention(*leaves).sum().backward(), calls=CALLS // 4)
    for name, fn in (("loop_orders.torch.attention", lambda: lot.attention(q, k, v)),
                     ("torch sdpa", lambda: functional.scaled_dot_product_attention(q, k, v))):
        graph = _captured(fn)
        out[f"{name} cuda graph replay"] = per_call_us(graph.replay)
    return out


def _captured(fn):
    """A CUDA graph of fn (warmed up on a side stream first, as torch's docs ask)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def n1024(causal: bool) -> dict:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import loop_orders as lo
    from experiments.bench_runtime import time_launches
    from loop_orders.device.arrays import KINDS

    q, k, v = (torch.randn(4, 16, 1024, 64, device="cuda") for _ in range(3))
    sched = lo.get_schedule("q_outer")
    p = lo.make_problem("q_outer", n_q=1024, d=64, batch=4, heads=16, block_q=128,
                        block_k=64, causal=causal)
    views = [KINDS["torch"].view(x).reshape(64, 1024, 64) for x in (q, k, v)]
    out = torch.empty_like(q)
    out_v = KINDS["torch"].view(out).reshape(64, 1024, 64)
    from loop_orders.device import runtime

    lse, counts = runtime.device_empty((1, 1), np.float32), runtime.device_empty(1, np.int64)

    def kernel(_i):
        sched.launch(p, *views, out_v, lse, counts, scale=0.125, count=False)

    def public(_i):
        lo.attention(q, k, v, schedule="q_outer", block_q=128, block_k=64, causal=causal)

    def sdpa(_i):
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return {name: time_launches(fn) for name, fn in
            (("q_outer kernel", kernel), ("q_outer lo.attention", public),
             ("torch sdpa efficient", sdpa))}


def fresh_process(cache: Path, **env_vars) -> dict:
    env = {**os.environ, "LOOP_ORDERS_CACHE_DIR": str(cache), **env_vars}
    proc = subprocess.run([sys.executable, "-c", FIRST_CALL], env=env, capture_output=True,
                          text=True, timeout=300)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def profile(path: Path, limit: int = 35) -> None:
    """cProfile of the host paths of `tiny_calls` (lo.attention, the torch op's forward and
    forward + backward on torch CUDA tensors), each's top `limit` functions by own time,
    written to `path`: where a call's host time goes."""
    import cProfile
    import io
    import pstats

    import torch

    import loop_orders as lo
    import loop_orders.torch as lot

    q, k, v = (torch.randn(1, 1, 64, 64, device="cuda") for _ in range(3))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    text = io.StringIO()
    for name, fn in (("lo.attention", lambda: lo.attention(q, k, v)),
                     ("loop_orders.torch.attention", lambda: lot.attention(q, k, v)),
                     ("forward+backward", lambda: lot.attention(*leaves).sum().backward())):
        for _ in range(WARMUP):
            fn()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(CALLS // 4):
            fn()
        torch.cuda.synchronize()
        prof.disable()
        text.write(f"=== {name}: {CALLS // 4} calls\n")
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(limit)
    path.write_text(text.getvalue())


def cold_parts(cache: Path) -> dict:
    """`COLD_PARTS` run in a fresh process with an empty cache at `cache`."""
    env = {**os.environ, "LOOP_ORDERS_CACHE_DIR": str(cache)}
    proc = subprocess.run([sys.executable, "-c", COLD_PARTS], env=env, capture_output=True,
                          text=True, timeout=300)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compile_cache() -> dict:
    from loop_orders.device import kernel_cache

    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "kernels"
        first = fresh_process(cache)
        entries = len(list(cache.glob("*.pkl")))
        second = fresh_process(cache)
        # the same first call compiling its kernels one after another, as its passes reach them
        serial = fresh_process(Path(tmp) / "serial", LOOP_ORDERS_COMPILE_AHEAD="0")
        racing = Path(tmp) / "racing"
        env = {**os.environ, "LOOP_ORDERS_CACHE_DIR": str(racing)}
        procs = [subprocess.Popen([sys.executable, "-c", FIRST_CALL], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(2)]
        raced = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1])
                 for p in procs]
        after = fresh_process(racing)
        parts = cold_parts(Path(tmp) / "parts")
    alone = [float(subprocess.run([sys.executable, "-c", IMPORT_ALONE], capture_output=True,
                                  text=True, check=True).stdout) for _ in range(3)]
    return {"first_process": first, "second_process": second, "entries": entries,
            "first_process_compiling_serially": serial,
            "racing_processes": raced, "after_the_race": after, "cold_parts": parts,
            "import_loop_orders_alone_s": alone, "where": str(kernel_cache.cache_dir())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--profile", action="store_true", help="also write "
                        "host_profile.txt: cProfile of the tiny calls' host paths")
    args = parser.parse_args(argv)
    from loop_orders.device import runtime
    from loop_orders.results import atomic_write_json, provenance

    if runtime.SIMULATOR:
        print("host_overhead: no CUDA GPU here; nothing measured")
        return 0
    import torch

    result = {"provenance": provenance(torch=torch.__version__),
              "tiny_per_call_us": tiny_calls(), "n1024_ms": n1024(False),
              "n1024_causal_ms": n1024(True),
              "compile_cache": compile_cache(), "calls": CALLS}
    args.out.mkdir(parents=True, exist_ok=True)
    if args.profile:
        profile(args.out / "host_profile.txt")
    atomic_write_json(args.out / "host_overhead.json", result)
    print(json.dumps({k: v for k, v in result.items() if k != "provenance"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
