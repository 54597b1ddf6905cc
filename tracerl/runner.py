"""The runner: a pool of concurrent workers that claim rollouts and run the user's agent.

A worker claims a rollout from the store, hands the agent its per-rollout base_url (so the
gateway attributes every model call to it), keeps the lease alive with heartbeats, enforces
a timeout, works out the reward and finishes the rollout. An agent that raises or hangs
becomes a failed or timed-out rollout with the error stored; it never stops the pool. If
the runner process dies, its leases expire and the store re-queues the rollouts for
another runner.

A reward function that raises is the user's bug, not the agent's failure: the rollout is
finished `failed` without a reward, its error the reward function's traceback marked as such
(types.REWARD_ERROR), so it has no outcome and is never trained on (a training run stops
after `guard.max_reward_errors` of them, showing the traceback).

An attempt during which the gateway found no engine replica in service (it marks the attempt
with an ENGINE_OUTAGE reward before answering 503) is not finished, whatever the agent made
of it: an outage is not the policy's doing, and finished as a failure it would be trained
as reward 0. Its lease is left to expire after `outage_backoff_s`, so the store re-queues
it as a new attempt (within max_attempts) once the engine had a moment to come back.

How agent code is loaded and called (a Python callable or an external command) is
tracerl.agents. The API key an agent gets is the attempt's own when the service has keys
(sent as a Bearer token, it opens that attempt's model calls and reward only).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import traceback
import uuid
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field

from tracerl import noise as tool_noise
from tracerl.agents import AgentFn, AgentResult, RewardFn
from tracerl.noise import NoiseConfig, NoiseSpec
from tracerl.store import LeaseLost, Store, StoreError, StoreUnavailable
from tracerl.types import ENGINE_OUTAGE, REWARD_ERROR, Reward, Rollout, RolloutStatus, Task

log = logging.getLogger(__name__)


class RunnerConfig(BaseModel):
    """How a pool of workers runs rollouts."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    concurrency: int = Field(default=16, ge=1)
    """Rollouts in flight at once (agents are mostly waiting on the model)."""
    timeout_s: float = Field(default=120.0, gt=0)
    """Wall time one rollout may take before it is finished as timed_out."""
    lease_s: float = Field(default=30.0, gt=0)
    """Lease length; heartbeats renew it every lease_s / 3."""
    api_key: str = "tracerl"
    """The API key handed to the agent when the claim carries none of its own (a store in
    this process: its gateway has no keys)."""
    poll_s: float = Field(default=0.05, gt=0)
    """Sleep between claims when nothing is queued."""
    noise: NoiseConfig = NoiseConfig()
    """Perturbed tool results for agents that use the hook (tracerl.noise); off by default."""
    outage_backoff_s: float = Field(default=2.0, gt=0)
    """An attempt that met an engine outage is re-run: its lease expires this long after
    the agent returned, and the store re-queues it."""


class Runner:
    """Claims rollouts from a store and runs them through the gateway, concurrently."""

    def __init__(
        self,
        store: Store,
        gateway_url: str,
        agent: AgentFn,
        reward_fn: RewardFn | None,
        cfg: RunnerConfig | None = None,
        runner_id: str | None = None,
        on_finish: Callable[[Rollout], None] | None = None,
        model: str = "policy",
    ) -> None:
        self.store = store
        self.gateway_url = gateway_url.rstrip("/")
        self.agent = agent
        self.reward_fn = reward_fn
        self.cfg = cfg or RunnerConfig()
        self.id = runner_id or f"runner-{uuid.uuid4().hex[:8]}"
        self.on_finish = on_finish or (lambda r: None)
        self.model = model
        """The `model` name handed to the agent: the role its calls are served as (the run's
        `model_name`)."""
        self.finished = 0
        self.reruns = 0
        """Attempts left to be re-run because they met an engine outage."""
        self.paused = False
        """While set, running rollouts go on but nothing new is claimed (another pool, e.g.
        a held-out evaluation's, has the queue to itself)."""
        self.busy_s = 0.0
        """Summed wall time of rollouts run (for utilisation: busy_s / (slots x wall))."""

    async def run(self, until_idle: bool = True, stop: asyncio.Event | None = None) -> None:
        """Keep up to `concurrency` rollouts running until nothing is queued or running
        (until_idle) or `stop` is set; then let the running ones finish.

        A slot that frees up is refilled at once (one claim for all free slots), so a
        long-tail rollout never holds the others back. With nothing to claim, the pool
        polls, backing off to once a second, for rollouts that come back (a dead runner's
        expired lease) or new work.
        """
        stop = stop or asyncio.Event()
        delay = self.cfg.poll_s
        active: set[asyncio.Task[None]] = set()
        while not stop.is_set():
            free = self.cfg.concurrency - len(active)
            claimed = []
            if free > 0 and not self.paused:
                claimed = await self._claim(free)
            for rollout in claimed:
                task = asyncio.create_task(self.run_one(rollout))
                active.add(task)
                task.add_done_callback(active.discard)
            if claimed:
                delay = self.cfg.poll_s
                continue
            if until_idle and not active and await asyncio.to_thread(self._idle):
                return
            if active:  # wake when a slot frees up, or poll again after `delay`
                await asyncio.wait(active, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
            else:
                await asyncio.sleep(delay)
            delay = min(2 * delay, 1.0)
        if active:
            await asyncio.gather(*active, return_exceptions=True)

    async def _claim(self, n: int) -> list[Rollout]:
        """Up to n rollouts; none while the store is unreachable (a remote store restarting):
        the pool keeps polling, with its usual back-off, instead of exiting."""
        try:
            return await asyncio.to_thread(self.store.claim, self.id, n, self.cfg.lease_s)
        except StoreUnavailable as e:
            log.warning("claim failed, will retry: %s", e.message)
            return []

    def _idle(self) -> bool:
        try:
            counts = self.store.counts()
        except StoreUnavailable:
            return False  # cannot tell while the store is away: keep polling
        return not counts.get("queued", 0) and not counts.get("running", 0)

    async def run_one(self, rollout: Rollout) -> None:
        """Run one claimed rollout to a final state (or abandon it if its lease is lost)."""
        started = time.perf_counter()
        try:
            await self._run_one(rollout)
        finally:
            self.busy_s += time.perf_counter() - started

    async def _run_one(self, rollout: Rollout) -> None:
        task = await asyncio.to_thread(self.store.get_task, rollout.task_id)
        base_url = f"{self.gateway_url}/rollouts/{rollout.id}/v1"
        # The attempt's own key when the store minted one (a claim over HTTP): it opens
        # this attempt's model calls and reward only, and dies with the attempt.
        minted = getattr(self.store, "agent_key", None)
        api_key = (minted and minted(rollout.id, rollout.attempt)) or self.cfg.api_key
        spec = await self._noise_spec(rollout)
        seen = tool_noise.with_spec(task, spec) if spec else task  # the reward judges the task
        run: asyncio.Future[AgentResult] = asyncio.ensure_future(
            self.agent(seen, base_url, api_key, self.model)
        )
        beat = asyncio.create_task(self._heartbeat(rollout, run))
        answer, reward, error = None, None, None
        status = RolloutStatus.succeeded
        try:
            result = await asyncio.wait_for(run, self.cfg.timeout_s)
            answer = result.answer
            reward = await asyncio.to_thread(self._reward, task, rollout, result)
        except TimeoutError:
            status, error = RolloutStatus.timed_out, f"timed out after {self.cfg.timeout_s:g}s"
        except asyncio.CancelledError:
            if not beat.done():
                raise
            return  # the heartbeat found the lease lost: another runner owns it now
        except RewardFunctionError as e:  # the user's bug: no outcome (types.REWARD_ERROR)
            status, error = RolloutStatus.failed, str(e)
        except Exception as e:  # the agent's failure is data, not a crash of the pool
            status, error = RolloutStatus.failed, _error_text(e)
        finally:
            beat.cancel()
        if await self._met_outage(rollout):
            await self._rerun_later(rollout)
            return
        if spec is not None and not await self._record_noise(rollout, spec):
            return
        await self._finish(rollout, status, answer, reward, error)

    async def _met_outage(self, rollout: Rollout) -> bool:
        """Whether the gateway marked this attempt as having met an engine outage."""
        try:
            marks = await asyncio.to_thread(self.store.rewards, rollout.id, rollout.attempt)
        except StoreError:
            return False  # the finish below meets the same store and says what is wrong
        return any(m.name == ENGINE_OUTAGE for m in marks)

    async def _rerun_later(self, rollout: Rollout) -> None:
        """Leave the attempt unfinished; its lease runs out in outage_backoff_s."""
        backoff = self.cfg.outage_backoff_s
        log.info("rollout %s attempt %d met an engine outage: re-run", rollout.id, rollout.attempt)
        with contextlib.suppress(StoreError):  # a lost lease is re-queued already
            await asyncio.to_thread(self.store.heartbeat, rollout.id, rollout.attempt, backoff)
        self.reruns += 1

    async def _noise_spec(self, rollout: Rollout) -> NoiseSpec | None:
        if not self.cfg.noise.enabled:
            return None
        step = await asyncio.to_thread(tool_noise.noise_step, self.store, self.model)
        return tool_noise.spec_for(self.cfg.noise, rollout.id, rollout.attempt, step)

    async def _record_noise(self, rollout: Rollout, spec: NoiseSpec) -> bool:
        """Store the attempt's perturbation count; False when the lease is gone."""
        count = len(tool_noise.take_applied(spec.id))
        record = Reward(rollout_id=rollout.id, attempt=rollout.attempt, value=count,
                        name=tool_noise.NOISE_REWARD)  # fmt: skip
        try:
            await asyncio.to_thread(self.store.add_reward, record)
        except LeaseLost:
            return False
        return True

    async def _finish(
        self,
        rollout: Rollout,
        status: RolloutStatus,
        answer: str | None,
        reward: float | None,
        error: str | None,
    ) -> None:
        try:
            done = await asyncio.to_thread(
                self.store.finish, rollout.id, rollout.attempt, status, answer, reward, error
            )
        except LeaseLost:
            return  # re-queued meanwhile; the new attempt will be finished by its runner
        self.finished += 1
        self.on_finish(done)

    def _reward(self, task: Task, rollout: Rollout, result: AgentResult) -> float | None:
        """The agent's own reward, else one it emitted over HTTP, else the reward function."""
        if result.reward is not None:
            return result.reward
        emitted = [
            r
            for r in self.store.rewards(rollout.id, rollout.attempt)
            if r.span_seq is None
            and r.role is None
            and r.name not in (tool_noise.NOISE_REWARD, ENGINE_OUTAGE)
        ]
        if emitted:
            return emitted[-1].value
        if self.reward_fn is None:
            return None
        try:
            return float(self.reward_fn(task.model_dump(), result.answer or ""))
        except Exception as e:  # a value that is no number (None, "1.0!") counts as well
            raise RewardFunctionError(e) from e

    async def _heartbeat(self, rollout: Rollout, run: asyncio.Future[AgentResult]) -> None:
        while True:
            await asyncio.sleep(self.cfg.lease_s / 3)
            try:
                await asyncio.to_thread(
                    self.store.heartbeat, rollout.id, rollout.attempt, self.cfg.lease_s
                )
            except LeaseLost:
                run.cancel()
                return
            except StoreError:
                continue  # a passing store hiccup; the lease still has time


class RewardFunctionError(Exception):
    """The reward function raised; the text is REWARD_ERROR, then its traceback."""

    def __init__(self, cause: BaseException) -> None:
        # Its traceback without this module's frame (the call), which tells the user nothing.
        frames = traceback.extract_tb(cause.__traceback__)[1:]
        lines = ["Traceback (most recent call last):\n", *traceback.format_list(frames)]
        lines += traceback.format_exception_only(type(cause), cause)
        # The end of a long one: where it raised, and what.
        super().__init__(f"{REWARD_ERROR}:\n{''.join(lines).strip()[-4000:]}")


def _error_text(e: BaseException) -> str:
    lines = traceback.format_exception_only(type(e), e)
    return "".join(lines).strip()[-2000:]
