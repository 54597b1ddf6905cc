"""The protocol every curation switch follows: hooks that do nothing unless overridden."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from pydantic import BaseModel

from tracerl.types import Group, Transition

__all__ = ["CurationStep"]


class CurationStep:
    """One curation switch. Every hook does nothing by default (a null step)."""

    state_key: ClassVar[str | None] = None
    """The CurationState field holding this step's memory; None when it has none."""

    def observe(self, group: Group) -> None:
        """See a complete group's fresh outcomes (before any step applies)."""

    def apply(self, groups: list[Group], batch: Sequence[Group]) -> list[Group]:
        """The groups to keep (possibly changed); `batch` holds the groups already taken
        into the batch being built."""
        return groups

    def advantages(self, groups: list[Group], rows: list[Transition]) -> list[Transition]:
        """Credit-assigned rows of `groups`, adjusted."""
        return rows

    def group_size(self, task_id: str, size: int) -> int:
        """Rollouts to issue for a task, given the size so far."""
        return size

    def metrics(self) -> dict[str, float]:
        """Counters since the last call."""
        return {}

    def state(self) -> BaseModel | None:
        """Memory to checkpoint (a record of type CurationState.<state_key>)."""
        return None

    def load_state(self, state: BaseModel) -> None:
        """Restore what state() returned."""
