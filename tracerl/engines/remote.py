"""The Engine protocol over OpenAI-compatible vLLM servers: token ids in, token ids out.

`generate` sends the prompt ids to `/v1/completions` (`return_token_ids`, `logprobs`) of one
replica and answers with HFEngine's semantics: the completion ends with the end token, or
with the token that completed a stop string (`stop_string` says which), or at max_tokens;
log-probs are those of the sampling distribution at the request's temperature. Cancelling
the awaiting coroutine closes the HTTP request, which aborts it on the server.

`load_state_dict` is the weight-sync seam: the tensors are written as safetensors into
`weights_dir/v<version>/`, then each replica in turn drains, reloads them, forgets its
prefix cache, and resumes. A replica stops admitting requests while it switches and every
request is sent and answered within one version, so each Generation records exactly the
weights that produced it; `policy_version` moves once every replica serves the new one.
"""

from __future__ import annotations

import asyncio
import copy
import random
import shutil
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from transformers import AutoConfig, GenerationConfig, PreTrainedTokenizerBase

from tracerl.types import Generation, SamplingParams

if TYPE_CHECKING:
    import torch

__all__ = ["RemoteEngine", "eos_token_ids"]

SERVED_NAME = "policy"
"""The model name the servers answer to (--served-model-name)."""
_POLL_S = 0.005
"""How often a request waiting for its replica to finish switching weights looks again."""


@dataclass
class _Replica:
    """One server and what the client knows of it; guarded by RemoteEngine._cond."""

    url: str
    version: int
    """Version of the weights it serves now."""
    inflight: int = 0
    """Requests sent to it and not yet answered."""
    switching: bool = False
    """New weights are being loaded: no request may be sent."""


class RemoteEngine:
    """Serves a policy from vLLM servers at `urls` (see the module docstring)."""

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
        self.urls = [u.rstrip("/") for u in urls]
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.eos_token_ids = list(eos_token_ids)
        self.policy_version = policy_version
        self.weights_dir = Path(weights_dir)
        self.tie_word_embeddings = tie_word_embeddings
        self.timeout_s = timeout_s
        self._eos = frozenset(self.eos_token_ids)
        # Stop strings are decoded with a private copy: a fast tokenizer used from two
        # threads at once can fail with "Already borrowed".
        self._stop_decoder = copy.deepcopy(tokenizer)
        self._rng = random.Random(seed)
        self._replicas = [_Replica(url, policy_version) for url in self.urls]
        self._next = 0
        self._cond = threading.Condition()
        self._switch_lock = threading.Lock()
        self._sync = httpx.Client(timeout=timeout_s)
        # httpx's async pools belong to the event loop that opened them: one client per loop.
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient]
        self._clients = weakref.WeakKeyDictionary()
        self._closed = False

    # -- generation --------------------------------------------------------------------

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        """Sample one completion on a replica; the servers batch concurrent calls."""
        self._check(prompt_ids, params)
        replica = self._pick()
        version = await self._admit(replica)
        try:
            response = await self._client().post(
                f"{replica.url}/v1/completions", json=self._body(prompt_ids, params)
            )
        finally:
            self._leave(replica)
        return self._generation(_json(response), params, version)

    def generate_sync(self, replica: int, prompt_ids: list[int], max_tokens: int = 1) -> Generation:
        """Greedy completion from one given replica, outside any event loop (checks, tests)."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        target = self._replicas[replica]
        response = self._sync.post(
            f"{target.url}/v1/completions", json=self._body(prompt_ids, params)
        )
        return self._generation(_json(response), params, target.version)

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

    def _body(self, prompt_ids: list[int], params: SamplingParams) -> dict[str, Any]:
        seed = params.seed if params.seed is not None else self._rng.randrange(2**62)
        return {
            "model": SERVED_NAME,
            "prompt": list(prompt_ids),
            "max_tokens": min(params.max_tokens, self.max_context - len(prompt_ids)),
            "temperature": params.temperature,
            "top_p": params.top_p,
            "seed": seed,
            "stop": [s for s in params.stop if s],
            # The same end tokens as HFEngine (model, generation config and tokenizer).
            "stop_token_ids": self.eos_token_ids,
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
        }

    def _generation(self, data: dict[str, Any], params: SamplingParams, version: int) -> Generation:
        """The server's answer with HFEngine's end rules applied to its tokens."""
        choice = data["choices"][0]
        ids = [int(t) for t in choice["token_ids"]]
        logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
        end = self._end(ids, [s for s in params.stop if s])
        if end is not None:
            cut, stop_string = end
            return Generation(
                completion_ids=ids[:cut],
                logprobs=logprobs[:cut],
                finish_reason="stop",
                policy_version=version,
                stop_string=stop_string,
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

    def _pick(self) -> _Replica:
        """Round robin (sticky routing of a rollout to one replica comes with rollout ids)."""
        replica = self._replicas[self._next % len(self._replicas)]
        self._next += 1
        return replica

    async def _admit(self, replica: _Replica) -> int:
        """Count a request in on `replica` once it is not switching; its version then."""
        while True:
            with self._cond:
                if not replica.switching:
                    replica.inflight += 1
                    return replica.version
            await asyncio.sleep(_POLL_S)

    def _leave(self, replica: _Replica) -> None:
        with self._cond:
            replica.inflight -= 1
            self._cond.notify_all()

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            client = httpx.AsyncClient(timeout=self.timeout_s, limits=limits)
            self._clients[loop] = client
        return client

    # -- weight sync ---------------------------------------------------------------------

    def load_state_dict(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Serve `state` (the HF model's keys) as `version` on every replica, then return.

        Blocks: call it from a thread other than the event loop generating on this engine.
        """
        path = self.weights_dir / f"v{version}"
        _write_safetensors(state, path, drop_tied_head=self.tie_word_embeddings)
        self.load_weights(path, version)

    def load_weights(self, path: str | Path, version: int) -> None:
        """Serve the safetensors weights in directory `path` as `version` on every replica."""
        with self._switch_lock:
            for replica in self._replicas:
                self._switch(replica, str(Path(path).resolve()), version)
            old, self.policy_version = self.policy_version, version
        if Path(path).parent == self.weights_dir and old != version:
            shutil.rmtree(self.weights_dir / f"v{old}", ignore_errors=True)

    def _switch(self, replica: _Replica, path: str, version: int) -> None:
        """Drain `replica`, reload its weights from `path`, and let requests in again."""
        with self._cond:
            replica.switching = True
            drained = self._cond.wait_for(lambda: replica.inflight == 0, self.timeout_s)
        try:
            if not drained:
                raise TimeoutError(f"{replica.url} did not drain within {self.timeout_s} s")
            self._post(replica, "/pause", params={"mode": "wait"})
            try:
                rpc = {"method": "tracerl_reload_weights", "kwargs": {"weights_path": path}}
                self._post(replica, "/collective_rpc", json=rpc)
                self._post(replica, "/reset_prefix_cache")
                self._post(replica, "/update_weight_version", json={"new_version": str(version)})
            finally:
                self._post(replica, "/resume")
            with self._cond:
                replica.version = version
        finally:
            with self._cond:
                replica.switching = False
                self._cond.notify_all()

    def _post(self, replica: _Replica, route: str, **kwargs: Any) -> None:
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


def _json(response: httpx.Response) -> dict[str, Any]:
    """The body of a successful answer; a 4xx becomes ValueError, anything else an error."""
    if response.status_code == 200:
        return dict(response.json())
    message = response.text
    if 400 <= response.status_code < 500:
        raise ValueError(f"vLLM refused the request ({response.status_code}): {message}")
    raise RuntimeError(f"vLLM failed ({response.status_code}): {message}")


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
