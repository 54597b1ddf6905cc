"""Engine servers started and stopped by this process.

`LaunchedEngine` is a RemoteEngine whose servers it starts: vLLM's (tracerl.engines.vllm)
or tracerl's transformers server (tracerl.engines.hf_server); a subclass says only which
command starts one (a `ServerCommand`). A `Launcher` says where: by default
(`LocalLauncher`) each is a child process of this one; a cluster run's launcher
(tracerl.cluster.engines) has Ray start each on a node of its own. Either way a server
(`ServerProcess`) runs in its own process group, bound to a free port of its machine's
loopback (or of the node's address on a real cluster), logging to `log_dir`. Keeping them
in service is supervise.py's: a server whose process exited or whose /health answers an
error (an engine that died under a live HTTP server), or a failed call to a server that no
longer answers /health, takes the replica out of service, and its recovery starts a fresh
server (RemoteEngine then loads the current weights into it before it takes calls). Every
group is killed on close and at interpreter exit.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from tracerl.engines.config import EngineConfig
from tracerl.engines.owner import OWNER_PID
from tracerl.engines.remote import RemoteEngine
from tracerl.engines.replicas import Replica
from tracerl.engines.supervise import Server, Supervisor, wait_healthy

__all__ = [
    "HOST",
    "PORT",
    "LaunchedEngine",
    "Launcher",
    "LocalLauncher",
    "Placement",
    "ServerCommand",
    "ServerProcess",
    "eos_token_ids",
    "group_has_others",
    "live_servers",
    "source_env",
]

SOURCE_ROOT = Path(__file__).resolve().parents[2]
"""The directory holding the tracerl package, put on the servers' PYTHONPATH so that they
import this tracerl (the vLLM venv does not install it)."""
_LIVE: set[ServerProcess] = set()
"""Servers started and not yet stopped, killed at interpreter exit."""


def live_servers() -> list[ServerProcess]:
    """Every server this process started and has not stopped (for checks and tests)."""
    return list(_LIVE)


def source_env() -> dict[str, str]:
    """This environment with tracerl's source first on PYTHONPATH, and no virtualenv
    settings that would leak into another environment's interpreter."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(SOURCE_ROOT), env.get("PYTHONPATH", "")) if p
    )
    env.pop("PYTHONHOME", None)
    env.pop("VIRTUAL_ENV", None)
    return env


HOST, PORT = "{host}", "{port}"
"""Arguments of a ServerCommand that stand for the address its server binds, filled in where
it starts."""


@dataclass(frozen=True)
class ServerCommand:
    """How to start one engine server, wherever it runs (a cluster sends it to a node)."""

    name: str
    """Names the server's log (<name>-<port>.log) and errors."""
    argv: tuple[str, ...]
    """Its command line; the arguments HOST and PORT stand for the address it binds."""
    env: dict[str, str]
    """Variables set over the starting machine's environment (see source_env)."""
    log_dir: str
    """Directory of its log, on the machine it runs on."""

    def start(self, host: str = "127.0.0.1", die_with_parent: bool = False) -> ServerProcess:
        """The server, started now on a free port of `host`; `die_with_parent`: it gets
        SIGTERM when the process that started it dies (Linux), however that process ends."""
        port = _free_port(host)
        argv = [host if a == HOST else str(port) if a == PORT else a for a in self.argv]
        env = source_env() | self.env | {OWNER_PID: str(os.getpid())}  # its watch (owner.py)
        return ServerProcess(self.name, argv, port, env, self.log_dir, host, die_with_parent)


class Launcher(Protocol):
    """Where an engine's servers start."""

    def start(self, index: int, command: ServerCommand) -> Server:
        """The server of replica `index`, started (not yet ready: see Server.wait_ready)."""
        ...

    def close(self) -> None:
        """Release what starting servers took (the servers themselves are stopped first)."""
        ...


Placement = Callable[[int], Launcher]
"""Given an engine's replica count, the launcher of its servers."""


class LocalLauncher:
    """Servers as child processes of this one, on this machine's loopback."""

    def start(self, index: int, command: ServerCommand) -> Server:
        """See Launcher.start."""
        return command.start()

    def close(self) -> None:
        """Nothing to release."""


class ServerProcess:
    """One server child process, in its own process group, on a free port of `host`."""

    def __init__(
        self,
        name: str,
        command: list[str],
        port: int,
        env: dict[str, str],
        log_dir: str,
        host: str = "127.0.0.1",
        die_with_parent: bool = False,
    ):
        self.port = port
        self.url = f"http://{host}:{port}"
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self.log_path = Path(log_dir) / f"{name}-{port}.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group: kill it whole
                preexec_fn=_die_with_parent if die_with_parent else None,
            )
        _LIVE.add(self)

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until /health answers 200; on exit or timeout, stop it and raise."""
        wait_healthy(self, timeout_s)

    def exited(self) -> int | None:
        """The exit code of the server's main process once it ended, else None.

        The process is left unreaped (a zombie) until `stop`: while it is, its process
        group id cannot be reused, so `stop` can still kill what it left running (vLLM's
        engine core) without risking someone else's group.
        """
        if self.process.returncode is not None:
            return self.process.returncode
        try:
            info = os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped meanwhile by stop()
            return self.process.poll()
        if info is None:
            return None
        return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the server's log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """Stop the server's whole process group: SIGTERM, up to 10 s for the main process
        and what it started to exit, then SIGKILL for whatever is left; then reap it."""
        _LIVE.discard(self)
        if self.process.returncode is not None:
            return  # reaped: stopped before
        pid = self.process.pid
        _kill_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while (self.exited() is None or group_has_others(pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        _kill_group(pid, signal.SIGKILL)  # the unreaped main process still holds the group id
        self.process.wait(timeout=10)


def _die_with_parent() -> None:
    """In a server's process before exec: ask Linux for SIGTERM when its parent dies."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class LaunchedEngine(RemoteEngine):
    """RemoteEngine over `cfg.replicas` servers it starts (or the user's, `cfg.urls`):
    child processes of this one, or wherever `place` puts them."""

    name = "server"
    """Names the servers' logs (<name>-<port>.log) and errors."""
    drop_tied_head = False
    """Whether weights sent to the servers leave out a head tied to the embedding."""

    def __init__(
        self,
        model_dir: str | Path,
        cfg: EngineConfig,
        policy_version: int = 0,
        place: Placement | None = None,
    ) -> None:
        # Absolute: a server may start in another working directory (a Ray worker's).
        self.model_dir = Path(model_dir).resolve()
        self.cfg = cfg
        self.launcher: Launcher = (place or _local)(cfg.replicas) if not cfg.urls else _local(0)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        config = AutoConfig.from_pretrained(model_dir)
        # Set before the servers start: their command lines take it.
        self.max_context = int(config.max_position_embeddings)
        self.supervisor = Supervisor(
            self.name, self._new_server, self._server_failed, cfg.startup_timeout_s
        )
        """The servers started here, kept in service (none with `cfg.urls`)."""
        self._own_weights_dir = cfg.weights_dir is None
        # Set before the servers start: close() removes it if one fails to start.
        self.weights_dir = Path(cfg.weights_dir or tempfile.mkdtemp(prefix="tracerl-weights-"))
        try:
            urls = list(cfg.urls) or self.supervisor.start_all(cfg.replicas)
            super().__init__(
                urls,
                tokenizer=tokenizer,
                max_context=self.max_context,
                eos_token_ids=eos_token_ids(model_dir, tokenizer),
                weights_dir=self.weights_dir,
                tie_word_embeddings=self.drop_tied_head
                and bool(getattr(config, "tie_word_embeddings", False)),
                policy_version=policy_version,
                timeout_s=cfg.request_timeout_s,
                seed=cfg.seed,
            )
            self.warm_up()
        except BaseException:
            self.close()
            raise
        if self.servers:
            self.supervisor.watch()

    # -- what a subclass says ----------------------------------------------------------

    def command(self, host: str, port: str) -> list[str]:
        """The command line of one server listening on `host`:`port` (called with the
        placeholders HOST and PORT; absolute paths only: it may run elsewhere)."""
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        """Variables a started server gets over its machine's environment (source_env)."""
        return {}

    # -- servers -------------------------------------------------------------------------

    def _new_server(self, index: int) -> Server:
        log_dir = str(Path(self.cfg.log_dir).resolve())
        command = ServerCommand(self.name, tuple(self.command(HOST, PORT)), self.env(), log_dir)
        return self.launcher.start(index, command)

    @property
    def servers(self) -> list[Server]:
        """The servers started here, by replica index."""
        return self.supervisor.servers

    def _server_failed(self, index: int, why: str) -> None:
        self.replica_failed(self.replicas.replicas[index], why)

    def warm_up(self) -> None:
        """One token from every server: a model a server cannot run fails here, with its log."""
        for i, url in enumerate(self.urls):
            try:
                self.generate_sync(i, [self.eos_token_ids[0]])
            except Exception as exc:
                tail = self.supervisor.log_tail(i)
                raise RuntimeError(
                    f"{self.name} server {url} failed its first request: {exc}\n{tail}"
                ) from exc

    def revive(self, replica: Replica) -> str:
        """Replace the server of `replica` by a fresh one and wait until it is ready."""
        if not self.servers:
            return super().revive(replica)
        return self.supervisor.restart(replica.index)

    def close(self) -> None:
        """Stop the client, then kill the servers started here and drop their weights."""
        if hasattr(self, "replicas"):  # a start that failed never set up the client
            super().close()
        self.supervisor.close()
        self.launcher.close()
        if self._own_weights_dir:
            shutil.rmtree(self.weights_dir, ignore_errors=True)


def eos_token_ids(model_dir: str | Path, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """End tokens as HFEngine takes them: generation config, model config, tokenizer."""
    try:
        generation = GenerationConfig.from_pretrained(model_dir)
    except OSError:
        generation = None
    config = AutoConfig.from_pretrained(model_dir)
    ids: list[int] = []
    for source in (generation, config, tokenizer):
        candidate = getattr(source, "eos_token_id", None)
        for token in candidate if isinstance(candidate, list) else [candidate]:
            if token is not None and token not in ids:
                ids.append(int(token))
    if not ids:
        raise ValueError("the model declares no end token (eos_token_id)")
    return ids


def _local(replicas: int) -> Launcher:
    """The default Placement: every server a child process of this one."""
    return LocalLauncher()


def _free_port(host: str) -> int:
    """A TCP port free on `host` now (the server binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def group_has_others(pgid: int) -> bool:
    """Whether a live process other than its leader is in process group `pgid` (Linux
    /proc; elsewhere assume so, and let SIGKILL end them)."""
    try:
        entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return True
    for name in entries:
        if int(name) == pgid:
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue  # ended meanwhile
        # After the command name (which may hold spaces): state, ppid, pgrp, ...
        state, _, pgrp = stat.rsplit(")", 1)[1].split()[:3]
        if int(pgrp) == pgid and state != "Z":  # a zombie holds nothing but its pid
            return True
    return False


def _kill_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


@atexit.register
def _stop_all() -> None:
    """No server outlives the process that started it."""
    for server in list(_LIVE):
        with contextlib.suppress(Exception):
            server.stop()
