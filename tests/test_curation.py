"""Data curation: each switch changes what is trained on in the intended way, and the
stateful ones survive a checkpoint round trip."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from tracerl.algorithms import GRPO
from tracerl.algorithms.curation import (
    AdaptiveGroupSize,
    CurationConfig,
    Curator,
    ReplayBuffer,
    conditional_advantage,
    drop_zero_variance,
    rollout_costs,
    zero_variance,
)
from tracerl.pipeline.sources import Group
from tracerl.pipeline.step import rows_for
from tracerl.store import SqliteStore
from tracerl.types import Rollout, RolloutStatus, Span, Task

OK, FAIL, LATE = RolloutStatus.succeeded, RolloutStatus.failed, RolloutStatus.timed_out


def task(tid: str) -> Task:
    return Task(id=tid, input={"question": tid})


def ro(rid: str, reward: float | None, status: RolloutStatus = OK, tid: str = "t") -> Rollout:
    return Rollout(id=rid, task_id=tid, status=status, reward=reward)


def group(gid: str, tid: str, rewards: list[float], prefix: str | None = None) -> Group:
    p = prefix or gid
    return Group(gid, task(tid), [ro(f"{p}-{i}", x, tid=tid) for i, x in enumerate(rewards)])


def sampled_adv(row) -> float:  # type: ignore[no-untyped-def]
    """The advantage on the row's sampled tokens (one value per row here)."""
    values = {x for x, m in zip(row.advantages, row.loss_mask, strict=True) if m}
    assert len(values) == 1
    return values.pop()


# ------------------------------------------------------------------- a real store's rollouts


def run_rollout(
    store: SqliteStore, tid: str, gid: str, reward: float, calls: int, version: int = 0
) -> Rollout:
    """A finished rollout with `calls` model calls (3 sampled tokens each), each call's
    prompt extending the previous call's prompt + completion + a tool result."""
    (queued,) = store.enqueue([tid], gid)
    (r,) = store.claim("test")
    assert r.id == queued.id
    prompt = [1, 2, 3]
    for seq in range(calls):
        completion = [10 + seq, 11, 12]
        store.add_span(
            Span(
                id=f"{r.id}-{seq}", rollout_id=r.id, attempt=r.attempt, seq=seq, role="policy",
                policy_version=version, prompt_ids=list(prompt), completion_ids=completion,
                logprobs=[-0.5, -1.0, -1.5],
            )
        )  # fmt: skip
        prompt = prompt + completion + [7, 7]
    return store.finish(r.id, r.attempt, OK, reward=reward)


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
    # Only finished rollouts count: the timed-out 0.0 does not make this group mixed, and a
    # missing reward reads as 0 (as rows_for reads it).
    late = Group("late", task("t"), [ro("l0", 1.0), ro("l1", 1.0), ro("l2", 0.0, LATE)])
    none = Group("none", task("t"), [ro("n0", None, FAIL), ro("n1", 0.0)])
    single = group("single", "t", [1.0])
    partial = Group("partial", task("t"), [ro("p0", 0.5), ro("p1", 0.0, FAIL)])
    groups = [mixed, solved, failed, late, none, single, partial]
    assert [zero_variance(g) for g in groups] == [False, True, True, True, True, True, False]
    kept, dropped = drop_zero_variance(groups)
    assert kept == [mixed, partial] and dropped == [solved, failed, late, none, single]

    curator = Curator(CurationConfig(dynamic_sampling=True), group_size=4)
    kept, dropped = curator.curate(groups)
    assert kept == [mixed, partial] and len(dropped) == 5
    assert curator.metrics() == {"curation/dropped_zero_variance": 5.0}
    assert curator.metrics() == {"curation/dropped_zero_variance": 0.0}  # since last call
    off = Curator(CurationConfig(), group_size=4)
    assert off.curate(groups) == (groups, []) and off.metrics() == {}


# ----------------------------------------------------------------------------------- replay


def test_replay_puts_a_stored_success_into_an_all_fail_group_of_a_hard_task(store) -> None:
    curator = Curator(CurationConfig(replay=True, replay_max_success_rate=0.25), group_size=4)
    # Step 0: "hard" succeeds once in 4 (rate 0.25), "easy" 3 times in 4 (rate 0.75).
    hard0 = [run_rollout(store, "hard", "h0", x, calls=2) for x in (1.0, 0.0, 0.0, 0.0)]
    easy0 = [run_rollout(store, "easy", "e0", x, calls=1) for x in (1.0, 1.0, 1.0, 0.0)]
    step0 = [Group("h0", task("hard"), hard0), Group("e0", task("easy"), easy0)]
    assert curator.curate(step0)[0] == step0  # both groups have a success: untouched
    success = hard0[0]

    # Step 1, trained on policy version 1: every rollout of both tasks fails.
    hard1 = [run_rollout(store, "hard", "h1", 0.0, calls=1, version=1) for _ in range(4)]
    easy1 = [run_rollout(store, "easy", "e1", 0.0, calls=1, version=1) for _ in range(4)]
    step1 = [Group("h1", task("hard"), hard1), Group("e1", task("easy"), easy1)]
    kept, _ = curator.curate(step1)
    # hard (rate now 1/8): the last failed rollout gives way to the stored success;
    # easy (rate 3/8 > 0.25) is left alone.
    assert [r.id for r in kept[0].rollouts] == [r.id for r in hard1[:3]] + [success.id]
    assert kept[1] == step1[1]
    assert curator.metrics()["curation/replayed"] == 1.0

    # What gets trained: the replayed rollout's rows come from its spans in the store, with
    # its own behaviour log-probs and version 0, in the new group; the group now has signal.
    rows = rows_for(store, kept, GRPO())
    replayed = [r for r in rows if r.rollout_id == success.id]
    assert len(replayed) == 1 and replayed[0].group_id == "h1" and replayed[0].reward == 1.0
    assert {v for v in replayed[0].versions if v >= 0} == {0}
    assert replayed[0].span_ids == [f"{success.id}-0", f"{success.id}-1"]
    assert sampled_adv(replayed[0]) > 0
    others = [r for r in rows if r.group_id == "h1" and r.rollout_id != success.id]
    assert len(others) == 3 and all(sampled_adv(r) < 0 for r in others)
    # Without replay the all-fail group trains on nothing.
    plain = rows_for(store, step1[:1], GRPO())
    assert all(a == 0.0 for r in plain for a in r.advantages)


def test_replay_never_inserts_one_rollout_twice_in_a_batch() -> None:
    buffer = ReplayBuffer(capacity=2, max_success_rate=0.5)
    buffer.observe(group("g0", "hard", [1.0, 0.0, 0.0, 0.0], prefix="old"))
    fails = [group(f"f{k}", "hard", [0.0, 0.0, 0.0, 0.0]) for k in range(2)]
    out = buffer.fill_batch(fails)
    assert [r.id for r in out[0].rollouts][-1] == "old-0"
    assert out[1] == fails[1]  # the only stored success is already in the batch
    # A success of this very batch is not replayed next to its own group either.
    same = [group("s", "hard", [1.0, 0.0]), group("f", "hard", [0.0, 0.0])]
    buffer2 = ReplayBuffer(max_success_rate=0.5)
    for g in same:
        buffer2.observe(g)
    assert buffer2.fill_batch(same) == same
    # With two stored successes, two all-fail groups get one each, the newest first.
    buffer.observe(group("g1", "hard", [1.0, 0.0, 0.0, 0.0, 0.0, 0.0], prefix="new"))
    out = buffer.fill_batch(fails)
    assert [g.rollouts[-1].id for g in out] == ["new-0", "old-0"]
    assert buffer.metrics()["curation/replayed"] == 3.0


def test_replay_capacity_rate_and_state_round_trip() -> None:
    buffer = ReplayBuffer(capacity=2, max_success_rate=0.3)
    for k in range(3):
        buffer.observe(group(f"g{k}", "hard", [1.0, 0.0, 0.0, 0.0, 0.0]))
    assert buffer.success_rate("hard") == pytest.approx(3 / 15)
    assert buffer.success_rate("unseen") is None
    state = json.loads(json.dumps(buffer.state()))  # checkpoints store it as JSON
    restored = ReplayBuffer(capacity=2, max_success_rate=0.3)
    restored.load_state(state)
    assert restored.state() == buffer.state()
    fail = group("f", "hard", [0.0, 0.0])
    assert restored.fill(fail).rollouts[-1].id == "g2-0"  # newest kept
    assert restored.fill(fail, exclude={"g2-0"}).rollouts[-1].id == "g1-0"
    assert restored.fill(fail, exclude={"g2-0", "g1-0"}) == fail  # g0-0 was evicted
    # A task that succeeds often gets no replay.
    buffer.observe(group("g4", "hard", [1.0] * 10))
    assert buffer.success_rate("hard") == pytest.approx(13 / 25)
    assert buffer.fill(fail) == fail


# ---------------------------------------------------------------------- adaptive group size


def test_adaptive_group_size_follows_the_rule_within_bounds() -> None:
    sizes = AdaptiveGroupSize(base=8, min_size=2, max_size=16, window=8, minority=2.0)
    sizes.observe(group("a", "solved", [1.0] * 8))
    sizes.observe(group("b", "never", [0.0] * 8))
    sizes.observe(group("c", "mid", [1.0, 0.0] * 4))
    sizes.observe(group("d", "rare", [1.0] + [0.0] * 5))  # p = 1/6
    sizes.observe(group("e", "hard", [1.0] + [0.0] * 7))  # p = 1/8
    sizes.observe(Group("f", task("late"), [ro("x", 1.0, LATE), ro("y", 0.0, LATE)]))
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

    state = json.loads(json.dumps(sizes.state()))
    restored = AdaptiveGroupSize(base=8, min_size=2, max_size=16, window=8, minority=2.0)
    restored.load_state(state)
    assert {t: restored.size(t) for t in got} == {t: sizes.size(t) for t in got}


def test_curator_issues_adaptive_sizes_and_keeps_state() -> None:
    cfg = CurationConfig(adaptive_group_size=True, replay=True, group_size_max=12)
    curator = Curator(cfg, group_size=6)
    assert curator.group_size("x") == 6
    curator.curate([group("a", "x", [1.0] + [0.0] * 9)])  # p = 0.1 -> 20, clamped to 12
    assert curator.group_size("x") == 12
    restored = Curator(cfg, group_size=6)
    restored.load_state(json.loads(json.dumps(curator.state())))
    assert restored.group_size("x") == 12
    assert restored.replay is not None and restored.replay.success_rate("x") == 0.1
    assert Curator(CurationConfig(), group_size=6).group_size("x") == 6
    with pytest.raises(ValueError):
        CurationConfig(group_size_min=5, group_size_max=4)


# -------------------------------------------------------------------- conditional advantage


def test_conditional_advantage_favours_the_cheaper_correct_rollout(store) -> None:
    # g1: two correct rollouts (2 and 4 calls), two incorrect; g2: one correct only;
    # g3: two correct with equal cost.
    spec = {
        "g1": [(1.0, 2), (1.0, 4), (0.0, 1), (0.0, 3)],
        "g2": [(1.0, 1), (0.0, 5)],
        "g3": [(1.0, 2), (1.0, 2), (0.0, 1)],
    }
    groups = [
        Group(gid, task("t"), [run_rollout(store, "t", gid, x, calls=n) for x, n in s])
        for gid, s in spec.items()
    ]
    rows = rows_for(store, groups, GRPO())
    costs = rollout_costs(store, groups, "calls")
    assert [costs[r.id] for r in groups[0].rollouts] == [2.0, 4.0, 1.0, 3.0]
    tokens = rollout_costs(store, groups, "tokens")
    assert [tokens[r.id] for r in groups[0].rollouts] == [6.0, 12.0, 3.0, 9.0]

    out = conditional_advantage(rows, costs, coef=0.5)
    a, b, c, d = (r.id for r in groups[0].rollouts)
    # Costs of the correct ones: 2 and 4 -> mean 3, population std 1 -> z = +1 and -1.
    bonus = {a: 0.5, b: -0.5}
    before = {r.rollout_id: r for r in rows}
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

    # DDCA scaling by pass rate: g1 passes 2 of 4, so the bonus halves.
    scaled = conditional_advantage(rows, costs, coef=0.5, scale_by_pass_rate=True)
    got = {r.rollout_id: sampled_adv(r) - prior[r.rollout_id] for r in scaled}
    assert got[a] == pytest.approx(0.25) and got[b] == pytest.approx(-0.25)
    assert got[c] == 0.0 and got[d] == 0.0

    curator = Curator(CurationConfig(conditional_coef=0.5), group_size=4)
    assert curator.needs_costs
    assert curator.advantages(rows, costs) == out
    m = curator.metrics()
    assert m["curation/conditional_rows_fraction"] == pytest.approx(2 / len(rows))
    assert m["curation/conditional_mean_abs_bonus"] == pytest.approx(0.5)


def test_conditional_bonus_is_standardized_cost() -> None:
    # Three correct rollouts, costs 1, 2, 6: bonus_i = coef * (mean - c_i) / pstdev.
    from tracerl.algorithms.transitions import spans_to_transitions

    rows = []
    for rid, reward in (("x", 1.0), ("y", 1.0), ("z", 1.0), ("w", 0.0)):
        span = Span(
            id=rid, rollout_id=rid, attempt=1, seq=0, role="policy", policy_version=0,
            prompt_ids=[1, 2], completion_ids=[3, 4], logprobs=[-1.0, -1.0],
        )  # fmt: skip
        rows += spans_to_transitions([span], reward, group_id="g", task_id="t")
    costs = {"x": 1.0, "y": 2.0, "z": 6.0, "w": 0.0}
    mean, std = 3.0, math.sqrt(((1 - 3) ** 2 + (2 - 3) ** 2 + (6 - 3) ** 2) / 3)
    assert std == pytest.approx(statistics.pstdev([1.0, 2.0, 6.0]))
    out = {r.rollout_id: r for r in conditional_advantage(rows, costs, coef=0.2)}
    for rid in ("x", "y", "z"):
        want = 0.2 * (mean - costs[rid]) / std
        assert out[rid].advantages == pytest.approx([0.0, 0.0, want, want])
    assert out["w"].advantages == [0.0, 0.0, 0.0, 0.0]
