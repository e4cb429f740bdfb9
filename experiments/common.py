"""What the experiments share: options, where files go, measuring one point, saving figures."""

from __future__ import annotations

import argparse
import os
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import loop_orders as lo
from loop_orders import results
from loop_orders.api import check_launch, check_simulator_budget
from loop_orders.api_grad import check_backward
from loop_orders.core.ledger import TENSORS, Ledger
from loop_orders.core.schedule import Problem, Schedule, backward_of
from loop_orders.device import runtime
from loop_orders.reference import (
    attention_grad_reference,
    grad_tolerance,
    relative_error,
    tolerance,
)

from .gpu_common import reference_rows

REPO_ROOT = Path(__file__).resolve().parent.parent
FIGURES_DIR = REPO_ROOT / "figures"
NOTES_PATH = REPO_ROOT / "paper_notes.md"
QUICK_DIR = Path(tempfile.gettempdir()) / "loop_orders_quick"

# What the simulator can measure in reasonable time (one Python thread per CUDA thread).
SIMULATOR_MAX_N = 64
SIMULATOR_MAX_D = 16
# What a GPU run measures: everything that launches, up to this N (dense writes N^2 floats).
GPU_MAX_N = 16384


@dataclass
class Context:
    """Options every experiment takes."""

    results_dir: Path
    figures_dir: Path
    notes_path: Path
    quick: bool = False
    progress: bool = True
    fresh: bool = False

    @property
    def backend(self) -> str:
        return runtime.backend_name()

    def results_path(self, name: str, backend: str | None = None) -> Path:
        return self.results_dir / f"{name}.{backend or self.backend}.json"

    def sweep(self, name: str, meta: dict) -> results.Sweep:
        return results.Sweep(f"{name}.{self.backend}", self.results_dir,
                             meta={**meta, "quick": self.quick}, fresh=self.fresh)

    def gpu_results(self, name: str) -> dict | None:
        """A committed GPU results file of this experiment, when we are not on the GPU."""
        path = self.results_path(name, "gpu")
        if self.backend == "gpu" or not path.exists():
            return None
        return results.load(path)


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help=f"small sweeps (CI); files go under {QUICK_DIR} unless the "
                             f"directories are given")
    parser.add_argument("--results-dir", default=None,
                        help=f"where results files go (default: ${results.ENV_RESULTS_DIR} "
                             f"or results/)")
    parser.add_argument("--figures-dir", default=None, help="where figures go (figures/)")
    parser.add_argument("--notes", default=None, help="paper_notes.md to rewrite")
    parser.add_argument("--fresh", action="store_true",
                        help="discard stored points instead of resuming")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def context_from_args(args: argparse.Namespace) -> Context:
    quick = bool(getattr(args, "quick", False))
    base = QUICK_DIR if quick else None
    env_results = os.environ.get(results.ENV_RESULTS_DIR)
    results_dir = Path(args.results_dir or env_results or
                       (base / "results" if base else results.results_dir()))
    figures_dir = Path(args.figures_dir or (base / "figures" if base else FIGURES_DIR))
    notes = Path(args.notes or (figures_dir.parent / "paper_notes.md" if quick else NOTES_PATH))
    return Context(results_dir=results_dir, figures_dir=figures_dir, notes_path=notes,
                   quick=quick, progress=not getattr(args, "no_progress", False),
                   fresh=bool(getattr(args, "fresh", False)))


def problem(sched: Schedule, n: int, d: int, block_q: int, block_k: int,
            causal: bool = False, options: dict | None = None) -> Problem:
    """The Problem of one point, without the launch limits (models hold at any size), with
    the schedule's options (defaults unless given)."""
    return Problem(n_q=n, n_k=n, d=d, dv=d, block_q=min(block_q, n), block_k=min(block_k, n),
                   causal=causal, options=sched.options_for(options))


# A GPU run measures a point when its kernels should take under this long (seconds):
# GPU_STEP_S per tile step of the longest chain of one CTA's steps, per wave of CTAs, plus the
# model's bytes at GPU_BYTES_PER_S. Generous; it keeps out Bc = 1 at N = 4096 and the like.
GPU_POINT_BUDGET_S = 2.0
GPU_STEP_S = 4e-6
GPU_BYTES_PER_S = 2e12
GPU_CTA_SLOTS = 264  # 132 SMs x 2


def gpu_seconds(order, p: Problem) -> float:
    """A rough upper estimate of a launch's time for the forward (Schedule) or backward
    (BackwardSchedule) `order` at p."""
    ctas = order.ctas(p)
    steps = p.bh * p.visited_pairs() / ctas * -(-ctas // GPU_CTA_SLOTS)
    return steps * GPU_STEP_S + order.model(p).bytes(p.itemsize) / GPU_BYTES_PER_S


def measurable(sched: Schedule, p: Problem, backend: str | None = None,
               backward: bool = False) -> bool:
    """Whether this backend measures the point with kernels (else it is only modelled)."""
    backend = backend or runtime.backend_name()
    if backend == "simulator" and (p.n_q > SIMULATOR_MAX_N or p.d > SIMULATOR_MAX_D):
        return False
    if p.n_q > GPU_MAX_N:
        return False
    try:
        lo.make_problem(sched.name, n_q=p.n_q, d=p.d, dv=p.dv, block_q=p.block_q,
                        block_k=p.block_k, causal=p.causal, options=dict(p.options))
        check_launch(sched, p, count=True, simulator_budget=False)
        if backward:
            check_backward(sched, backward_of(sched), p, True, True, simulator_budget=False)
        if backend == "simulator" and runtime.SIMULATOR:
            check_simulator_budget(sched, p, backward)
    except ValueError:
        return False
    if backend == "gpu":
        orders = [sched] + ([backward_of(sched)] if backward else [])
        return sum(gpu_seconds(o, p) for o in orders) <= GPU_POINT_BUDGET_S
    return True


def measure(sched: Schedule, p: Problem, seed: int, backward: bool = False
            ) -> tuple[Ledger, float]:
    """Run the counted kernels on random inputs; return (counts, relative error): of the
    forward, or with `backward` of the backward pass (its gradients' largest error).

    Correctness gates the count: an output that fails the reference check raises.
    """
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((p.n_q, w)).astype(np.float32) for w in (p.d, p.d, p.dv))
    kwargs = {"schedule": sched.name, "block_q": p.block_q, "block_k": p.block_k,
              "causal": p.causal, "options": dict(p.options), "count": True}
    # past FULL_CHECK_N the float64 check takes sampled rows (the reference is quadratic)
    rows = (np.arange(p.n_q) if p.n_q <= FULL_CHECK_N else
            np.sort(rng.choice(p.n_q, CHECK_ROWS, replace=False)))
    if backward:
        do = rng.standard_normal((p.n_q, p.dv)).astype(np.float32)
        g = lo.attention_grad(q, k, v, do, **kwargs)
        if p.n_q <= FULL_CHECK_N:
            refs = attention_grad_reference(q, k, v, do, causal=p.causal)
            got = [runtime.to_host(x) for x in (g.dq, g.dk, g.dv)]
        else:  # dQ's sampled rows (dK and dV need every row; tests/test_gpu.py checks them)
            refs = [dq_rows_reference(q, k, v, do, rows, p.causal)]
            got = [runtime.to_host(g.dq)[rows]]
        err = max(relative_error(x, r) for x, r in zip(got, refs, strict=True))
        tol = grad_tolerance(p.dtype, backward_of(sched).output_roundings(p))
        counts = g.counts_backward
    else:
        res = lo.attention(q, k, v, **kwargs)
        ref = reference_rows(q[None], k[None], v[None], [0], rows, p.causal)[0]
        err = relative_error(runtime.to_host(res.out)[rows], ref)
        tol = tolerance(p.dtype, sched.output_roundings(p), v, ref)
        counts = res.counts
    runtime.release_memory()
    if not err <= tol:
        raise RuntimeError(f"{sched.name} failed the reference check at {p.describe()}: "
                           f"relative error {err:.2e} > {tol:.1e}")
    return counts, err


FULL_CHECK_N = 2048
CHECK_ROWS = 64


def dq_rows_reference(q, k, v, do, rows, causal: bool) -> np.ndarray:
    """Float64 dQ of the given query rows (a row of dQ needs its rows of P and dP only)."""
    q, k, v, do = (np.asarray(x, dtype=np.float64) for x in (q, k, v, do))
    scale = 1.0 / np.sqrt(q.shape[-1])
    s = scale * q[rows] @ k.T
    if causal:
        s = np.where(np.arange(k.shape[0])[None, :] <= rows[:, None], s, -np.inf)
    prob = np.exp(s - s.max(axis=1, keepdims=True))
    prob /= prob.sum(axis=1, keepdims=True)
    dp = do[rows] @ v.T
    ds = prob * (dp - (prob * dp).sum(axis=1, keepdims=True))
    return scale * ds @ k


def model_and_measure(sched: Schedule, p: Problem, seed: int, backward: bool = False) -> dict:
    """The values stored for one point: model, and measured counts where this backend can
    (the forward pass, or with `backward` the backward pass)."""
    order = backward_of(sched) if backward else sched
    values = {"model": order.model(p).to_dict(), "measured": None, "backend": None,
              "rel_error": None}
    if p.options:
        values["options"] = dict(p.options) if backward else sched.resolved_options(p)
    if measurable(sched, p, backward=backward):
        counts, err = measure(sched, p, seed, backward)
        values.update(measured=counts.to_dict(), backend=runtime.backend_name(), rel_error=err)
    return values


def total(ledger_dict: dict | None) -> int | None:
    if ledger_dict is None:
        return None
    return Ledger.from_dict(ledger_dict).total


def declared_tensors(names, ledgers=()) -> tuple[str, ...]:
    """Every tensor the schedules `names` declare (`Schedule.ledger_tensors`: the common ones,
    then each schedule's own, such as split_kv's workspace) and any other tensor one of
    `ledgers` holds, each once. Tables, bars and checks iterate over these, never over the
    common tensors alone, so no schedule's own tensor can drop out of them."""
    known = set(lo.schedule_names())
    declared = [t for n in names if n in known for t in lo.get_schedule(n).ledger_tensors()]
    held = [t for lg in ledgers for t in lg.tensors]
    return tuple(dict.fromkeys([*TENSORS, *declared, *held]))


def tensor_totals(ledger_dict: dict, tensors) -> dict[str, int]:
    """Elements read + written per tensor of `tensors` (zero where the ledger moves none)."""
    ledger = Ledger.from_dict(ledger_dict)
    return {t: ledger.tensor_total(t) for t in tensors}


def run_experiment(module, argv=None) -> Context:
    """Command-line entry of one experiment module: run its sweep, plot, print the figures."""
    parser = argparse.ArgumentParser(description=module.__doc__.split("\n\n")[0])
    add_options(parser)
    ctx = context_from_args(parser.parse_args(argv))
    module.run(ctx)
    for path in module.plot(ctx):
        print(path)
    return ctx


def save_figure(fig, figures_dir: Path, name: str) -> list[Path]:
    """Write figures/<name>.png and .pdf atomically (temporary file, then rename), then close
    the figure."""
    figures_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for ext, kwargs in (("png", {"dpi": 150, "metadata": {"Software": None}}),
                        ("pdf", {"metadata": {"CreationDate": None, "Producer": None}})):
        target = figures_dir / f"{name}.{ext}"
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=f".{ext}", dir=figures_dir)
        os.close(fd)
        try:
            fig.savefig(tmp, format=ext, bbox_inches="tight", **kwargs)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        written.append(target)
    pyplot().close(fig)
    return written


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def schedule_colors(names) -> dict[str, str]:
    palette = ["tab:red", "tab:blue", "tab:green", "tab:purple", "tab:orange", "tab:brown",
               "tab:pink", "tab:gray", "tab:olive", "tab:cyan"]
    return {name: palette[i % len(palette)] for i, name in enumerate(names)}


def tensor_colors(tensors) -> dict[str, tuple]:
    """A colour per tensor drawn (tab10, then tab20's lighter shades past ten tensors)."""
    import matplotlib

    palette = (*matplotlib.colormaps["tab10"].colors, *matplotlib.colormaps["tab20"].colors[1::2])
    return {t: palette[i % len(palette)] for i, t in enumerate(tensors)}


def seed_for(config: dict) -> int:
    """A fixed input seed per configuration, so a resumed sweep measures the same inputs."""
    return zlib.crc32(results.config_key(config).encode())
