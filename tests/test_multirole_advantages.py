"""Advantages for a planner with a variable number of executor sub-agents per rollout.

Hand-built spans of four rollouts of one task: the planner calls the executor 1, 3, 2 and 0
times. Spans become rows (one planner row per rollout, one row per executor sub-agent), and
the advantages are checked against a plain-Python reference and hand-computed values:
each role has its own group baseline over rollouts (not over calls), every executor row
of a rollout carries that rollout's advantage, the per-rollout weights give each rollout
a total weight of 1 per role whatever its number of calls, and no row is added or dropped.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from tracerl.algorithms.advantages import GRPO, RLOO, DrGRPO, compute_advantages
from tracerl.algorithms.transitions import spans_to_transitions
from tracerl.trainer.loss import loss_weights
from tracerl.types import Span, Transition

# rollout -> (final reward, sampled tokens of each executor sub-agent's two calls)
ROLLOUTS: dict[str, tuple[float, list[tuple[int, int]]]] = {
    "a": (1.0, [(4, 2)]),
    "b": (0.0, [(2, 1), (5, 2), (3, 3)]),
    "c": (1.0, [(6, 1), (1, 2)]),
    "d": (0.0, []),  # the planner answered without asking
}
PLANNER_TOKENS = 3  # sampled per planner call


class _Calls:
    """Builds the spans of one rollout attempt, numbering calls in order."""

    def __init__(self, rollout: str) -> None:
        self.rollout = rollout
        self.spans: list[Span] = []
        self.next_token = 1000 * (ord(rollout) - ord("a") + 1)

    def _ids(self, n: int) -> list[int]:
        self.next_token += n
        return list(range(self.next_token - n, self.next_token))

    def call(self, role: str, prompt: list[int], sampled: int, parent: str | None) -> Span:
        span = Span(
            id=f"{self.rollout}{len(self.spans)}",
            rollout_id=self.rollout,
            attempt=1,
            seq=len(self.spans),
            role=role,
            policy_version=0,
            prompt_ids=prompt,
            completion_ids=self._ids(sampled),
            logprobs=[-0.5] * sampled,
            parent_span_id=parent,
        )
        self.spans.append(span)
        return span

    def conversation(
        self, role: str, sampled: list[int], parent: str | None, between: list[int]
    ) -> list[Span]:
        """One agent's calls: each prompt extends the last prompt + completion + new context."""
        out: list[Span] = []
        prompt = self._ids(5)
        for i, n in enumerate(sampled):
            if i:
                last = out[-1]
                prompt = last.prompt_ids + last.completion_ids + self._ids(between[i - 1])
            out.append(self.call(role, prompt, n, parent))
        return out


def rollout_spans(rollout: str) -> list[Span]:
    """The planner asks, one executor sub-agent answers each question, the planner answers.

    Spans are made in call order: planner call k, then the k-th executor's two calls.
    """
    calls = _Calls(rollout)
    executors = ROLLOUTS[rollout][1]
    planner_prompt = calls._ids(6)
    for k in range(len(executors) + 1):
        if k:
            last = next(s for s in reversed(calls.spans) if s.role == "planner")
            planner_prompt = last.prompt_ids + last.completion_ids + calls._ids(2)
        asking = calls.call("planner", planner_prompt, PLANNER_TOKENS, None)
        if k < len(executors):
            calls.conversation("executor", list(executors[k]), asking.id, [2])
    return calls.spans


def rows() -> list[Transition]:
    out = []
    for rollout, (reward, _) in ROLLOUTS.items():
        out += spans_to_transitions(rollout_spans(rollout), reward, group_id="g", task_id="t")
    return out


def test_spans_become_one_planner_row_and_one_row_per_executor_subagent() -> None:
    got = rows()
    planner = [r for r in got if r.role == "planner"]
    executor = [r for r in got if r.role == "executor"]
    assert [r.rollout_id for r in planner] == ["a", "b", "c", "d"]
    assert [r.num_spans for r in planner] == [2, 4, 3, 1]
    assert [r.rollout_id for r in executor] == ["a", "b", "b", "b", "c", "c"]
    assert [sum(r.loss_mask) for r in executor] == [6, 3, 7, 6, 7, 3]


def reference(
    rows: list[Transition], kind: str, normalize: str
) -> dict[tuple[str, ...], tuple[float, float]]:
    """(advantage, weight) of each row, keyed by its span ids, computed from scratch."""
    out = {}
    for role in sorted({r.role for r in rows}):
        mine = [r for r in rows if r.role == role]
        rollouts = sorted({r.rollout_id for r in mine})
        ret = {
            x: sum(r.reward for r in mine if r.rollout_id == x)
            / sum(1 for r in mine if r.rollout_id == x)
            for x in rollouts
        }
        values = list(ret.values())
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
        for r in mine:
            if kind == "grpo":
                adv = (r.reward - mean) / (std + 1e-6)
            elif kind == "rloo":
                adv = r.reward - (sum(values) - ret[r.rollout_id]) / (len(values) - 1)
            else:
                adv = r.reward - mean
            if max(values) == min(values):
                adv = 0.0
            same = [s for s in mine if s.rollout_id == r.rollout_id]
            if normalize == "token":
                weight = 1.0 / sum(sum(s.loss_mask) for s in same)
            elif normalize == "sequence":
                weight = 1.0 / len(same)
            else:
                weight = 1.0
            out[tuple(r.span_ids)] = (adv, weight)
    return out


def _scalar(row: Transition) -> float:
    """The one advantage a row carries on its sampled tokens (0 elsewhere)."""
    on = {a for a, m in zip(row.advantages, row.loss_mask, strict=True) if m}
    off = {a for a, m in zip(row.advantages, row.loss_mask, strict=True) if not m}
    assert len(on) == 1 and off <= {0.0}
    return on.pop()


@pytest.mark.parametrize(
    ("algo", "kind", "normalize"),
    [
        (GRPO(), "grpo", "token"),
        (GRPO(normalize="sequence"), "grpo", "sequence"),
        (RLOO(), "rloo", "token"),
        (DrGRPO(), "drgrpo", "none"),
    ],
)
def test_per_role_advantages_and_weights_match_the_reference(algo, kind, normalize) -> None:  # type: ignore[no-untyped-def]
    before = rows()
    out = compute_advantages(algo, before)
    # No padding: exactly the rows that came in, each once.
    assert sorted(tuple(r.span_ids) for r in out) == sorted(tuple(r.span_ids) for r in before)
    want = reference(before, kind, normalize)
    for r in out:
        adv, weight = want[tuple(r.span_ids)]
        assert _scalar(r) == pytest.approx(adv, abs=1e-12)
        assert r.weight == pytest.approx(weight, rel=1e-12)


def test_hand_computed_grpo_values() -> None:
    out = compute_advantages(GRPO(), rows())
    adv = {(r.role, r.rollout_id, r.span_ids[0]): _scalar(r) for r in out}
    # Planner returns 1, 0, 1, 0: mean 1/2, sample std sqrt(1/3).
    s = math.sqrt(1 / 3) + 1e-6
    planner = {x: a for (role, x, _), a in adv.items() if role == "planner"}
    assert planner == pytest.approx({"a": 0.5 / s, "b": -0.5 / s, "c": 0.5 / s, "d": -0.5 / s})
    # Executor returns over the rollouts that called it, one each however many calls:
    # a = 1, b = 0, c = 1, so mean 2/3 (a per-call mean would be 3/6) and std sqrt(1/3).
    executor = [(x, a) for (role, x, _), a in adv.items() if role == "executor"]
    assert [x for x, _ in executor] == ["a", "b", "b", "b", "c", "c"]
    assert [a for _, a in executor] == pytest.approx(
        [1 / 3 / s] + [-2 / 3 / s] * 3 + [1 / 3 / s] * 2
    )


def test_step_rewards_move_only_their_row_against_the_rollout_baseline() -> None:
    # The second executor of rollout b gets a step reward of 1 (its last call is seq 5).
    spans = {x: rollout_spans(x) for x in ROLLOUTS}
    assert [s.seq for s in spans["b"] if s.role == "executor"] == [1, 2, 4, 5, 7, 8]
    out_rows = []
    for x, (reward, _) in ROLLOUTS.items():
        steps = {5: 1.0} if x == "b" else None
        out_rows += spans_to_transitions(spans[x], reward, steps, group_id="g", task_id="t")
    out = compute_advantages(DrGRPO(), out_rows)
    executor = [r for r in out if r.role == "executor"]
    assert [r.rollout_id for r in executor] == ["a", "b", "b", "b", "c", "c"]
    # Executor returns: a = 1, b = mean(0, 1, 0) = 1/3, c = 1; baseline 7/9.
    base = 7 / 9
    assert [_scalar(r) for r in executor] == pytest.approx(
        [1 - base, -base, 1 - base, -base, 1 - base, 1 - base]
    )


def test_role_rewards_replace_the_outcome_for_their_role_only() -> None:
    # The executor is judged on its own work (1 in rollout b, 0 elsewhere; d never called
    # it, so its role reward has no row); the planner keeps the outcome (1, 0, 1, 0).
    out_rows = []
    for x, (reward, _) in ROLLOUTS.items():
        roles = {"executor": 1.0} if x in ("b", "d") else {"executor": 0.0}
        out_rows += spans_to_transitions(
            rollout_spans(x), reward, None, roles, group_id="g", task_id="t"
        )
    out = compute_advantages(DrGRPO(), out_rows)
    planner = {r.rollout_id: _scalar(r) for r in out if r.role == "planner"}
    assert planner == pytest.approx({"a": 0.5, "b": -0.5, "c": 0.5, "d": -0.5})
    executor = [r for r in out if r.role == "executor"]
    assert [(r.rollout_id, r.reward) for r in executor] == [("a", 0.0)] + [("b", 1.0)] * 3 + [
        ("c", 0.0)
    ] * 2
    # Executor returns a = 0, b = 1, c = 0 (the outcome would have said 1, 0, 1): baseline 1/3.
    assert [_scalar(r) for r in executor] == pytest.approx([-1 / 3] + [2 / 3] * 3 + [-1 / 3] * 2)


@pytest.mark.parametrize(
    ("normalize", "aggregation"), [("token", "token"), ("sequence", "sequence")]
)
def test_each_rollout_weighs_one_per_role_in_the_loss(normalize, aggregation) -> None:  # type: ignore[no-untyped-def]
    out = compute_advantages(GRPO(normalize=normalize), rows())
    width = max(len(r.input_ids) for r in out)
    mask_BT = torch.tensor([r.loss_mask + [0] * (width - len(r.loss_mask)) for r in out])
    weight_BT = torch.tensor([[r.weight] * width for r in out], dtype=torch.float64)
    W_B = loss_weights(mask_BT, weight_BT, aggregation).sum(dim=1).tolist()
    mass: dict[tuple[str, str], float] = {}
    for r, w in zip(out, W_B, strict=True):
        mass[(r.role, r.rollout_id)] = mass.get((r.role, r.rollout_id), 0.0) + w
    assert mass == pytest.approx(
        {("planner", x): 1.0 for x in "abcd"} | {("executor", x): 1.0 for x in "abc"}
    )
    # So rollout b's three executors together weigh what rollout a's one executor weighs.
    executor_b = [
        w for r, w in zip(out, W_B, strict=True) if (r.role, r.rollout_id) == ("executor", "b")
    ]
    assert len(executor_b) == 3 and statistics.fsum(executor_b) == pytest.approx(1.0)


def test_alignment_gives_each_calling_rollout_the_same_executor_rows() -> None:
    # M-GRPO's trajectory alignment with D = 2: a (1 call) gets a copy of its row, b (3)
    # loses one at random, c (2) is unchanged, d (0) has nothing to copy; planners untouched.
    before = rows()
    out = compute_advantages(GRPO(align={"executor": 2}), before)
    executor = [r for r in out if r.role == "executor"]
    assert [r.rollout_id for r in executor] == ["a", "a", "b", "b", "c", "c"]
    assert len([r for r in out if r.role == "planner"]) == 4
    originals = {tuple(r.span_ids): r for r in before}
    for r in executor:  # every row is one of the rollout's own rows: copies, never padding
        source = originals[tuple(r.span_ids)]
        assert source.rollout_id == r.rollout_id and r.input_ids == source.input_ids
    assert executor[0].span_ids == executor[1].span_ids
    b_ids = [tuple(r.span_ids) for r in executor if r.rollout_id == "b"]
    assert len(set(b_ids)) == 2
    c_ids = [tuple(r.span_ids) for r in executor if r.rollout_id == "c"]
    assert c_ids == [
        tuple(r.span_ids) for r in before if (r.role, r.rollout_id) == ("executor", "c")
    ]
    # The baseline is still over rollouts (a = 1, b = 0, c = 1) and each rollout still
    # weighs 1 in the executor's loss, now spread over exactly two rows.
    s = math.sqrt(1 / 3) + 1e-6
    assert [_scalar(r) for r in executor] == pytest.approx(
        [1 / 3 / s] * 2 + [-2 / 3 / s] * 2 + [1 / 3 / s] * 2
    )
    for x in "abc":
        mine = [r for r in executor if r.rollout_id == x]
        assert statistics.fsum(r.weight * sum(r.loss_mask) for r in mine) == pytest.approx(1.0)
    # The draw is seeded by rollout and role: rows rebuilt from the same spans (a resumed
    # step) align the same way.
    again = compute_advantages(GRPO(align={"executor": 2}), rows())
    assert [r.span_ids for r in again if r.role == "executor"] == [r.span_ids for r in executor]


def test_alignment_rejects_a_size_below_one() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        compute_advantages(GRPO(align={"executor": 0}), rows())
