"""Internalization: train with an asset in context, and withdraw it on a schedule.

Each training rollout carries the asset with a probability that falls linearly over the
run (CurriculumConfig.probability), drawn per rollout when its group is issued: the
rollout is queued with the asset's version (Rollout.assets) or with it withheld (0), so
the gateway builds its prompts with or without the text, and the spans, hence the training
rows, are exactly what the policy saw. Held-out evaluations run without it (`withheld`):
they measure what the weights learned, not what the prompt said.

The draws are seeded per (run seed, group, enqueue, position), so a rerun of the same
config gives each rollout the same draw. Metrics: the scheduled probability, and the share
of the rollouts issued since the last report that carried the asset.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

from tracerl.assets.config import CurriculumConfig
from tracerl.store import Store
from tracerl.types import Rollout

__all__ = ["Curriculum"]


class Curriculum:
    """Issues training rollouts with the asset or without it: its `enqueue` is a training
    source's (pipeline.sources.Enqueue). Thread-safe: an async source issues from its own
    thread while the training loop reads the metrics."""

    def __init__(self, cfg: CurriculumConfig, version: int, step: Callable[[], int]) -> None:
        """`version`: the asset version carried; `step`: the training step now."""
        self.cfg, self.version, self.step = cfg, version, step
        self._lock = threading.Lock()
        self._enqueues: dict[str, int] = {}
        self._carried = self._issued = 0
        self._chance = 0.0  # summed probability the issued rollouts were drawn with

    @property
    def carried(self) -> dict[str, int]:
        """A rollout's assets when it carries the asset."""
        return {self.cfg.name: self.version}

    @property
    def withheld(self) -> dict[str, int]:
        """A rollout's assets when it does not (held-out evaluations always)."""
        return {self.cfg.name: 0}

    def at_start(self) -> dict[str, int]:
        """What the first groups mostly see: carried if the schedule starts above 1/2."""
        return self.carried if self.cfg.start > 0.5 else self.withheld

    def enqueue(
        self, store: Store, task_ids: list[str], group_id: str, max_attempts: int
    ) -> list[Rollout]:
        """Queue the rollouts, each with the asset with the step's probability."""
        p = self.cfg.probability(self.step())
        with self._lock:
            n = self._enqueues.get(group_id, 0)
            self._enqueues[group_id] = n + 1
        draws = [self._draw(group_id, n, i) < p for i in range(len(task_ids))]
        on = [t for t, d in zip(task_ids, draws, strict=True) if d]
        off = [t for t, d in zip(task_ids, draws, strict=True) if not d]
        out = store.enqueue(on, group_id, max_attempts, assets=self.carried) if on else []
        if off:
            out += store.enqueue(off, group_id, max_attempts, assets=self.withheld)
        with self._lock:
            self._carried += len(on)
            self._issued += len(task_ids)
            self._chance += p * len(task_ids)
        return out

    def _draw(self, group_id: str, enqueue: int, position: int) -> float:
        return random.Random(f"{self.cfg.seed}/{group_id}/{enqueue}/{position}").random()

    def values(self) -> dict[str, float | int | None]:
        """A step's metrics, over the rollouts issued since the last call (None for none):
        the version carried, the probability they were drawn with, and the share that
        carried the asset."""
        with self._lock:
            carried, issued, chance = self._carried, self._issued, self._chance
            self._carried = self._issued = 0
            self._chance = 0.0
        return {
            "assets/version": self.version,
            "assets/probability": chance / issued if issued else None,
            "assets/carried": carried / issued if issued else None,
        }
