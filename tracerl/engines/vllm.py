"""vLLM servers as an engine: started here from their own environment, reached over HTTP.

vLLM pins torch, transformers and fastapi versions the main environment cannot share, so it
lives in a venv of its own (`make vllm`) and is never imported here. `VLLMEngine` starts
`replicas` OpenAI-compatible servers from that venv (or uses servers the user runs,
`engine.urls`) and serves them through `RemoteEngine`, the HTTP client behind the Engine
protocol. Each started server runs in its own process group, bound to 127.0.0.1 on a free
port, logging to `log_dir`; the whole group is killed on close and at interpreter exit.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
from transformers import AutoConfig, AutoTokenizer

from tracerl.engines.config import EngineConfig
from tracerl.engines.remote import RemoteEngine, eos_token_ids

__all__ = ["VLLMEngine", "VLLMServer", "server_args", "server_env"]

WORKER_EXTENSION = "tracerl.engines.vllm_worker.TracerlWorkerExtension"
"""Loaded by each vLLM worker (--worker-extension-cls): weight reload that refreshes the
CPU backend's packed output head, and log-probs taken before top-p (see its module)."""
SOURCE_ROOT = Path(__file__).resolve().parents[2]
"""The directory holding the tracerl package, put on the servers' PYTHONPATH so they can
import the worker extension (the vLLM venv does not install tracerl)."""
_LIVE: set[VLLMServer] = set()
"""Servers started and not yet stopped, killed at interpreter exit."""


def server_args(model_dir: str | Path, port: int, cfg: EngineConfig, max_context: int) -> list[str]:
    """Command-line arguments of one vLLM OpenAI server serving `model_dir` for tracerl."""
    return [
        "--model", str(model_dir),
        "--served-model-name", "policy",
        "--host", "127.0.0.1",
        "--port", str(port),
        # fp32 and eager: the log-probs must match the trainer's fp32 re-scoring.
        "--dtype", "float32",
        "--enforce-eager",
        "--kv-cache-memory-bytes", str(int(cfg.kv_cache_gib * 2**30)),
        "--max-model-len", str(max_context),
        "--max-num-seqs", str(cfg.max_batch_size),
        # Log-probs of the distribution sampled from (temperature applied), not T = 1's.
        "--logprobs-mode", "processed_logprobs",
        # The model's generation_config.json must not change sampling behind our back.
        "--generation-config", "vllm",
        "--seed", str(cfg.seed),
        "--worker-extension-cls", WORKER_EXTENSION,
    ]  # fmt: skip


def server_env() -> dict[str, str]:
    """Environment of a started server: dev endpoints on, the worker extension importable."""
    env = dict(os.environ)
    env["VLLM_SERVER_DEV_MODE"] = "1"  # /pause, /resume, /collective_rpc, ...
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: ~1 GB less
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(SOURCE_ROOT), env.get("PYTHONPATH", "")) if p
    )
    # The main venv's settings must not leak into the vLLM venv's interpreter.
    env.pop("PYTHONHOME", None)
    env.pop("VIRTUAL_ENV", None)
    return env


class VLLMServer:
    """One vLLM OpenAI server child process, in its own process group."""

    def __init__(
        self, python: str, model_dir: str | Path, cfg: EngineConfig, max_context: int
    ) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        log_dir = Path(cfg.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"server-{self.port}.log"
        command = [python, "-m", "vllm.entrypoints.openai.api_server"]
        command += server_args(model_dir, self.port, cfg, max_context)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=server_env(),
                start_new_session=True,  # its own process group: kill it whole
            )
        _LIVE.add(self)

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until /health answers 200; on exit or timeout, stop it and raise."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self._fail(f"exited with code {self.process.returncode} while starting")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.5)
        self._fail(f"did not answer /health within {timeout_s:.0f} s")

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the server's log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """Kill the server's whole process group (SIGTERM, then SIGKILL after 10 s)."""
        _LIVE.discard(self)
        if self.process.poll() is not None:
            return
        _kill_group(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _kill_group(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def _fail(self, what: str) -> None:
        self.stop()
        raise RuntimeError(
            f"vLLM server on {self.url} {what}; log {self.log_path} ends with:\n{self.log_tail()}"
        )


class VLLMEngine(RemoteEngine):
    """RemoteEngine over vLLM servers started here (or the user's, `cfg.urls`)."""

    def __init__(self, model_dir: str | Path, cfg: EngineConfig, policy_version: int = 0) -> None:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        config = AutoConfig.from_pretrained(model_dir)
        max_context = int(config.max_position_embeddings)
        self.servers: list[VLLMServer] = []
        self._own_weights_dir = cfg.weights_dir is None
        weights_dir = Path(cfg.weights_dir or tempfile.mkdtemp(prefix="tracerl-weights-"))
        urls = list(cfg.urls) or self._start_servers(model_dir, cfg, max_context)
        try:
            super().__init__(
                urls,
                tokenizer=tokenizer,
                max_context=max_context,
                eos_token_ids=eos_token_ids(model_dir, tokenizer),
                weights_dir=weights_dir,
                tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                policy_version=policy_version,
                timeout_s=cfg.request_timeout_s,
            )
            self.warm_up()
        except BaseException:
            self.close()
            raise

    def _start_servers(
        self, model_dir: str | Path, cfg: EngineConfig, max_context: int
    ) -> list[str]:
        python = _resolve_python(cfg.python)
        try:
            for _ in range(cfg.replicas):
                self.servers.append(VLLMServer(python, model_dir, cfg, max_context))
            for server in self.servers:
                server.wait_ready(cfg.startup_timeout_s)
        except BaseException:
            self._stop_servers()
            raise
        return [server.url for server in self.servers]

    def warm_up(self) -> None:
        """One token from every server: a model vLLM cannot run fails here, with its log."""
        for i, url in enumerate(self.urls):
            try:
                self.generate_sync(i, [self.eos_token_ids[0]])
            except Exception as exc:
                tail = self.servers[i].log_tail() if i < len(self.servers) else ""
                raise RuntimeError(
                    f"vLLM server {url} failed its first request: {exc}\n{tail}"
                ) from exc

    def close(self) -> None:
        """Stop the client, then kill the servers started here and drop their weights."""
        super().close()
        self._stop_servers()
        if self._own_weights_dir:
            shutil.rmtree(self.weights_dir, ignore_errors=True)

    def _stop_servers(self) -> None:
        for server in self.servers:
            server.stop()


def _resolve_python(python: str) -> str:
    """The vLLM venv's interpreter, or a clear error saying how to build it."""
    path = Path(python)
    if path.exists():
        return str(path)
    found = shutil.which(python)
    if found is None:
        raise FileNotFoundError(
            f"no vLLM Python at {python!r}: build the vLLM environment with `make vllm`, "
            "or set engine.python (or engine.urls to use servers you run)"
        )
    return found


def _free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the server binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _kill_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


@atexit.register
def _stop_all() -> None:
    """No vLLM server outlives the process that started it."""
    for server in list(_LIVE):
        with contextlib.suppress(Exception):
            server.stop()
