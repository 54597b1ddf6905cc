"""Spans -> training rows: prefix merging, loss masks, log-prob alignment, returns, the
temperature rows carry, and which of n > 1 choices earn the reward."""

from __future__ import annotations

from pathlib import Path

import pytest

from tracerl.algorithms.transitions import spans_to_transitions
from tracerl.types import Span, Transition


def span(
    seq: int,
    prompt: list[int],
    completion: list[int],
    *,
    role: str = "policy",
    version: int = 0,
    rollout_id: str = "r1",
    temperature: float = 1.0,
) -> Span:
    # Distinct, recognisable log-probs: -(seq + 1) - 0.01 * position.
    lps = [-(seq + 1) - 0.01 * i for i in range(len(completion))]
    return Span(
        id=f"{rollout_id}-{role}-{seq}",
        rollout_id=rollout_id,
        attempt=1,
        seq=seq,
        role=role,
        policy_version=version,
        prompt_ids=prompt,
        completion_ids=completion,
        logprobs=lps,
        temperature=temperature,
    )


def calculator_rollout() -> list[Span]:
    """4 turns: question -> tool call -> result -> tool call -> result -> ... -> answer."""
    p0 = [1, 2, 3]
    c0, t1 = [10, 11], [4, 5]
    c1, t2 = [12, 13, 14], [6]
    c2, t3 = [15], [7, 8]
    c3 = [16, 17, 99]  # ends with the end token
    p1 = p0 + c0 + t1
    p2 = p1 + c1 + t2
    p3 = p2 + c2 + t3
    return [
        span(0, p0, c0, version=3),
        span(1, p1, c1, version=3),
        span(2, p2, c2, version=4),
        span(3, p3, c3, version=4),
    ]


def test_four_turn_rollout_merges_into_one_row() -> None:
    spans = calculator_rollout()
    (row,) = spans_to_transitions(spans, 1.0, group_id="g", task_id="t")
    assert row.input_ids == [1, 2, 3, 10, 11, 4, 5, 12, 13, 14, 6, 15, 7, 8, 16, 17, 99]
    assert row.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 0, 0, 1, 1, 1]
    assert row.span_ids == [s.id for s in spans] and row.num_spans == 4
    assert row.reward == 1.0 and row.group_id == "g" and row.task_id == "t"
    assert row.advantages == [0.0] * len(row.input_ids)
    # Reference alignment: walk the spans' completions and find each one in the row.
    expected_lp: dict[int, float] = {}
    expected_v: dict[int, int] = {}
    for s in spans:
        start = len(s.prompt_ids)
        assert row.input_ids[start : start + len(s.completion_ids)] == s.completion_ids
        for i, lp in enumerate(s.logprobs):
            expected_lp[start + i] = lp
            expected_v[start + i] = s.policy_version
    for t in range(len(row.input_ids)):
        assert row.behaviour_logprobs[t] == expected_lp.get(t, 0.0)
        assert row.versions[t] == expected_v.get(t, -1)
        assert row.loss_mask[t] == (1 if t in expected_lp else 0)


def test_merged_row_costs_fewer_tokens_than_one_row_per_span() -> None:
    spans = calculator_rollout()
    (row,) = spans_to_transitions(spans, 1.0, group_id="g", task_id="t")
    per_span = sum(len(s.prompt_ids) + len(s.completion_ids) for s in spans)
    assert len(row.input_ids) == 17 and per_span == 44
    assert sum(row.loss_mask) == sum(len(s.completion_ids) for s in spans)


def test_edited_history_starts_a_new_row() -> None:
    s0, s1, s2, s3 = calculator_rollout()
    edited = list(s2.prompt_ids)
    edited[4] = 42  # the agent rewrote its first answer
    s2 = s2.model_copy(update={"prompt_ids": edited})
    s3 = s3.model_copy(update={"prompt_ids": edited + s2.completion_ids + [7, 8]})
    rows = spans_to_transitions([s0, s1, s2, s3], 0.5, group_id="g", task_id="t")
    assert [r.span_ids for r in rows] == [[s0.id, s1.id], [s2.id, s3.id]]
    second = rows[1]
    assert second.input_ids == s3.prompt_ids + s3.completion_ids
    # The whole edited prompt is context, only the two completions are sampled.
    n2 = len(edited)
    assert second.loss_mask == [0] * n2 + [1] + [0, 0] + [1, 1, 1]


def test_two_roles_give_separate_rows() -> None:
    planner = [span(0, [1, 2], [10], role="planner"), span(2, [1, 2, 10, 3], [11], role="planner")]
    executor = [
        span(1, [5], [20, 21], role="executor"),
        span(3, [5, 20, 21, 6], [22], role="executor"),
    ]
    rows = spans_to_transitions(
        [planner[0], executor[0], planner[1], executor[1]], 1.0, group_id="g", task_id="t"
    )
    assert [(r.role, r.input_ids) for r in rows] == [
        ("planner", [1, 2, 10, 3, 11]),
        ("executor", [5, 20, 21, 6, 22]),
    ]
    assert rows[1].loss_mask == [0, 1, 1, 0, 1]


def test_interleaved_conversations_of_one_role_each_merge() -> None:
    a0 = span(0, [1, 2], [10])
    b1 = span(1, [7, 8], [20])
    a2 = span(2, [1, 2, 10, 3], [11])
    rows = spans_to_transitions([a0, b1, a2], 0.0, group_id="g", task_id="t")
    assert [r.span_ids for r in rows] == [[a0.id, a2.id], [b1.id]]


def test_step_rewards_add_to_the_row_holding_the_span() -> None:
    s0, s1, s2, s3 = calculator_rollout()
    s2 = s2.model_copy(update={"prompt_ids": [9] + s2.prompt_ids})  # break after turn 1
    s3 = s3.model_copy(update={"prompt_ids": [9] + s3.prompt_ids})
    rows = spans_to_transitions(
        [s0, s1, s2, s3], 1.0, {1: 0.25, 3: -0.5}, group_id="g", task_id="t"
    )
    assert [r.reward for r in rows] == [1.25, 0.5]


def test_temperature_change_starts_a_new_row_and_is_recorded() -> None:
    s0 = span(0, [1, 2], [10], temperature=0.7)
    s1 = span(1, [1, 2, 10, 3], [11], temperature=1.0)
    rows = spans_to_transitions([s0, s1], 0.0, group_id="g", task_id="t")
    assert [r.temperature for r in rows] == [0.7, 1.0]


def test_spans_of_two_rollouts_are_refused() -> None:
    with pytest.raises(ValueError):
        spans_to_transitions(
            [span(0, [1], [2]), span(1, [1, 2], [3], rollout_id="r2")],
            0.0,
            group_id="g",
            task_id="t",
        )
    assert spans_to_transitions([], 1.0, group_id="g", task_id="t") == []


def test_greedy_calls_make_rows_at_the_temperature_their_logprobs_were_taken_at() -> None:
    # The engine records a greedy call (T = 0) at T = 1: its row says 1, never 0, and it
    # merges with a T = 1 call that extends it.
    greedy = span(0, [1, 2], [10], temperature=0.0)
    sampled = span(1, [1, 2, 10, 3], [11], temperature=1.0)
    (row,) = spans_to_transitions([greedy, sampled], 1.0, group_id="g", task_id="t")
    assert row.temperature == 1.0 and row.num_spans == 2
    with pytest.raises(ValueError, match="greater than 0"):
        Transition.model_validate(row.model_dump() | {"temperature": 0.0})


def choice(seq: int, prompt: list[int], completion: list[int], call: str, index: int, n: int,
           content: str = "") -> Span:  # fmt: skip
    """Choice `index` of a call that returned `n` (as the gateway records n > 1)."""
    s = span(seq, prompt, completion)
    response = {
        "message": {"role": "assistant", "content": content},
        "choice": {"call": call, "index": index, "of": n},
    }
    return s.model_copy(update={"id": f"{call}-{index}", "response": response})


def test_only_the_choice_the_conversation_went_on_with_or_returned_earns_the_reward() -> None:
    p0, tool = [1, 2, 3], [4, 5]
    first = [choice(i, p0, c, "a", i, 3) for i, c in enumerate([[10], [11], [12]])]
    p1 = p0 + [11] + tool  # the agent went on with choice 1
    final = [
        choice(3, p1, [20, 99], "b", 0, 2, content="84"),
        choice(4, p1, [21, 99], "b", 1, 2, content="85"),  # ... and returned this one
    ]
    spans = first + final
    (row,) = spans_to_transitions(spans, 1.0, group_id="g", task_id="t", answer=" 85\n")
    assert row.span_ids == ["a-1", "b-1"] and row.input_ids == p1 + [21, 99]
    assert row.reward == 1.0
    # Without the answer the final call's choices are left out too: none was returned.
    (row,) = spans_to_transitions(spans, 1.0, group_id="g", task_id="t")
    assert row.span_ids == ["a-1"]
    # A choice left aside that the agent rewarded itself is trained, on that reward alone.
    rows = spans_to_transitions(spans, 1.0, {2: 0.5}, group_id="g", task_id="t", answer="85")
    assert [(r.span_ids, r.reward) for r in rows] == [(["a-1", "b-1"], 1.0), (["a-2"], 0.5)]


def test_identical_choices_are_trained_once() -> None:
    same = [choice(i, [1, 2], [10, 99], "a", i, 2, content="85") for i in range(2)]
    (row,) = spans_to_transitions(same, 1.0, group_id="g", task_id="t", answer="85")
    assert row.span_ids == ["a-0"]


def _best_of(task: dict, *, base_url: str, api_key: str, model: str) -> str:
    """Samples 3 first turns and goes on with the last; samples 2 answers, returns the
    second."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages: list = [{"role": "user", "content": task["question"]}]
    first = client.chat.completions.create(model=model, messages=messages, n=3, max_tokens=12)
    messages += [first.choices[2].message.model_dump(exclude_none=True)]
    messages += [{"role": "user", "content": "sure?"}]
    final = client.chat.completions.create(model=model, messages=messages, n=2, max_tokens=12)
    return final.choices[1].message.content or ""


def test_n_choices_recorded_by_the_gateway_train_only_the_kept_ones(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from tracerl.agents import python_agent
    from tracerl.algorithms.rows import rollout_rows
    from tracerl.evaluate import run_rollouts
    from tracerl.pipeline.sources import read_finished
    from tracerl.stack import start_stack
    from tracerl.types import Group, Task

    task = Task(id="t", input={"question": "What is 2+2?"})
    stack = start_stack(tiny_model_dir, tmp_path / "traces.db")
    try:
        with ThreadPoolExecutor(2) as threads:
            (rollout,) = run_rollouts(
                stack.store, stack.url, python_agent(_best_of, threads),
                lambda task, answer: 1.0, [task],
            )  # fmt: skip
        f = read_finished(stack.store, rollout)
    finally:
        stack.close()
    assert len(f.spans) == 5  # every choice is kept in the store
    calls = [[s for s in f.spans if s.choice and s.choice.of == n] for n in (3, 2)]
    assert [[s.choice.index for s in c if s.choice] for c in calls] == [[0, 1, 2], [0, 1]]
    went_on, returned = calls[0][2], calls[1][1]
    distinct = {tuple(s.completion_ids) for s in calls[0]} | {
        tuple(s.completion_ids) for s in calls[1]
    }
    assert len(distinct) == 5, "sampled choices happened to coincide"
    (row,) = rollout_rows(f, Group(id="g", task=task, rollouts=[f]))
    assert row.span_ids == [went_on.id, returned.id] and row.reward == 1.0
    assert row.input_ids == returned.prompt_ids + returned.completion_ids


def test_a_distilled_call_trains_its_completion_on_the_prompt_without_the_asset() -> None:
    """A span that recorded its prompt without its assets (an asset curriculum's, when it
    distills) makes its row as sampled, and with `unassisted` a row on that prompt, its
    behaviour log-probs unknown (NaN); a span that recorded none makes no such row."""
    import math

    from tracerl.types import UNASSISTED

    carried = span(0, [1, 2, 3, 4, 5], [10, 11, 99]).model_copy(
        update={"response": {UNASSISTED: [1, 5]}}
    )
    (sampled,) = spans_to_transitions([carried], 1.0, group_id="g", task_id="t")
    assert sampled.input_ids == [1, 2, 3, 4, 5, 10, 11, 99]
    (row,) = spans_to_transitions([carried], 1.0, group_id="g", task_id="t", unassisted=True)
    assert row.input_ids == [1, 5, 10, 11, 99] and row.loss_mask == [0, 0, 1, 1, 1]
    assert row.behaviour_logprobs[:2] == [0.0, 0.0]
    assert all(math.isnan(x) for x in row.behaviour_logprobs[2:])
    plain = span(0, [1, 5], [10])
    assert spans_to_transitions([plain], 1.0, group_id="g", task_id="t", unassisted=True) == []


def test_distilled_rows_teach_the_successes_of_carried_rollouts_only() -> None:
    """rows_for: every rollout's rows as sampled (GRPO over them alone), then each carried
    rollout's reply again on its prompt without the asset, with its rollout's advantage
    when positive; a failure, or a rollout that carried nothing, adds no such row."""
    from tracerl.algorithms import GRPO
    from tracerl.algorithms.rows import rows_for
    from tracerl.types import UNASSISTED, FinishedRollout, Group, Rollout, RolloutStatus, Task

    def finished(rid: str, reward: float, carried: bool) -> FinishedRollout:
        s = span(0, [1, 2, 3, 4], [10, 11], rollout_id=rid)
        if carried:
            s = s.model_copy(update={"response": {UNASSISTED: [1, 4]}})
        rollout = Rollout(id=rid, task_id="t", status=RolloutStatus.succeeded, attempt=1,
                          reward=reward)  # fmt: skip
        return FinishedRollout(rollout=rollout, spans=[s])

    spec = (("win", 1.0, True), ("lose", 0.0, True), ("plain", 1.0, False), ("no", 0.0, False))
    groups = [Group(id="g", task=Task(id="t", input={}), rollouts=[finished(*s) for s in spec])]
    rows = rows_for(groups, GRPO())
    sampled, distilled = rows[:4], rows[4:]
    assert [r.rollout_id for r in sampled] == ["win", "lose", "plain", "no"]
    assert all(len(r.input_ids) == 6 for r in sampled)
    (row,) = distilled
    win = sampled[0].advantages[-1]
    assert row.rollout_id == "win" and win > 0 and row.input_ids == [1, 4, 10, 11]
    assert row.advantages == [0.0, 0.0, win, win]
