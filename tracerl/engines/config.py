"""Which engine serves a policy and how (torch-free, so reading a config stays light)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["EngineConfig"]


class EngineConfig(BaseModel):
    """Which engine serves the policy and how."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    kind: Literal["hf", "hf_server", "vllm"] = "hf"
    """'hf': transformers with continuous batching in this process, on the CPU or a GPU
    (`device`). 'hf_server': the same engine in server processes of its own
    (tracerl.engines.hf_server), reached over HTTP like vLLM. 'vllm': vLLM OpenAI servers
    reached over HTTP, started here from the vLLM environment (`python`). Both server kinds
    can use servers the user runs instead (`urls`)."""
    device: str = "cpu"
    """torch device for the hf and hf_server engines ("cpu", "cuda", "cuda:1")."""
    max_batch_size: int = Field(default=32, ge=1)
    """Most sequences decoded together (vLLM: --max-num-seqs of each server)."""
    default_max_tokens: int = Field(default=256, ge=1)
    """max_tokens for requests that give none."""
    seed: int = 0
    """Seed of the engine's sampler for unseeded requests."""
    python: str = ".venv-vllm/bin/python"
    """vllm: the Python of the environment vLLM is installed in (`make vllm` builds it),
    relative to the working directory or absolute; servers are started with it."""
    urls: list[str] = Field(default_factory=list)
    """vllm, hf_server: base URLs of servers the user runs (e.g. "http://127.0.0.1:8000");
    when given, nothing is started here (and a server that dies is waited for, not
    restarted). vLLM servers must be started with VLLM_SERVER_DEV_MODE=1,
    --logprobs-mode processed_logprobs and tracerl's worker extension (see
    tracerl.engines.vllm.server_args)."""
    replicas: int = Field(default=1, ge=1)
    """vllm, hf_server: servers to start, each holding a full copy of the weights. Calls of
    one rollout and role stay on one replica; new rollouts go to the least loaded; a
    replica that dies is restarted and brought to the current weights."""
    kv_cache_gib: float = Field(default=0.25, gt=0)
    """vllm: KV cache size of each started server, in GiB (uncapped, vLLM on a CPU takes
    most of the machine's memory)."""
    startup_timeout_s: float = Field(default=300.0, gt=0)
    """vllm, hf_server: how long a started server may take to answer /health before it is
    killed."""
    request_timeout_s: float = Field(default=600.0, gt=0)
    """vllm, hf_server: longest a generation or a weight-sync call may take."""
    log_dir: str = "runs/engine-logs"
    """vllm, hf_server: directory of each started server's log (<kind>-<port>.log)."""
    weights_dir: str | None = None
    """vllm, hf_server: where new weights are written for the servers to read
    (v<version>/); it must be readable by every server. None: a temporary directory,
    removed on close."""
