"""How the ranks of one engine meet: a store to rendezvous at, then `torch.distributed`.

Single node (`LoopbackStore`): the process that starts the ranks hosts the rendezvous store
itself, on a socket it binds to 127.0.0.1 on a port the OS picks (never a fixed one, never
another interface), and hands the address to its ranks (`RankInit`). The ranks' own
collectives (gloo, NCCL's bootstrap) are bound to the loopback interface too
(`loopback_socket_env`). Several nodes (torchrun): the ranks meet at the address the user
passed (``MASTER_ADDR:MASTER_PORT``), and nothing else is opened.

Only tensors cross the process groups made here; nothing is unpickled from a socket.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class RankInit:
    """What one rank needs to join: the store's address (`host`, `port`), its `rank` of
    `world_size`, the collective `backend` ("gloo" on CPU, "nccl" on CUDA) and the timeout of
    the rendezvous and of every collective, in seconds. The store is already listening
    (`LoopbackStore`)."""

    host: str
    port: int
    rank: int
    world_size: int
    backend: str
    timeout_s: float = 600.0


class LoopbackStore:
    """The rendezvous store of a single-node engine, hosted by the process that starts the
    ranks: a `TCPStore` master on 127.0.0.1 and a free port chosen by the OS when the socket is
    bound (no window in which another process could take it). Keep the object alive while the
    ranks run; `close()` stops it."""

    def __init__(self, world_size: int, timeout_s: float = 600.0) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((LOOPBACK, 0))
            sock.listen(max(16, 2 * world_size))
            self.port: int = sock.getsockname()[1]
        except BaseException:
            sock.close()
            raise
        # The store takes the listening socket over (it closes it when it is destroyed).
        self._store: dist.TCPStore | None = dist.TCPStore(
            LOOPBACK,
            self.port,
            world_size + 1,
            is_master=True,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=sock.detach(),
            use_libuv=False,
        )
        self.host = LOOPBACK

    def close(self) -> None:
        self._store = None


def loopback_interface() -> str:
    """The name of the loopback network interface ("lo" on Linux, "lo0" on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    for name in ("lo", "lo0"):
        if name in names:
            return name
    raise RuntimeError(
        f"no loopback network interface found (interfaces: {', '.join(names)}); a single-node "
        "engine binds its collectives to loopback only"
    )


def loopback_socket_env() -> dict[str, str]:
    """Environment for a single-node rank so that gloo and NCCL open their sockets on the
    loopback interface only (both libraries read these variables when a group is created)."""
    lo = loopback_interface()
    return {"GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo}


def init_rank(spec: RankInit) -> None:
    """Join the default process group at `spec`'s store (blocks until all ranks joined)."""
    timeout = timedelta(seconds=spec.timeout_s)
    store = dist.TCPStore(spec.host, spec.port, spec.world_size, is_master=False, timeout=timeout)
    dist.init_process_group(
        spec.backend, store=store, rank=spec.rank, world_size=spec.world_size, timeout=timeout
    )


def init_rank_from_launcher(rank: int, world_size: int, backend: str, timeout_s: float) -> None:
    """Join the default process group that a launcher (torchrun) set up: the rendezvous
    address is the one the user gave the launcher (its ``MASTER_ADDR``/``MASTER_PORT``)."""
    dist.init_process_group(
        backend,
        init_method="env://",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
