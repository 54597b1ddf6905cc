"""The transformers engine as a server process, speaking the HTTP subset of vLLM's server
that RemoteEngine uses, so it is served, routed, restarted and synced exactly like vLLM.

`python -m tracerl.engines.hf_server --model DIR --port P` serves one HFEngine on
127.0.0.1:P (or `--host`, a cluster node's address):

- `POST /v1/completions`: a token-id prompt (and vLLM's `structured_outputs.grammar`, the
  grammar of a constrained completion); answers vLLM's fields (`choices[0].token_ids`,
  `logprobs.token_logprobs`, with `logprobs: k` `logprobs.top_logprobs` keyed "token_id:<id>",
  `finish_reason`, `stop_reason`). The log-probs are HFEngine's,
  so re-scoring holds as in process. A client that disconnects cancels its request.
- `GET /health`: the weight version label, requests running and admitted so far.
- Weight sync, as vLLM's dev endpoints: `/pause?mode=wait` (stop admitting, wait for the
  requests in flight), `/collective_rpc` with method `tracerl_reload_weights` (load the
  safetensors in `weights_path`), `/reset_prefix_cache` (HFEngine caches no prefixes),
  `/update_weight_version`, `/resume`.

`engine.kind = "hf_server"` starts such servers (HFServerEngine, below) with the launcher
vLLM's servers use (tracerl.engines.launch).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from collections.abc import Collection
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import FastAPI, Request, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tracerl.doors import DoorsMiddleware
from tracerl.engines.constrained import ConstrainedParams
from tracerl.engines.http import SERVER_KEEPALIVE_S
from tracerl.engines.launch import LaunchedEngine
from tracerl.engines.owner import watch_owner
from tracerl.types import Generation, SamplingParams

if TYPE_CHECKING:
    from tracerl.engines.hf import HFEngine

__all__ = ["HFServerEngine", "create_app", "main"]

_DISCONNECT_POLL_S = 0.1
"""How often a running request checks whether its client went away."""


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`, of which this server reads the grammar only."""

    model_config = ConfigDict(extra="ignore", use_attribute_docstrings=True)

    grammar: str = Field(min_length=1)
    """An llguidance grammar the completion must match (HFEngine masks with it)."""


class CompletionBody(BaseModel):
    """The fields of vLLM's /v1/completions request that this server acts on.

    The others RemoteEngine sends are implied: the ids and log-probs are always returned,
    ids are never re-decoded, and the end tokens are the model's own, as HFEngine takes them
    (the same list RemoteEngine sends as `stop_token_ids`).
    """

    model_config = ConfigDict(extra="ignore", use_attribute_docstrings=True)

    prompt: list[int] = Field(min_length=1)
    """Prompt token ids."""
    max_tokens: int = Field(default=16, ge=1)
    """Most tokens to sample."""
    temperature: float = Field(default=1.0, ge=0)
    """Sampling temperature; 0 is greedy."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus mass."""
    seed: int | None = None
    """Seed of this request's sampler."""
    stop: list[str] = Field(default_factory=list)
    """Stop strings."""
    structured_outputs: StructuredOutputs | None = None
    """The grammar of a constrained completion."""
    logprobs: int | None = Field(default=None, ge=0)
    """How many of the most likely tokens to return at each position (vLLM's
    `logprobs.top_logprobs`, keyed "token_id:<id>" as with `return_tokens_as_token_ids`)."""


class RpcBody(BaseModel):
    """A /collective_rpc call: the one method this server has, and its arguments."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    method: str
    """Only "tracerl_reload_weights"."""
    kwargs: dict[str, str] = Field(default_factory=dict)
    """{"weights_path": a directory holding model.safetensors}."""


class _Gate:
    """Admission of completions, closed by /pause while weights are reloaded (event-loop
    only, so plain counters are safe)."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.open.set()
        self.idle = asyncio.Event()
        self.idle.set()
        self.inflight = 0
        self.admitted = 0

    async def enter(self) -> None:
        await self.open.wait()
        self.inflight += 1
        self.admitted += 1
        self.idle.clear()

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self.idle.set()


def create_app(engine: HFEngine, hosts: Collection[str] = ()) -> FastAPI:
    """The HTTP app serving `engine` (see the module docstring). It has no keys, so it
    answers to loopback Host names and `hosts` (the address it listens on) only, and a web
    page may not drive it (tracerl.doors): a POST to /pause from any page would stall it."""
    app = FastAPI(title="tracerl transformers engine")
    app.add_middleware(DoorsMiddleware, hosts=hosts)
    gate = _Gate()
    versions = {"label": str(engine.policy_version)}

    @app.get("/health")
    async def health() -> Response:
        # What a router or a test may want to see: the version and the load.
        stats = {"running": gate.inflight, "admitted": gate.admitted}
        return _json({"weight_version": versions["label"], **stats})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        try:
            body = CompletionBody.model_validate(orjson.loads(await request.body()))
        except (orjson.JSONDecodeError, ValidationError) as e:
            return _json({"error": {"message": str(e), "type": "BadRequestError"}}, 400)
        params = SamplingParams(
            max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
            stop=body.stop, seed=body.seed, top_logprobs=body.logprobs or 0,
        )  # fmt: skip
        if body.structured_outputs is not None:
            grammar = body.structured_outputs.grammar
            params = ConstrainedParams(**params.model_dump(), grammar=grammar)
        await gate.enter()
        try:
            gen = await _unless_disconnected(request, engine.generate(body.prompt, params))
        except ValueError as e:
            return _json({"error": {"message": str(e), "type": "BadRequestError"}}, 400)
        finally:
            gate.leave()
        return _json(_completion(gen))

    @app.post("/pause")
    async def pause() -> Response:
        gate.open.clear()
        await gate.idle.wait()
        return _json({})

    @app.post("/resume")
    async def resume() -> Response:
        gate.open.set()
        return _json({})

    @app.post("/collective_rpc")
    async def collective_rpc(body: RpcBody) -> Response:
        if body.method != "tracerl_reload_weights" or "weights_path" not in body.kwargs:
            return _json({"error": {"message": f"unknown method {body.method!r}"}}, 400)
        path = Path(body.kwargs["weights_path"]) / "model.safetensors"
        # Reading and copying the weights blocks: off the loop, which keeps answering.
        await asyncio.to_thread(_reload, engine, path)
        return _json({"results": [None]})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        return _json({})  # HFEngine keeps no cache between requests

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> Response:
        versions["label"] = str(orjson.loads(await request.body()).get("new_version"))
        return _json({})

    return app


def _reload(engine: HFEngine, path: Path) -> None:
    """Serve the weights in `path`; the engine switches once its (paused) batch drained."""
    from safetensors.torch import load_file

    # The version inside HFEngine only labels its own answers, which this server does not
    # report: RemoteEngine records the version it synced.
    engine.load_state_dict(load_file(str(path)), engine.policy_version + 1)


async def _unless_disconnected(request: Request, work: Any) -> Generation:
    """Await `work`, cancelling it if the client disconnects first."""
    task: asyncio.Task[Generation] = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
            raise asyncio.CancelledError


def _completion(gen: Generation) -> dict[str, Any]:
    logprobs: dict[str, Any] = {"token_logprobs": gen.logprobs}
    if gen.top_logprobs:
        top = [{f"token_id:{t}": lp for t, lp in position} for position in gen.top_logprobs]
        logprobs["top_logprobs"] = top
    choice = {
        "index": 0,
        "text": "",
        "token_ids": gen.completion_ids,
        "logprobs": logprobs,
        "finish_reason": gen.finish_reason,
        "stop_reason": gen.stop_string,
    }
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "choices": [choice]}


def _json(data: dict[str, Any], status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


class HFServerEngine(LaunchedEngine):
    """LaunchedEngine over transformers servers (this module) run by this Python."""

    name = "hf_server"

    def command(self, host: str, port: str) -> list[str]:
        """`python -m tracerl.engines.hf_server` with the engine config's settings (this
        Python: a cluster's nodes have tracerl's environment at the same path)."""
        cfg = self.cfg
        return [
            sys.executable, "-m", "tracerl.engines.hf_server",
            "--model", str(self.model_dir), "--host", host, "--port", port,
            "--device", cfg.device, "--max-batch-size", str(cfg.max_batch_size),
            "--seed", str(cfg.seed),
        ]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Serve one model on 127.0.0.1 (or --host) until killed."""
    import uvicorn

    from tracerl.engines.hf import HFEngine

    parser = argparse.ArgumentParser(description="Serve a transformers model for tracerl.")
    parser.add_argument("--model", required=True, help="local HF model directory")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    watch_owner()  # stop when the process that started this server is gone
    engine = HFEngine(
        args.model, device=args.device, max_batch_size=args.max_batch_size, seed=args.seed
    )
    try:
        uvicorn.run(
            create_app(engine, [args.host]), host=args.host, port=args.port, log_level="warning",
            access_log=False, timeout_keep_alive=SERVER_KEEPALIVE_S,
        )  # fmt: skip
    finally:
        engine.close()


if __name__ == "__main__":
    main()
