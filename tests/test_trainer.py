"""The trainer: LoRA (adapter-only training, merged weights, peft files) and the KL term."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tracerl.algorithms import GRPO, compute_advantages
from tracerl.algorithms.transitions import spans_to_transitions
from tracerl.trainer.loss import LossConfig
from tracerl.trainer.trainer import LoraSettings, Trainer, TrainerConfig
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
