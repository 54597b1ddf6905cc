"""SFT to a held-out target: the exact-match score, the holdout split, stopping at the target
and `tracerl sft --skill_target` saying when the cap came first."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console
from transformers import AutoModelForCausalLM

from tracerl.entrypoints.config import SftCommand
from tracerl.entrypoints.sft import main as sft_main
from tracerl.models import Demo, SftConfig, build_tiny_model, render_chat, sft
from tracerl.models.sft import EncodedDemo, SftResult, exact_match, split_holdout
from tracerl.precision import choose_precision
from tracerl.trainer.config import LoraSettings

COLORS = {"sky": "blue", "grass": "green", "snow": "white", "coal": "black"}
# Learnable in a few dozen steps: the answer depends on the question, from a small table.
DEMOS = [
    Demo(messages=[{"role": "user", "content": f"Color of {thing}?"},
                   {"role": "assistant", "content": color}])
    for _ in range(10) for thing, color in COLORS.items()
]  # fmt: skip
FAST = SftConfig(steps=30, batch_size=8, lr=3e-3, warmup=2, eval_every=5, progress=False)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    texts = [render_chat(d.messages, d.tools) for d in DEMOS]
    return build_tiny_model(tmp_path_factory.mktemp("base"), texts)


@torch.no_grad()
def test_exact_match_of_a_hand_built_case(base_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    ids = [5, 17, 42, 9]
    for _ in range(4):  # the greedy continuation: what teacher forcing must find
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    wrong = [*ids[:-1], (ids[-1] + 1) % model.config.vocab_size]
    mask = [False] * 4 + [True] * 4
    cases = [
        EncodedDemo(input_ids=ids, loss_mask=mask),  # copied: 1
        EncodedDemo(input_ids=wrong, loss_mask=mask),  # last assistant token differs: 0
        EncodedDemo(input_ids=wrong, loss_mask=[*mask[:-1], False]),  # differs off the mask: 1
        EncodedDemo(input_ids=ids[:6], loss_mask=mask[:6]),  # shorter, padded in the batch: 1
    ]
    assert exact_match(model, cases, pad_id=0, max_len=64) == 0.75
    assert exact_match(model, cases, pad_id=0, max_len=64, batch_size=1) == 0.75
    assert exact_match(model, cases[1:2], pad_id=0, max_len=7) == 1.0  # the wrong id cut off


def test_holdout_split_is_seeded_disjoint_and_never_empty() -> None:
    train, held = split_holdout(list(range(40)), 0.1, seed=3)
    assert len(held) == 4 and sorted(train + held) == list(range(40))
    assert split_holdout(list(range(40)), 0.1, seed=3) == (train, held)
    assert len(split_holdout([1, 2], 0.01, seed=0)[1]) == 1
    assert len(split_holdout([1, 2], 0.99, seed=0)[0]) == 1
    assert split_holdout([1, 2], 0.0, seed=0) == ([1, 2], [])


def test_a_model_trained_longer_copies_more_held_out_demos(base_dir: Path, tmp_path: Path) -> None:
    cfg = FAST.model_copy(update={"holdout": 0.2})
    result = sft(base_dir, DEMOS, tmp_path / "out", cfg)
    checks = result.held_out
    assert [c.step for c in checks] == [5, 10, 15, 20, 25, 30]
    assert result.target_reached is None and not result.stopped_early
    assert checks[0].exact_match < 0.5 < checks[-1].exact_match


def test_sft_stops_at_the_first_check_reaching_the_target(base_dir: Path, tmp_path: Path) -> None:
    cfg = FAST.model_copy(update={"steps": 200, "holdout": 0.2, "target": 0.5})
    result = sft(base_dir, DEMOS, tmp_path / "out", cfg)
    assert result.target_reached and result.stopped_early and result.steps < 200
    assert result.held_out[-1].step == result.steps and result.steps % 5 == 0
    assert result.held_out[-1].exact_match >= 0.5
    assert all(c.exact_match < 0.5 for c in result.held_out[:-1])
    with pytest.raises(ValueError, match="holdout"):
        sft(base_dir, DEMOS, tmp_path / "bad", FAST.model_copy(update={"target": 0.5}))


def test_cli_warns_when_the_cap_comes_before_the_target(base_dir: Path, tmp_path: Path) -> None:
    demos = tmp_path / "demos.jsonl"
    demos.write_text("".join(json.dumps(d.model_dump()) + "\n" for d in DEMOS))
    out = tmp_path / "weak"
    cfg = SftCommand(demos=str(demos), base=str(base_dir), out=str(out), steps=3,
                     recipe="skill-then-habit", habit_steps=2, skill_target=1.0, eval_every=2)  # fmt: skip
    console = Console(width=300, record=True)
    sft_main(cfg, console)
    text = console.export_text()
    assert "skill: held-out exact match 0.000 at 2, 0.000 at 3" in text
    assert "warning: skill: the 3-step cap came before the held-out target 1" in text
    assert "going on to the habit stage" in text
    assert f"habit: saved {out}: 2 steps" in text
    assert (out / "config.json").exists() and (tmp_path / "weak-skill" / "config.json").exists()
    skill = SftResult.model_validate_json((tmp_path / "weak-skill" / "sft.json").read_text())
    assert (skill.steps, skill.target_reached) == (3, False)
    assert [c.step for c in skill.held_out] == [2, 3]
    assert SftResult.model_validate_json((out / "sft.json").read_text()).steps == 2


def test_cli_holdout_without_a_target_scores_every_check_and_trains_every_step(
    base_dir: Path, tmp_path: Path
) -> None:
    """`--holdout` alone: the held-out score at each check in sft.json, no early stop."""
    demos = tmp_path / "demos.jsonl"
    demos.write_text("".join(json.dumps(d.model_dump()) + "\n" for d in DEMOS))
    out = tmp_path / "scored"
    cfg = SftCommand(demos=str(demos), base=str(base_dir), out=str(out), steps=4, lr=3e-3,
                     holdout=0.25, eval_every=2)  # fmt: skip
    console = Console(width=300, record=True)
    sft_main(cfg, console)
    result = SftResult.model_validate_json((out / "sft.json").read_text())
    assert (result.steps, result.target, result.target_reached) == (4, None, None)
    assert [c.step for c in result.held_out] == [2, 4]
    assert "sft: held-out exact match" in console.export_text()


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()


def test_an_interrupted_sft_resumes_to_the_same_weights(
    base_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed after its step-10 checkpoint, a resumed run ends where an uninterrupted run
    ends: same weights, losses and checks; a finished run is not trained again."""
    cfg = FAST.model_copy(update={"steps": 16, "holdout": 0.2, "checkpoint_every": 5})
    whole = sft(base_dir, DEMOS, tmp_path / "whole", cfg)
    sft_module = importlib.import_module("tracerl.models.sft")
    real_step, calls = sft_module._step, []

    def dying_step(*args: object, **kwargs: object) -> float:
        calls.append(1)
        if len(calls) == 13:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(sft_module, "_step", dying_step)
    with pytest.raises(KeyboardInterrupt):
        sft(base_dir, DEMOS, tmp_path / "cut", cfg)
    monkeypatch.setattr(sft_module, "_step", real_step)
    assert (tmp_path / "cut" / ".sft-checkpoint" / "state.json").exists()
    resumed = sft(base_dir, DEMOS, tmp_path / "cut", cfg, resume=True)
    assert resumed.resumed_at == 10 and resumed.steps == 16
    assert resumed.losses == whole.losses and resumed.held_out == whole.held_out
    a, b = _weights(tmp_path / "whole"), _weights(tmp_path / "cut")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not (tmp_path / "cut" / ".sft-checkpoint").exists()
    again = sft(base_dir, DEMOS, tmp_path / "cut", cfg, resume=True)
    assert again.losses == resumed.losses  # read back, not retrained
    with pytest.raises(ValueError, match="other settings.*lr"):
        sft(base_dir, DEMOS, tmp_path / "cut", cfg.model_copy(update={"lr": 1e-3}), resume=True)


def test_sft_says_its_plan_and_records_its_precision(base_dir: Path, tmp_path: Path) -> None:
    lines: list[str] = []
    cfg = FAST.model_copy(update={"steps": 12, "holdout": 0.2, "target": 1.0})
    result = sft(base_dir, DEMOS, tmp_path / "out", cfg, say=lines.append)
    text = "\n".join(lines)
    assert "32 examples trained on, 8 held out (scored every 5 steps)" in text
    assert "batch 8, until held-out exact match >= 1, at most 12 steps" in text
    assert "constant until the target (the 12-step cap does not shape it)" in text
    assert "precision: " in text and "s a step here" in text
    hardware = choose_precision("auto", "cpu")  # no model: the hardware alone
    assert result.precision_reason in text
    if hardware.bf16:  # native bf16: `auto` timed this model in both and says so
        assert "s in bf16" in result.precision_reason and "s in fp32" in result.precision_reason
    else:
        assert (result.precision, result.precision_reason) == ("fp32", hardware.line())
    saved = SftResult.model_validate_json((tmp_path / "out" / "sft.json").read_text())
    assert saved.precision == result.precision and saved.train_examples == 32


def test_reaching_the_target_starts_a_cooldown_then_a_last_check(
    base_dir: Path, tmp_path: Path
) -> None:
    """Constant rate until the target, then `cooldown` steps decaying to zero, a last check,
    and the same weights after an interruption inside the cooldown."""
    cfg = FAST.model_copy(update={"steps": 200, "holdout": 0.2, "target": 0.5, "cooldown": 7})
    result = sft(base_dir, DEMOS, tmp_path / "out", cfg)
    reached = next(c.step for c in result.held_out if c.exact_match >= 0.5)
    assert result.target_reached and result.steps == reached + 7
    assert result.held_out[-1].step == reached + 7  # the last check, after the cooldown
    assert all(c.step % 5 == 0 for c in result.held_out[:-1])
    sft_module = importlib.import_module("tracerl.models.sft")
    state = sft_module.SftState(cooldown_from=reached)
    factor = sft_module._lr_factor(cfg, state)
    assert factor(reached - 1) == 1.0 and factor(reached + 7) == 0.0
    assert factor(reached + 1) == pytest.approx(1 - 1 / 7)
    state.cooldown_from = None
    assert factor(150) == 1.0  # the cap does not shape the rate


def test_lora_sft_saves_a_plain_model_dir_and_its_adapter(base_dir: Path, tmp_path: Path) -> None:
    cfg = FAST.model_copy(update={"steps": 20, "lr": 5e-3, "lora": LoraSettings(r=4)})
    result = sft(base_dir, DEMOS, tmp_path / "out", cfg)
    assert result.losses[-1] < result.losses[0]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    assert not any("lora" in k for k in merged.state_dict())
    changed = [
        k for k, v in merged.state_dict().items() if not torch.equal(v, base.state_dict()[k])
    ]
    assert changed and all("proj" in k for k in changed)  # only adapted layers moved
    assert (tmp_path / "out" / "adapter" / "adapter_config.json").exists()
