"""The lifecycle rules both SQL stores apply: which rollout moves are allowed, which attempt
may still write, what each move changes, which seq an appended span takes, which number a
new policy version gets, and when a republished policy version takes a path.

Pure functions of records already read; SqliteStore (sqlite.py) and PostgresStore
(postgres.py) own the reading, locking and writing around them, so the two back ends
cannot drift on a rule or an error message.
"""

from __future__ import annotations

import uuid

from tracerl.store import Conflict, InvalidTransition, LeaseLost, NotFound, StoreError
from tracerl.types import (
    FINISHED,
    VALID_TRANSITIONS,
    PolicyVersion,
    Rollout,
    RolloutStatus,
    Span,
)

__all__ = [
    "attempts",
    "check_current",
    "check_found",
    "check_move",
    "check_running",
    "claim_changes",
    "expiry",
    "finish_changes",
    "final_status",
    "new_rollouts",
    "next_seqs",
    "next_version",
    "sets_path",
]

Attempt = tuple[str, int]
"""(rollout id, attempt)."""

VERSION_MAX = 2**31
"""Versions are stored as 32-bit integers (PolicyVersion.version < 2**31)."""


def new_rollouts(
    task_ids: list[str],
    group_id: str | None,
    max_attempts: int,
    now: float,
    assets: dict[str, int] | None = None,
    seeds: list[int] | None = None,
) -> list[Rollout]:
    """One queued rollout per task id (repeats allowed), each with a fresh id, the given
    assets, and the seed at its position in `seeds` (ValueError unless it matches
    task_ids in length)."""
    if max_attempts < 1:
        raise ValueError("max_attempts must be at least 1")
    if seeds is not None and len(seeds) != len(task_ids):
        raise ValueError(f"{len(seeds)} seeds for {len(task_ids)} rollouts: give one each")
    return [
        Rollout(id=uuid.uuid4().hex[:16], task_id=t, group_id=group_id,
                max_attempts=max_attempts, created_at=now, assets=assets,
                seed=None if seeds is None else seeds[i])
        for i, t in enumerate(task_ids)
    ]  # fmt: skip


def check_found(wanted: list[str], found: set[str]) -> None:
    """NotFound for the first wanted task id the store lacks."""
    if missing := [t for t in wanted if t not in found]:
        raise NotFound(f"no task {missing[0]!r}")


def check_move(r: Rollout, to: RolloutStatus) -> None:
    """InvalidTransition unless VALID_TRANSITIONS allows r's status -> `to`."""
    if to not in VALID_TRANSITIONS[r.status]:
        raise InvalidTransition(f"rollout {r.id}: {r.status.value} -> {to.value} is not allowed")


def check_running(r: Rollout, attempt: int) -> Rollout:
    """`r`, if `attempt` is its running attempt; else LeaseLost."""
    if r.status is not RolloutStatus.running or r.attempt != attempt:
        raise LeaseLost(
            f"rollout {r.id} attempt {attempt} is not running "
            f"(now {r.status.value}, attempt {r.attempt})"
        )
    return r


def final_status(status: RolloutStatus | str) -> RolloutStatus:
    """The status a finish asks for, refused (InvalidTransition) unless it is final."""
    status = RolloutStatus(status)
    if status not in FINISHED:
        raise InvalidTransition(f"finish needs a final status, not {status.value}")
    return status


def check_current(r: Rollout, attempt: int) -> None:
    """LeaseLost unless `attempt` may finish `r`. A queued rollout can only be finished
    (cancelled) with attempt 0, i.e. before any claim; after one, a queued rollout means the
    caller's lease was lost, so that is LeaseLost rather than a cancel."""
    if r.attempt != attempt or (r.status is RolloutStatus.queued and attempt > 0):
        raise LeaseLost(
            f"rollout {r.id} attempt {attempt} is not the current attempt "
            f"(now {r.status.value}, attempt {r.attempt})"
        )


def claim_changes(r: Rollout, runner_id: str, now: float, lease_s: float) -> dict[str, object]:
    """What a claim changes besides the status (-> running): the next attempt, leased."""
    return {"attempt": r.attempt + 1, "runner_id": runner_id, "started_at": now,
            "lease_expires_at": now + lease_s, "error": None}  # fmt: skip


def finish_changes(
    answer: str | None, reward: float | None, error: str | None, now: float
) -> dict[str, object]:
    """What a finish changes besides the status: the outcome, and the lease released."""
    return {"answer": answer, "reward": reward, "error": error, "finished_at": now,
            "runner_id": None, "lease_expires_at": None}  # fmt: skip


def expiry(r: Rollout, now: float) -> tuple[RolloutStatus, dict[str, object]]:
    """Where a running rollout whose lease expired goes: back to the queue, or timed out
    once its attempts are used up; and what that changes besides the status."""
    cleared: dict[str, object] = {"runner_id": None, "lease_expires_at": None}
    if r.attempt >= r.max_attempts:
        error = f"lease expired after {r.attempt} attempts"
        return RolloutStatus.timed_out, {**cleared, "error": error, "finished_at": now}
    return RolloutStatus.queued, {**cleared, "error": "lease expired"}


def sets_path(pv: PolicyVersion, stored_path: str) -> bool:
    """Whether publishing `pv` again must write its path over the stored version's: yes when
    that version was served before its checkpoint existed (no path) and `pv` has one;
    Conflict when it is already published at another path; else nothing changes."""
    if stored_path == "" and pv.path:
        return True
    if pv.path and stored_path != pv.path:
        raise Conflict(f"{pv.role} version {pv.version} already published at {stored_path}")
    return False


def attempts(spans: list[Span]) -> list[Attempt]:
    """The attempts a batch of spans writes to, each once, sorted (so that two writers lock
    the same rollouts in the same order)."""
    return sorted({(s.rollout_id, s.attempt) for s in spans})


def next_seqs(spans: list[Span], highest: dict[Attempt, int | None]) -> list[int]:
    """The seq each appended span takes: after its attempt's highest recorded one
    (`highest`; None when it has none), one after another in list order."""
    last = {a: -1 if top is None else top for a, top in highest.items()}
    out = []
    for s in spans:
        key = (s.rollout_id, s.attempt)
        last[key] += 1
        out.append(last[key])
    return out


def next_version(roles: list[str], highest: int | None) -> int:
    """The number a new version of `roles` takes: one above `highest`, the highest any of
    them holds (None: none yet, so 0); ValueError without a role."""
    if not roles:
        raise ValueError("a policy version needs at least one role")
    version = 0 if highest is None else highest + 1
    if version >= VERSION_MAX:
        raise StoreError(f"policy versions of {roles} are used up (the last was {highest})")
    return version
