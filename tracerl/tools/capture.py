"""Running one sandbox process: its output read up to a cap, a wall-clock deadline, and a
kill that leaves nothing of the sandbox alive.

bwrap runs in a process group of its own. Its stdout and stderr are read as they come (bytes
past the cap are read and dropped, so a flood neither blocks the code nor fills memory). At
the deadline, or once the code is done, the sandbox's init is killed, which makes the kernel
kill every process left in the sandbox's pid namespace; `execute` returns once bwrap has
reaped that init, so no process of the sandbox outlives it.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import IO

__all__ = ["Capped", "Execution", "execute", "read_available"]

TEARDOWN_S = 2.0
"""How long tear-down may take after the kill before it is left to the kernel."""


class Capped:
    """One output stream kept up to a cap; its last bytes are kept apart to read the error
    the code ended with."""

    TAIL = 2048

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.head = bytearray()
        self.tail = b""
        self.seen = 0

    def add(self, chunk: bytes) -> None:
        self.seen += len(chunk)
        room = self.cap - len(self.head)
        if room > 0:
            self.head += chunk[:room]
        self.tail = (self.tail + chunk)[-self.TAIL :]

    @property
    def truncated(self) -> bool:
        return self.seen > self.cap

    def text(self) -> str:
        return self.head.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Execution:
    """What reading and ending one sandbox process gave."""

    stdout: Capped
    """The process's stdout, capped."""
    stderr: Capped
    """The process's stderr, capped."""
    timed_out: bool
    """The deadline passed before the process ended by itself."""


def _pump(streams: dict[IO[bytes], Capped], deadline: float) -> bool:
    """Read every stream until EOF or the deadline; True when all reached EOF."""
    with selectors.DefaultSelector() as sel:
        for stream in streams:
            sel.register(stream, selectors.EVENT_READ)
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            for key, _ in sel.select(remaining):
                chunk = os.read(key.fd, 65536)
                if chunk:
                    streams[key.fileobj].add(chunk)  # type: ignore[index]
                else:
                    sel.unregister(key.fileobj)
    return True


def read_available(fd: int) -> bytes:
    """Everything already written to a pipe, without waiting for more."""
    os.set_blocking(fd, False)
    data = b""
    try:
        while chunk := os.read(fd, 4096):
            data += chunk
    except BlockingIOError:
        pass
    return data


def _sandbox_init(bwrap_status: bytes) -> int | None:
    """Host pid of bwrap's child, the init of the sandbox's pid namespace (--json-status-fd)."""
    for line in bwrap_status.decode(errors="replace").splitlines():
        try:
            pid = json.loads(line).get("child-pid")
        except (json.JSONDecodeError, AttributeError):
            continue
        if isinstance(pid, int):
            return pid
    return None


def _end(proc: subprocess.Popen[bytes], streams: dict[IO[bytes], Capped], info_r: int) -> None:
    """End the sandbox and drain the pipes.

    The sandbox's init is killed first: the kernel kills every other process of its pid
    namespace before the init can be reaped, and bwrap, its parent, reaps it and exits. So
    when bwrap has exited, nothing of the sandbox is left, not even a zombie (killing bwrap
    first would orphan the init to the host's pid 1, which need not reap it).
    """
    init = _sandbox_init(read_available(info_r))
    if init is not None and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(init, signal.SIGKILL)
    try:
        proc.wait(TEARDOWN_S)
    except subprocess.TimeoutExpired:  # bwrap itself stuck: kill its whole process group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    _pump(streams, time.monotonic() + TEARDOWN_S)


def execute(
    command: list[str], pass_fds: tuple[int, ...], info_r: int, wall_s: float, cap: int
) -> Execution:
    """Run bwrap's `command` (which writes its status to the pipe read by `info_r`) until it
    ends or `wall_s` passes, keeping up to `cap` bytes of each output stream."""
    deadline = time.monotonic() + wall_s
    proc = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=pass_fds,
        start_new_session=True,  # a process group of its own, killed as one
    )
    assert proc.stdout is not None and proc.stderr is not None
    out, err = Capped(cap), Capped(cap)
    streams = {proc.stdout: out, proc.stderr: err}
    timed_out = True
    try:
        if _pump(streams, deadline):
            proc.wait(max(0.0, deadline - time.monotonic()))
            timed_out = False
    except subprocess.TimeoutExpired:
        pass
    finally:
        _end(proc, streams, info_r)
        proc.stdout.close()
        proc.stderr.close()
    return Execution(out, err, timed_out)
