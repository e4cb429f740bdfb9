"""A training step of an unmodified GPT-2-shaped model, its attention run in each loop order.

    python -m experiments.model_traffic [--out results]     # GPU: GPT-2 small's block stack
    python -m experiments.model_traffic --tiny --out DIR    # the simulator: 2 tiny layers

The model (`gpt2`) is GPT-2's block stack written from torch alone, laid out as nanoGPT's:
token and position embeddings, `layers` pre-LayerNorm blocks (causal self-attention calling
`torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)`, then a 4x GELU
MLP), a final LayerNorm and the vocabulary head. It knows nothing of loop_orders. One step
(forward, cross-entropy, backward) runs with torch's SDPA, then once per schedule and value
of its backward's options with `loop_orders.torch.use(...)` routing the model's SDPA calls,
under `counting()`. Per run: every attention pass's counted HBM traffic summed per pass
(elements per tensor and direction, bytes), which must equal `lo.predict_traffic` of one
layer's attention times the layers (and each pass its schedule's model); the loss and the
largest relative gradient error against torch's step.

Only attention's traffic is counted: the projections, MLP, LayerNorms and torch's copies
(the heads made contiguous) move bytes too, outside every ledger here.
Writes model_traffic.json (setting, per run the ledgers and errors) with provenance.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Shape:
    layers: int = 12
    heads: int = 12
    head_dim: int = 64
    seq: int = 1024
    batch: int = 4
    vocab: int = 50257
    blocks: tuple = (64, 64)  # block_q, block_k of our schedules
    seed: int = 0


GPT2_SMALL = Shape()
# --tiny: the same code at a size the simulator runs on the CPU in seconds
TINY = Shape(layers=2, heads=2, head_dim=4, seq=8, batch=1, vocab=16, blocks=(4, 4))


def gpt2(shape: Shape):
    """GPT-2's block stack at `shape` (nanoGPT's layout), calling torch's SDPA by name."""
    import torch
    import torch.nn.functional as F  # noqa: N812 (the name models use)
    from torch import nn

    width = shape.heads * shape.head_dim

    class CausalSelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn, self.c_proj = nn.Linear(width, 3 * width), nn.Linear(width, width)

        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = (t.view(b, n, shape.heads, shape.head_dim).transpose(1, 2)
                       for t in self.c_attn(x).split(width, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0,
                                               is_causal=True)
            return self.c_proj(y.transpose(1, 2).contiguous().view(b, n, width))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(width), CausalSelfAttention(), \
                nn.LayerNorm(width)
            self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                     nn.Linear(4 * width, width))

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(shape.vocab, width), nn.Embedding(shape.seq, width)
            self.h = nn.ModuleList(Block() for _ in range(shape.layers))
            self.ln_f, self.lm_head = nn.LayerNorm(width), nn.Linear(width, shape.vocab)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for block in self.h:
                x = block(x)
            return self.lm_head(self.ln_f(x))

    torch.manual_seed(shape.seed)
    return GPT()


def batch(shape: Shape, device):
    """Token ids and next-token targets of one step (seeded)."""
    import torch

    gen = torch.Generator().manual_seed(shape.seed)
    tokens = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), generator=gen)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def train_step(model, idx, targets):
    """Forward, cross-entropy and backward; (loss, every parameter's gradient by name)."""
    import torch.nn.functional as F  # noqa: N812

    model.zero_grad(set_to_none=True)
    logits = model(idx)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    return float(loss.detach()), {name: p.grad.detach().clone()
                                  for name, p in model.named_parameters()}


def predicted(shape: Shape, schedule: str, options, backward: bool):
    """One layer's attention pass, the model's ledger, times the layers."""
    import loop_orders as lo

    return lo.predict_traffic(schedule, n=shape.seq, d=shape.head_dim, batch=shape.batch,
                              heads=shape.heads, block_q=shape.blocks[0],
                              block_k=shape.blocks[1], causal=True, save_lse=True,
                              options=options, backward=backward).scaled(shape.layers)


def summed(calls, pass_: str):
    """(counted, each pass's own model) ledgers of one pass, summed over the layers."""
    mine = [c for c in calls if c.pass_ == pass_]
    return sum((c.ledger for c in mine[1:]), mine[0].ledger), sum(
        (c.model for c in mine[1:]), mine[0].model), len(mine)


def routed_run(model, shape: Shape, variant, idx, targets) -> tuple[dict, dict]:
    """One step with the model's SDPA routed through `variant`, counted, per pass."""
    import loop_orders.torch as lot

    options = variant.options or {}
    with lot.use(variant.schedule, block_q=shape.blocks[0], block_k=shape.blocks[1],
                 **options), lot.counting() as calls:
        loss, grads = train_step(model, idx, targets)
    row = {"run": variant.label, "schedule": variant.schedule, "options": variant.options,
           "loss": loss}
    itemsize = calls[0].problem.itemsize
    for pass_ in ("forward", "backward"):
        counted, model_ledger, n_calls = summed(calls, pass_)
        expect = predicted(shape, variant.schedule, variant.options, pass_ == "backward")
        row[pass_] = {"calls": n_calls, "elements": counted.total,
                      "bytes": counted.bytes(itemsize), "counted": counted.to_dict(),
                      "equals_model": counted == model_ledger == expect}
    return row, grads


def grad_error(grads: dict, reference: dict) -> float:
    """The largest relative error (max abs difference over max abs) over the parameters."""
    return max(float((grads[k] - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
               for k, ref in reference.items())


def run(shape: Shape, device) -> dict:
    """Torch's step, then each routed step from the same weights; the results' body."""
    from loop_orders.core.schedule import grad_variants

    model = gpt2(shape).to(device)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    idx, targets = batch(shape, device)
    loss, reference = train_step(model, idx, targets)
    rows = [{"run": "torch_sdpa", "loss": loss}]
    for variant in grad_variants(forwards=True):
        model.load_state_dict(init)
        row, grads = routed_run(model, shape, variant, idx, targets)
        row["grad_error_vs_sdpa"] = grad_error(grads, reference)
        rows.append(row)
        print(f"{row['run']:24s} loss {row['loss']:.6f}  forward {row['forward']['bytes']:,} B"
              f"  backward {row['backward']['bytes']:,} B  counted == model: "
              f"{row['forward']['equals_model'] and row['backward']['equals_model']}",
              flush=True)
    return {"setting": asdict(shape), "runs": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny shape the simulator runs on the CPU (tests)")
    args = parser.parse_args(argv)
    from loop_orders.device import runtime

    if runtime.SIMULATOR and not args.tiny:
        print("model_traffic: no CUDA GPU here; nothing run (--tiny runs a tiny shape)")
        return 0
    import torch

    from loop_orders.results import atomic_write_json, provenance

    body = run(TINY if args.tiny else GPT2_SMALL, "cpu" if runtime.SIMULATOR else "cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    path = atomic_write_json(args.out / "model_traffic.json",
                             {"provenance": provenance(torch=torch.__version__), **body})
    print(json.dumps({r["run"]: r.get("forward", {}).get("bytes") for r in body["runs"]}))
    print(f"wrote {path}")
    return 0 if all(r[p]["equals_model"] for r in body["runs"][1:]
                    for p in ("forward", "backward")) else 1


if __name__ == "__main__":
    raise SystemExit(main())
