"""Starting N data-parallel ranks on this machine, listening on loopback only.

`spawn(fn, world_size, *args)` runs `fn(*args)` in N fresh processes, each a rank of one
default process group (gloo on CPU, NCCL when `backend="nccl"`), and returns what each rank
returned, in rank order. How ranks start is kept apart from what they do: `fn` only needs
an initialised default group, so a Ray actor that calls `init_rank` itself can run the same
function (tracerl.trainer.distributed never starts processes).

Nothing listens beyond loopback. The rendezvous TCPStore binds to every interface even when
told "127.0.0.1", so this process binds a socket to 127.0.0.1 itself and hands it to the
store (`master_listen_fd`); the store lives here, in the launcher, and the ranks connect to
it as clients. Gloo's own rank-to-rank listeners follow GLOO_SOCKET_IFNAME, set to `lo`.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["LOOPBACK", "Rendezvous", "init_rank", "loopback_store", "spawn"]

LOOPBACK = "127.0.0.1"
TIMEOUT = datetime.timedelta(seconds=300)


class Rendezvous(NamedTuple):
    """A store served from this process; keep it referenced while ranks run."""

    store: dist.TCPStore
    """The server side of the store."""
    sock: socket.socket
    """The listening socket the store serves on (closing it would end the store)."""
    port: int
    """Where ranks connect: 127.0.0.1:port."""


def loopback_store(world_size: int) -> Rendezvous:
    """A rendezvous store served from this process on 127.0.0.1 only.

    The socket is bound here, so the store cannot widen it to 0.0.0.0.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((LOOPBACK, 0))
    sock.listen(max(128, world_size))
    port = sock.getsockname()[1]
    store = dist.TCPStore(
        LOOPBACK, port, is_master=True, wait_for_workers=False, timeout=TIMEOUT,
        master_listen_fd=sock.fileno(),
    )  # fmt: skip
    return Rendezvous(store, sock, port)


def init_rank(rank: int, world_size: int, port: int, backend: str = "gloo") -> None:
    """Join the default process group as `rank` through the store on 127.0.0.1:`port`."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore(LOOPBACK, port, is_master=False, timeout=TIMEOUT)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    threads: int = 1,
    timeout_s: float = 600.0,
) -> list[Any]:
    """Run `fn(*args)` on `world_size` ranks; returns each rank's result, in rank order.

    fn must be importable by name (a module-level function): ranks are spawned, not forked,
    so no thread or lock of this process leaks into them. A rank that raises fails the call
    with its traceback.
    """
    rdzv = loopback_store(world_size)
    ctx = mp.get_context("spawn")
    results: Any = ctx.SimpleQueue()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, rdzv.port, backend, threads, fn, args, results))
        for r in range(world_size)
    ]  # fmt: skip
    for p in procs:
        p.start()
    try:
        out = _collect(results, procs, timeout_s)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        rdzv.sock.close()  # the store was kept alive (referenced) until every rank was done
    return out


def _collect(results: Any, procs: list[Any], timeout_s: float) -> list[Any]:
    """Each rank's (rank, ok, value) from the queue; raises on the first failure."""
    out: dict[int, Any] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
    while len(out) < len(procs):
        if datetime.datetime.now() > deadline:
            raise TimeoutError(f"ranks {sorted(set(range(len(procs))) - set(out))} timed out")
        if results.empty():
            if any(p.exitcode not in (None, 0) for p in procs):
                codes = [p.exitcode for p in procs]
                raise RuntimeError(f"a rank died without a result (exit codes {codes})")
            time.sleep(0.05)
            continue
        rank, ok, value = results.get()
        if not ok:
            raise RuntimeError(f"rank {rank} failed:\n{value}")
        out[rank] = pickle.loads(value)
    return [out[r] for r in range(len(procs))]


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    threads: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    """One rank: join the group, run fn, report its result (or traceback), leave."""
    torch.set_num_threads(threads)
    try:
        init_rank(rank, world_size, port, backend)
        # Plain pickle bytes: torch's queue pickler would send tensors as shared memory,
        # which the receiver can no longer open once this rank has exited.
        results.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
