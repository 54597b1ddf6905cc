"""Paired comparison and optimization of an asset, end to end through the gateway, with a
scripted model whose success the asset's text decides and a scripted proposer (a mock
OpenAI server returning fixed candidates: one helpful, one harmful, one neutral)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.assets_world import HARMFUL, HELPFUL, NEUTRAL, SEED, proposer_server, tasks, world
from tracerl.assets.compare import compare, run_arm
from tracerl.assets.config import OptimizeSettings
from tracerl.assets.optimize import Optimizer, pareto
from tracerl.assets.proposers import SYSTEM, BootstrapProposer, LlmProposer, parse_candidate
from tracerl.assets.records import AssetRef
from tracerl.store import SqliteStore

TRAIN = tasks("t", 12)
HELD_OUT = tasks("e", 20, "eval")


@pytest.fixture
def store() -> Iterator[SqliteStore]:
    s = SqliteStore(":memory:")
    s.put_asset("rules", SEED, note="written by hand")
    yield s
    s.close()


def test_compare_pairs_the_arms_and_counts_repairs_and_regressions(
    tiny_model_dir: Path, store: SqliteStore
) -> None:
    store.put_asset("rules", HARMFUL)
    with world(tiny_model_dir, store) as w:
        c = compare(
            w.arena, AssetRef.parse("rules@1"), AssetRef.parse("rules@v2"), TRAIN, repeats=2
        )
        without = compare(w.arena, AssetRef.parse("rules@0"), AssetRef.parse("rules"), TRAIN)
    # Seed: even n right (6 of 12); harmful: n % 4 == 0 only (3 of 12): it breaks n = 2, 6, 10.
    assert (c.a, c.b, len(c.pairs)) == (1, 2, 24)
    assert (c.success_a, c.success_b) == (0.5, 0.25)
    assert (c.repairs, c.regressions) == (0, 6)
    assert {p.task_id for p in c.pairs if p.a and not p.b} == {"t2", "t6", "t10"}
    assert c.p_value == pytest.approx(2 / 2**6)
    # The pairs are (task, repeat) run under one seed in both arms.
    a_seeds = {store.get_rollout(p.rollout_a).seed for p in c.pairs}
    assert a_seeds == {store.get_rollout(p.rollout_b).seed for p in c.pairs} and len(a_seeds) == 24
    # Version 0 runs without the asset: every answer wrong, the current version repairs 3.
    assert (without.a, without.b, without.success_a, without.repairs) == (0, 2, 0.0, 3)
    assert [x.id for x in store.comparisons("rules")] == [c.id, without.id]
    # Every span says what it saw.
    seen = {tuple(s.assets.items()) for p in c.pairs for s in store.spans(p.rollout_b)}
    assert seen == {(("rules", 2),)}
    assert all(store.spans(p.rollout_a)[0].assets == {} for p in without.pairs)


def test_the_optimizer_accepts_the_helpful_candidate_and_rejects_the_harmful_one(
    tiny_model_dir: Path, store: SqliteStore
) -> None:
    with (
        proposer_server([HELPFUL, HARMFUL, NEUTRAL]) as (url, seen),
        world(tiny_model_dir, store) as w,
    ):
        proposer = LlmProposer(store, url, "scripted-proposer")
        settings = OptimizeSettings(rounds=3, candidates=3)
        opt = Optimizer(w.arena, "rules", proposer, settings).run(
            AssetRef(name="rules"), TRAIN, HELD_OUT
        )
    assert opt.status == "accepted" and opt.seed == 1
    (first,) = opt.rounds  # the helpful candidate solves every train pair: no second round
    by_text = {store.asset("rules", c.version).text: c for c in first.candidates}
    helpful, harmful, neutral = by_text[HELPFUL], by_text[HARMFUL], by_text[NEUTRAL]
    assert helpful.kept and not harmful.kept and not neutral.kept
    assert first.archive == [helpful.version] and opt.best == helpful.version
    comparisons = {c.id: c for c in store.comparisons("rules")}
    hurt = comparisons[harmful.comparison]
    assert (hurt.purpose, hurt.a, hurt.b, hurt.optimization) == (
        "train",
        1,
        harmful.version,
        opt.id,
    )
    assert (hurt.repairs, hurt.regressions) == (0, 3)  # n = 2, 6, 10 broken
    assert (comparisons[helpful.comparison].repairs, comparisons[neutral.comparison].repairs) == (
        6,
        0,
    )
    final = comparisons[opt.final or ""]
    assert (final.purpose, final.success_a, final.success_b) == ("held-out", 0.5, 1.0)
    assert final.p_value < 0.05 and final.p_value == opt.p_value
    # Accepted: the winner's text is the new current version; candidates are kept, never current.
    current = store.asset("rules")
    assert current.version == opt.accepted and current.text == HELPFUL and not current.candidate
    assert all(store.asset("rules", c.version).candidate for c in first.candidates)
    assert store.optimizations("rules") == [opt]
    # The proposer saw failures beside successes of the same tasks, and its calls are spans.
    assert len(seen) == 3 and seen[0]["messages"][0]["content"] == SYSTEM
    shown = seen[0]["messages"][1]["content"]
    assert "Failed attempt" in shown and "Successful attempt" in shown and SEED in shown
    assert first.proposer_prompt == shown
    spans = store.spans(helpful.proposer_rollout or "")
    assert len(spans) == 3 and spans[0].role == "llm:scripted-proposer"
    assert spans[0].messages[1]["content"] == shown
    assert spans[0].response["message"]["content"].startswith("<prompt>")
    proposer_task = store.get_task(store.get_rollout(helpful.proposer_rollout or "").task_id)
    assert proposer_task.split == "proposer"


def test_no_winner_on_train_leaves_the_seed_current(
    tiny_model_dir: Path, store: SqliteStore
) -> None:
    with proposer_server([HARMFUL, NEUTRAL]) as (url, _), world(tiny_model_dir, store) as w:
        proposer = LlmProposer(store, url, "scripted-proposer")
        opt = Optimizer(w.arena, "rules", proposer, OptimizeSettings(rounds=2, candidates=2)).run(
            AssetRef(name="rules", version=1), TRAIN, HELD_OUT
        )
    assert opt.status == "rejected" and opt.best == 1 and opt.final is None
    assert len(opt.rounds) == 2 and all(r.archive == [1] for r in opt.rounds)
    assert store.asset("rules").version == 1  # the seed stays current


def test_a_win_without_significance_is_rejected(tiny_model_dir: Path, store: SqliteStore) -> None:
    # Fixes odd n everywhere, but three held-out tasks with one odd n cannot show it.
    with proposer_server([HELPFUL]) as (url, _), world(tiny_model_dir, store) as w:
        proposer = LlmProposer(store, url, "scripted-proposer")
        opt = Optimizer(w.arena, "rules", proposer, OptimizeSettings(rounds=1, candidates=1)).run(
            AssetRef(name="rules"), TRAIN, tasks("e", 3, "eval")
        )
    final = next(c for c in store.comparisons("rules") if c.id == opt.final)
    assert final.success_b > final.success_a and final.p_value >= 0.05
    assert opt.status == "rejected" and opt.accepted is None
    assert store.asset("rules").text == SEED


def test_the_bootstrap_proposer_adds_worked_examples_from_successful_traces(
    tiny_model_dir: Path, store: SqliteStore
) -> None:
    with world(tiny_model_dir, store) as w:
        proposer = BootstrapProposer(examples=2)
        opt = Optimizer(w.arena, "rules", proposer, OptimizeSettings(rounds=1, candidates=2)).run(
            AssetRef(name="rules"), TRAIN, HELD_OUT
        )
    assert opt.status == "accepted" and opt.proposer == "bootstrap"
    (round1,) = opt.rounds
    best = store.asset("rules", opt.best or 0)
    assert best.candidate and best.text.startswith(SEED) and "Worked examples" in best.text
    assert best.note.startswith("bootstrap: examples from rollouts ")
    for rid in best.note.removeprefix("bootstrap: examples from rollouts ").split(", "):
        assert store.get_rollout(rid).reward == 1.0  # drawn from successes only
    assert all(c.proposer_rollout is None for c in round1.candidates)


def test_pareto_keeps_complementary_versions_and_drops_dominated_ones() -> None:
    solved = {1: {"a", "b"}, 2: {"a", "b", "c"}, 3: {"d"}, 4: {"a"}, 5: {"d"}, 6: set()}
    assert pareto([1, 2, 3, 4, 5, 6], solved) == [2, 3]


def test_a_reply_reads_as_its_prompt_block_or_itself() -> None:
    assert parse_candidate("Sure.\n<prompt>\nBe exact.\n</prompt> thanks") == "Be exact."
    assert parse_candidate("<prompt>Unclosed rules") == "Unclosed rules"
    assert parse_candidate("  Just the text. ") == "Just the text."


def test_run_arm_records_what_each_rollout_was_given(
    tiny_model_dir: Path, store: SqliteStore
) -> None:
    with world(tiny_model_dir, store) as w:
        arm = run_arm(w.arena, "rules", 1, TRAIN[:4], repeats=1, seed=3)
    rollouts = store.rollouts(group_id=arm.group_id)
    assert {r.assets["rules"] for r in rollouts if r.assets} == {1} and len(rollouts) == 4
    assert sorted(arm.outcomes) == ["t0#0", "t1#0", "t2#0", "t3#0"]
    assert arm.solved() == {"t0#0", "t2#0"}
