"""The trainer: LoRA (adapter-only training, merged weights, peft files) and the KL term."""

from __future__ import annotations

import logging
import math
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tracerl.algorithms import GRPO, compute_advantages
from tracerl.algorithms.transitions import spans_to_transitions
from tracerl.trainer.config import LoraSettings, TrainerConfig
from tracerl.trainer.loss import LossConfig
from tracerl.trainer.trainer import Trainer
from tracerl.types import Span


def _rows(vocab: int) -> list:  # type: ignore[type-arg]
    rng = random.Random(0)
    rows = []
    for k in range(4):
        prompt = [rng.randrange(vocab) for _ in range(6)]
        completion = [rng.randrange(vocab) for _ in range(4)]
        span = Span(
            id=f"s{k}", rollout_id=f"r{k}", attempt=1, seq=0, role="policy", policy_version=0,
            prompt_ids=prompt, completion_ids=completion, logprobs=[-3.0] * 4,
        )  # fmt: skip
        rows += spans_to_transitions([span], float(k % 2), group_id="g", task_id="t")
    return compute_advantages(GRPO(), rows)


def test_lora_trains_adapter_and_publishes_merged_weights(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    cfg = TrainerConfig(lr=1e-2, bf16=False, lora=LoraSettings(r=4, alpha=8))
    trainer = Trainer(tiny_model_dir, cfg)
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    trainer.train(_rows(base.config.vocab_size))
    merged = trainer.engine_state_dict()
    assert set(merged) == set(base.state_dict())  # the engine's model loads it as is
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(merged[q], base.state_dict()[q])  # the adapter moved it
    emb = "model.embed_tokens.weight"
    assert torch.equal(merged[emb], base.state_dict()[emb])  # untouched outside adapters

    trainer.save_model(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").exists()
    from peft import PeftModel

    loaded = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).merge_and_unload()
    assert torch.allclose(loaded.state_dict()[q], merged[q], atol=1e-6)


def test_kl_to_reference_is_zero_at_start_and_grows(tiny_model_dir: Path) -> None:
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    rows = _rows(base.config.vocab_size)
    for lora in (None, LoraSettings(r=4, alpha=8)):
        loss = LossConfig(kl_coef=0.1)
        trainer = Trainer(tiny_model_dir, TrainerConfig(lr=1e-2, bf16=False, lora=lora, loss=loss))
        first = trainer.train(rows)
        second = trainer.train(rows)
        assert first.kl_reference is not None and abs(first.kl_reference) < 1e-6
        assert second.kl_reference is not None and second.kl_reference > 1e-6
    plain = Trainer(tiny_model_dir, TrainerConfig(bf16=False)).train(rows)
    assert plain.kl_reference is None


def _greedy_then_sampled(task: dict, *, base_url: str, api_key: str, model: str) -> str:
    """An agent whose first call is greedy (as evaluators and agents often ask) and whose
    second samples at temperature 1."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages: list = [{"role": "user", "content": task["question"]}]
    first = client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=12
    )
    messages += [{"role": "assistant", "content": first.choices[0].message.content or ""}]
    messages += [{"role": "user", "content": "and again?"}]
    second = client.chat.completions.create(model=model, messages=messages, max_tokens=12)
    return second.choices[0].message.content or ""


def test_greedy_calls_mixed_into_training_data_train_with_finite_loss(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Spans recorded at temperature 0 (greedy: the engine records log-probs at T = 1)
    -> rows -> one trainer step: the loss is finite and the weights move, none to NaN."""
    from concurrent.futures import ThreadPoolExecutor

    from tracerl.agents import python_agent
    from tracerl.algorithms.rows import rows_for
    from tracerl.evaluate import run_rollouts
    from tracerl.pipeline.sources import read_finished
    from tracerl.stack import start_stack
    from tracerl.types import Group, Task

    tasks = [Task(id=f"t{i}", input={"question": f"What is {i}+{i}?"}) for i in range(3)]
    stack = start_stack(tiny_model_dir, tmp_path / "traces.db")
    try:
        with ThreadPoolExecutor(8) as threads:
            rollouts = run_rollouts(
                stack.store, stack.url, python_agent(_greedy_then_sampled, threads),
                lambda task, answer: len(answer) / 10, tasks, repeats=3, group_id="g",
            )  # fmt: skip
        finished = [read_finished(stack.store, r) for r in rollouts]
    finally:
        stack.close()
    assert {s.temperature for f in finished for s in f.spans} == {0.0, 1.0}
    by_task = {t.id: Group(id=f"g-{t.id}", task=t, rollouts=[]) for t in tasks}
    groups = [
        g.model_copy(update={"rollouts": [f for f in finished if f.rollout.task_id == tid]})
        for tid, g in by_task.items()
    ]
    rows = rows_for(groups, GRPO())
    assert any(any(a != 0 for a in r.advantages) for r in rows)

    trainer = Trainer(tiny_model_dir, TrainerConfig(lr=1e-2, bf16=False))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    metrics = trainer.train(rows)
    assert math.isfinite(metrics.loss) and metrics.nonfinite_steps == 0
    after = trainer.model.state_dict()
    assert all(torch.isfinite(v).all() for v in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_a_non_finite_loss_never_reaches_the_optimizer(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A step whose loss is NaN (a corrupt advantage here; a NaN behaviour log-prob means
    unknown, and is weighted as the proximal policy's) is skipped, counted and warned about;
    the weights and the optimizer are left as they were."""
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    rows = _rows(base.config.vocab_size)
    bad = rows[1]
    k = bad.loss_mask.index(1)
    poisoned = bad.model_copy(
        update={"advantages": [*bad.advantages[:k], math.nan, *bad.advantages[k + 1 :]]}
    )
    trainer = Trainer(tiny_model_dir, TrainerConfig(lr=1e-2, bf16=False))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with caplog.at_level(logging.WARNING, logger="tracerl.trainer"):
        metrics = trainer.train([rows[0], poisoned, *rows[2:]])
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a NaN step moved weights"
    assert not trainer.optimizer.state and trainer.scheduler.last_epoch == 0
    assert metrics.nonfinite_steps == 1 and metrics.optimizer_steps == 0
    assert math.isfinite(metrics.loss) and "not finite" in caplog.text
    # The next clean batch trains as usual.
    assert trainer.train(rows).optimizer_steps == 1
