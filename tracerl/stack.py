"""One process holding the store, the engine and the gateway, serving HTTP on loopback.

This is the laptop shape: `tracerl demo`, `eval`, `serve` and the tests build it; runners
in the same process or elsewhere reach it over HTTP. On a GPU machine the engine's device
changes (`device = "cuda"`) and nothing else does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer

from tracerl.engines.base import Engine
from tracerl.engines.config import EngineConfig
from tracerl.gateway import Gateway, ServedModel, create_app
from tracerl.gateway.remote import RemoteModel
from tracerl.server import BackgroundServer, serve_in_thread
from tracerl.store.sqlite import SqliteStore


def make_engine(model_dir: str | Path, cfg: EngineConfig, version: int = 0) -> Engine:
    """Build the configured engine for a local model directory."""
    if cfg.kind == "vllm":
        from tracerl.engines.vllm import VLLMEngine

        return VLLMEngine(model_dir, cfg, policy_version=version)
    from tracerl.engines.hf import HFEngine

    return HFEngine(
        model_dir,
        device=cfg.device,
        max_batch_size=cfg.max_batch_size,
        policy_version=version,
        seed=cfg.seed,
    )


@dataclass
class LocalStack:
    """Store + engines + gateway in this process, the HTTP API on a background thread.

    `engines` holds one engine per policy (a set of weights); several roles (model names
    agents ask for) may be served by one engine: the same backbone in several roles.
    """

    store: SqliteStore
    engines: dict[str, Engine]
    gateway: Gateway
    server: BackgroundServer

    @property
    def engine(self) -> Engine:
        """The first policy's engine (the only one in a single-policy run)."""
        return next(iter(self.engines.values()))

    @property
    def url(self) -> str:
        """Base URL of the gateway (and of the store API under /store)."""
        return self.server.url

    def close(self) -> None:
        """Stop serving and release the engines and the database."""
        self.server.stop()
        for engine in self.engines.values():
            engine.close()
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
    return start_multi_stack(
        {model_name: model_dir}, {model_name: model_name}, store_path, engine_cfg, host, port
    )


def start_multi_stack(
    models: dict[str, str | Path],
    roles: dict[str, str],
    store_path: str | Path,
    engine_cfg: EngineConfig | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    remote: dict[str, RemoteModel] | None = None,
) -> LocalStack:
    """One engine per entry of `models` (policy -> model dir); the gateway answers to each
    role of `roles` (role -> policy) with that policy's engine, and to each role of
    `remote` by forwarding to its OpenAI-compatible URL."""
    engine_cfg = engine_cfg or EngineConfig()
    missing = sorted(set(roles.values()) - set(models))
    if missing:
        raise ValueError(f"roles name policies with no model: {missing}")
    store = SqliteStore(store_path)
    engines = {name: make_engine(path, engine_cfg) for name, path in models.items()}
    tokenizers = {name: AutoTokenizer.from_pretrained(str(path)) for name, path in models.items()}
    served = {
        role: ServedModel(role, engines[policy], tokenizers[policy], engine_cfg.default_max_tokens)
        for role, policy in roles.items()
    }
    gateway = Gateway(store, served, remote=remote)
    server = serve_in_thread(create_app(gateway), host, port)
    return LocalStack(store, engines, gateway, server)
