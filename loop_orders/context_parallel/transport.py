"""The counted transport: every transfer of a context-parallel schedule is issued here.

`Link` wraps the torch.distributed calls the schedules use (NCCL on GPUs, gloo on CPU; no
transport of our own) and counts, per step and tensor, the bytes this device sends to other
devices and receives from them, at the place each transfer is issued:

    shift(step, tensors)      batch_isend_irecv: each tensor to the next device of the ring,
                              the previous device's into a new buffer     sent = received = x
    all_gather(step, name, x) every device's x to every device            sent = (P-1) x,
                                                                          received = sum of
                                                                          the other P-1
    all_to_all(step, name, pieces)  piece j to device j, device j's back  sent = pieces to
                                                                          others, received =
                                                                          pieces from others

(x: a tensor's bytes, numel x element size.) A device's own piece never leaves it and is not
counted. These are the bytes the collective's definition moves between devices, whatever
algorithm NCCL picks for it (a ring all-gather sends and receives exactly these). A group of
one device (or no process group at all) moves nothing: the calls return their input.

`Timeline` records where time goes when a call is timed: CUDA events on the device's current
stream for CUDA tensors (read once, after one synchronisation, at the end), the host clock
for CPU tensors (gloo's waits and the simulator's launches have finished when they return).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch
import torch.distributed as dist

# The order tensors are listed in (steps first).
TENSOR_ORDER = ("q", "k", "v", "o", "lse")


class Transfer(NamedTuple):
    """Bytes one device moves for one tensor in one step of a schedule."""

    step: int
    tensor: str
    sent: int  # bytes this device sends to other devices
    received: int  # bytes it receives from other devices


class StepBytes(NamedTuple):
    """A step's bytes over every tensor."""

    sent: int
    received: int


def sort_transfers(transfers) -> tuple[Transfer, ...]:
    return tuple(sorted(transfers, key=lambda t: (t.step, TENSOR_ORDER.index(t.tensor))))


def per_step(transfers) -> dict[int, StepBytes]:
    """{step: StepBytes} summed over the tensors of each step."""
    steps: dict[int, StepBytes] = {}
    for t in transfers:
        held = steps.get(t.step, StepBytes(0, 0))
        steps[t.step] = StepBytes(held.sent + t.sent, held.received + t.received)
    return dict(sorted(steps.items()))


def nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


class Shift:
    """Transfers `Link.shift` has issued: `wait()` returns the received tensors by name."""

    def __init__(self, works, received: dict[str, torch.Tensor]):
        self._works, self._received = works, received

    def wait(self) -> dict[str, torch.Tensor]:
        for work in self._works:
            work.wait()
        return self._received


class Link:
    """This device's end of the interconnect within `group` (None: the default group, or a
    single device when torch.distributed is not initialised), counting every transfer."""

    def __init__(self, group=None):
        self.group = group
        joined = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if joined else 0
        self.world = dist.get_world_size(group) if joined else 1
        if self.rank < 0:
            raise ValueError("group: this process is not a member of the process group")
        self._bytes: dict[tuple[int, str], StepBytes] = {}

    def _count(self, step: int, tensor: str, sent: int, received: int) -> None:
        held = self._bytes.get((step, tensor), StepBytes(0, 0))
        self._bytes[step, tensor] = StepBytes(held.sent + sent, held.received + received)

    def transfers(self) -> tuple[Transfer, ...]:
        """What this device has sent and received so far, per (step, tensor)."""
        return sort_transfers(Transfer(step, tensor, b.sent, b.received)
                              for (step, tensor), b in self._bytes.items())

    def _global(self, rank: int) -> int:
        """The default group's rank of this group's `rank` (what P2POp takes)."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def shift(self, step: int, tensors: dict[str, torch.Tensor]) -> Shift:
        """Send each tensor to the next device of the ring (rank + 1) and receive the
        previous device's (rank - 1) into new buffers, all issued at once; returns at once."""
        after = self._global((self.rank + 1) % self.world)
        before = self._global((self.rank - 1) % self.world)
        tensors = {name: x.contiguous() for name, x in tensors.items()}
        received = {name: torch.empty_like(x) for name, x in tensors.items()}
        ops = [dist.P2POp(dist.isend, x, after, self.group) for x in tensors.values()]
        ops += [dist.P2POp(dist.irecv, buf, before, self.group) for buf in received.values()]
        for name, x in tensors.items():
            self._count(step, name, nbytes(x), nbytes(received[name]))
        return Shift(dist.batch_isend_irecv(ops), received)

    def all_gather(self, step: int, name: str, x: torch.Tensor) -> list[torch.Tensor]:
        """Every device's x, in rank order (this device's own is x itself)."""
        if self.world == 1:
            return [x]
        x = x.contiguous()
        out = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(out, x, group=self.group)
        out[self.rank] = x
        others = [o for j, o in enumerate(out) if j != self.rank]
        self._count(step, name, (self.world - 1) * nbytes(x), sum(map(nbytes, others)))
        return out

    def all_to_all(self, step: int, name: str, pieces: list[torch.Tensor]
                   ) -> list[torch.Tensor]:
        """Send pieces[j] to device j; return what each device j sent here, in rank order
        (square exchange: device j's piece for us is shaped like ours for it)."""
        if self.world == 1:
            return list(pieces)
        pieces = [x.contiguous() for x in pieces]
        out = [torch.empty_like(x) for x in pieces]
        dist.all_to_all(out, pieces, group=self.group)
        out[self.rank] = pieces[self.rank]
        self._count(step, name, sum(nbytes(x) for j, x in enumerate(pieces) if j != self.rank),
                    sum(nbytes(x) for j, x in enumerate(out) if j != self.rank))
        return out


class Span(NamedTuple):
    """Time one device spent in one part of a step (milliseconds).

    what: 'transfer' (issued to complete, nothing else in between), 'compute' (the local
    kernels and the combine), 'wait' (after the compute, until the transfer it overlapped
    is complete: the transfer time left exposed), 'step' (the whole step)."""

    step: int
    what: str
    ms: float


class Timeline:
    """Marks in the device's order of work, turned into Spans at the end. Disabled, every
    method is a no-op (the untimed path records nothing and never synchronises)."""

    def __init__(self, enabled: bool, device: torch.device):
        self.enabled = enabled
        self.cuda = enabled and device.type == "cuda"
        self._pending: list[tuple[int, str, object, object]] = []

    def mark(self):
        if not self.enabled:
            return None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()  # on the current stream, where our kernels run
            return event
        return time.perf_counter()

    def add(self, step: int, what: str, start, end) -> None:
        if self.enabled:
            self._pending.append((step, what, start, end))

    def spans(self) -> tuple[Span, ...] | None:
        if not self.enabled:
            return None
        if self.cuda:
            torch.cuda.synchronize()
            return tuple(Span(step, what, start.elapsed_time(end))
                         for step, what, start, end in self._pending)
        return tuple(Span(step, what, (end - start) * 1e3)
                     for step, what, start, end in self._pending)
