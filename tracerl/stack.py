"""One process holding the store, the engine and the gateway, serving HTTP on loopback.

This is the laptop shape: `tracerl demo`, `eval`, `serve` and the tests build it; runners
in the same process or elsewhere reach it over HTTP. On a GPU machine the engine kind
changes and nothing else does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field
from transformers import AutoTokenizer

from tracerl.engines.base import Engine
from tracerl.gateway import Gateway, ServedModel, create_app
from tracerl.server import BackgroundServer, serve_in_thread
from tracerl.store.sqlite import SqliteStore


class EngineConfig(BaseModel):
    """Which engine serves the policy and how."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    kind: str = "hf"
    """'hf' (transformers, CPU or GPU) or 'vllm' (GPU, optional extra)."""
    device: str = "cpu"
    """torch device for the hf engine."""
    max_batch_size: int = Field(default=32, ge=1)
    """Most sequences decoded together."""
    default_max_tokens: int = Field(default=256, ge=1)
    """max_tokens for requests that give none."""
    seed: int = 0
    """Seed of the engine's sampler for unseeded requests."""


def make_engine(model_dir: str | Path, cfg: EngineConfig, version: int = 0) -> Engine:
    """Build the configured engine for a local model directory."""
    if cfg.kind == "hf":
        from tracerl.engines.hf import HFEngine

        return HFEngine(
            model_dir,
            device=cfg.device,
            max_batch_size=cfg.max_batch_size,
            policy_version=version,
            seed=cfg.seed,
        )
    if cfg.kind == "vllm":
        from tracerl.engines.vllm import VLLMEngine  # type: ignore[import-not-found]

        engine: Engine = VLLMEngine(model_dir, policy_version=version)
        return engine
    raise ValueError(f"unknown engine kind {cfg.kind!r}; expected 'hf' or 'vllm'")


@dataclass
class LocalStack:
    """Store + engine + gateway in this process, the HTTP API on a background thread."""

    store: SqliteStore
    engine: Engine
    gateway: Gateway
    server: BackgroundServer

    @property
    def url(self) -> str:
        """Base URL of the gateway (and of the store API under /store)."""
        return self.server.url

    def close(self) -> None:
        """Stop serving and release the engine and the database."""
        self.server.stop()
        self.engine.close()
        self.store.close()


def start_stack(
    model_dir: str | Path,
    store_path: str | Path,
    engine_cfg: EngineConfig | None = None,
    model_name: str = "policy",
    host: str = "127.0.0.1",
    port: int = 0,
) -> LocalStack:
    """Open the store, load the engine, and serve the gateway on host:port."""
    engine_cfg = engine_cfg or EngineConfig()
    store = SqliteStore(store_path)
    engine = make_engine(model_dir, engine_cfg)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    served = ServedModel(model_name, engine, tokenizer, engine_cfg.default_max_tokens)
    gateway = Gateway(store, {model_name: served})
    server = serve_in_thread(create_app(gateway), host, port)
    return LocalStack(store, engine, gateway, server)
