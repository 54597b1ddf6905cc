"""The Engine protocol over OpenAI-compatible servers: token ids in, token ids out.

The servers are vLLM's (tracerl.engines.vllm) or tracerl's transformers server
(tracerl.engines.hf_server), which speaks the same subset. `generate` sends the prompt ids
to `/v1/completions` (`return_token_ids`, `logprobs`) of one replica and answers with
HFEngine's semantics: the completion ends with the end token, or with the token that
completed a stop string (`stop_string` says which), or at max_tokens; log-probs are those of
the sampling distribution at the request's temperature, and with `top_logprobs` the most
likely tokens of that distribution at each position (vLLM's `logprobs: k`, keyed by id with
`return_tokens_as_token_ids`). Cancelling the awaiting coroutine closes the HTTP request,
which aborts it on the server.

Replicas (tracerl.engines.replicas): calls of one routing key stick to one replica, new keys
go to the least loaded. A replica whose connection fails, or that answers a server error
(5xx), and then does not answer /health (a dead server, or a live HTTP server over a dead
engine) is taken out of service, the call is retried once on another (with the same
seed), or fails with EngineUnavailable; a
recovery thread brings the replica back (a subclass restarts its server) and reloads the
current weights before it takes calls again.

Constrained decoding: a ConstrainedParams grammar (llguidance Lark, built by the gateway) is
sent as vLLM's `structured_outputs.grammar`; vLLM's guidance backend and tracerl's
transformers server both mask the logits with it before sampling, and the log-probs they
report are taken after the mask (vLLM applies the grammar bitmask to the logits before its
sampler computes processed log-probs), so a constrained span's log-probs are those of the
masked distribution and `engines.scoring` reproduces them from the span's grammar.

`load_state_dict` is the weight-sync seam: the tensors are written as safetensors into
`weights_dir/v<version>/`, then each replica in service in turn drains, reloads them,
forgets its prefix cache, and resumes. A replica stops admitting requests while it switches
and every request is sent and answered within one version, so each Generation records
exactly the weights that produced it; `policy_version` moves once every replica in service
serves the new one.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import random
import shutil
import threading
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from transformers import PreTrainedTokenizerBase

from tracerl.engines.base import EngineUnavailable
from tracerl.engines.constrained import check_grammar
from tracerl.engines.http import CONNECTION_ERRORS, KEEPALIVE_S, alive, answer
from tracerl.engines.replicas import Replica, ReplicaSet
from tracerl.types import Generation, SamplingParams

if TYPE_CHECKING:
    import torch

__all__ = ["RemoteEngine"]

log = logging.getLogger(__name__)

SERVED_NAME = "policy"
"""The model name the servers answer to (--served-model-name)."""
_POLL_S = 0.005
"""How often a request waiting for its replica to finish switching weights looks again."""
_RETRY_S = (1.0, 30.0)
"""First and longest wait between two attempts to bring a replica back."""


class RemoteEngine:
    """Serves a policy from OpenAI-compatible servers at `urls` (see the module docstring)."""

    constrains_decoding = True
    """It sends a ConstrainedParams grammar to the servers, which sample under its mask."""

    def __init__(
        self,
        urls: list[str],
        *,
        tokenizer: PreTrainedTokenizerBase,
        max_context: int,
        eos_token_ids: list[int],
        weights_dir: str | Path,
        tie_word_embeddings: bool = False,
        policy_version: int = 0,
        timeout_s: float = 600.0,
        seed: int = 0,
    ) -> None:
        if not urls:
            raise ValueError("a remote engine needs at least one server URL")
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.eos_token_ids = list(eos_token_ids)
        self.policy_version = policy_version
        self.weights_dir = Path(weights_dir)
        self.tie_word_embeddings = tie_word_embeddings
        self.timeout_s = timeout_s
        self.grammar_eos_token_ids = list(eos_token_ids)
        """What a complete grammar lets the servers sample: the end tokens (a subclass whose
        servers allow fewer says which)."""
        self._eos = frozenset(self.eos_token_ids)
        # Stop strings are decoded with a private copy: a fast tokenizer used from two
        # threads at once can fail with "Already borrowed".
        self._stop_decoder = copy.deepcopy(tokenizer)
        self._rng = random.Random(seed)
        self.replicas = ReplicaSet([u.rstrip("/") for u in urls], policy_version)
        self._switch_lock = threading.Lock()
        self._weights_path: str | None = None
        """The weights served now (None: those the servers started with)."""
        self._sync = httpx.Client(timeout=timeout_s)
        # httpx's async pools belong to the event loop that opened them: one client per loop.
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient]
        self._clients = weakref.WeakKeyDictionary()
        self._closed = False
        self.recoveries = 0
        """Times a replica was brought back into service."""

    @property
    def urls(self) -> list[str]:
        """The replicas' base URLs now."""
        return [r.url for r in self.replicas.replicas]

    # -- generation --------------------------------------------------------------------

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, routing_key: str | None = None
    ) -> Generation:
        """Sample one completion on the replica of `routing_key`; the servers batch
        concurrent calls. A replica that fails is taken out and the call retried once."""
        self._check(prompt_ids, params)
        body = self._body(prompt_ids, params)  # one seed: a retry samples as the first try
        failed: Replica | None = None
        for _ in range(2):
            replica, version = await self._admit(routing_key, failed)
            try:
                response = await self._client().post(f"{replica.url}/v1/completions", json=body)
            except CONNECTION_ERRORS as exc:
                if self._closed:
                    raise RuntimeError("engine is closed") from exc
                # A connection can fail while its server is fine (one closed under an idle
                # pooled connection): only a server that does not answer /health is out.
                if not await alive(replica.url):
                    self.replica_failed(replica, repr(exc))
                    failed = replica
                continue
            finally:
                self.replicas.leave(replica)
            # A server error from a server whose engine died (vLLM answers 500 over a dead
            # engine core, and 503 on /health) is the replica's failure, not the call's.
            if response.status_code >= 500 and not await alive(replica.url):
                why = f"answered {response.status_code}: {response.text[:200]}"
                self.replica_failed(replica, why)
                failed = replica
                continue
            return self._generation(answer(response), params, version)
        raise EngineUnavailable(f"replica {failed.url if failed else '?'} failed twice")

    def generate_sync(self, replica: int, prompt_ids: list[int], max_tokens: int = 1) -> Generation:
        """Greedy completion from one given replica, outside any event loop (checks, tests)."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        target = self.replicas.replicas[replica]
        response = self._sync.post(
            f"{target.url}/v1/completions", json=self._body(prompt_ids, params)
        )
        return self._generation(answer(response), params, target.version)

    def _check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if self._closed:
            raise RuntimeError("engine is closed")
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if len(prompt_ids) >= self.max_context:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; max_context is {self.max_context}, "
                "which leaves no room for a completion"
            )
        if params.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if params.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < params.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        check_grammar(params)

    def _body(self, prompt_ids: list[int], params: SamplingParams) -> dict[str, Any]:
        seed = params.seed if params.seed is not None else self._rng.randrange(2**62)
        body: dict[str, Any] = {
            "model": SERVED_NAME,
            "prompt": list(prompt_ids),
            "max_tokens": min(params.max_tokens, self.max_context - len(prompt_ids)),
            "temperature": params.temperature,
            "top_p": params.top_p,
            "seed": seed,
            "stop": [s for s in params.stop if s],
            # The same end tokens as HFEngine (model, generation config and tokenizer).
            "stop_token_ids": self.eos_token_ids,
            "logprobs": params.top_logprobs,
            # Alternatives keyed "token_id:<id>", not by text two ids may share.
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
        }
        grammar = getattr(params, "grammar", None)
        if grammar:
            body["structured_outputs"] = {"grammar": grammar}
        return body

    def _generation(self, data: dict[str, Any], params: SamplingParams, version: int) -> Generation:
        """The server's answer with HFEngine's end rules applied to its tokens."""
        choice = data["choices"][0]
        ids = [int(t) for t in choice["token_ids"]]
        logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
        top = _top_logprobs(choice["logprobs"].get("top_logprobs"), params.top_logprobs)
        end = self._end(ids, [s for s in params.stop if s])
        if end is not None:
            cut, stop_string = end
            return Generation(
                completion_ids=ids[:cut],
                logprobs=logprobs[:cut],
                finish_reason="stop",
                policy_version=version,
                stop_string=stop_string,
                top_logprobs=top[:cut],
            )
        # No end found by our rules: the server stopped on a string only it saw, or on length.
        stop_reason = choice.get("stop_reason")
        stopped = choice.get("finish_reason") == "stop"
        return Generation(
            completion_ids=ids,
            logprobs=logprobs,
            finish_reason="stop" if stopped else "length",
            policy_version=version,
            stop_string=stop_reason if stopped and isinstance(stop_reason, str) else None,
            top_logprobs=top,
        )

    def _end(self, ids: list[int], stops: list[str]) -> tuple[int, str | None] | None:
        """(tokens kept, stop string) at the first token that ends the completion, as
        HFEngine decides after each sampled token; None if none does."""
        window = max((len(s.encode()) for s in stops), default=0) + 2
        for i, token in enumerate(ids):
            if token in self._eos:
                return i + 1, None
            if stops:
                tail = ids[max(0, i + 1 - window) : i + 1]
                text = self._stop_decoder.decode(tail, skip_special_tokens=False)
                for stop in stops:
                    if stop in text:
                        return i + 1, stop
        return None

    # -- replicas ------------------------------------------------------------------------

    async def _admit(self, key: str | None, avoid: Replica | None) -> tuple[Replica, int]:
        """A replica for the call (not `avoid`) once it admits calls, and its version."""
        while True:
            if self._closed:
                raise RuntimeError("engine is closed")
            replica = self.replicas.pick(key, avoid)
            if replica is None:
                raise EngineUnavailable("no engine replica is in service; retry shortly")
            version = self.replicas.enter(replica)
            if version is not None:
                return replica, version
            await asyncio.sleep(_POLL_S)  # switching weights: look again soon

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            limits = httpx.Limits(
                max_connections=None, max_keepalive_connections=64, keepalive_expiry=KEEPALIVE_S
            )
            client = httpx.AsyncClient(timeout=self.timeout_s, limits=limits)
            self._clients[loop] = client
        return client

    def replica_failed(self, replica: Replica, why: str) -> None:
        """Take `replica` out of service and bring it back in the background (once)."""
        if self._closed or not self.replicas.mark_down(replica):
            return
        log.warning("engine replica %s is out of service: %s", replica.url, why)
        name = f"engine-recovery-{replica.index}"
        threading.Thread(target=self._recover, args=(replica,), name=name, daemon=True).start()

    def _recover(self, replica: Replica) -> None:
        """Revive `replica` until it is back with the current weights, or the engine closes."""
        delay = _RETRY_S[0]
        while not self._closed:
            try:
                url = self.revive(replica)
                with self._switch_lock:  # no weight sync runs meanwhile: none is missed
                    self._rejoin(replica, url)
                log.warning("engine replica %s is back at version %d", url, replica.version)
                return
            except Exception as exc:  # keep trying: the run goes on without it
                if self._closed:
                    return
                log.warning("engine replica %d not back yet (%s); retrying", replica.index, exc)
            time.sleep(delay)
            delay = min(2 * delay, _RETRY_S[1])

    def revive(self, replica: Replica) -> str:
        """Wait until the server of `replica` answers /health again; its URL. (A server the
        user runs is restarted by the user; subclasses that own servers restart them.)"""
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline and not self._closed:
            try:
                if self._sync.get(f"{replica.url}/health", timeout=2.0).status_code == 200:
                    return replica.url
            except httpx.TransportError:
                pass
            time.sleep(_RETRY_S[0])
        raise TimeoutError(f"{replica.url} did not answer /health")

    def _rejoin(self, replica: Replica, url: str) -> None:
        """Load the current weights on the revived server at `url`, check one token, and put
        it back in service. Called with the switch lock held."""
        version = self.policy_version
        replica.url = url  # down: nothing else reads it meanwhile
        if self._weights_path is not None:
            self._reload(replica, self._weights_path, version)
        else:
            self._post(replica, "/update_weight_version", json={"new_version": str(version)})
        self.generate_sync(replica.index, [self.eos_token_ids[0]])
        if self._closed:
            raise RuntimeError("engine is closed")
        self.replicas.mark_up(replica, url, version)
        self.recoveries += 1

    # -- weight sync ---------------------------------------------------------------------

    def load_state_dict(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Serve `state` (the HF model's keys) as `version` on every replica, then return.

        Blocks: call it from a thread other than the event loop generating on this engine.
        """
        path = self.weights_dir / f"v{version}"
        _write_safetensors(state, path, drop_tied_head=self.tie_word_embeddings)
        self.load_weights(path, version)

    def load_weights(self, path: str | Path, version: int) -> None:
        """Serve the safetensors weights in directory `path` as `version` on every replica
        in service; a replica out of service loads them when it comes back."""
        resolved = str(Path(path).resolve())
        with self._switch_lock:
            for replica in self.replicas.up_replicas():
                self._switch(replica, resolved, version)
            old, self.policy_version = self.policy_version, version
            self._weights_path = resolved
        if Path(path).parent == self.weights_dir and old != version:
            shutil.rmtree(self.weights_dir / f"v{old}", ignore_errors=True)

    def _switch(self, replica: Replica, path: str, version: int) -> None:
        """Drain `replica`, reload its weights from `path`, and let requests in again. A
        replica that fails meanwhile is taken out (it reloads when it comes back)."""
        switched = False
        try:
            if not self.replicas.drain(replica, self.timeout_s):
                raise TimeoutError(f"{replica.url} did not drain within {self.timeout_s} s")
            self._reload(replica, path, version)
            switched = True
        except httpx.TransportError as exc:
            self.replica_failed(replica, f"weight sync: {exc!r}")
        finally:
            self.replicas.undrain(replica, version if switched else None)

    def _reload(self, replica: Replica, path: str, version: int) -> None:
        """The server's weight-sync sequence: pause, reload, forget cached prefixes, tag the
        version, resume."""
        self._post(replica, "/pause", params={"mode": "wait"})
        try:
            rpc = {"method": "tracerl_reload_weights", "kwargs": {"weights_path": path}}
            self._post(replica, "/collective_rpc", json=rpc)
            self._post(replica, "/reset_prefix_cache")
            self._post(replica, "/update_weight_version", json={"new_version": str(version)})
        finally:
            self._post(replica, "/resume")

    def _post(self, replica: Replica, route: str, **kwargs: Any) -> None:
        response = self._sync.post(f"{replica.url}{route}", **kwargs)
        if response.status_code != 200:
            raise RuntimeError(f"{replica.url}{route}: {response.status_code} {response.text}")

    def close(self) -> None:
        """Stop using the servers; requests still running fail on their closed clients."""
        if self._closed:
            return
        self._closed = True
        self._sync.close()
        self._clients.clear()


def _write_safetensors(state: dict[str, torch.Tensor], path: Path, *, drop_tied_head: bool) -> None:
    """`state` as one safetensors file in `path`, with CPU copies of the tensors."""
    from safetensors.torch import save_file

    tensors = {
        name: tensor.detach().to("cpu").clone().contiguous()
        for name, tensor in state.items()
        # A tied head is the embedding: vLLM loads it from there and skips lm_head.
        if not (drop_tied_head and name == "lm_head.weight")
    }
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))


def _top_logprobs(
    positions: list[dict[str, float]] | None, k: int
) -> list[list[tuple[int, float]]]:
    """vLLM's `top_logprobs` (one {"token_id:<id>": log-prob} per position) as the k best
    (id, log-prob) of each position, best first: vLLM adds the sampled token when it is
    not among the k."""
    if not k or not positions:
        return []
    out = []
    for position in positions:
        pairs = [(int(key.rpartition(":")[2]), float(lp)) for key, lp in position.items()]
        out.append(sorted(pairs, key=lambda pair: -pair[1])[:k])
    return out
