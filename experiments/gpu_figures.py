"""Figures of the GPU experiments, drawn from their committed results files.

The measurements themselves need a GPU and minutes of device time, so `loop-orders figures`
does not rerun them: the GPU experiments do (README, "GPU experiments"). This step plots
whatever of their results files (bench_runtime, hw_traffic, bench_blocksize, bench_decode,
bench_backward, train_tiny, fig2_setting, bench_tensor_cores, bench_hopper) the results
directory holds, and says which is
missing.
"""

from __future__ import annotations

from pathlib import Path

from . import common, plot_bench
from .gpu_common import input_kind

NAME = "gpu"


def run(ctx: common.Context) -> None:
    """Nothing to measure here; see the module docstring."""


L2_BYTES = 60 * 2**20  # the H200 we measure on: 132 SMs, 60 MB of L2


def plot_hw(rows: list[dict], out: Path) -> list[Path]:
    """Two figures: per schedule, model, counted, ncu logical and DRAM bytes vs N (float32,
    not causal); and DRAM / logical bytes vs N, where the L2 absorbs re-reads, with the N at
    which one B·H·N² float32 matrix (dense's S or P) fills the L2. Tiles: the file's first."""
    tiles = (rows[0]["block_q"], rows[0]["block_k"])
    sel = [r for r in rows if r["dtype"] == "float32" and r["causal"] == "False"
           and (r["block_q"], r["block_k"]) == tiles]
    schedules = list(dict.fromkeys(r["schedule"] for r in sel))
    fig, axes = common.pyplot().subplots(1, len(schedules), figsize=(4.6 * len(schedules), 4.2),
                                         squeeze=False)
    ratio_fig, ratio_ax = common.pyplot().subplots(figsize=(6.4, 4.4))
    for ax, name in zip(axes[0], schedules, strict=True):
        pts = sorted((int(r["n"]), r) for r in sel if r["schedule"] == name)
        n = [p[0] for p in pts]
        series = {
            "model": [int(r["model_bytes"]) for _, r in pts],
            "counted": [int(r["counted_bytes"]) for _, r in pts],
            "ncu ld+st (L1)": [int(r["ncu_ld_bytes"]) + int(r["ncu_st_bytes"]) for _, r in pts],
            "DRAM rd+wr": [int(r["dram_read_bytes"]) + int(r["dram_write_bytes"])
                           for _, r in pts],
        }
        for (label, ys), style in zip(series.items(), ["-", "o", "x", "s--"], strict=True):
            ax.loglog(n, ys, style, label=label, base=2)
        ax.set_title(f"{name} (Br × Bc = {tiles[0]} × {tiles[1]})", fontsize=10)
        ax.set_xlabel("N")
        ax.set_ylabel("bytes")
        ax.legend(fontsize=7)
        ratio = [d / max(1, c) for d, c in zip(series["DRAM rd+wr"], series["counted"],
                                               strict=True)]
        ratio_ax.semilogx(n, ratio, "o-", label=name, base=2)
    bh = int(sel[0]["batch"]) * int(sel[0]["heads"])
    ratio_ax.axvline((L2_BYTES / (4 * bh)) ** 0.5, color="grey", ls=":",
                     label=f"B·H·N²·4 B = L2 ({L2_BYTES >> 20} MB), B·H = {bh}")
    ratio_ax.axhline(1.0, color="grey", lw=0.8)
    ratio_ax.set_title("DRAM bytes / logical bytes (< 1: L2 hits)", fontsize=10)
    ratio_ax.set_xlabel("N")
    ratio_ax.legend(fontsize=7)
    return (plot_bench.save_with_provenance(fig, rows[0], out, "hw_traffic")
            + plot_bench.save_with_provenance(ratio_fig, rows[0], out, "hw_traffic_l2"))


def plot_blocksize(rows: list[dict], out: Path) -> list[Path]:
    """Block size Br vs the model's HBM bytes and the measured runtime, side by side (the
    analogue of the FlashAttention paper's Figure 2, middle), one schedule per row."""
    schedules = list(dict.fromkeys(r["schedule"] for r in rows))
    fig, axes = common.pyplot().subplots(len(schedules), 2, figsize=(9, 3.6 * len(schedules)),
                                         squeeze=False)
    for (left, right), name in zip(axes, schedules, strict=True):
        pts = sorted((int(r["block_q"]), int(r["model_bytes"]), r["ms_median"], r["status"])
                     for r in rows if r["schedule"] == name)
        labels = [str(p[0]) for p in pts]
        left.bar(labels, [p[1] / 1e9 for p in pts], color="tab:blue")
        left.set_ylabel("HBM traffic, model (GB)")
        timed = [(str(p[0]), float(p[2])) for p in pts if p[3] == "ok"]
        right.bar([t[0] for t in timed], [t[1] for t in timed], color="tab:orange")
        right.set_ylabel("runtime (ms, median)")
        first = next(r for r in rows if r["schedule"] == name)
        for ax in (left, right):
            ax.set_xlabel("Br (query rows per block)")
            ax.set_title(f"{name}: N={first['n']}, d={first['d']}, Bc={first['block_k']}, "
                         f"B·H={int(first['batch']) * int(first['heads'])}", fontsize=9)
    return plot_bench.save_with_provenance(fig, rows[0], out, "bench_blocksize")


def plot_tensor_cores(rows: list[dict], out: Path) -> list[Path]:
    """Tensor cores at N = 4096: each schedule's float16 runtime beside SDPA's
    FlashAttention-2 kernel per (d, causal), and q_outer's throughput in every precision
    beside SDPA's and our float32 FMA path."""
    ok = [r for r in rows if r["status"] == "ok" and r["n"] == "4096"]
    shapes = sorted({(r["d"], r["causal"]) for r in ok}, key=lambda x: (int(x[0]), x[1]))
    labels = [f"d={d}{' causal' if c == 'True' else ''}" for d, c in shapes]
    fig, (left, right) = common.pyplot().subplots(1, 2, figsize=(12, 4.2))

    def bars(ax, series, value):
        width = 0.8 / len(series)
        for k, (label, provider, dtype) in enumerate(series):
            at = {(r["d"], r["causal"]): float(r[value]) for r in ok
                  if r["provider"] == provider and r["dtype"] == dtype}
            ax.bar([i + k * width for i in range(len(shapes))], [at.get(x, 0) for x in shapes],
                   width, label=label, color=f"C{k}")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))], labels)
        ax.legend(fontsize=7, ncol=3, loc="upper left")

    bars(left, [(name, name, "float16") for name in ("q_outer", "kv_outer", "dense", "split_kv")]
         + [("SDPA flash", "torch_sdpa_flash", "float16")], "ms_median")
    left.set_yscale("log")
    left.set_ylim(top=200)  # room for the legend above the bars
    left.set_ylabel("runtime (ms, median, log scale)")
    left.set_title("float16 inputs, N = 4096, B·H·N = 262144", fontsize=9)
    bars(right, [("q_outer float16", "q_outer", "float16"),
                 ("q_outer bfloat16", "q_outer", "bfloat16"),
                 ("q_outer TF32", "q_outer", "tf32"),
                 ("q_outer float32 FMA", "q_outer", "float32"),
                 ("SDPA flash float16", "torch_sdpa_flash", "float16")], "tflops")
    right.set_ylabel("TFLOP/s")
    right.set_ylim(top=1.35 * max(float(r["tflops"]) for r in ok))
    right.set_title("q_outer per precision beside SDPA, N = 4096", fontsize=9)
    runs = {**ok[0], "git_sha": " + ".join(dict.fromkeys(r["git_sha"] for r in ok)),
            "date": ok[0]["date"][:10]}
    return plot_bench.save_with_provenance(fig, runs, out, "bench_tensor_cores")


def _f(x) -> float:
    return float(x) if x not in ("", None) else float("nan")


def plot_decode(rows: list[dict], out: Path) -> list[Path]:
    """The decode regime: kernel time vs N_k at N_q = 1, 16, 128 (B·H = 16, d = 64), each
    provider in float32 (solid) and float16 (dashed); and at the target shape (N_q = 1,
    N_k = 65536), time and the model's bytes against the split count S."""
    plt = common.pyplot()
    ok = [r for r in rows if r["status"] == "ok"]
    fig, axes = plt.subplots(1, 4, figsize=(21, 4.8))
    colors = common.schedule_colors(["split_kv", "q_outer", "torch_sdpa"])
    for ax, n_q in zip(axes[:3], ("1", "16", "128"), strict=True):
        for dtype, style in (("float32", "o-"), ("float16", "s--")):
            sel = [r for r in ok if r["n_q"] == n_q and r["bh"] == "16" and r["d"] == "64"
                   and r["dtype"] == dtype and not r["provider"].startswith("split_kv_s")]
            for provider in dict.fromkeys(r["provider"] for r in sel):
                pts = sorted((int(r["n_k"]), _f(r["ms_kernel"])) for r in sel
                             if r["provider"] == provider)
                base = "torch_sdpa" if provider.startswith("torch") else provider
                ax.loglog(*zip(*pts, strict=True), style, color=colors[base], base=2,
                          label=f"{provider} ({dtype})")
        ax.set(title=f"N_q = {n_q}, B·H = 16, d = 64", xlabel="keys N_k",
               ylabel="kernel time (ms)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6.5)
    target = [r for r in ok if r["provider"].startswith("split_kv_s")]
    if target:
        pts = sorted((int(r["splits"]), _f(r["ms_kernel"]), _f(r["model_bytes"]))
                     for r in target)
        s, ms, nbytes = zip(*pts, strict=True)
        ax = axes[3]
        ax.semilogx(s, ms, "o-", color=colors["split_kv"], base=2, label="split_kv, S fixed")
        auto = [r for r in ok if r["provider"] == "split_kv" and all(
            r[k] == v for k, v in (("n_q", "1"), ("n_k", "65536"), ("bh", "16"), ("d", "64"),
                                   ("dtype", "float32")))]
        if auto:
            ax.plot([int(auto[0]["splits"])], [_f(auto[0]["ms_kernel"])], "*", ms=14,
                    color="k", label=f"auto (S = {auto[0]['splits']})")
        ax.set(xlabel="splits S", ylabel="kernel time (ms)", yscale="log",
               title="N_q = 1, N_k = 65536, B·H = 16, d = 64, float32")
        twin = ax.twinx()
        twin.semilogx(s, [b / 1e9 for b in nbytes], "x:", color="0.4", base=2,
                      label="model HBM bytes (GB)")
        twin.set_ylabel("model HBM traffic (GB)")
        ax.legend(fontsize=7, loc="upper center")
        twin.legend(fontsize=7, loc="center right")
    return plot_bench.save_with_provenance(fig, rows[0], out, "bench_decode")


def plot_gqa_decode(rows: list[dict], out: Path) -> list[Path]:
    """Grouped-query decode (H_q = 32 over H_kv = 8, d = 128, float16): kernel time vs N_k
    per provider at each batch, and the K/V bytes each of ours moved (counted == model)."""
    plt = common.pyplot()
    ok = [r for r in rows if r["status"] == "ok"]
    batches = sorted({int(r["batch"]) for r in ok})
    fig, axes = plt.subplots(1, len(batches) + 1, figsize=(6 * (len(batches) + 1), 4.6))
    providers = list(dict.fromkeys(r["provider"] for r in ok))
    for ax, batch in zip(axes, batches, strict=False):
        for provider in providers:
            pts = sorted((int(r["n_k"]), _f(r["ms_kernel"])) for r in ok
                         if r["provider"] == provider and int(r["batch"]) == batch)
            style = "o-" if "packed" in provider else "s--" if "per head" in provider else "k^:"
            ax.loglog(*zip(*pts, strict=True), style, base=2, label=provider)
        ax.set(title=f"decode, B = {batch}, H_q = 32 over H_kv = 8, d = 128, float16",
               xlabel="keys N_k", ylabel="kernel time (ms)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[-1]
    for provider in providers:
        pts = sorted((int(r["n_k"]), _f(r["kv_bytes"]) / 1e6) for r in ok
                     if r["provider"] == provider and int(r["batch"]) == batches[0])
        ax.loglog(*zip(*pts, strict=True), "o-", base=2, label=provider)
    ax.set(title=f"K and V bytes read (B = {batches[0]}; SDPA: K/V once)",
           xlabel="keys N_k", ylabel="MB")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return plot_bench.save_with_provenance(fig, rows[0], out, "bench_gqa_decode")


def plot_backward(rows: list[dict], out: Path) -> list[Path]:
    """Forward + backward time per provider (stacked forward and backward for ours), one
    panel per (N, d, inputs, causal) and run (a process on one GPU), beside SDPA's forward +
    backward timed in that process."""
    plt = common.pyplot()
    ok = [r for r in rows if r["status"].startswith("ok")]
    groups = sorted(dict.fromkeys((r["n"], r["d"], r["dtype"], r["causal"], r["date"])
                                  for r in ok if r["block_q"]),
                    key=lambda g: (g[3], int(g[0]), int(g[1]), g[2], g[4]))
    providers = list(dict.fromkeys(r["provider"] for r in ok if r["block_q"]))
    cols = min(5, len(groups))
    lines = -(-len(groups) // cols)
    fig, axes = plt.subplots(lines, cols, figsize=(4.2 * cols, 4.8 * lines), squeeze=False)
    for ax in axes.flat[len(groups):]:
        ax.axis("off")
    for ax, (n, d, dtype, causal, run) in zip(axes.flat, groups, strict=False):
        tdtype = input_kind(dtype)["dtype"]  # SDPA's rows: a TF32 label's torch dtype
        ours = [r for r in ok if r["block_q"] and (r["n"], r["d"], r["dtype"], r["causal"],
                                                   r["date"]) == (n, d, dtype, causal, run)]
        sel = {r["provider"]: r for r in ours}
        sel.update({r["provider"]: r for r in ok if not r["block_q"] and r["date"] == run
                    and (r["n"], r["d"], r["dtype"], r["causal"]) == (n, d, tdtype, causal)})
        labels, fwd, bwd = [], [], []
        for name in providers + [p for p in sel if p.startswith("torch")]:
            if name not in sel:
                continue
            r = sel[name]
            labels.append(name.replace("torch_sdpa_", "SDPA "))
            if r["ms_forward"]:
                fwd.append(_f(r["ms_forward"]))
                bwd.append(_f(r["ms_backward"]))
            else:
                fwd.append(_f(r["ms_total"]))
                bwd.append(0.0)
        ax.bar(labels, fwd, color="tab:blue", label="forward")
        ax.bar(labels, bwd, bottom=fwd, color="tab:orange", label="backward")
        ax.set_title(f"N = {n}, d = {d}, {dtype}, causal = {causal}\n"
                     f"{ours[0]['device'].replace('NVIDIA ', '')}, {ours[0]['git_sha']}",
                     fontsize=9)
        ax.set_ylabel("ms (kernels alone)")
        ax.tick_params(axis="x", rotation=60, labelsize=7)
        ax.legend(fontsize=7)
    runs = list(dict.fromkeys((r["device"], r["git_sha"], r["date"]) for r in ok))
    summary = {"device": " + ".join(dict.fromkeys(dev for dev, _, _ in runs)),
               "git_sha": " + ".join(dict.fromkeys(sha for _, sha, _ in runs)),
               "date": f"{len(runs)} runs, each panel's named"}
    return plot_bench.save_with_provenance(fig, summary, out, "bench_backward")


def plot_train(rows: list[dict], out: Path) -> list[Path]:
    """Training loss per step of every run (on top of each other), and the counted HBM
    traffic of one step's attention calls, forward and backward, per schedule."""
    plt = common.pyplot()
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(14, 4.8),
                                   gridspec_kw={"width_ratios": [1.4, 1]})
    runs = list(dict.fromkeys(r["run"] for r in rows))
    for i, run in enumerate(runs):
        pts = sorted((int(r["step"]), _f(r["loss"])) for r in rows if r["run"] == run)
        ax.plot(*zip(*pts, strict=True), lw=2.5 if run == "torch_sdpa" else 1,
                ls="-" if i % 2 == 0 else "--", label=run)
    ax.set(xlabel="step", ylabel="training loss (cross-entropy, nats)",
           title="loss curves (the same weights and batches for every run)")
    ax.legend(fontsize=7)
    counted = [r for r in rows if r["counted"] == "True" and r["step"] == "0"]
    names = [r["run"] for r in counted]
    fwd = [_f(r["forward_bytes"]) / 1e9 for r in counted]
    bwd = [_f(r["backward_bytes"]) / 1e9 for r in counted]
    bars.bar(names, fwd, color="tab:blue", label="forward (counted = model)")
    bars.bar(names, bwd, bottom=fwd, color="tab:orange", label="backward (counted = model)")
    bars.set(ylabel="HBM traffic of one step's attention (GB)", title="traffic per step")
    bars.tick_params(axis="x", rotation=45, labelsize=7)
    bars.legend(fontsize=7)
    return plot_bench.save_with_provenance(fig, rows[0], out, "train_tiny")


def plot_fig2(rows: list[dict], out: Path) -> list[Path]:
    """The Figure 2 setting: per run, forward + backward bytes (model = counted, ncu DRAM)
    and runtime, float16 and float32, beside what the paper prints (dashed)."""
    from .gpu_notes import PAPER_FIG2

    plt = common.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(18, 4.8))
    runs = list(dict.fromkeys(r["run"] for r in rows))
    x = range(len(runs))
    for offset, dtype in ((-0.2, "float16"), (0.2, "float32")):
        total = {key: [sum(_f(r[key]) for r in rows if r["run"] == run and r["dtype"] == dtype)
                       for run in runs]
                 for key in ("counted_bytes", "dram_read_bytes", "dram_write_bytes", "ms")}
        dram = [a + b for a, b in zip(total["dram_read_bytes"], total["dram_write_bytes"],
                                      strict=True)]
        for ax, values, label in ((axes[0], [v / 1e9 for v in total["counted_bytes"]],
                                   "counted = model"),
                                  (axes[1], [v / 1e9 for v in dram], "ncu DRAM"),
                                  (axes[2], total["ms"], "runtime")):
            ax.bar([i + offset for i in x], values, width=0.4, label=f"{label}, {dtype}")
    for ax, key, unit in ((axes[0], "hbm_gb", "GB"), (axes[1], "hbm_gb", "GB"),
                          (axes[2], "ms", "ms")):
        for name, printed in PAPER_FIG2.items():
            ax.axhline(printed[key], ls="--", lw=1, color="k" if name == "standard" else "0.5",
                       label=f"paper, {name}: {printed[key]} {unit}")
        ax.set_xticks(list(x), runs, rotation=40, fontsize=7)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("forward + backward HBM elements' bytes (GB)")
    axes[1].set_ylabel("DRAM read + write after the L2 (GB)")
    axes[2].set_ylabel("forward + backward, kernels alone (ms)")
    setting = rows[0]
    axes[1].set_title(f"B = {setting['batch']}, H = {setting['heads']}, N = {setting['n']}, "
                      f"d = {setting['d']}, causal (the paper: an A100, with dropout and a "
                      "padding mask)", fontsize=9)
    return plot_bench.save_with_provenance(fig, rows[0], out, "fig2_setting")


def plot_hopper(rows: list[dict], out: Path) -> list[Path]:
    """Hopper's forward (bench_hopper's table): q_outer's fastest wgmma build and its public
    call (naming no tiles) as speed-ups over SDPA's FlashAttention-2 and cuDNN kernels in the
    same run, per N, d and mask, float16 and bfloat16, the 1.0 line marked."""
    table = [r for r in rows if r.get("part") == "table" and r["status"] == "ok"]
    points = sorted({(int(r["n"]), int(r["d"]), r["causal"]) for r in table})
    labels = [f"N={n}\nd={d}{' causal' if c == 'True' else ''}" for n, d, c in points]
    series = [(f"{who}, {dtype}", who, dtype) for who in ("wgmma", "public call")
              for dtype in ("float16", "bfloat16")
              if any(r["dtype"] == dtype and (r["provider"] == "q_outer public call")
                     == (who == "public call") for r in table)]  # those the run has
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(15, 4.6), sharey=True)
    width = 0.8 / len(series)
    for ax, (against, name) in zip(axes, (("flash", "FlashAttention-2"), ("cudnn", "cuDNN")),
                                   strict=True):
        for k, (label, who, dtype) in enumerate(series):
            at = {(int(r["n"]), int(r["d"]), r["causal"]): _f(r[f"vs_{against}"])
                  for r in table if r["dtype"] == dtype and r["provider"].startswith("q_outer")
                  and (r["provider"] == "q_outer public call") == (who == "public call")
                  and "mma.sync" not in r["provider"]}
            ax.bar([i + k * width for i in range(len(points))],
                   [at.get(x, float("nan")) for x in points], width, label=label,
                   color=f"C{k}")
        ax.axhline(1.0, color="k", lw=1, ls="--")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(points))], labels, fontsize=7)
        ax.set_title(f"q_outer on wgmma against SDPA's {name} (same run; > 1: ours faster)",
                     fontsize=9)
        ax.legend(fontsize=7, ncol=2, loc="upper left")
    axes[0].set_ylabel("speed-up (their ms / ours)")
    axes[0].set_ylim(0, 1.25 * max(_f(r["vs_flash"]) for r in table
                                  if r["provider"].startswith("q_outer")
                                  and r["vs_flash"] != ""))
    runs = {**table[0], "git_sha": " + ".join(dict.fromkeys(r["git_sha"] for r in table)),
            "date": table[0]["date"][:10]}
    return plot_bench.save_with_provenance(fig, runs, out, "bench_hopper")


def plot(ctx: common.Context) -> list:
    written = []
    for name, required, draw in (("bench_runtime.csv", "provider", plot_bench.plot),
                                 ("hw_traffic.csv", "ncu_ld_bytes", plot_hw),
                                 ("bench_blocksize.csv", "model_bytes", plot_blocksize),
                                 ("bench_decode.csv", "n_k", plot_decode),
                                 ("bench_gqa_decode.csv", "kv_heads", plot_gqa_decode),
                                 ("bench_backward.csv", "ms_backward", plot_backward),
                                 ("train_tiny.csv", "loss", plot_train),
                                 ("fig2_setting.csv", "counted_bytes", plot_fig2),
                                 ("bench_tensor_cores.csv", "layout", plot_tensor_cores),
                                 ("bench_hopper.csv", "vs_cudnn", plot_hopper)):
        path = ctx.results_dir / name
        if path.exists():
            written += draw(plot_bench.read_rows(path, required), ctx.figures_dir)
        else:
            print(f"gpu: no {path} yet (measured on a GPU machine; README, GPU experiments)")
    return written
