"""Train a small causal transformer with each loop order's attention, and with torch SDPA.

    python -m experiments.train_tiny [--out DIR] [--steps 300]       # on a GPU, torch there

A character-level language model (byte vocabulary) on text that ships with Python: the
source files of its standard library, read in name order (no download). `Setting`: 4 layers
of 4 heads of head dim 64, sequence 256, batch 16, AdamW, float32. Every run starts from
the same initial weights and sees the same batches; only the attention differs: each
schedule through `loop_orders.torch.attention` (its forward and backward kernels), every
option value of its backward (dq atomic / separate), and torch SDPA. On COUNTED_STEPS the
step runs under `loop_orders.torch.counting()`, and the counted traffic of every attention
call (forward and backward) is summed and checked against the model's.

Writes train_tiny.csv (run, step, loss, step ms, and per counted step the forward and
backward elements and bytes, counted and model) and train_tiny.json (the setting, final
losses, their ratio to SDPA's) with provenance.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Setting:
    layers: int = 4
    heads: int = 4
    head_dim: int = 64
    seq: int = 256
    batch: int = 16
    blocks: tuple = (64, 64)  # block_q, block_k of our schedules
    lr: float = 1e-3
    warmup: int = 30
    seed: int = 0
    text_bytes: int = 4 << 20
    dtype: str = "float32"


# --smoke: the same code at a size the simulator runs on the CPU (tests/test_experiments.py)
SMOKE = Setting(layers=1, heads=2, head_dim=8, seq=16, batch=2, blocks=(8, 8), warmup=1,
                text_bytes=1 << 16)


def corpus(size: int) -> np.ndarray:
    """The first `size` bytes of the standard library's .py files, in path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for path in sorted(root.glob("*.py")):
        out.append(path.read_bytes())
        total += len(out[-1])
        if total >= size:
            break
    return np.frombuffer(b"".join(out)[:size], dtype=np.uint8)


def runs() -> list[dict]:
    """One run per schedule with a backward pass and value of its backward's options; SDPA."""
    from loop_orders.core.schedule import grad_variants

    return [{"run": v.label, "schedule": v.schedule, "options": v.options}
            for v in grad_variants(forwards=True)] + [
        {"run": "torch_sdpa", "schedule": None, "options": None}]


def build_model(attention, st: Setting):
    import torch
    from torch import nn

    width = st.heads * st.head_dim

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                     nn.Linear(4 * width, width))

        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, st.heads, st.head_dim).permute(
                2, 0, 3, 1, 4).contiguous().unbind(0)
            y = attention(q, k, v).transpose(1, 2).reshape(b, n, width)
            x = x + self.proj(y)
            return x + self.mlp(self.ln2(x))

    class TinyGPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(256, width), nn.Embedding(st.seq, width)
            self.blocks = nn.ModuleList(Block() for _ in range(st.layers))
            self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, 256)

        def forward(self, idx):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln(x))

    return TinyGPT()


def attention_fn(run: dict, st: Setting):
    import torch

    if run["schedule"] is None:
        return lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True)
    import loop_orders.torch as lot

    return lambda q, k, v: lot.attention(q, k, v, schedule=run["schedule"], causal=True,
                                         block_q=st.blocks[0], block_k=st.blocks[1],
                                         options=run["options"])


def batches(data: np.ndarray, steps: int, st: Setting):
    rng = np.random.default_rng(st.seed)
    for _ in range(steps):
        starts = rng.integers(0, len(data) - st.seq - 1, st.batch)
        window = np.stack([data[s:s + st.seq + 1] for s in starts]).astype(np.int64)
        yield window[:, :-1], window[:, 1:]


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def train(run: dict, init: dict, data, steps: int, counted_steps: set, st: Setting,
          device: str) -> list[dict]:
    import torch

    import loop_orders.torch as lot

    model = build_model(attention_fn(run, st), st).to(device)
    model.load_state_dict(init)
    opt = torch.optim.AdamW(model.parameters(), lr=st.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / st.warmup) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    rows = []
    for step, (x, y) in enumerate(batches(data, steps, st)):
        x, y = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
        counting = step in counted_steps and run["schedule"] is not None
        synchronize(device)
        t0 = time.perf_counter()
        with lot.counting() if counting else contextlib.nullcontext() as calls:
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
        opt.step()
        sched.step()
        synchronize(device)
        row = {"run": run["run"], "step": step, "loss": float(loss),
               "ms": (time.perf_counter() - t0) * 1e3, "counted": counting}
        if counting:
            row.update(traffic(calls))
        rows.append(row)
        if step % 50 == 0 or step == steps - 1:
            print(f"{run['run']:24s} step {step:4d} loss {float(loss):.4f} "
                  f"{row['ms']:7.2f} ms", flush=True)
    return rows


def traffic(calls: list) -> dict:
    """Summed counted and model elements (and bytes) of one step, per pass; checked equal."""
    out = {}
    for pass_ in ("forward", "backward"):
        mine = [c for c in calls if c.pass_ == pass_]
        counted = sum(c.ledger.total for c in mine)
        model = sum(c.model.total for c in mine)
        if counted != model or not mine:
            raise AssertionError(f"{pass_}: counted {counted} != model {model}")
        out[f"{pass_}_elements"] = counted
        out[f"{pass_}_model_elements"] = model
        out[f"{pass_}_bytes"] = sum(c.ledger.bytes(c.problem.itemsize) for c in mine)
        out[f"{pass_}_calls"] = len(mine)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--runs", help="comma-separated subset of run names")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny setting the simulator runs on the CPU (tests)")
    args = parser.parse_args(argv)
    from loop_orders.device import runtime

    if runtime.SIMULATOR and not args.smoke:
        print("train_tiny: no CUDA GPU here; nothing trained (--smoke runs a tiny setting)")
        return 0
    import torch

    from experiments.gpu_common import write_csv
    from loop_orders.results import atomic_write_json, provenance

    st = SMOKE if args.smoke else Setting()
    device = "cpu" if runtime.SIMULATOR else "cuda"
    prov = provenance(torch=torch.__version__)
    data = corpus(st.text_bytes)
    torch.manual_seed(st.seed)
    init = {k: v.clone() for k, v in build_model(None, st).state_dict().items()}
    chosen = [r for r in runs() if not args.runs or r["run"] in args.runs.split(",")]
    counted_steps = {0, args.steps - 1}
    if not runtime.SIMULATOR:
        import loop_orders as lo
        from experiments.gpu_common import warm

        warm((r["schedule"], lo.make_problem(
            r["schedule"], n_q=st.seq, d=st.head_dim, batch=st.batch, heads=st.heads,
            block_q=st.blocks[0], block_k=st.blocks[1], causal=True, save_lse=True,
            options=r["options"]), True) for r in chosen if r["schedule"])
    rows, summary = [], {}
    args.out.mkdir(parents=True, exist_ok=True)
    for run in chosen:
        t0 = time.time()
        got = train(run, init, data, args.steps, counted_steps, st, device)
        rows += got
        summary[run["run"]] = {"final_loss": got[-1]["loss"],
                               "mean_last_20": float(np.mean([r["loss"] for r in got[-20:]])),
                               "seconds": time.time() - t0,
                               "median_step_ms": float(np.median([r["ms"] for r in got]))}
        write_csv(args.out / "train_tiny.csv", rows, prov)
    base = summary.get("torch_sdpa")
    for s in summary.values():
        if base:
            s["final_vs_sdpa"] = s["mean_last_20"] / base["mean_last_20"]
    setting = {**asdict(st), "steps": args.steps, "counted_steps": sorted(counted_steps),
               "corpus": "the standard library's *.py files, in path order"}
    atomic_write_json(args.out / "train_tiny.json", {"provenance": prov, "setting": setting,
                                                     "summary": summary})
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
