"""The one-screen loop and the full trainer compute the same update from the same batch, and
the loop runs from the command line."""

from __future__ import annotations

import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.rollouts import policy_span
from tracerl.algorithms import GRPO, compute_advantages
from tracerl.algorithms.transitions import spans_to_transitions
from tracerl.engines.scoring import score_completion
from tracerl.loop_minimal import update
from tracerl.store.sqlite import SqliteStore
from tracerl.trainer.loss import LossConfig
from tracerl.trainer.trainer import Trainer, TrainerConfig
from tracerl.types import Span

ROOT = Path(__file__).resolve().parents[1]


def _rollout(model, rng: random.Random, rid: str, vocab: int) -> list[Span]:  # type: ignore[no-untyped-def]
    """Two calls: the second's prompt extends the first's prompt + completion."""
    p1 = [rng.randrange(vocab) for _ in range(rng.randint(5, 9))]
    c1 = [rng.randrange(vocab) for _ in range(rng.randint(2, 6))]
    p2 = p1 + c1 + [rng.randrange(vocab) for _ in range(3)]
    c2 = [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
    spans = []
    for seq, (p, c) in enumerate([(p1, c1), (p2, c2)]):
        true = score_completion(model, p, c)
        # A stale, slightly different behaviour policy so the importance weights matter.
        behaviour = [x + rng.uniform(-0.9, 0.4) for x in true]
        spans.append(policy_span(rid, seq, p, c, behaviour))
    return spans


def test_minimal_loop_matches_full_trainer(tiny_model_dir: Path) -> None:
    torch.manual_seed(0)
    rng = random.Random(0)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    vocab = reference.config.vocab_size
    batch = []
    for g in range(2):
        for k in range(4):
            spans = _rollout(reference, rng, f"g{g}r{k}", vocab)
            batch.append((f"g{g}", spans, float(rng.random() < 0.5) + 0.1 * k))

    cfg = TrainerConfig(lr=1e-3, bf16=False, grad_clip=1.0, loss=LossConfig(tis_cap=2.0))
    trainer = Trainer(tiny_model_dir, cfg)
    rows = [
        row
        for gid, spans, reward in batch
        for row in spans_to_transitions(spans, reward, group_id=gid, task_id=gid)
    ]
    assert len(rows) == len(batch)  # every rollout merged into one sequence
    metrics = trainer.train(compute_advantages(GRPO(), rows))

    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0)
    before = {k: v.clone() for k, v in reference.state_dict().items()}
    loss = update(reference, opt, batch)
    assert abs(loss - metrics.loss) <= 1e-6 * max(1.0, abs(loss))

    full = trainer.model.state_dict()
    moved = 0.0
    for name, value in reference.state_dict().items():
        step = (value - before[name]).abs().max().item()
        moved = max(moved, step)
        diff = (value - full[name]).abs().max().item()
        # Adam's first step is ~lr * sign(grad), which magnifies float noise in gradients
        # near zero; a real disagreement would move weights by a sizeable part of lr.
        assert diff <= 1e-2 * cfg.lr, f"{name}: {diff:.2e} vs step {step:.2e}"
    assert moved > 1e-5  # the update really moved the weights


COIN = """import random


def reward(task, answer):
    return random.random()  # every group disagrees, so every update has a gradient
"""


@pytest.mark.slow
def test_minimal_loop_runs_from_the_command_line(tmp_path: Path) -> None:
    # The CPU smoke path: `python -m tracerl.loop_minimal` with its own tiny model, 2 steps.
    (tmp_path / "coin.py").write_text(COIN)
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "tracerl.loop_minimal", "--out", str(out), "--steps", "2",
        "--tasks_per_step", "2", "--group_size", "2", "--lr", "1e-3",
        "--reward", f"{tmp_path / 'coin.py'}:reward",
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    steps = re.findall(r"step (\d+): reward (\S+) loss (\S+) version (\d+)", done.stdout)
    assert [(int(s), int(v)) for s, _, _, v in steps] == [(0, 1), (1, 2)]
    assert all(math.isfinite(float(loss)) for _, _, loss, _ in steps)

    store = SqliteStore(out / "traces.db")
    rollouts = store.rollouts()
    assert len(rollouts) == 2 * 2 * 2 and all(r.status == "succeeded" for r in rollouts)
    versions = {s.policy_version for r in rollouts for s in store.spans(r.id)}
    assert versions == {0, 1}  # the second step was sampled by the published update
    store.close()

    start = AutoModelForCausalLM.from_pretrained(out / "tiny-model").state_dict()
    trained = AutoModelForCausalLM.from_pretrained(out / "model").state_dict()
    moved = max((trained[k] - v).abs().max().item() for k, v in start.items())
    assert moved > 1e-5  # the two updates changed the weights that were saved
