"""Start, watch and stop the rank processes of a single-node engine (`LocalRanks`).

The starting process (the driver) hosts the rendezvous store (`rendezvous.LoopbackStore`),
starts one process per rank with the multiprocessing `forkserver` method (a clean server
process that imported torch and the `preload` modules once; each rank is a fork of it, so a
rank starts in a fraction of a second instead of re-importing torch), and talks to each over a
private pipe in bytes only (`send` / `recv`; nothing is unpickled from a pipe: the payload's
format is the caller's, e.g. the engine's typed step messages). Each rank process:

* binds its collectives to the loopback interface, ignores Ctrl-C (the driver handles it and
  tells the ranks), and runs with `threads` intra-op threads;
* exits by itself when the driver is gone (a watchdog on the driver's pid), so killing the
  driver leaves no orphans;
* reports an exception in its entry function as an error frame (rank + traceback) before it
  exits with status 1.

`recv` raises `RankFailure` (naming the rank, its exit status or signal, its error) as soon as a
rank dies or reports an error; `close()` stops every rank (terminate, then kill) and is safe to
call twice, also after a failure.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from .rendezvous import LoopbackStore, RankInit, init_rank, loopback_socket_env

_MSG, _ERR = b"M", b"E"

RankEntry = Callable[..., None]
"""entry(rank: int, conn: RankConn, *args): the body of one rank process (module level, so that
the rank can import it), run after the rank joined the default process group."""

PRELOAD: tuple[str, ...] = ("torch", "torch.distributed", "deepinfer_parallel.local_ranks")


class RankFailure(RuntimeError):
    """A rank process died or raised; `rank` names it."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


class RankConn:
    """A rank's end of its pipe to the driver: bytes frames (`send`, `recv`, `poll`)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def send(self, payload: bytes) -> None:
        self._conn.send_bytes(_MSG + payload)

    def recv(self) -> bytes:
        return self._conn.recv_bytes()

    def poll(self, timeout: float = 0.0) -> bool:
        return self._conn.poll(timeout)

    def send_error(self, text: str) -> None:
        self._conn.send_bytes(_ERR + text.encode("utf-8", "replace"))


@contextlib.contextmanager
def _without_main_module():
    """Start processes without the parent's `__main__`: multiprocessing would re-run the
    user's script in the fork server and in every rank (so any script calling `LLM(...)` at
    top level would need an ``if __name__ == "__main__"`` guard); the ranks run package code
    only."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _watch_driver(driver_pid: int) -> None:
    while True:
        time.sleep(0.5)
        try:
            os.kill(driver_pid, 0)
        except ProcessLookupError:
            os._exit(3)  # the driver is gone: no orphans
        except PermissionError:  # a pid reused by another user's process: also gone
            os._exit(3)


def _rank_main(
    entry: RankEntry,
    init: RankInit,
    conn: Connection,
    driver_pid: int,
    env: dict[str, str],
    threads: int,
    args: tuple,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(env)
    threading.Thread(target=_watch_driver, args=(driver_pid,), daemon=True).start()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    rc = RankConn(conn)
    try:
        init_rank(init)
        entry(init.rank, rc, *args)
    except BaseException:
        with contextlib.suppress(OSError):  # the driver may be gone already
            rc.send_error(f"rank {init.rank}: {traceback.format_exc()}")
        os._exit(1)  # skip teardown: peers may be stuck in a collective with this rank
    if dist.is_initialized():
        dist.destroy_process_group()


class LocalRanks:
    """`world_size` rank processes of one node running `entry` (see the module docstring).

    backend: "gloo" or "nccl"; threads: intra-op threads per rank; timeout_s: rendezvous and
    collective timeout; env: extra environment for the ranks; preload: modules the fork server
    imports once (it is started by the first `LocalRanks` of the process: later ones reuse it
    and their `preload` is not imported again).
    """

    def __init__(
        self,
        entry: RankEntry,
        world_size: int,
        *,
        backend: str = "gloo",
        threads: int = 1,
        timeout_s: float = 600.0,
        args: Sequence[Any] = (),
        env: dict[str, str] | None = None,
        preload: Sequence[str] = (),
    ) -> None:
        self.world_size = world_size
        self._store = LoopbackStore(world_size, timeout_s)
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([*PRELOAD, *preload])
        child_env = {**loopback_socket_env(), **(env or {})}
        self._conns: list[Connection] = []
        self._procs: list[mp.process.BaseProcess] = []
        self._finished: set[int] = set()  # ranks that exited with status 0
        self._closed = False
        try:
            for rank in range(world_size):
                parent, child = ctx.Pipe(duplex=True)
                init = RankInit(
                    self._store.host, self._store.port, rank, world_size, backend, timeout_s
                )
                p = ctx.Process(
                    target=_rank_main,
                    args=(entry, init, child, os.getpid(), child_env, threads, tuple(args)),
                    name=f"deepinfer-rank-{rank}",
                    daemon=True,
                )
                with _without_main_module():
                    p.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(p)
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self._procs]

    def send(self, rank: int, payload: bytes) -> None:
        self._check_open()
        try:
            self._conns[rank].send_bytes(payload)
        except OSError:
            self._raise_failure(rank)

    def send_all(self, payload: bytes) -> None:
        for rank in range(self.world_size):
            self.send(rank, payload)

    def recv(self, timeout_s: float | None = None) -> tuple[int, bytes]:
        """The next message from any rank as (rank, payload); raises `RankFailure` if a rank
        died or reported an error, TimeoutError if none came in `timeout_s`. A rank that
        exited with status 0 after its last message is done, not failed; when every rank is,
        RuntimeError."""
        self._check_open()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            live = [r for r in range(self.world_size) if r not in self._finished]
            if not live:
                raise RuntimeError("every rank process has exited; no message can come")
            sentinels = {self._procs[r].sentinel: r for r in live}
            conns = {id(self._conns[r]): r for r in live}
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait([*(self._conns[r] for r in live), *sentinels], left)
            if not ready:
                raise TimeoutError(f"no message from the {self.world_size} ranks in {timeout_s} s")
            # messages first: a rank that reported an error and exited has its reason in the pipe
            for obj in ready:
                if isinstance(obj, Connection):
                    rank = conns[id(obj)]
                    try:
                        frame = obj.recv_bytes()
                    except (EOFError, OSError):
                        if self._exited_cleanly(rank):
                            continue
                        self._raise_failure(rank)
                    if frame[:1] == _ERR:
                        self._fail(rank, frame[1:].decode("utf-8", "replace"))
                    return rank, frame[1:]
            for obj in ready:
                if not isinstance(obj, Connection):
                    rank = sentinels[obj]
                    if self._conns[rank].poll(0):
                        break  # its last messages are still in the pipe: read them first
                    if not self._exited_cleanly(rank):
                        self._raise_failure(rank)

    def _exited_cleanly(self, rank: int) -> bool:
        """`rank`'s process ended with status 0 (marks it finished)."""
        p = self._procs[rank]
        p.join(timeout=5)
        if p.exitcode == 0:
            self._finished.add(rank)
            return True
        return False

    def _raise_failure(self, rank: int) -> None:
        self._fail(rank, None)

    def _fail(self, rank: int, error: str | None) -> None:
        """Stop every rank and raise `RankFailure` for the root cause: a rank that died without
        reporting (killed, crashed) explains the others' errors (their peer went away), so it
        wins over reported errors; else the first reported error."""
        time.sleep(0.2)  # let the other ranks notice and report, if they will
        failures: list[tuple[int, str, bool]] = []  # (rank, message, died silently)
        errors = {rank: error} if error is not None else {}
        for r, (p, conn) in enumerate(zip(self._procs, self._conns, strict=True)):
            try:
                while conn.poll(0):
                    frame = conn.recv_bytes()
                    if frame[:1] == _ERR:
                        errors.setdefault(r, frame[1:].decode("utf-8", "replace"))
            except (EOFError, OSError):
                pass
            if r in errors:
                failures.append((r, errors[r], False))
            elif r == rank or (not p.is_alive() and p.exitcode != 0):
                p.join(timeout=1.0)
                failures.append((r, self._how_it_ended(r), True))
        self.close(grace_s=0.0)
        failures.sort(key=lambda f: (not f[2], f[0] != rank, f[0]))
        root_rank, message, _ = failures[0]
        others = [f"rank {r}: {m.splitlines()[-1]}" for r, m, _ in failures[1:]]
        if others:
            message += "\n(then " + "; ".join(others) + ")"
        raise RankFailure(root_rank, message)

    def _how_it_ended(self, rank: int) -> str:
        p = self._procs[rank]
        code = p.exitcode
        if code is None:
            how = "closed its pipe"
        elif code < 0:
            how = f"was killed by signal {-code} ({signal.Signals(-code).name})"
        else:
            how = f"exited with status {code}"
        return f"rank {rank} (pid {p.pid}) {how}"

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the rank processes are shut down")

    def close(self, grace_s: float = 5.0) -> None:
        """Stop every rank: wait `grace_s` for those already exiting, terminate the rest, kill
        what still runs. Idempotent."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + grace_s
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(timeout=2.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=2.0)
        for c in self._conns:
            c.close()
        self._store.close()

    def join(self, timeout_s: float) -> bool:
        """Wait for every rank to exit by itself; True if all did."""
        deadline = time.monotonic() + timeout_s
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        return not any(p.is_alive() for p in self._procs)


def _call(rank: int, conn: RankConn, fn: Callable[..., Any], args: tuple) -> None:
    conn.send(json.dumps(fn(rank, *args)).encode())


def run_local_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    timeout_s: float = 120.0,
    backend: str = "gloo",
    threads: int = 1,
) -> list[Any]:
    """Run ``fn(rank, *args)`` (a module-level function) once on each of `world_size` local
    ranks and return their JSON-serialisable results in rank order. A rank's exception is
    re-raised as `RankFailure`; past `timeout_s` every rank is stopped and TimeoutError raised
    (so a hang fails fast)."""
    ranks = LocalRanks(
        _call,
        world_size,
        backend=backend,
        threads=threads,
        timeout_s=timeout_s,
        args=(fn, tuple(args)),
    )
    deadline = time.monotonic() + timeout_s
    results: dict[int, Any] = {}
    try:
        while len(results) < world_size:
            rank, payload = ranks.recv(timeout_s=max(0.0, deadline - time.monotonic()))
            results[rank] = json.loads(payload)
        ranks.join(timeout_s=max(1.0, deadline - time.monotonic()))
    finally:
        ranks.close()
    return [results[r] for r in range(world_size)]
