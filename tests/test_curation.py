"""Data curation: each switch changes what is trained on in the intended way, and the
stateful ones survive a checkpoint round trip."""

from __future__ import annotations

import math
import statistics

import pytest
from pydantic import ValidationError

from tracerl.algorithms import GRPO
from tracerl.algorithms.config import CurationConfig
from tracerl.algorithms.curation import (
    ConditionalAdvantage,
    Curation,
    CurationState,
    DynamicSampling,
    Replay,
    ReplayState,
    rollout_cost,
    zero_variance,
)
from tracerl.algorithms.rows import rows_for
from tracerl.algorithms.sizing import AdaptiveGroupSize, GroupSizeState
from tracerl.pipeline.sources import read_finished
from tracerl.store import SqliteStore
from tracerl.types import FinishedRollout, Group, Rollout, RolloutStatus, Span, Task

OK, FAIL, LATE = RolloutStatus.succeeded, RolloutStatus.failed, RolloutStatus.timed_out


def task(tid: str) -> Task:
    return Task(id=tid, input={"question": tid})


def ro(
    rid: str, reward: float | None, status: RolloutStatus = OK, tid: str = "t"
) -> FinishedRollout:
    """A finished rollout without spans (enough for outcome-only steps)."""
    return FinishedRollout(rollout=Rollout(id=rid, task_id=tid, status=status, reward=reward))


def group(gid: str, tid: str, rewards: list[float], prefix: str | None = None) -> Group:
    p = prefix or gid
    rollouts = [ro(f"{p}-{i}", x, tid=tid) for i, x in enumerate(rewards)]
    return Group(id=gid, task=task(tid), rollouts=rollouts)


def build(cfg: CurationConfig, group_size: int = 4, threshold: float = 1.0) -> Curation:
    return Curation.build(cfg, group_size=group_size, success_threshold=threshold)


def sampled_adv(row) -> float:  # type: ignore[no-untyped-def]
    """The advantage on the row's sampled tokens (one value per row here)."""
    values = {x for x, m in zip(row.advantages, row.loss_mask, strict=True) if m}
    assert len(values) == 1
    return values.pop()


def calls_spans(rid: str, calls: int, version: int = 0, attempt: int = 1) -> list[Span]:
    """`calls` model calls (3 sampled tokens each), each call's prompt extending the previous
    call's prompt + completion + a tool result."""
    spans, prompt = [], [1, 2, 3]
    for seq in range(calls):
        completion = [10 + seq, 11, 12]
        spans.append(
            Span(
                id=f"{rid}-{seq}", rollout_id=rid, attempt=attempt, seq=seq, role="policy",
                policy_version=version, prompt_ids=list(prompt), completion_ids=completion,
                logprobs=[-0.5, -1.0, -1.5],
            )
        )  # fmt: skip
        prompt = prompt + completion + [7, 7]
    return spans


# ------------------------------------------------------------------- a real store's rollouts


def run_rollout(
    store: SqliteStore, tid: str, gid: str, reward: float, calls: int, version: int = 0
) -> FinishedRollout:
    """A finished rollout with `calls` model calls (see calls_spans), read back from the
    store as the sources read it."""
    (queued,) = store.enqueue([tid], gid)
    (r,) = store.claim("test")
    assert r.id == queued.id
    for span in calls_spans(r.id, calls, version, r.attempt):
        store.add_span(span)
    return read_finished(store, store.finish(r.id, r.attempt, OK, reward=reward))


@pytest.fixture
def store() -> SqliteStore:
    s = SqliteStore(":memory:")
    s.add_tasks([task("hard"), task("easy"), task("t")])
    return s


# ------------------------------------------------------------------------- dynamic sampling


def test_dynamic_sampling_drops_groups_without_signal() -> None:
    mixed = group("mixed", "t", [1.0, 0.0, 1.0])
    solved = group("solved", "t", [1.0, 1.0, 1.0])
    failed = group("failed", "t", [0.0, 0.0])
    # Only rollouts with an outcome count: the timed-out 0.0 does not make this group mixed,
    # and a missing reward reads as 0 (as rows_for reads it).
    late_rollouts = [ro("l0", 1.0), ro("l1", 1.0), ro("l2", 0.0, LATE)]
    late = Group(id="late", task=task("t"), rollouts=late_rollouts)
    none = Group(id="none", task=task("t"), rollouts=[ro("n0", None, FAIL), ro("n1", 0.0)])
    single = group("single", "t", [1.0])
    partial = Group(id="partial", task=task("t"), rollouts=[ro("p0", 0.5), ro("p1", 0.0, FAIL)])
    groups = [mixed, solved, failed, late, none, single, partial]
    assert [zero_variance(g) for g in groups] == [False, True, True, True, True, True, False]
    step = DynamicSampling()
    assert step.apply(groups, []) == [mixed, partial]
    assert step.metrics() == {"curation/dropped_zero_variance": 5.0}

    curation = build(CurationConfig(dynamic_sampling=True))
    kept, dropped = curation.curate(groups)
    assert kept == [mixed, partial] and dropped == [solved, failed, late, none, single]
    assert curation.metrics() == {"curation/dropped_zero_variance": 5.0}
    assert curation.metrics() == {"curation/dropped_zero_variance": 0.0}  # since last call
    off = build(CurationConfig())
    assert off.steps == []
    assert off.curate(groups) == (groups, []) and off.metrics() == {}


# ----------------------------------------------------------------------------------- replay


def test_replay_puts_a_stored_success_into_an_all_fail_group_of_a_hard_task(store) -> None:
    curation = build(CurationConfig(replay=True, replay_max_success_rate=0.25))
    # Step 0: "hard" succeeds once in 4 (rate 0.25), "easy" 3 times in 4 (rate 0.75).
    hard0 = [run_rollout(store, "hard", "h0", x, calls=2) for x in (1.0, 0.0, 0.0, 0.0)]
    easy0 = [run_rollout(store, "easy", "e0", x, calls=1) for x in (1.0, 1.0, 1.0, 0.0)]
    step0 = [
        Group(id="h0", task=task("hard"), rollouts=hard0),
        Group(id="e0", task=task("easy"), rollouts=easy0),
    ]
    assert curation.curate(step0)[0] == step0  # both groups have a success: untouched
    success = hard0[0]

    # Step 1, trained on policy version 1: every rollout of both tasks fails.
    hard1 = [run_rollout(store, "hard", "h1", 0.0, calls=1, version=1) for _ in range(4)]
    easy1 = [run_rollout(store, "easy", "e1", 0.0, calls=1, version=1) for _ in range(4)]
    step1 = [
        Group(id="h1", task=task("hard"), rollouts=hard1),
        Group(id="e1", task=task("easy"), rollouts=easy1),
    ]
    kept, dropped = curation.curate(step1)
    assert dropped == []
    # hard (rate now 1/8): the last failed rollout gives way to the stored success;
    # easy (rate 3/8 > 0.25) is left alone.
    assert [r.id for r in kept[0].rollouts] == [r.id for r in hard1[:3]] + [success.id]
    assert kept[0].id == "h1" and kept[1] == step1[1]
    assert [r.id for r in step1[0].rollouts] == [r.id for r in hard1]  # input not changed
    m = curation.metrics()
    # Successes of both tasks are stored (easy's are just never needed).
    assert m["curation/replayed"] == 1.0 and m["curation/replay_tasks"] == 2.0

    # What gets trained: the replayed rollout's rows come from the spans it was read with,
    # with its own behaviour log-probs and version 0, in the new group; the group now has
    # signal.
    assert kept[0].rollouts[-1] == success and len(success.spans) == 2
    rows = rows_for(kept, GRPO())
    replayed = [r for r in rows if r.rollout_id == success.id]
    assert len(replayed) == 1 and replayed[0].group_id == "h1" and replayed[0].reward == 1.0
    assert {v for v in replayed[0].versions if v >= 0} == {0}
    assert replayed[0].span_ids == [f"{success.id}-0", f"{success.id}-1"]
    assert sampled_adv(replayed[0]) > 0
    others = [r for r in rows if r.group_id == "h1" and r.rollout_id != success.id]
    assert len(others) == 3 and all(sampled_adv(r) < 0 for r in others)
    # Without replay the all-fail group trains on nothing.
    plain = rows_for(step1[:1], GRPO())
    assert plain and all(a == 0.0 for r in plain for a in r.advantages)


def test_replay_never_inserts_one_rollout_twice_in_a_batch() -> None:
    replay = Replay(capacity=2, max_success_rate=0.5)
    replay.observe(group("g0", "hard", [1.0, 0.0, 0.0, 0.0], prefix="old"))
    fails = [group(f"f{k}", "hard", [0.0, 0.0, 0.0, 0.0]) for k in range(2)]
    out = replay.apply(fails, [])
    assert [r.id for r in out[0].rollouts][-1] == "old-0"
    assert out[1] == fails[1]  # the only stored success is already in the batch
    # A success of this very batch is not replayed next to its own group either.
    same = [group("s", "hard", [1.0, 0.0]), group("f", "hard", [0.0, 0.0])]
    replay2 = Replay(max_success_rate=0.5)
    for g in same:
        replay2.observe(g)
    assert replay2.apply(same, []) == same
    # With two stored successes, two all-fail groups get one each, the newest first.
    replay.observe(group("g1", "hard", [1.0, 0.0, 0.0, 0.0, 0.0, 0.0], prefix="new"))
    out = replay.apply(fails, [])
    assert [g.rollouts[-1].id for g in out] == ["new-0", "old-0"]
    assert replay.metrics()["curation/replayed"] == 3.0


def test_async_replay_never_puts_a_stored_rollout_twice_into_one_batch(store) -> None:
    """Regression: the async source curates one group at a time while building a batch, so
    replay must see the groups already taken (`batch`), not only the group in hand."""
    cfg = CurationConfig(replay=True, replay_capacity=1, replay_max_success_rate=0.25)
    curation = build(cfg)
    hard0 = [run_rollout(store, "hard", "h0", x, calls=1) for x in (1.0, 0.0, 0.0, 0.0)]
    g0 = Group(id="h0", task=task("hard"), rollouts=hard0)
    assert curation.curate([g0], batch=[]) == ([g0], [])  # it has a success: untouched
    success = hard0[0]

    # The next batch: two all-fail groups of "hard" arrive one after the other.
    def all_fail(gid: str) -> Group:
        fails = [run_rollout(store, "hard", gid, 0.0, calls=1, version=1) for _ in range(4)]
        return Group(id=gid, task=task("hard"), rollouts=fails)

    g1, g2 = all_fail("h1"), all_fail("h2")
    kept1, dropped1 = curation.curate([g1], batch=[])
    kept2, dropped2 = curation.curate([g2], batch=kept1)
    assert dropped1 == dropped2 == []
    assert [r.id for r in kept1[0].rollouts] == [r.id for r in g1.rollouts[:3]] + [success.id]
    assert kept2 == [g2]  # the only stored success is already in this batch
    ids = [f.id for g in kept1 + kept2 for f in g.rollouts]
    assert ids.count(success.id) == 1 and len(ids) == len(set(ids))
    rows = rows_for(kept1 + kept2, GRPO())
    assert sum(r.rollout_id == success.id for r in rows) == 1
    assert curation.metrics()["curation/replayed"] == 1.0

    # A later batch may replay it again (it is a different batch).
    kept3, _ = curation.curate([all_fail("h3")], batch=[])
    assert kept3[0].rollouts[-1].id == success.id
    # Nor is a stored success replayed into a batch that already holds its original group.
    kept4, _ = curation.curate([all_fail("h4")], batch=[g0])
    assert success.id not in {f.id for f in kept4[0].rollouts}


def test_replay_capacity_rate_and_state_round_trip() -> None:
    replay = Replay(capacity=2, max_success_rate=0.3)
    for k in range(3):
        replay.observe(group(f"g{k}", "hard", [1.0, 0.0, 0.0, 0.0, 0.0]))
    assert replay.success_rate("hard") == pytest.approx(3 / 15)
    assert replay.success_rate("unseen") is None
    # Checkpoints store it as JSON.
    state = ReplayState.model_validate_json(replay.state().model_dump_json())
    assert [f.id for f in state.stored["hard"]] == ["g1-0", "g2-0"]
    restored = Replay(capacity=2, max_success_rate=0.3)
    restored.load_state(state)
    assert restored.state() == replay.state()
    fail = group("f", "hard", [0.0, 0.0])
    assert restored.fill(fail).rollouts[-1].id == "g2-0"  # newest kept
    assert restored.fill(fail, exclude={"g2-0"}).rollouts[-1].id == "g1-0"
    assert restored.fill(fail, exclude={"g2-0", "g1-0"}) == fail  # g0-0 was evicted
    # A saved state is a copy: later observations do not change it.
    saved = replay.state()
    # A task that succeeds often gets no replay.
    replay.observe(group("g4", "hard", [1.0] * 10))
    assert replay.success_rate("hard") == pytest.approx(13 / 25)
    assert replay.fill(fail) == fail
    assert saved.seen["hard"] == (15, 3) and [f.id for f in saved.stored["hard"]] == [
        "g1-0",
        "g2-0",
    ]


# ---------------------------------------------------------------------- adaptive group size


def test_adaptive_group_size_follows_the_rule_within_bounds() -> None:
    sizes = AdaptiveGroupSize(base=8, min_size=2, max_size=16, window=8, minority=2.0)
    sizes.observe(group("a", "solved", [1.0] * 8))
    sizes.observe(group("b", "never", [0.0] * 8))
    sizes.observe(group("c", "mid", [1.0, 0.0] * 4))
    sizes.observe(group("d", "rare", [1.0] + [0.0] * 5))  # p = 1/6
    sizes.observe(group("e", "hard", [1.0] + [0.0] * 7))  # p = 1/8
    timed_out = [ro("x", 1.0, LATE), ro("y", 0.0, LATE)]
    sizes.observe(Group(id="f", task=task("late"), rollouts=timed_out))
    got = {t: sizes.size(t) for t in ("unseen", "late", "solved", "never", "mid", "rare", "hard")}
    # unseen and no-outcome tasks: base; uniform: min; mid: max(base, 2/0.5); rare: 2/(1/6);
    # hard: 2/(1/8) = 16, at the bound.
    assert got == {
        "unseen": 8, "late": 8, "solved": 2, "never": 2, "mid": 8, "rare": 12, "hard": 16,
    }  # fmt: skip
    assert sizes.metrics() == {"curation/group_size_mean": pytest.approx(sum(got.values()) / 7)}
    assert sizes.metrics() == {}
    tight = AdaptiveGroupSize(base=8, min_size=4, max_size=10)
    tight.observe(group("e", "hard", [1.0] + [0.0] * 7))
    tight.observe(group("a", "solved", [1.0] * 8))
    assert (tight.size("hard"), tight.size("solved")) == (10, 4)
    # The window forgets: once "hard" is solved 8 times in a row it is a solved task.
    sizes.observe(group("g", "hard", [1.0] * 8))
    assert sizes.size("hard") == 2

    state = GroupSizeState.model_validate_json(sizes.state().model_dump_json())
    restored = AdaptiveGroupSize(base=8, min_size=2, max_size=16, window=8, minority=2.0)
    restored.load_state(state)
    assert {t: restored.size(t) for t in got} == {t: sizes.size(t) for t in got}


def test_curation_issues_adaptive_sizes_and_keeps_state() -> None:
    cfg = CurationConfig(adaptive_group_size=True, replay=True, group_size_max=12)
    curation = build(cfg, group_size=6)
    assert curation.group_size("x") == 6
    curation.curate([group("a", "x", [1.0] + [0.0] * 9)])  # p = 0.1 -> 20, clamped to 12
    assert curation.group_size("x") == 12
    # Checkpoints store it as JSON.
    state = CurationState.model_validate_json(curation.state().model_dump_json())
    assert state.replay is not None and state.group_sizes is not None
    assert state.group_sizes.outcomes == {"x": [1] + [0] * 9}
    restored = build(cfg, group_size=6)
    restored.load_state(state)
    assert restored.state() == curation.state()
    assert restored.group_size("x") == 12
    (replay,) = (s for s in restored.steps if isinstance(s, Replay))
    assert replay.success_rate("x") == 0.1
    off = build(CurationConfig(), group_size=6)
    assert off.group_size("x") == 6 and off.state() == CurationState()
    off.load_state(state)  # a step turned off since then: its memory is ignored
    assert off.group_size("x") == 6
    # A step turned on since the checkpoint starts empty.
    later = build(cfg, group_size=6)
    later.load_state(CurationState())
    assert later.group_size("x") == 6
    with pytest.raises(ValueError):
        CurationConfig(group_size_min=5, group_size_max=4)


def test_success_threshold_is_a_parameter_of_build() -> None:
    with pytest.raises(ValidationError):
        CurationConfig(success_threshold=0.5)  # type: ignore[call-arg]  # moved out
    cfg = CurationConfig(adaptive_group_size=True, replay=True, group_size_max=12)
    half = build(cfg, group_size=6, threshold=0.5)
    full = build(cfg, group_size=6, threshold=1.0)
    for c in (half, full):
        c.curate([group("a", "x", [0.5] + [0.0] * 9)])
    # 0.5 is a success only at threshold 0.5: p = 0.1 -> 12 there, a never-solved task (min
    # size) at 1.0.
    assert (half.group_size("x"), full.group_size("x")) == (12, 2)


# -------------------------------------------------------------------- conditional advantage


def test_conditional_advantage_favours_the_cheaper_correct_rollout(store) -> None:
    """Regression: the bonus is tested through the path production takes,
    rows_for(groups, algorithm, curation), with costs from the spans the groups carry."""
    # g1: two correct rollouts (2 and 4 calls), two incorrect; g2: one correct only;
    # g3: two correct with equal cost.
    spec = {
        "g1": [(1.0, 2), (1.0, 4), (0.0, 1), (0.0, 3)],
        "g2": [(1.0, 1), (0.0, 5)],
        "g3": [(1.0, 2), (1.0, 2), (0.0, 1)],
    }
    groups = [
        Group(
            id=gid,
            task=task("t"),
            rollouts=[run_rollout(store, "t", gid, x, calls=n) for x, n in s],
        )
        for gid, s in spec.items()
    ]
    rows = rows_for(groups, GRPO())
    assert [rollout_cost(f, "calls") for f in groups[0].rollouts] == [2.0, 4.0, 1.0, 3.0]
    assert [rollout_cost(f, "tokens") for f in groups[0].rollouts] == [6.0, 12.0, 3.0, 9.0]

    curation = build(CurationConfig(conditional_coef=0.5))
    assert [type(s) for s in curation.steps] == [ConditionalAdvantage]
    out = rows_for(groups, GRPO(), curation)
    a, b, c, d = (r.id for r in groups[0].rollouts)
    # Costs of the correct ones: 2 and 4 -> mean 3, population std 1 -> z = +1 and -1.
    bonus = {a: 0.5, b: -0.5}
    before = {r.rollout_id: r for r in rows}
    assert len(out) == len(rows)
    for new in out:
        old = before[new.rollout_id]
        k = bonus.get(old.rollout_id, 0.0)
        want = [x + k * m for x, m in zip(old.advantages, old.loss_mask, strict=True)]
        assert new.advantages == pytest.approx(want, abs=1e-12)
        assert new.weight == old.weight  # the per-rollout normalisation is kept
        if old.rollout_id not in bonus:
            assert new == old  # incorrect rollouts, g2 and g3: untouched
    after = {r.rollout_id: sampled_adv(r) for r in out}
    prior = {rid: sampled_adv(r) for rid, r in before.items()}
    assert prior[a] == pytest.approx(prior[b]) and prior[a] > 0  # tied before
    assert after[a] - after[b] == pytest.approx(1.0)  # the cheaper one is now ahead
    assert after[c] == prior[c] < 0 and after[d] == prior[d] < after[b]
    m = curation.metrics()
    assert m["curation/conditional_rows_fraction"] == pytest.approx(2 / len(rows))
    assert m["curation/conditional_mean_abs_bonus"] == pytest.approx(0.5)

    # DDCA scaling by pass rate: g1 passes 2 of 4, so the bonus halves.
    scaled_cfg = CurationConfig(conditional_coef=0.5, conditional_scale_by_pass_rate=True)
    scaled = rows_for(groups, GRPO(), build(scaled_cfg))
    got = {r.rollout_id: sampled_adv(r) - prior[r.rollout_id] for r in scaled}
    assert got[a] == pytest.approx(0.25) and got[b] == pytest.approx(-0.25)
    assert got[c] == 0.0 and got[d] == 0.0

    # By sampled tokens (6 and 12 -> z = +1 and -1) the bonus is the same here.
    tokens_cfg = CurationConfig(conditional_coef=0.5, secondary="tokens")
    by_tokens = rows_for(groups, GRPO(), build(tokens_cfg))
    assert {r.rollout_id: sampled_adv(r) for r in by_tokens} == pytest.approx(after)


def test_conditional_bonus_is_standardized_cost() -> None:
    """Regression (with the test above): three correct rollouts costing 1, 2 and 6 calls, the
    costs read from their spans by Curation.advantages via rows_for:
    bonus_i = coef * (mean - c_i) / pstdev."""

    def finished(rid: str, reward: float, calls: int) -> FinishedRollout:
        rollout = Rollout(id=rid, task_id="t", status=OK, attempt=1, reward=reward)
        return FinishedRollout(rollout=rollout, spans=calls_spans(rid, calls))

    spec = (("x", 1.0, 1), ("y", 1.0, 2), ("z", 1.0, 6), ("w", 0.0, 1))
    groups = [Group(id="g", task=task("t"), rollouts=[finished(*s) for s in spec])]
    costs = {f.id: rollout_cost(f, "calls") for f in groups[0].rollouts}
    assert costs == {"x": 1.0, "y": 2.0, "z": 6.0, "w": 1.0}
    mean, std = 3.0, math.sqrt(((1 - 3) ** 2 + (2 - 3) ** 2 + (6 - 3) ** 2) / 3)
    assert std == pytest.approx(statistics.pstdev([1.0, 2.0, 6.0]))
    plain = {r.rollout_id: r for r in rows_for(groups, GRPO())}
    curation = build(CurationConfig(conditional_coef=0.2))
    out = {r.rollout_id: r for r in rows_for(groups, GRPO(), curation)}
    assert out.keys() == plain.keys() == {"x", "y", "z", "w"}
    for rid in ("x", "y", "z"):
        want = 0.2 * (mean - costs[rid]) / std
        new, old = out[rid], plain[rid]
        added = [n - o for n, o in zip(new.advantages, old.advantages, strict=True)]
        assert added == pytest.approx([want * m for m in old.loss_mask], abs=1e-12)
        assert sum(old.loss_mask) == 3 * costs[rid]  # every sampled token gets it
    assert out["w"] == plain["w"]
    m = curation.metrics()
    assert m["curation/conditional_rows_fraction"] == pytest.approx(3 / 4)
    assert m["curation/conditional_mean_abs_bonus"] == pytest.approx(
        statistics.fmean(abs(0.2 * (mean - c) / std) for c in (1.0, 2.0, 6.0))
    )
