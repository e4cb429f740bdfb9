"""The tensor-core backward on a GPU: FlashAttention's error rule, then forward + backward
timed beside SDPA flash and cuDNN in the same process.

    python -m experiments.bench_backward_tc --out DIR     # DIR/backward_tensor_cores.gpu.json

Correctness first (FA_CASES, B=2, H=3, odd lengths and head dims 32 ... 256, float16 and
bfloat16, causal or not; each in its own process, so their kernels compile at once): for out,
dq, dk, dv, max|ours - ref| <= 2 max|pt - ref| with ref computed in float32 (upcast) and pt
plain PyTorch attention in the input dtype, gradients of out against a random g. Then
TIME_CASES at B=4, H=16, N=4096 through the torch op (what users call; its kernels compiled
beforehand at N=256 in the same pool), CUDA events, median of 10 after 3 warm-ups."""
import json
import multiprocessing as mp
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

FA_CASES = [  # (n, d, dtype, causal, dq)
    (113, 64, "float16", False, "atomic"), (203, 40, "bfloat16", True, "atomic"),
    (1023, 128, "float16", True, "atomic"), (256, 59, "bfloat16", False, "atomic"),
    (217, 96, "float16", True, "atomic"), (1024, 111, "bfloat16", True, "atomic"),
    (128, 32, "float16", False, "atomic"), (512, 80, "bfloat16", False, "atomic"),
    (113, 64, "bfloat16", True, "separate"), (1023, 128, "float16", False, "separate"),
    (203, 160, "float16", True, "atomic"), (256, 256, "bfloat16", False, "atomic"),
    (2048, 64, "float16", True, "atomic"), (1024, 128, "bfloat16", False, "atomic"),
    (113, 64, "float16", False, "kv_outer"), (203, 40, "bfloat16", True, "kv_outer"),
    (1023, 128, "float16", True, "kv_outer"),
]
TIME_SHAPE = (4, 16, 4096)  # B, H, N
TIME_CASES = [  # (d, dtype, causal, dq, block_q, block_k); dq "atomic1": one Q_i buffer
    (64, "float16", False, "atomic", 64, 64), (64, "float16", False, "atomic1", 64, 64),
    (64, "float16", False, "separate", 64, 64), (64, "float16", False, "atomic", 64, 128),
    (64, "float16", False, "separate", 64, 128), (64, "float16", True, "atomic", 64, 64),
    (64, "float16", True, "separate", 64, 128), (128, "float16", False, "atomic", 64, 64),
    (128, "float16", False, "separate", 64, 64), (128, "float16", True, "atomic", 64, 64),
    (128, "float16", True, "separate", 64, 64), (64, "bfloat16", False, "separate", 64, 128),
    (128, "bfloat16", True, "atomic", 64, 64), (64, "float16", False, "kv_outer", 64, 64),
]


def attn_math(q, k, v, causal, upcast):
    import torch
    dt = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    s = (q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2)
    if causal:
        n_q, n_k = s.shape[-2:]
        mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s.float(), dim=-1).to(v.dtype)
    return (p @ v).to(dt)


def fa_check(case):
    import torch

    import loop_orders.torch as lot
    n, d, dtype, causal, dq = case
    t0 = time.time()
    torch.manual_seed(n * 1000 + d)
    tdt = getattr(torch, dtype)
    b, h = 2, 3
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=tdt, requires_grad=True)
               for _ in range(3))
    g = torch.randn(b, h, n, d, device="cuda", dtype=tdt)
    row = {"n": n, "d": d, "dtype": dtype, "causal": causal, "dq": dq}
    try:
        sched, opts, _ = variant(dq)
        out = lot.attention(q, k, v, schedule=sched, causal=causal, options=opts)
        ours = [out, *torch.autograd.grad(out, (q, k, v), g)]
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        return row
    o_ref = attn_math(q, k, v, causal, True)
    ref = [o_ref, *torch.autograd.grad(o_ref, (q, k, v), g.float().to(o_ref.dtype))]
    o_pt = attn_math(q, k, v, causal, False)
    pt = [o_pt, *torch.autograd.grad(o_pt, (q, k, v), g)]
    for name, a, r, p in zip(("out", "dq", "dk", "dv"), ours, ref, pt, strict=True):
        err = (a.float() - r.float()).abs().max().item()
        base = (p.float() - r.float()).abs().max().item()
        row[name] = [err, base, err / base if base else float("inf")]
    row["pass"] = all(row[x][0] <= 2 * row[x][1] for x in ("out", "dq", "dk", "dv"))
    row["seconds"] = round(time.time() - t0, 1)
    return row


def warm_time_case(case):
    """Compile a timing case's kernels at a small N (into the kernel cache)."""
    import torch

    import loop_orders.torch as lot
    from loop_orders.microkernel import tuning

    d, dtype, causal, dq, bq, bk = case
    sched, opts, q_stages = variant(dq)
    tdt = getattr(torch, dtype)
    q, k, v = (torch.randn(1, 2, 256, d, device="cuda", dtype=tdt, requires_grad=True)
               for _ in range(3))
    try:
        with tuning.tuned(q_stages=q_stages):
            out = lot.attention(q, k, v, schedule=sched, causal=causal, block_q=bq,
                                block_k=bk, options=opts)
            out.sum().backward()
            torch.cuda.synchronize()
    except Exception as exc:  # reported in the results file
        return [case, f"{type(exc).__name__}: {str(exc)[:300]}"]
    return [case, "ok"]


def timed(fn, reps=10):
    import torch
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def variant(dq: str) -> tuple[str, dict, int | None]:
    """(schedule, options, Q_i/dO_i buffers) of a case's `dq` field: "atomic", "separate",
    "atomic1" (q_outer atomic on one buffer) or "kv_outer"."""
    if dq == "kv_outer":
        return "kv_outer", {}, None
    return "q_outer", {"dq": dq.replace("atomic1", "atomic")}, 1 if dq == "atomic1" else None


def time_case(case) -> dict:
    """One TIME_CASES row: ours (forward + backward, and forward alone) beside SDPA's."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import loop_orders.torch as lot
    from loop_orders.microkernel import tuning

    d, dtype, causal, dq, bq, bk = case
    sched, opts, q_stages = variant(dq)
    B, H, N = TIME_SHAPE  # noqa: N806 - the paper's names
    tuning.CURRENT = tuning.Tuning(None, None, q_stages)
    tdt = getattr(torch, dtype)
    q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=tdt, requires_grad=True)
               for _ in range(3))
    do = torch.randn(B, H, N, d, device="cuda", dtype=tdt)

    def ours():
        out = lot.attention(q, k, v, schedule=sched, causal=causal, block_q=bq, block_k=bk,
                            options=opts)
        out.backward(do)

    def ours_forward():
        with torch.no_grad():
            lot.attention(q, k, v, schedule=sched, causal=causal, block_q=bq, block_k=bk,
                          options=opts)

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                                       is_causal=causal)
            out.backward(do)
        return run

    row = {"d": d, "dtype": dtype, "causal": causal, "dq": dq, "block_q": bq, "block_k": bk,
           "B": B, "H": H, "N": N}
    for name, fn in (("ours_fwd_bwd", ours), ("ours_fwd", ours_forward),
                     ("sdpa_flash", sdpa(SDPBackend.FLASH_ATTENTION)),
                     ("sdpa_cudnn", sdpa(SDPBackend.CUDNN_ATTENTION))):
        try:
            row[name] = round(timed(fn), 4)
        except Exception as exc:  # a refusal is a row, not the end of the sweep
            row[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
    if isinstance(row["ours_fwd_bwd"], float) and isinstance(row["sdpa_flash"], float):
        row["vs_flash"] = round(row["sdpa_flash"] / row["ours_fwd_bwd"], 3)
        if isinstance(row["sdpa_cudnn"], float):
            row["vs_cudnn"] = round(row["sdpa_cudnn"] / row["ours_fwd_bwd"], 3)
    tuning.CURRENT = tuning.Tuning()
    return row


def time_all() -> list[dict]:
    import torch

    rows = []
    for case in TIME_CASES:
        rows.append(time_case(case))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    return rows


def main():
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results")
    parser.add_argument("--no-time", action="store_true", help="the error rule only")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    ctx = mp.get_context("spawn")
    fa, warm = [], []
    with ProcessPoolExecutor(max_workers=14, mp_context=ctx) as pool:
        futures = {pool.submit(fa_check, c): "fa" for c in FA_CASES}
        futures.update({pool.submit(warm_time_case, c): "warm" for c in TIME_CASES})
        for f in as_completed(futures):
            try:
                r = f.result()
            except Exception as exc:
                r = {"worker_error": str(exc)[:300]}
            (fa if futures[f] == "fa" else warm).append(r)
            print(futures[f], json.dumps(r), f"{time.time() - t0:.0f}s", flush=True)
    import torch

    from loop_orders.results import atomic_write_json, provenance

    rows = [] if args.no_time else time_all()
    atomic_write_json(os.path.join(args.out, "backward_tensor_cores.gpu.json"), {
        "provenance": provenance(torch=torch.__version__,
                                 device=torch.cuda.get_device_name()),
        "fa_rule": sorted(fa, key=lambda r: (r["dq"], r["dtype"], r["d"], r["n"])),
        "warm": warm, "timing": rows})
    print(f"bench_backward_tc: done in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
