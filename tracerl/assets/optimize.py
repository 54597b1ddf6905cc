"""Optimizing an asset from its traces: propose, compare on a train split, keep an archive,
accept only what wins on held-out tasks with significance.

A round: the best version's failures on the train split, each beside a success of the same
task (by any version tried, or another repeat) or of a similar task, go to the proposer;
each candidate it writes is stored as a candidate version, run on the train split with the
same seeds, and compared with the best (recorded, repairs and regressions counted). The
archive keeps, per train pair, the versions that solve it: a version survives unless
another solves everything it solves and more (a Pareto front, as GEPA keeps), so a
candidate that fixes what the best cannot survives even when it is worse on average; its
successes are shown to the proposer in later rounds. The best is the archive's most
successful version (the older one on a tie).

The end: the best is run against the seed on the held-out tasks, paired. It is accepted,
and put as the asset's new current version, only if it succeeds more often there and the
paired test's p-value is below alpha; otherwise the seed stays current. Each round is
recorded as it ends (Store.put_optimization), every comparison as it is made, every
candidate as a version; the proposer's calls are spans of rollouts of their own.
"""

from __future__ import annotations

import random
import time
import traceback
import uuid

from tracerl.assets.compare import Arena, ArmResult, paired, run_arm
from tracerl.assets.config import OptimizeSettings
from tracerl.assets.proposers import (
    Case,
    Evidence,
    Example,
    Proposal,
    Proposer,
    similar,
    transcript,
)
from tracerl.assets.records import (
    AssetRef,
    Candidate,
    Comparison,
    Optimization,
    OptimizationRound,
)
from tracerl.types import Task

__all__ = ["Optimizer", "pareto", "split_held_out"]


def split_held_out(tasks: list[Task], share: float, seed: int = 0) -> tuple[list[Task], list[Task]]:
    """(train, held-out): the tasks of split "eval" held out when there are any, else a
    seeded `share` of them (at least one task each side; ValueError for fewer than 2)."""
    held = [t for t in tasks if t.split == "eval"]
    if held:
        return [t for t in tasks if t.split != "eval"], held
    if len(tasks) < 2:
        raise ValueError("optimize needs at least 2 tasks: some to search on, some held out")
    order = list(tasks)
    random.Random(seed).shuffle(order)
    k = min(max(1, round(share * len(order))), len(order) - 1)
    return order[k:], order[:k]


def pareto(versions: list[int], solved: dict[int, set[str]]) -> list[int]:
    """The versions no other dominates: one is dropped when another solves everything it
    solves and more, or exactly the same pairs and comes earlier in `versions`."""
    kept: list[int] = []
    for v in versions:
        mine = solved[v]
        beaten = any(mine < solved[u] for u in versions)
        if not beaten and not any(mine == solved[u] for u in kept):
            kept.append(v)
    return kept


class Optimizer:
    """One optimization of one asset."""

    def __init__(
        self, arena: Arena, name: str, proposer: Proposer, settings: OptimizeSettings
    ) -> None:
        self.arena, self.name, self.proposer, self.settings = arena, name, proposer, settings
        self.store = arena.store
        self.arms: dict[int, ArmResult] = {}
        """Each version tried, run on the train split."""
        self.texts: dict[int, str] = {}
        self.tasks: dict[str, Task] = {}

    def run(self, seed: AssetRef, train: list[Task], held_out: list[Task]) -> Optimization:
        """Search from `seed`'s version (default the current one) on `train`, test the best
        on `held_out`; the finished record (also in the store)."""
        start = self.arena.version(seed)
        if start == 0:
            raise ValueError(f"{seed}: optimize a version of the asset, not its absence")
        if not train or not held_out:
            raise ValueError("optimize needs train tasks and held-out tasks")
        self.tasks = {t.id: t for t in train}
        record = Optimization(
            id=uuid.uuid4().hex[:16], name=self.name, seed=start, proposer=self.proposer.name,
            alpha=self.settings.alpha,
        )  # fmt: skip
        self.store.put_optimization(record)
        try:
            record = self._search(record, start, train)
            record = self._final(record, start, held_out)
        except Exception:
            error = traceback.format_exc(limit=3)[-2000:]
            self._put(record.model_copy(update={"status": "failed", "error": error}))
            raise
        return record

    # -- the search ------------------------------------------------------------------------

    def _search(self, record: Optimization, start: int, train: list[Task]) -> Optimization:
        self.texts[start] = self.store.asset(self.name, start).text
        self._run(start, train)
        archive, best = [start], start
        for index in range(1, self.settings.rounds + 1):
            if not self._failures(best):
                break  # the best solves every train pair: nothing left to learn from
            evidence = self._evidence(best, archive)
            label = f"{record.id}/round{index}"
            proposals = self.proposer.propose(evidence, self.settings.candidates, label)
            tried = [(self._put_candidate(p), p) for p in proposals]
            tried = [(v, p) for v, p in tried if v not in self.arms]
            judged = [(v, p, self._judge(record.id, best, v, train)) for v, p in tried]
            solved = {v: arm.solved() for v, arm in self.arms.items()}
            archive = pareto(sorted({*archive, *(v for v, _, _ in judged)}), solved)
            parent, best = best, max(archive, key=lambda v: len(solved[v]))
            prompt = self.proposer.shown
            done = OptimizationRound(
                index=index, parent=parent, archive=archive, best=best, proposer_prompt=prompt,
                candidates=[
                    _candidate(v, parent, p, c, solved[v], v in archive) for v, p, c in judged
                ],
            )  # fmt: skip
            record = self._put(
                record.model_copy(update={"rounds": [*record.rounds, done], "best": best})
            )
        return record.model_copy(update={"best": best})

    def _run(self, version: int, tasks: list[Task]) -> ArmResult:
        s = self.settings
        self.arms[version] = run_arm(
            self.arena,
            self.name,
            version,
            tasks,
            s.repeats,
            s.seed,
            desc=f"train {self.name}@{version}",
        )
        return self.arms[version]

    def _judge(self, opt_id: str, best: int, version: int, train: list[Task]) -> Comparison:
        """Run a candidate on the train split and compare it with the best (recorded)."""
        arm = self._run(version, train)
        s = self.settings
        c = paired(self.arms[best], arm, s.test, s.seed, purpose="train", optimization=opt_id)
        self.store.add_comparison(c)
        return c

    def _put_candidate(self, p: Proposal) -> int:
        """The version holding the proposal's text: an existing one with that very text,
        else a new candidate version."""
        for version, text in self.texts.items():
            if text == p.text:
                return version
        asset = self.store.put_asset(self.name, p.text, p.note, candidate=True)
        self.texts[asset.version] = asset.text
        return asset.version

    def _put(self, record: Optimization) -> Optimization:
        record = record.model_copy(update={"updated_at": time.time()})
        self.store.put_optimization(record)
        return record

    # -- what the proposer sees -------------------------------------------------------------

    def _failures(self, version: int) -> list[str]:
        return [k for k, o in self.arms[version].outcomes.items() if not o.success]

    def _evidence(self, best: int, archive: list[int]) -> Evidence:
        """The best's first failures, each beside a success of its task (any version tried,
        archive first) or of the most similar task that has one."""
        wins: dict[str, list[tuple[int, str]]] = {}
        order = archive + [v for v in self.arms if v not in archive]
        for v in order:
            for key, o in self.arms[v].outcomes.items():
                if o.success:
                    wins.setdefault(_task(key), []).append((v, o.rollout_id))
        cases = []
        for key in self._failures(best)[: self.settings.cases]:
            failed = self._example(_task(key), best, self.arms[best].outcomes[key].rollout_id)
            cases.append(Case(failed=failed, succeeded=self._success_for(failed.task_id, wins)))
        shown = [c.succeeded for c in cases if c.succeeded is not None]
        more = [self._example(t, v, r) for t, won in wins.items() for v, r in won[:1]]
        successes = list({e.rollout_id: e for e in [*shown, *more]}.values())[:12]
        return Evidence(name=self.name, text=self.texts[best], cases=cases, successes=successes)

    def _success_for(self, task_id: str, wins: dict[str, list[tuple[int, str]]]) -> Example | None:
        if task_id in wins:
            v, rid = wins[task_id][0]
            return self._example(task_id, v, rid)
        neighbours = similar(self.tasks[task_id], [self.tasks[t] for t in wins])
        if not neighbours:
            return None
        v, rid = wins[neighbours[0].id][0]
        return self._example(neighbours[0].id, v, rid)

    def _example(self, task_id: str, version: int, rollout_id: str) -> Example:
        rollout = self.store.get_rollout(rollout_id)
        outcome = next(
            o for o in self.arms[version].outcomes.values() if o.rollout_id == rollout_id
        )
        return Example(
            task_id=task_id, input=self.tasks[task_id].input, rollout_id=rollout_id,
            version=version, success=outcome.success, reward=outcome.reward,
            transcript=transcript(self.store.spans(rollout_id), rollout.answer),
        )  # fmt: skip

    # -- the held-out test --------------------------------------------------------------------

    def _final(self, record: Optimization, start: int, held_out: list[Task]) -> Optimization:
        best = record.best or start
        if best == start:
            return self._put(record.model_copy(update={"status": "rejected"}))
        s = self.settings
        seed_arm = run_arm(
            self.arena, self.name, start, held_out, s.repeats, s.seed, "held-out seed"
        )
        best_arm = run_arm(
            self.arena, self.name, best, held_out, s.repeats, s.seed, "held-out best"
        )
        c = paired(seed_arm, best_arm, s.test, s.seed, purpose="held-out", optimization=record.id)
        self.store.add_comparison(c)
        wins = c.success_b > c.success_a and c.p_value < s.alpha
        update: dict[str, object] = {"final": c.id, "p_value": c.p_value}
        if wins:
            note = (
                f"accepted from candidate v{best} (optimization {record.id}): held-out "
                f"success {c.success_a:.3f} -> {c.success_b:.3f}, p = {c.p_value:.3g}"
            )
            accepted = self.store.put_asset(self.name, self.texts[best], note)
            update |= {"status": "accepted", "accepted": accepted.version}
        else:
            update["status"] = "rejected"
        return self._put(record.model_copy(update=update))


def _task(key: str) -> str:
    return key.rpartition("#")[0]


def _candidate(
    version: int, parent: int, p: Proposal, c: Comparison, solved: set[str], kept: bool
) -> Candidate:
    return Candidate(
        version=version, parent=parent, proposer=p.proposer, proposer_rollout=p.rollout_id,
        success=c.success_b, solved=sorted(solved), comparison=c.id, kept=kept,
    )  # fmt: skip
