"""Getting host-built tensors onto the device without making the host wait.

`upload` is one pinned, non-blocking copy; `HostStaging` packs all of a step's index uploads
into one copy (`StepContext.staged`).
"""

from __future__ import annotations

import torch


def upload(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device` without making the host wait: pinned + non-blocking on CUDA
    (the caching host allocator keeps the pinned buffer alive until the copy has run)."""
    if device.type == "cpu":
        return x
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


class HostStaging:
    """Pinned host and device int64 buffers that carry a step's host-built index tensors to the
    device in one non-blocking copy (`StepContext.staged`) instead of one pinned allocation and
    copy each (~70 us of host time apiece on the H200 host).

    `depth` buffer pairs are used in turn; a host buffer is refilled only once the copy that
    last read it has run (an event; with async scheduling at most two steps are in flight, so
    with depth 4 that wait never blocks), and the device buffer's next copy is ordered after
    every kernel of the step that read it (one stream). Owned by the model (`Model.staging`).
    """

    def __init__(self, device: torch.device, capacity: int = 1 << 20, depth: int = 4) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.pairs = [
            (
                torch.empty(capacity, dtype=torch.int64, pin_memory=self.cuda),
                torch.empty(capacity, dtype=torch.int64, device=device),
            )
            for _ in range(depth)
        ]
        self.events: list[torch.cuda.Event | None] = [None] * depth
        self.next = 0

    def acquire(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (host, device) pair, its previous copy finished."""
        ev = self.events[self.next]
        if ev is not None and not ev.query():
            ev.synchronize()
        return self.pairs[self.next]

    def release(self, used: int) -> None:
        """Enqueue the copy of the first `used` elements of the acquired pair."""
        host, dev = self.pairs[self.next]
        if used:
            dev[:used].copy_(host[:used], non_blocking=True)
            if self.cuda:
                ev = torch.cuda.Event()
                ev.record()
                self.events[self.next] = ev
        self.next = (self.next + 1) % len(self.pairs)
