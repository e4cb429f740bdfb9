"""Sliding-window attention on a GPU: time and traffic against the window, beside SDPA.

    python -m experiments.bench_window [--out DIR] [--quick]       # on a GPU, torch there
    python -m experiments.bench_window --plot results/bench_window.csv [--figures-dir DIR]

Mistral's mask: causal with a window of w keys to the left (`window=(w, 0)`), N = 16384
queries and keys, batch 1, 16 heads, float16, d = 64 and 128, w in {256 ... 4096} and the
plain causal mask (no window) for comparison. Each point runs q_outer's forward (128 x 64
tiles, the runtime benchmark's) and torch SDPA given the same mask as a boolean tensor (the
efficient backend: FlashAttention's backend in torch takes no mask) in the same run:
- checked first, on head 0: the error of each against a float32 SDPA of the same mask, ours
  within 2x SDPA's own float16 error (FlashAttention's rule);
- counted once (our counted build) and the ledger compared with the model, exactly;
- timed: the kernels alone (launches back to back between CUDA events,
  `bench_runtime.time_launches`) and the public call `lo.attention` on torch tensors.
The flash orders skip every K/V block outside a query block's window, so time should grow as
N w; SDPA's efficient kernel reads the N x N mask.

Writes bench_window.csv (provider, d, window, ms_kernel, ms_call, model and counted bytes,
errors, status) with provenance; --plot draws figures/bench_window from it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import loop_orders as lo
from experiments.bench_runtime import time_launches
from experiments.gpu_common import counted_launch, write_csv
from loop_orders.device.arrays import KINDS
from loop_orders.warm import Job, warm

N, HEADS, DTYPE = 16384, 16, "float16"
WINDOWS = [256, 512, 1024, 2048, 4096, -1]  # -1: causal without a window
DIMS = [64, 128]
QUICK = {"windows": [256, 4096, -1], "dims": [64]}
SCHEDULE = "q_outer"
BLOCK_Q, BLOCK_K = 128, 64  # the runtime benchmark's float16 tiles


def problem(d: int, w: int) -> lo.Problem:
    return lo.make_problem(SCHEDULE, n_q=N, d=d, heads=HEADS, causal=True, window=(w, 0),
                           dtype=DTYPE, block_q=BLOCK_Q, block_k=BLOCK_K)


class Point:
    """q, k, v for one head dim and window, on the GPU; the boolean mask; the float32
    reference of head 0."""

    def __init__(self, d: int, w: int, seed: int):
        import torch

        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.d, self.w = d, w
        self.q, self.k, self.v = (torch.randn(1, HEADS, N, d, device="cuda", generator=gen,
                                              dtype=torch.float16) for _ in range(3))
        i = torch.arange(N, device="cuda")
        offset = i[None, :] - i[:, None]  # key - query
        self.mask = (offset <= 0) & ((offset >= -w) if w >= 0 else True)
        self.ref = self.sdpa(*(x[:, :1].float() for x in (self.q, self.k, self.v)))

    def sdpa(self, q, k, v):
        from torch.nn import functional
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return functional.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)

    def error(self, out) -> float:
        return float((out[:, :1].float() - self.ref).abs().max())


def bench_ours(point: Point) -> dict:
    import torch

    sched = lo.get_schedule(SCHEDULE)
    res = lo.attention(point.q, point.k, point.v, schedule=SCHEDULE, causal=True,
                       window=(point.w, 0), block_q=BLOCK_Q, block_k=BLOCK_K, count=True)
    p = res.problem
    model = sched.model(p)
    if res.counts != model:
        raise AssertionError(f"counted {res.counts} != model {model}")
    kind = KINDS["torch"]
    out = torch.empty_like(point.q)
    views = [kind.view(x).reshape(p.bh, N, point.d) for x in (point.q, point.k, point.v, out)]
    run = counted_launch(sched, p, *views)

    def public(_i):
        lo.attention(point.q, point.k, point.v, schedule=SCHEDULE, causal=True,
                     window=(point.w, 0), block_q=BLOCK_Q, block_k=BLOCK_K)

    return {"ms_kernel": time_launches(run.launch), "ms_call": time_launches(public),
            "model_bytes": model.bytes(2), "counted_bytes": res.counts.bytes(2),
            "error": point.error(out), "tiles": f"{p.block_q}x{p.block_k}"}


def bench_sdpa(point: Point) -> dict:
    out = point.sdpa(point.q, point.k, point.v)
    ms = time_launches(lambda _i: point.sdpa(point.q, point.k, point.v))
    return {"ms_kernel": ms, "ms_call": ms, "error": point.error(out)}


def row(provider: str, point: Point, **values) -> dict:
    base = {"provider": provider, "n": N, "heads": HEADS, "d": point.d, "window": point.w,
            "dtype": DTYPE, "tiles": "", "ms_kernel": "", "ms_call": "", "model_bytes": "",
            "counted_bytes": "", "error": "", "error_sdpa_fp16": "", "status": "ok"}
    base.update(values)
    return base


def run(args) -> int:
    dims, windows = (QUICK["dims"], QUICK["windows"]) if args.quick else (DIMS, WINDOWS)
    warm([Job(SCHEDULE, problem(d, w), count) for d in dims for w in windows
          for count in (False, True)])
    rows = []
    for i, d in enumerate(dims):
        for j, w in enumerate(windows):
            point = Point(d, w, 100 * i + j)
            theirs = bench_sdpa(point)
            try:
                ours = bench_ours(point)
                status = "ok" if ours["error"] <= 2 * theirs["error"] else \
                    f"failed: error {ours['error']:.2e} > 2 x SDPA's {theirs['error']:.2e}"
                rows.append(row(f"{SCHEDULE} window", point, **ours,
                                error_sdpa_fp16=theirs["error"], status=status))
            except (ValueError, AssertionError) as exc:
                rows.append(row(f"{SCHEDULE} window", point, status=f"failed: {exc}"[:200]))
            rows.append(row("torch sdpa efficient, bool mask", point, **theirs))
            print(rows[-2], rows[-1], sep="\n", flush=True)
            del point
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "bench_window.csv", rows)
    return 1 if any(r["status"] != "ok" for r in rows) else 0


def plot(csv_path: Path, figures_dir: Path) -> None:
    """Kernel time against the window, ours and SDPA's, one panel per head dim (the plain
    causal mask as a dotted line), from the results file."""
    import csv

    from experiments.common import pyplot, save_figure

    rows = [r for r in csv.DictReader(csv_path.open()) if r["status"] == "ok"]
    plt = pyplot()
    dims = sorted({int(r["d"]) for r in rows})
    fig, axes = plt.subplots(1, len(dims), figsize=(5 * len(dims), 4), squeeze=False)
    for ax, d in zip(axes[0], dims, strict=True):
        for provider, style in ((f"{SCHEDULE} window", "o-"),
                                ("torch sdpa efficient, bool mask", "s--")):
            mine = [r for r in rows if r["provider"] == provider and int(r["d"]) == d]
            pts = sorted((int(r["window"]), float(r["ms_kernel"])) for r in mine
                         if int(r["window"]) > 0)
            line = ax.plot(*zip(*pts, strict=True), style, label=provider)[0]
            full = [float(r["ms_kernel"]) for r in mine if int(r["window"]) < 0]
            if full:
                ax.axhline(full[0], color=line.get_color(), ls=":",
                           label=f"{provider}, causal, no window")
        ax.set(xscale="log", yscale="log", xlabel="window w (keys to the left)",
               ylabel="ms (kernel)", title=f"N = {N}, d = {d}, float16")
        windows = sorted({int(r["window"]) for r in rows if int(r["window"]) > 0})
        ax.xaxis.set_minor_locator(plt.NullLocator())
        ax.set_xticks(windows, [str(w) for w in windows])
        ax.legend(fontsize=7)
    save_figure(fig, figures_dir, "bench_window")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--plot", type=Path, default=None, help="a bench_window.csv to draw")
    parser.add_argument("--figures-dir", type=Path, default=Path("figures"))
    args = parser.parse_args(argv)
    if args.plot is not None:
        plot(args.plot, args.figures_dir)
        return 0
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
