"""The forward on Hopper's wgmma beside its mma.sync build, SDPA flash (FlashAttention-2) and
SDPA cuDNN, in one process on one GPU (issue 53's table).

    python -m experiments.bench_hopper [--out DIR] [--quick]

First the wgmma build's tiles and variants at N = 4096 (or each N of --sweep-n), float16 (TILES
x VARIANTS, per head dim, causal or not: the pipelined update, where P V_j-1 runs under S_ij's
softmax and K/V come through a ring every thread copies into; the same with a producer
warpgroup filling the ring by TMA, on a CTA a block and on persistent CTAs; and the update
that waits for each product); then, at each
point of the table (N x d x causal x dtype, B H N fixed as bench_runtime's), q_outer on wgmma
with the tiles and variant fastest for that head dim and mask at the largest swept N <= N,
q_outer's public call naming no tiles (`lo.attention` on torch tensors: the tiles and build a
user gets), q_outer on mma.sync at its own benchmark tiles (`tuning` products="mma"), kv_outer
on wgmma at q_outer's tiles, dense's matmuls on wgmma and on mma.sync (N <= DENSE_N), and SDPA
flash and cuDNN. Each of ours is checked against the float64 reference on sampled rows before
it is timed (`bench_runtime.measure`). Writes bench_hopper.csv (one row a timing, with the
tiles, the build in effect and the ratio to SDPA flash and cuDNN at the same point) with
provenance.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import numpy as np

import loop_orders as lo
from experiments import bench_runtime as br
from experiments.gpu_common import check_output, input_kind, warm, write_csv
from loop_orders.device import runtime
from loop_orders.microkernel import tuning
from loop_orders.results import provenance

TABLE = {"n": [1024, 4096, 16384], "d": [64, 128], "causal": [False, True],
         "dtype": ["float16", "bfloat16"]}
TILE_N = 4096
TILES = {64: [(128, 64), (128, 128)], 128: [(128, 64), (128, 128)]}  # two warpgroups a CTA
VARIANT_TILES = {64: (128, 64), 128: (128, 128)}  # --variants-only: the ring's fastest (H200)
# (label, tuning products, `MicroKernelSchedule.hopper_build`): pipelined, the K/V ring filled
# by every thread's cp.async; each product waited; the ring filled by a producer's TMA copies;
# the same on persistent CTAs
VARIANTS = [("q_outer wgmma-ring", "wgmma-ring"), ("q_outer wgmma-sync", "wgmma-sync"),
            ("q_outer wgmma-tma", "wgmma-tma"), ("q_outer wgmma-persistent", "wgmma-persistent")]
MMA_TILES = (128, 64)  # the mma.sync build's benchmark tiles (bench_runtime.BLOCKS)
DENSE_N, DENSE_TILES = 4096, (128, 64)  # dense's matmuls, on wgmma and on mma.sync


def problem(name: str, n: int, d: int, causal: bool, dtype: str, tiles) -> lo.Problem:
    batch, heads = br.shape_for(n)
    return lo.make_problem(name, n_q=n, d=d, batch=batch, heads=heads, causal=causal,
                           block_q=tiles[0], block_k=tiles[1], **input_kind(dtype))


def timed(label: str, name: str, p: lo.Problem, rng, products=None, heads=None) -> dict:
    """One row of ours: the schedule at p under this override (None: the default choice;
    heads: a causal grid's heads a group, `tuning` causal_heads)."""
    sched = lo.get_schedule(name)
    with tuning.tuned(products=products, causal_heads=heads):
        try:
            row = br.measure(name, p.dtype, sched, p, rng)
        except (AssertionError, RuntimeError) as exc:  # out of tolerance, or refused at
            # launch: recorded, never timed
            row = br.blank_row(name, p.dtype, sched, p, f"wrong: {str(exc)[:160]}")
            print(f"{label} d={p.d} causal={p.causal}: {row['status']}", flush=True)
    row["provider"] = label
    row["causal_heads"] = "" if heads is None else heads
    return row


def with_heads(label: str, heads: int | None) -> str:
    """A row's provider, naming the causal grid's heads a group where the row sets them (0:
    over every head)."""
    return label + ("" if heads is None else f" heads{heads}")


def sweep_tiles(rng, path: Path, prov: dict, sweep_n=(TILE_N,),
                causal_heads=()) -> tuple[list[dict], dict]:
    """The wgmma build's tiles x VARIANTS at each N of `sweep_n`, float16, and on causal
    points each again with its grid taking `causal_heads` heads at a time, written to `path`
    row by row; the fastest (tiles, products, heads) per (N, d, causal)."""
    rows, best = [], {}
    def grids(causal):  # the default grid, then each asked of a causal point
        return (None, *causal_heads) if causal else (None,)

    warm((("q_outer", problem("q_outer", TILE_N, d, causal, "float16", tiles), False,
           (("products", products), ("causal_heads", heads)))
          for d in TILES for causal in (False, True) for tiles in TILES[d]
          for _, products in VARIANTS for heads in grids(causal)), counted=(False,))
    for n, d, causal in itertools.product(sweep_n, TILES, (False, True)):
        for tiles, (label, products), heads in itertools.product(TILES[d], VARIANTS,
                                                                 grids(causal)):
            p = problem("q_outer", n, d, causal, "float16", tiles)
            row = timed(with_heads(label, heads), "q_outer", p, rng, products=products,
                        heads=heads)
            rows.append(row)
            write_csv(path, uniform([{"part": "tiles", **r} for r in rows]), prov)
            if row["status"] == "ok" and (best.get((n, d, causal)) is None
                                          or row["ms_median"] < best[(n, d, causal)][0]):
                best[(n, d, causal)] = (row["ms_median"], tiles, products, heads)
        runtime.release_memory()
    return rows, {key: choice for key, (_, *choice) in best.items()}


def best_at(best: dict, n: int, d: int, causal: bool) -> tuple:
    """The sweep's fastest (tiles, products, heads) for (d, causal) at the largest swept
    N <= n (the smallest swept N where none is), or mma.sync's tiles and the default build."""
    swept = sorted(k[0] for k in best if k[1:] == (d, causal))
    if not swept:
        return MMA_TILES, None, None
    return best[(max([m for m in swept if m <= n] or swept[:1]), d, causal)]


def public_call(p: lo.Problem, rng) -> dict:
    """q_outer through `lo.attention` on torch tensors naming no tiles (the tiles and build a
    user gets on this GPU, `Schedule.fast_tiles`), timed as the kernels are, host included
    (its calls queue while the GPU runs the last)."""
    import torch

    sched = lo.get_schedule("q_outer")
    sets = [tuple(torch.randn(p.batch, p.heads, p.n_q, p.d, device="cuda",
                              dtype=getattr(torch, p.dtype)) for _ in range(3))
            for _ in range(br.input_sets(p))]

    def launch(i):
        return lo.attention(*sets[i % len(sets)], causal=p.causal)

    chosen = launch(0).problem
    row = br.blank_row("q_outer public call", p.dtype, sched, chosen)
    row["provider"] = "q_outer public call"
    try:
        out = launch(0).out.float().cpu().numpy().reshape(p.bh, p.n_q, p.dv)
        host = [t.float().cpu().numpy().reshape(p.bh, p.n_q, -1) for t in sets[0]]
        err = check_output(sched, chosen, *host, out, rng)
        ms = br.time_launches(launch)
    except (AssertionError, RuntimeError, ValueError) as exc:
        row["status"] = f"wrong: {str(exc)[:160]}"
        return row
    row.update(ms_median=round(ms, 4), tflops=round(br.flops(p) / ms / 1e9, 3),
               rel_error=f"{err:.2e}")
    print(f"q_outer public call d={p.d} causal={p.causal} N={p.n_q} {chosen.block_q}x"
          f"{chosen.block_k} {row['layout']}: {ms:.3f} ms", flush=True)
    return row


def table(rng, best: dict, points) -> list[dict]:
    rows = []
    for n, d, causal, dtype in points:
        tiles, products, heads = best_at(best, n, d, causal)
        p = problem("q_outer", n, d, causal, dtype, tiles)
        point = [br.measure(f"torch_sdpa_{backend}", dtype, backend, p, rng)
                 for backend in ("flash", "cudnn")]
        point.append(timed(with_heads(f"q_outer {products or 'wgmma'}", heads), "q_outer", p,
                           rng, products=products, heads=heads))
        point.append(public_call(p, rng))
        point.append(timed("kv_outer wgmma", "kv_outer",
                           problem("kv_outer", n, d, causal, dtype, tiles), rng))
        point.append(timed("q_outer mma.sync", "q_outer",
                           problem("q_outer", n, d, causal, dtype, MMA_TILES), rng,
                           products="mma"))
        if n <= DENSE_N:  # S and P in HBM: B H N^2 floats each
            dense = problem("dense", n, d, causal, dtype, DENSE_TILES)
            point += [timed("dense wgmma", "dense", dense, rng),
                      timed("dense mma.sync", "dense", dense, rng, products="mma")]
        base = {r["provider"]: r["ms_median"] for r in point if r["status"] == "ok"}
        for r in point:
            for backend in ("flash", "cudnn"):
                theirs = base.get(f"torch_sdpa_{backend}")
                r[f"vs_{backend}"] = round(theirs / r["ms_median"], 3) \
                    if theirs and r["status"] == "ok" else ""
        rows += point
        runtime.release_memory()
    return rows


def uniform(rows: list[dict]) -> list[dict]:
    """The rows with every key any of them has (blank where a row has none), in order."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return [{k: r.get(k, "") for k in keys} for r in rows]


def swept_tiles(text: str) -> tuple[int, tuple[int, int]]:
    """--tiles' "D:BQxBK" as (d, (block_q, block_k))."""
    d, tiles = text.split(":")
    block_q, block_k = tiles.split("x")
    return int(d), (int(block_q), int(block_k))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--quick", action="store_true", help="N = 4096 only, float16 only")
    parser.add_argument("--n", type=int, nargs="+", help="the table's N (default: TABLE's)")
    parser.add_argument("--dtypes", help="comma-separated (default: float16,bfloat16)")
    parser.add_argument("--sweep-n", type=int, nargs="+", default=[TILE_N],
                        help=f"the N of the tile sweep (default {TILE_N}); the table takes "
                        "the fastest at the largest swept N <= its own")
    parser.add_argument("--causal-heads", type=int, nargs="+", default=(),
                        help="sweep causal points again with the grid taking this many "
                        "heads at a time (`tuning` causal_heads, 0: over every head; default: "
                        "none)")
    parser.add_argument("--variants-only", action="store_true",
                        help="the sweep's variants at VARIANT_TILES only")
    parser.add_argument("--variants", nargs="+", choices=[v for _, v in VARIANTS],
                        help="sweep only these variants (default: all of VARIANTS)")
    parser.add_argument("--tiles", nargs="+", type=swept_tiles, metavar="D:BQxBK",
                        help="sweep only these head dims and tiles, e.g. 128:64x128 "
                        "(default: TILES)")
    args = parser.parse_args(argv)
    if args.variants_only:
        TILES.update({d: [tiles] for d, tiles in VARIANT_TILES.items()})
    if args.tiles:
        TILES.clear()
        for d, tiles in args.tiles:
            TILES.setdefault(d, []).append(tiles)
    if args.variants:
        VARIANTS[:] = [v for v in VARIANTS if v[1] in args.variants]
    args.out.mkdir(parents=True, exist_ok=True)
    br.PROV = prov = provenance()
    rng = np.random.default_rng()
    path = args.out / "bench_hopper.csv"
    tile_rows, best = sweep_tiles(rng, path, prov, args.sweep_n, args.causal_heads)
    for (n, d, causal), (tiles, products, heads) in sorted(best.items()):
        print(f"fastest wgmma tiles, N={n} d={d} causal={causal}: {tiles} {products}"
              + (f", heads {heads} a group" if heads else ""), flush=True)
    n = args.n or ([TILE_N] if args.quick else TABLE["n"])
    dtypes = args.dtypes.split(",") if args.dtypes else (
        ["float16"] if args.quick else TABLE["dtype"])
    warm(((name, problem(name, n[0], d, causal, dtype,
                         DENSE_TILES if name == "dense" else best_at(best, n[0], d, causal)[0]),
           False) for name in ("q_outer", "kv_outer", "dense")
          for d, causal, dtype in itertools.product(TABLE["d"], TABLE["causal"], dtypes)),
         counted=(False,))  # the table's default builds (mma.sync's compile as they come)
    rows = []
    for point in itertools.product(n, TABLE["d"], TABLE["causal"], dtypes):
        rows += table(rng, best, [point])
        write_csv(path, uniform([{"part": "tiles", **r} for r in tile_rows]
                                + [{"part": "table", **r} for r in rows]), prov)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
