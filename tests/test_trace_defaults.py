"""What `tracerl sft --from-traces` and `tracerl export` read from a store when no --filter
is given: the successful rollouts only, never a failure or a timeout to imitate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tracerl.cli import main
from tracerl.store import SqliteStore
from tracerl.types import RolloutStatus, Span, Task

S = RolloutStatus
OUTCOMES: list[tuple[str, RolloutStatus, float | None]] = [
    ("won", S.succeeded, 1.0),
    ("wrong", S.succeeded, 0.0),
    ("crashed", S.failed, None),
    ("crashed-scored", S.failed, 1.0),  # a runner reported a reward, then the agent failed
    ("late", S.timed_out, None),
    ("late-scored", S.timed_out, 1.0),
]
"""One rollout per (task id, final status, final reward)."""


def _store(path: Path) -> dict[int, str]:
    """A store holding one single-call rollout per OUTCOMES entry; task id by the first
    token each one sampled."""
    store = SqliteStore(path)
    store.add_tasks([Task(id=name, input={"q": name}) for name, _, _ in OUTCOMES])
    store.enqueue([name for name, _, _ in OUTCOMES])
    first_token = {}
    for i, r in enumerate(store.claim("runner", len(OUTCOMES))):
        token = 100 + 10 * i
        first_token[token] = r.task_id
        store.add_span(Span(
            id=f"s{i}", rollout_id=r.id, attempt=r.attempt, seq=0, role="policy",
            policy_version=0, prompt_ids=[1, 2, 3], completion_ids=[token, token + 1],
            logprobs=[-0.5, -0.5],
        ))  # fmt: skip
        _, status, reward = next(o for o in OUTCOMES if o[0] == r.task_id)
        store.finish(r.id, r.attempt, status, answer="x", reward=reward)
    store.close()
    return first_token


class _Trained(Exception):
    """Raised by the stand-in trainer with the examples it was given."""

    def __init__(self, examples: list[Any]) -> None:
        super().__init__("trained")
        self.examples = examples


def _sampled_by(examples: list[Any], first_token: dict[int, str]) -> list[str]:
    """Task ids of the rollouts whose sampled tokens the examples train on."""
    out = []
    for e in examples:
        trained = [t for t, m in zip(e.input_ids, e.loss_mask, strict=True) if m]
        out.append(first_token[trained[0]])
    return out


def test_sft_from_traces_takes_only_successes_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: with no --filter every finished rollout was trained on, failed and
    timed-out ones included."""
    first_token = _store(tmp_path / "traces.db")

    def trainer(examples: list[Any], *args: Any, **kwargs: Any) -> None:
        raise _Trained(examples)

    monkeypatch.setattr("tracerl.entrypoints.sft.sft_new_or_base", trainer)
    argv = ["sft", "--from-traces", str(tmp_path), "--base", str(tmp_path), "--out",
            str(tmp_path / "out"), "--steps", "1"]  # fmt: skip
    with pytest.raises(_Trained) as trained:
        main(argv)
    assert _sampled_by(trained.value.examples, first_token) == ["won"]
    said = capsys.readouterr().out
    assert "1 rows from 1 rollouts" in said and "succeeded" in said and "reward >= 1" in said
    # The run's own threshold decides; a filter given is taken as written.
    with pytest.raises(_Trained) as trained:
        main([*argv, "--success_threshold", "0"])
    assert sorted(_sampled_by(trained.value.examples, first_token)) == ["won", "wrong"]
    with pytest.raises(_Trained) as trained:
        main([*argv, "--filter", "reward >= 1"])
    assert sorted(_sampled_by(trained.value.examples, first_token)) == [
        "crashed-scored", "late-scored", "won"
    ]  # fmt: skip


def test_export_writes_only_successes_by_default(tmp_path: Path) -> None:
    """`tracerl export` writes training data (`tracerl sft --demos` reads it, and OpenAI
    lines keep no reward to filter on later): the same default as sft --from-traces."""
    first_token = _store(tmp_path / "traces.db")
    out = tmp_path / "lines.jsonl"
    main(["export", "--store", str(tmp_path), "--out", str(out), "--format", "openai"])
    assert [json.loads(line)["task_id"] for line in out.read_text().splitlines()] == ["won"]
    every = ["--filter", "status != queued"]
    main(["export", "--store", str(tmp_path), "--out", str(out), "--format", "openai", *every])
    assert len(out.read_text().splitlines()) == len(OUTCOMES) == len(first_token)
