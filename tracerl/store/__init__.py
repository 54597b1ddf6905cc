"""The store: tasks, rollout attempts and their lifecycle, spans, rewards, policy versions,
and assets (versioned prompts and skills, their comparisons and optimizations).

`Store` is the interface every part codes against. `SqliteStore` (embedded, one file, or
":memory:" for tests; sqlite.py, its layout in schema.py) implements it in-process;
`StoreClient` (client.py) implements it over HTTP for runners on other machines, against
the router in http.py (what both send: wire.py). `connect()` picks one from a path or URL.

Errors are one small hierarchy so that callers, and the HTTP layer, can tell a missing
record from a refused state change from a lease that went to someone else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from tracerl.assets.records import Asset, Comparison, Optimization
from tracerl.types import PolicyVersion, Reward, Rollout, RolloutStatus, Span, Task

__all__ = [
    "Conflict",
    "InvalidTransition",
    "LeaseLost",
    "LocalStore",
    "NotFound",
    "SqliteStore",
    "Store",
    "StoreError",
    "StoreUnavailable",
    "connect",
]


class StoreError(Exception):
    """Base of every error the store raises on purpose; `message` says what went wrong."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class StoreUnavailable(StoreError):
    """The store could not be reached (a remote store restarting, the network): the call
    may be retried; nothing was changed by it on the caller's side."""


class NotFound(StoreError):
    """No task, rollout or version with that id."""


class InvalidTransition(StoreError):
    """The lifecycle change is not in VALID_TRANSITIONS (e.g. finishing twice)."""


class LeaseLost(StoreError):
    """The caller's attempt is no longer the running one: the lease expired and the
    rollout was re-queued or finished. A runner getting this should abandon the rollout."""


class Conflict(StoreError):
    """A record with this id already exists with different content."""


@runtime_checkable
class Store(Protocol):
    """What runners, the gateway, the pipeline and the CLI need from a store."""

    def add_tasks(self, tasks: list[Task]) -> None:
        """Add tasks; re-adding an identical task is a no-op, a different one a Conflict."""
        ...

    def get_task(self, task_id: str) -> Task:
        """The task with this id, or NotFound."""
        ...

    def tasks(self, split: str | None = None) -> list[Task]:
        """All tasks (of one split), in the order they were added."""
        ...

    def enqueue(
        self,
        task_ids: list[str],
        group_id: str | None = None,
        max_attempts: int = 3,
        assets: dict[str, int] | None = None,
        seeds: list[int] | None = None,
    ) -> list[Rollout]:
        """One queued rollout per task id (repeat an id for several rollouts of a task), each
        given `assets` (Rollout.assets) and its entry of `seeds` (one per task id, or None)."""
        ...

    def claim(self, runner_id: str, n: int = 1, lease_s: float = 30.0) -> list[Rollout]:
        """Re-queue expired leases, then lease up to n of the oldest queued rollouts."""
        ...

    def open_session(self, key: str, lease_s: float = 600.0) -> Rollout:
        """A new task of split "session" (one per key) and its rollout, already running with
        max_attempts 1, in one transaction: what the gateway records unattributed calls in."""
        ...

    def heartbeat(self, rollout_id: str, attempt: int, lease_s: float = 30.0) -> Rollout:
        """Extend the lease of a running attempt; LeaseLost if it is no longer running."""
        ...

    def get_rollout(self, rollout_id: str) -> Rollout:
        """The rollout with this id, or NotFound."""
        ...

    def add_span(self, span: Span) -> None:
        """Record one model call of the running attempt."""
        ...

    def add_spans(self, spans: list[Span]) -> None:
        """Record several model calls at once (all or none), at the seqs they carry."""
        ...

    def append_spans(self, spans: list[Span]) -> list[int]:
        """Record model calls of running attempts at seqs the store chooses: each span takes
        the next seq of its attempt, in list order (the seq it carries is ignored); all or
        none. Returns the seqs given. Gateways sharing an attempt never pick the same one."""
        ...

    def add_reward(self, reward: Reward) -> None:
        """Record a reward for the running attempt."""
        ...

    def finish(
        self,
        rollout_id: str,
        attempt: int,
        status: RolloutStatus,
        answer: str | None = None,
        reward: float | None = None,
        error: str | None = None,
    ) -> Rollout:
        """Move the attempt to a final status, storing the answer and final reward."""
        ...

    def spans(self, rollout_id: str, attempt: int | None = None) -> list[Span]:
        """Spans of one attempt (default: the current one), ordered by seq."""
        ...

    def rewards(self, rollout_id: str, attempt: int | None = None) -> list[Reward]:
        """Rewards of one attempt (default: the current one), in the order given."""
        ...

    def rollouts(
        self,
        status: RolloutStatus | None = None,
        group_id: str | None = None,
        task_id: str | None = None,
        limit: int | None = None,
    ) -> list[Rollout]:
        """Rollouts matching every given filter, oldest first."""
        ...

    def requeue_expired(self, now: float | None = None) -> list[Rollout]:
        """Re-queue (or time out, when out of attempts) running rollouts whose lease expired."""
        ...

    def issue_version(self, roles: list[str]) -> int:
        """A new policy version number for weights about to be served in `roles`: one above
        every version the store holds for any of them (0 for the first), recorded for each
        role (no checkpoint path yet) in the same transaction, so no two calls, in any
        process, get the same number. Every number an engine serves comes from here."""
        ...

    def publish_version(self, pv: PolicyVersion) -> None:
        """Record a policy version, or the checkpoint path of one served before its
        checkpoint was written (see lifecycle.sets_path)."""
        ...

    def latest_version(self, role: str = "policy") -> PolicyVersion | None:
        """The highest published version of a role, or None before the first."""
        ...

    def counts(self) -> dict[str, int]:
        """Number of rollouts in each status (every status present, zeros included)."""
        ...

    def put_asset(self, name: str, text: str, note: str = "", candidate: bool = False) -> Asset:
        """Store `text` as the next version of asset `name` (1 for a new name), numbered by
        the store; a plain version becomes the current one, a candidate never does."""
        ...

    def asset(self, name: str, version: int | None = None) -> Asset:
        """One version of an asset, or (None) its current one: NotFound otherwise."""
        ...

    def assets(self) -> list[Asset]:
        """The current version of every asset that has one, by name."""
        ...

    def asset_versions(self, name: str) -> list[Asset]:
        """Every version of an asset, candidates included, oldest first (NotFound: none)."""
        ...

    def add_comparison(self, comparison: Comparison) -> None:
        """Record a paired comparison of two asset versions (the same id again: a no-op if
        identical, else Conflict)."""
        ...

    def comparisons(self, name: str | None = None) -> list[Comparison]:
        """Recorded comparisons (of one asset), oldest first."""
        ...

    def put_optimization(self, optimization: Optimization) -> None:
        """Record an optimization, replacing what its id held (it is rewritten each round)."""
        ...

    def optimizations(self, name: str | None = None) -> list[Optimization]:
        """Recorded optimizations (of one asset), oldest first."""
        ...

    def close(self) -> None:
        """Release the connection; the store is unusable afterwards."""
        ...


@runtime_checkable
class LocalStore(Protocol):
    """What a store whose file this process opens itself (SqliteStore) offers beyond Store,
    so that a gateway call makes fewer trips to the store's threads."""

    def rollout_now(self, rollout_id: str) -> Rollout | None:
        """The rollout as last committed, read at once, waiting on no writer and no lock
        (cheap enough for an event loop); None when that cannot be done this instant (then
        ask get_rollout, on a thread); NotFound when there is no such rollout."""
        ...

    def append_groups(self, groups: list[list[Span]]) -> list[list[int] | StoreError]:
        """`append_spans` of each group, all in one transaction: one commit for many calls.
        Each group is recorded whole or not at all on its own: one refused (LeaseLost,
        Conflict) gets its error in its place, and the others are still recorded. Returns
        once they are committed; an error of the transaction itself (the disk) is raised."""
        ...

    def append_now(self, spans: list[Span]) -> list[int] | None:
        """`append_spans` at once, waiting on no lock and no other writer (cheap enough for
        an event loop): the seqs, once committed; None when that cannot be done this instant
        (then append_groups, on a thread). It leaves the WAL to `checkpoint`."""
        ...

    def checkpoint(self) -> None:
        """Move what append_now wrote from the write-ahead log into the database file."""
        ...


def connect(target: str | Path = ":memory:") -> Store:
    """A StoreClient for an http(s):// URL, else a SqliteStore on that path."""
    if str(target).startswith(("http://", "https://")):
        from tracerl.store.client import StoreClient  # httpx only when needed

        return StoreClient(str(target))
    return SqliteStore(target)


# Imported last: sqlite.py imports the errors defined above.
from tracerl.store.sqlite import SqliteStore  # noqa: E402
