"""What a call is given besides the agent's request: the assets in its system message and,
under a rollout with a seed, its sampling seed. The gateway asks here once per call, before
templating, so the model sees, and the span records, the prompt with the assets in it.

Which versions. The gateway's config (GatewayConfig.assets) names assets applied to every
call of the roles it lists; a rollout's own `assets` (Rollout.assets) overrides the version
per name, 0 withholding it (a comparison's arms, a curriculum's draws). A version left to
"current" is looked up once per rollout attempt and kept for the attempt's later calls, so
one rollout never sees two versions and its prompts keep extending each other (token-in/
token-out reuse holds). Texts are immutable once put, so they are cached by version.

Seeds. A rollout with a seed gives its k-th call (from 0, per attempt, counted here) the
seed `seed + k` when the request names none: two rollouts with one seed draw the same
random numbers call for call (the arms of a paired comparison).

Store calls run on the gateway's store executor, never on its event loop.
"""

from __future__ import annotations

import asyncio
import functools
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, TypeVar

from tracerl.assets.apply import Mode, with_assets
from tracerl.assets.config import AssetUse
from tracerl.gateway.chat import ChatRequest, CompletionRequest
from tracerl.gateway.errors import GatewayError
from tracerl.store import NotFound, Store
from tracerl.types import Rollout

__all__ = ["AssetContext"]

T = TypeVar("T")

TEXTS_KEPT = 256
"""Asset versions whose text is kept in memory."""


@dataclass
class _Attempt:
    """What one rollout attempt's calls are given."""

    versions: dict[str, int]
    """Each asset's version for this attempt (0: withheld), in the order they apply."""
    calls: int = 0
    """Calls made so far (the next one's seed offset)."""


class AssetContext:
    """Applies assets to calls and seeds them; remembers `memory` attempts."""

    def __init__(
        self, store: Store | None, uses: dict[str, AssetUse], executor: Executor, memory: int
    ) -> None:
        if uses and store is None:
            raise ValueError(f"assets {sorted(uses)} need a store to read them from")
        self.store = store
        self.uses = dict(uses)
        """The assets the gateway's config applies, and how."""
        self._executor = executor
        self.memory = memory
        self._attempts: OrderedDict[tuple[str, int], _Attempt] = OrderedDict()
        self._texts: OrderedDict[tuple[str, int], str] = OrderedDict()

    def check(self) -> None:
        """ValueError unless every configured asset (at its pinned version, or a current
        one) is in the store: a misnamed asset is found at start, not at the first call."""
        for name, use in self.uses.items():
            assert self.store is not None
            try:
                self.store.asset(name, use.version)
            except NotFound as e:
                raise ValueError(f"gateway.assets: {e.message}") from None

    async def chat(
        self, req: ChatRequest, role: str, rollout: Rollout | None
    ) -> tuple[ChatRequest, dict[str, int]]:
        """The request as the model sees it (the role's assets in its system message, the
        rollout's seed), and the asset versions applied."""
        versions = await self._versions(rollout)
        applied = {n: v for n, v in versions.items() if v and self._applies(n, role)}
        update: dict[str, Any] = {}
        if applied:
            texts: list[tuple[str, Mode]] = [
                (await self._text(n, v), self._use(n).mode) for n, v in applied.items()
            ]
            update["messages"] = with_assets(req.messages, texts)
        if (seed := self._seed(rollout, req.seed)) is not None:
            update["seed"] = seed
        return (req.model_copy(update=update) if update else req), applied

    async def completion(
        self, req: CompletionRequest, rollout: Rollout | None
    ) -> CompletionRequest:
        """A raw completion gets no assets (it has no messages), only the rollout's seed."""
        await self._versions(rollout)  # opens the attempt, as a chat call would
        seed = self._seed(rollout, req.seed)
        return req if seed is None else req.model_copy(update={"seed": seed})

    def forget(self, rollout_id: str, attempt: int) -> None:
        """Drop a finished attempt's versions and call count."""
        self._attempts.pop((rollout_id, attempt), None)

    # -- versions, texts, seeds ----------------------------------------------------------

    def _use(self, name: str) -> AssetUse:
        """How `name` applies: the config's, else the defaults (append, every role)."""
        return self.uses.get(name) or AssetUse()

    def _applies(self, name: str, role: str) -> bool:
        roles = self._use(name).roles
        return roles is None or role in roles

    async def _versions(self, rollout: Rollout | None) -> dict[str, int]:
        """Each asset's version for the call: the attempt's, resolved at its first call."""
        if rollout is None:
            return await self._resolve({})
        key = (rollout.id, rollout.attempt)
        state = self._attempts.pop(key, None)
        if state is None:
            state = _Attempt(await self._resolve(rollout.assets or {}))
        self._attempts[key] = state  # the most recently used last
        while len(self._attempts) > self.memory:
            self._attempts.popitem(last=False)
        return state.versions

    async def _resolve(self, override: dict[str, int]) -> dict[str, int]:
        """Config assets in config order, then the rollout's other ones by name."""
        out: dict[str, int] = {}
        for name, use in self.uses.items():
            version = override.get(name, use.version)
            out[name] = (await self._asset(name, None)) if version is None else version
        for name in sorted(set(override) - set(self.uses)):
            out[name] = override[name]
        return out

    async def _asset(self, name: str, version: int | None) -> int:
        """The version of `name` the store has (its current one for None); 409 if none."""
        assert self.store is not None
        try:
            asset = await self._io(self.store.asset, name, version)
        except NotFound as e:
            raise GatewayError(409, e.message, code="asset_not_found") from None
        self._keep((name, asset.version), asset.text)
        return asset.version

    async def _text(self, name: str, version: int) -> str:
        key = (name, version)
        if key not in self._texts:
            await self._asset(name, version)
        self._texts.move_to_end(key)
        return self._texts[key]

    def _keep(self, key: tuple[str, int], text: str) -> None:
        self._texts[key] = text
        while len(self._texts) > TEXTS_KEPT:
            self._texts.popitem(last=False)

    def _seed(self, rollout: Rollout | None, given: int | None) -> int | None:
        """The seed of the attempt's next call (opened by `_versions`): the request's own,
        else the rollout's + k."""
        if rollout is None or rollout.seed is None:
            return given
        state = self._attempts[(rollout.id, rollout.attempt)]
        k, state.calls = state.calls, state.calls + 1
        return given if given is not None else rollout.seed + k

    async def _io(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))
