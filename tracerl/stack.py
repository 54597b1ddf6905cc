"""One process holding the store, the engines and the gateway, serving HTTP on loopback.

This is the laptop shape: `tracerl demo`, `train`, `eval`, `serve` and the tests build it;
runners in the same process or elsewhere reach it over HTTP. On a GPU machine the engine's
device changes (`device = "cuda"`) and nothing else does; `engine.kind` "hf_server" or "vllm"
serves the policy from server processes (several `engine.replicas`) instead of this one.

Threads and event loops of one training process (`tracerl train`, pipeline/run.py): each
thread, its owner, and what runs on it.

- main (owner: pipeline/run.py `train`): builds this stack, then the training loop:
  `source.batch`, `Trainer.train`, `publish` (`store.issue_version`,
  `Engine.load_state_dict`), checkpoints (`store.publish_version`), metrics. In sync mode
  and for held-out evaluations it also runs the runner's event loop: one
  `asyncio.run(runner.run(...))` per batch (SyncSource) or evaluation
  (evaluate.run_rollouts).
- `tracerl-http` (owner: this stack, `server`): uvicorn and the gateway's event loop, which
  serves the OpenAI routes, `/rollouts/<id>/reward`, `/health` and the `/store` API.
  Nothing blocks it: it awaits the three kinds of thread below.
- `tracerl-tokenize`, one thread (owner: `gateway`): chat templates and tokenizing. One,
  so a tokenizer is never used by two threads at once.
- `tracerl-store`, four threads (owner: `gateway.store_executor`): the gateway's store
  calls (rollout lookups, span and reward writes) and the `/store` API's.
- `hf-engine`, one per policy (owner: `engines`): the model; prefill, decode steps, and
  weight swaps between steps. Answers reach the gateway's loop by call_soon_threadsafe.
- server engines only (engine.kind vllm or hf_server; owner: the engine,
  tracerl.engines.supervise): `<kind>-watch` notices a server process that exited, and an
  `engine-recovery-<i>` thread per replica out of service restarts its server and reloads
  the current weights (under the engine's weight-sync lock, so it never races `publish`).
  Both stop at the engine's close.
- AsyncSource's thread (owner: pipeline/sources.py, async mode only): its own event loop
  runs `runner.run(until_idle=False)` until `close`, and issues groups.
- the runner loop's default executor (owner: that loop, via asyncio.to_thread): the
  runner's store calls (claim, get_task, heartbeat, finish, rewards), the reward function.
- the agent pool, `ThreadPoolExecutor(runner.concurrency)` (owner: pipeline/run.py
  `train`): synchronous agent functions; their model calls reach `tracerl-http` over
  loopback. Async agents run on the runner's loop.

The store (SqliteStore, or PostgresStore for a postgresql:// URL) is called from the main,
store, source and runner-executor threads at once; SqliteStore serialises them on its one
connection (tracerl/store/sqlite.py), PostgresStore lends each its own pooled connection.

Shutdown, in this order: the source (AsyncSource.close stops its loop and thread; running
rollouts are left to their leases) and the runner, by the pipeline's owner; the agent pool;
then `LocalStack.close`, which stops the HTTP server (no request reaches the gateway any
more; requests in flight get a few seconds to finish), the gateway's tokenizer and store
threads, the engines (requests still waiting fail), and last the store, which every thread
above may have been using. `close` is idempotent.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tracerl.auth import Keys
from tracerl.engines.base import Engine
from tracerl.engines.config import EngineConfig
from tracerl.gateway import Gateway, ServedModel, create_app
from tracerl.gateway.remote import RemoteModel
from tracerl.limits import Limits
from tracerl.roles import GatewayConfig, ReplyFormat
from tracerl.server import BackgroundServer, serve_in_thread
from tracerl.store import Store
from tracerl.store.open import open_store

if TYPE_CHECKING:
    from tracerl.engines.launch import Placement


def make_engine(
    model_dir: str | Path, cfg: EngineConfig, version: int = 0, place: Placement | None = None
) -> Engine:
    """Build the configured engine for a local model directory. `place` says where a server
    engine's servers start (None: child processes of this one; a cluster's nodes:
    tracerl.cluster.engines); the in-process hf engine ignores it."""
    if cfg.kind == "vllm":
        from tracerl.engines.vllm import VLLMEngine

        return VLLMEngine(model_dir, cfg, policy_version=version, place=place)
    if cfg.kind == "hf_server":
        from tracerl.engines.hf_server import HFServerEngine

        return HFServerEngine(model_dir, cfg, policy_version=version, place=place)
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

    store: Store
    """Tasks, rollouts, spans: used by every thread of the process (closed last)."""
    engines: dict[str, Engine]
    """One engine per policy (a set of weights)."""
    gateway: Gateway
    """The OpenAI-compatible routes, with its tokenizer and store threads."""
    server: BackgroundServer
    """The HTTP server thread running the gateway's event loop."""
    _closed: bool = field(default=False, init=False, repr=False)

    @property
    def engine(self) -> Engine:
        """The first policy's engine (the only one in a single-policy run)."""
        return next(iter(self.engines.values()))

    @property
    def url(self) -> str:
        """Base URL of the gateway (and of the store API under /store)."""
        return self.server.url

    def close(self) -> None:
        """Stop the HTTP server, then the gateway's threads, the engines, the store.

        Idempotent. Every step runs even if an earlier one raises (the error is raised once
        all have run), so a failing engine never leaves the database open.
        """
        if self._closed:
            return
        self._closed = True
        with ExitStack() as steps:  # callbacks run last-pushed first
            steps.callback(self.store.close)
            for engine in reversed(self.engines.values()):
                steps.callback(engine.close)
            steps.callback(self.gateway.close)
            steps.callback(self.server.stop)


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
    keys: Keys | None = None,
    limits: Limits | None = None,
    gateway_cfg: GatewayConfig | None = None,
    place: Placement | None = None,
    formats: dict[str, ReplyFormat] | None = None,
) -> LocalStack:
    """One engine per entry of `models` (policy -> model dir); the gateway answers to each
    role of `roles` (role -> policy) with that policy's engine, reading its replies as
    `formats` says (role -> format; a role not in it: read off its chat template), to each
    role of `remote` by forwarding to its OpenAI-compatible URL, and to other names as
    `gateway_cfg` maps them. `keys` (None: open, to loopback names and `host` only) and
    `limits` guard the HTTP API (tracerl.doors); `place` puts server engines' servers (see
    make_engine)."""
    engine_cfg = engine_cfg or EngineConfig()
    missing = sorted(set(roles.values()) - set(models))
    if missing:
        raise ValueError(f"roles name policies with no model: {missing}")
    store = open_store(store_path)  # a postgresql:// URL shares the store between machines
    # The starting weights get a version of their own from the store (0 in a new store): a
    # store holding an earlier run's spans never sees its numbers again.
    version = store.issue_version(sorted(roles)) if roles else 0
    engines = {name: make_engine(path, engine_cfg, version, place) for name, path in models.items()}
    # The gateway renders each role's prompts with its engine's own tokenizer and reads its
    # replies in the role's own format, even where roles share one engine.
    formats = formats or {}
    served = {}
    for role, policy in roles.items():
        fmt = formats.get(role, ReplyFormat())
        engine = engines[policy]
        max_tokens = engine_cfg.default_max_tokens
        served[role] = ServedModel(
            role, engine, engine.tokenizer, max_tokens, fmt.tool_parser, fmt.thinking
        )
    names = gateway_cfg or GatewayConfig()
    gateway = Gateway(store, served, remote=remote, aliases=names.model_aliases,
                      default_model=names.default_model, record=names.record,
                      session_idle_s=names.session_idle_s, assets=names.assets,
                      unassisted=names.unassisted)  # fmt: skip
    # Without keys, Host names the server answers to: loopback ones and the one it listens on
    # (a cluster's gateway_host, which its runners call it by).
    app = create_app(gateway, keys=keys, limits=limits, hosts=[host])
    server = serve_in_thread(app, host, port)
    return LocalStack(store, engines, gateway, server)
