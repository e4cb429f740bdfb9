"""Where a kernel's instructions go: the loops of its SASS and the blocks that copy tiles.

    python -m experiments.sass_loops [--schedule q_outer] [--n 4096] [--d 64 128]
        [--block-q 128] [--block-k 64] [--causal no|yes|both] [--dtype float32 ...]
        [--count] [--backward] [--option dq=separate] [--out results/sass_loops.json]

On a machine without a GPU (as `ptx_check`: libNVVM and ptxas from the CUDA toolkit) each
kernel of each problem's forward call (B = 4, H = 16, dv = d) is built for sm_90a and
disassembled with nvdisasm (the CUDA toolkit's, or PyPI's nvidia-cuda-nvdisasm). An FMA
kernel limited by issue slots runs at best at the share of FFMA among the instructions it
issues, so this prints, per kernel:

    loops:   each backward branch's body (first and last address), its instructions, FFMA,
             shared loads, the loops nested in it (the hot loops over S_ij's chunks and
             P_ij V_j's keys, the K/V loop around them), and the cycles a trip of it may lose
             to register-bank conflicts on its FFMAs (`bank_conflicts`)
    copies:  each basic block holding cp.async (LDGSTS) instructions: its instructions per
             copy, the address arithmetic a tile load costs

On tensor-core kernels (16-bit inputs, TF32) a loop row also counts its HMMA (mma.sync),
LDSM (ldmatrix), shared stores, barriers and global atomics, and the instructions a trip
issues per HMMA (`per_hmma`); --backward reports the backward's kernels instead of the
forward's.

Counts are static (one trip of a loop, both sides of a branch); a trip's share of FFMA is the
issue-slot bound of that loop. With --out the rows go to a JSON file with provenance.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import NamedTuple

INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")
BRANCH_TARGET = re.compile(r"`\((\.L_x_\d+)\)")
GUARD = re.compile(r"^@!?U?P[T0-9]+\s+")
REGISTER = re.compile(r"^[-|]*R(\d+)(\.reuse)?")
GLOBAL_ATOMICS = ("RED", "REDG", "ATOM", "ATOMG")  # not ATOMS (shared) or REDUX (a warp's)


class Instruction(NamedTuple):
    address: int
    text: str

    @property
    def opcode(self) -> str:
        """The opcode without its guard predicate and modifiers (FFMA, LDS, BRA, ...)."""
        return GUARD.sub("", self.text).split()[0].split(".")[0]

    @property
    def operands(self) -> list[str]:
        """The operands' text, destination first."""
        parts = GUARD.sub("", self.text).split(None, 1)
        return [o.strip() for o in parts[1].split(",")] if len(parts) > 1 else []


class Block(NamedTuple):
    label: str
    instructions: list


class Loop(NamedTuple):
    start: int
    end: int
    instructions: int
    ffma: int
    shared_loads: int
    nested: int
    bank_conflicts: int  # `bank_conflicts` of a trip
    hmma: int  # tensor-core products (HMMA: mma.sync on 16-bit inputs or TF32)
    ldsm: int  # ldmatrix loads
    shared_stores: int
    barriers: int  # BAR (__syncthreads and named barriers)
    atomics: int  # RED / ATOM to global memory


def parse(sass: str) -> tuple[list[Instruction], dict[str, int], list[Block]]:
    """nvdisasm's text as instructions, each label's address and the basic blocks (split at
    labels)."""
    instructions, labels, blocks = [], {}, [Block("entry", [])]
    pending = []
    for line in sass.splitlines():
        if m := LABEL.match(line):
            pending.append(m.group(1))
            blocks.append(Block(m.group(1), []))
        elif m := INSTRUCTION.match(line):
            ins = Instruction(int(m.group(1), 16), m.group(2))
            for name in pending:
                labels[name] = ins.address
            pending = []
            instructions.append(ins)
            blocks[-1].instructions.append(ins)
    return instructions, labels, [b for b in blocks if b.instructions]


def bank_conflicts(body: list[Instruction]) -> int:
    """A static estimate of the cycles a trip of `body` loses to register-bank conflicts on
    its FFMAs, on the model of two register banks (register number mod 2), which Jia et al.
    2018 ("Dissecting the NVIDIA Volta GPU Architecture via Microbenchmarking") measured on
    Volta; NVIDIA documents none for Hopper. An FFMA reads its three sources from the banks,
    except a source the operand reuse cache holds (the same register in the same slot,
    marked .reuse by the instruction before), and each source beyond the first from one bank
    costs a cycle. The compiler assigns registers to keep this low. On the H200 the count
    ranked three builds of q_outer's warp-specialised kernel as their times did, and ncu's
    dispatch stalls rose with it between two of them
    (results/gpu_logs/ws_persistent_tickets_6d1d23f.log)."""
    cycles, cached = 0, [None, None, None]  # the register the reuse cache holds per slot
    for ins in body:
        if ins.opcode != "FFMA":
            cached = [None, None, None]
            continue
        banks = [0, 0]
        for slot, text in enumerate(ins.operands[1:4]):
            m = REGISTER.match(text)
            reg = int(m.group(1)) if m else None
            if reg is not None and reg != cached[slot]:
                banks[reg % 2] += 1
            cached[slot] = reg if m and m.group(2) else None
        cycles += max(0, max(banks) - 1)
    return cycles


def loops(instructions: list[Instruction], labels: dict[str, int]) -> list[Loop]:
    """One loop per backward branch: the instructions from its target to the branch."""
    spans = []
    for ins in instructions:
        m = BRANCH_TARGET.search(ins.text)
        if ins.opcode == "BRA" and m and labels.get(m.group(1), ins.address + 1) <= ins.address:
            spans.append((labels[m.group(1)], ins.address))
    found = []
    for start, end in spans:
        body = [i for i in instructions if start <= i.address <= end]
        ops = Counter(i.opcode for i in body)
        nested = sum(1 for s, e in spans if (s, e) != (start, end) and start <= s and e <= end)
        found.append(Loop(start, end, len(body), ops["FFMA"], ops["LDS"], nested,
                          bank_conflicts(body), ops["HMMA"], ops["LDSM"], ops["STS"],
                          ops["BAR"], sum(ops[op] for op in GLOBAL_ATOMICS)))
    return found


def copy_blocks(blocks: list[Block]) -> list[dict]:
    """The basic blocks issuing cp.async copies: instructions per copy."""
    rows = []
    for b in blocks:
        copies = sum(1 for i in b.instructions if i.opcode == "LDGSTS")
        if copies:
            rows.append({"label": b.label, "start": f"{b.instructions[0].address:#x}",
                         "instructions": len(b.instructions), "copies": copies,
                         "per_copy": round(len(b.instructions) / copies, 1)})
    return rows


def nvdisasm() -> str:
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia
    except ImportError:
        nvidia = None
    for root in getattr(nvidia, "__path__", []):
        for path in Path(root).glob("cu*/bin/nvdisasm"):
            return str(path)
    raise SystemExit("sass_loops: no nvdisasm (the CUDA toolkit's, or pip install "
                     "nvidia-cuda-nvdisasm)")


def report(kernel, args) -> dict:
    from experiments import ptx_check

    ptx = ptx_check.kernel_ptx(kernel, args)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        built = ptx_check.ptxas(ptx, cubin)
        sass = subprocess.run([nvdisasm(), "-c", "-g", str(cubin)], capture_output=True,
                              text=True, check=True).stdout
    instructions, labels, blocks = parse(sass)
    return {"kernel": kernel.py_func.__name__, "registers": built["registers"],
            "spill_stores": built["spill_stores"], "instructions": len(instructions),
            "loops": [{**lp._asdict(), "start": f"{lp.start:#x}", "end": f"{lp.end:#x}",
                       "ffma_share": round(lp.ffma / lp.instructions, 3),
                       "per_hmma": round(lp.instructions / lp.hmma, 2) if lp.hmma else None}
                      for lp in loops(instructions, labels) if lp.ffma or lp.hmma],
            "copies": copy_blocks(blocks)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", default="q_outer")
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--d", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--block-q", type=int, default=128)
    parser.add_argument("--block-k", type=int, default=64)
    parser.add_argument("--causal", choices=["no", "yes", "both"], default="no")
    parser.add_argument("--dtype", nargs="+", default=["float32"],
                        help="float32, float16, bfloat16, or tf32, tf32x3 (float32 at that "
                        "precision)")
    parser.add_argument("--count", action="store_true", help="the counted builds")
    parser.add_argument("--backward", action="store_true",
                        help="the backward's kernels (tiles --block-q x --block-k)")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="a schedule option, e.g. dq=separate (repeatable)")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args(argv)

    from experiments import ptx_check  # first: it sets up compiling without a device

    lo, sched = ptx_check.lo, ptx_check.lo.get_schedule(args.schedule)
    options = dict(o.split("=", 1) for o in args.option) or None
    rows = []
    for dtype in args.dtype:
        for d in args.d:
            for causal in {"no": [False], "yes": [True], "both": [False, True]}[args.causal]:
                p = lo.make_problem(args.schedule, n_q=args.n, d=d, block_q=args.block_q,
                                    block_k=args.block_k, causal=causal, batch=4, heads=16,
                                    options=options, **ptx_check.input_kind(dtype))
                launches = (ptx_check.backward_launches(sched, p, args.count) if args.backward
                            else ptx_check.recorded(sched, p, args.count, False))
                for kernel, *_, launch_args in launches:
                    row = {"schedule": args.schedule, "n": args.n, "d": d, "dtype": dtype,
                           "causal": causal, "count": args.count, "backward": args.backward,
                           "options": options, **report(kernel, launch_args)}
                    print_row(row)
                    rows.append(row)
    if args.out:
        from loop_orders.results import atomic_write_json, provenance

        atomic_write_json(args.out, {"provenance": provenance(ptxas="sm_90a", cc="9.0"),
                                     "tiles": [args.block_q, args.block_k], "kernels": rows})
    return 0


def print_row(row: dict) -> None:
    print(f"{row['kernel']} d={row['d']} {row['dtype']} causal={row['causal']}: "
          f"{row['registers']} registers, {row['spill_stores']} B spilled, "
          f"{row['instructions']} instructions")
    for lp in row["loops"]:
        tensor = (f"{lp['hmma']} HMMA ({lp['per_hmma']} instructions each), {lp['ldsm']} "
                  f"LDSM, {lp['shared_stores']} STS, {lp['barriers']} BAR, {lp['atomics']} "
                  f"RED/ATOM, " if lp["hmma"] else "")
        print(f"  loop {lp['start']}-{lp['end']}: {lp['instructions']} instructions, {tensor}"
              f"{lp['ffma']} FFMA ({lp['ffma_share']:.0%}), {lp['shared_loads']} LDS, "
              f"{lp['nested']} nested, {lp['bank_conflicts']} bank-conflict cycles")
    for cp in row["copies"]:
        print(f"  copies at {cp['start']}: {cp['copies']} cp.async in {cp['instructions']} "
              f"instructions ({cp['per_copy']} a copy)")


if __name__ == "__main__":
    sys.exit(main())
