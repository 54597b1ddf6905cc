"""Precision from the hardware: bf16 autocast only where it is native, fp32 elsewhere, and the
choice said and recorded."""

from __future__ import annotations

import pytest
import torch

from tracerl import precision
from tracerl.precision import choose_precision, native_bf16, use_bf16
from tracerl.trainer.config import TrainerConfig


@pytest.fixture
def cpu(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Pretend the CPU has (or lacks) native bf16."""

    def pretend(amx: bool, avx512_bf16: bool, capability: str) -> None:
        native_bf16.cache_clear()
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)

    yield pretend
    native_bf16.cache_clear()


def test_auto_is_fp32_on_an_avx2_cpu_and_says_why(cpu) -> None:  # type: ignore[no-untyped-def]
    cpu(False, False, "AVX2")
    chosen = choose_precision("auto", "cpu")
    assert (chosen.bf16, chosen.name, chosen.emulated) == (False, "fp32", False)
    assert chosen.line() == "precision: fp32 (CPU has AVX2 only; bf16 would be emulated)"
    assert use_bf16("auto", "cpu") is False and use_bf16(True, "cpu") is True


def test_auto_is_bf16_where_the_cpu_has_it(cpu) -> None:  # type: ignore[no-untyped-def]
    cpu(False, True, "AVX512")
    assert choose_precision("auto").line() == "precision: bf16 autocast (CPU has AVX512-BF16)"
    cpu(True, False, "AVX512")
    assert choose_precision("auto").bf16 and use_bf16("auto", torch.device("cpu"))
    assert choose_precision(False).line() == "precision: fp32 (CPU has AMX; bf16 off as asked)"


def test_bf16_forced_on_emulating_hardware_warns(cpu) -> None:  # type: ignore[no-untyped-def]
    cpu(False, False, "AVX2")
    with pytest.warns(UserWarning, match="emulated there"):
        chosen = choose_precision(True)
    assert chosen.bf16 and chosen.emulated


def test_every_config_that_trains_defaults_to_auto() -> None:
    from tracerl.entrypoints.config import SftCommand
    from tracerl.models.sft import SftConfig

    assert TrainerConfig().bf16 == SftConfig().bf16 == "auto"
    assert SftCommand(out="x").bf16 == "auto"
    assert TrainerConfig(bf16="false").bf16 is False  # a flag's text parses as a bool
    assert precision.Precision.model_fields["bf16"].annotation is bool


def timings(fp32_s: float, bf16_s: float):  # type: ignore[no-untyped-def]
    """A probe that takes `fp32_s` or `bf16_s` seconds (by the clock the chooser reads)."""
    clock = [0.0]
    calls: list[bool] = []

    def probe(bf16: bool) -> None:
        calls.append(bf16)
        clock[0] += bf16_s if bf16 else fp32_s

    return probe, clock, calls


@pytest.mark.parametrize(
    ("fp32_s", "bf16_s", "bf16"),
    [(0.09, 0.11, False), (0.10, 0.088, False), (0.20, 0.05, True)],
    ids=["bf16-slower", "near-tie-keeps-fp32", "bf16-faster"],
)
def test_auto_on_native_hardware_times_the_model_and_keeps_the_faster(  # type: ignore[no-untyped-def]
    cpu, monkeypatch: pytest.MonkeyPatch, fp32_s: float, bf16_s: float, bf16: bool
) -> None:
    """Native bf16 is not enough: a small model can be slower in bf16 (the demo's model on a
    CPU with AMX: 0.86x fp32). `auto` keeps bf16 only when it is clearly faster."""
    cpu(True, True, "AVX512")
    probe, clock, calls = timings(fp32_s, bf16_s)
    monkeypatch.setattr(precision.time, "perf_counter", lambda: clock[0])
    chosen = choose_precision("auto", "cpu", probe)
    assert chosen.bf16 is bf16 and not chosen.emulated
    assert (chosen.step_s_fp32, chosen.step_s_bf16) == pytest.approx((fp32_s, bf16_s))
    assert calls.count(True) == calls.count(False) == 1 + precision.PROBE_ROUNDS
    timed = f"a step {bf16_s:.3g} s in bf16, {fp32_s:.3g} s in fp32"
    if bf16:
        assert chosen.line() == f"precision: bf16 autocast (CPU has AMX; {timed})"
    else:
        assert chosen.line() == (
            f"precision: fp32 (CPU has AMX, but bf16 is not clearly faster on this model; {timed})"
        )


def test_a_probe_runs_only_where_auto_has_a_choice(cpu) -> None:  # type: ignore[no-untyped-def]
    probe, _, calls = timings(0.1, 0.1)
    cpu(False, False, "AVX2")  # emulated bf16: fp32 without timing anything
    assert choose_precision("auto", "cpu", probe).line().startswith("precision: fp32 (CPU has")
    cpu(True, True, "AVX512")
    assert (
        choose_precision(True, "cpu", probe).bf16 and not choose_precision(False, "cpu", probe).bf16
    )
    assert calls == []


def test_a_probe_pass_leaves_no_gradient_and_no_rng_draw() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
        attention_dropout=0.5,
    )  # fmt: skip
    model = LlamaForCausalLM(config).train()
    ids = torch.randint(0, 64, (2, 16))

    def backward(bf16: bool) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            model(input_ids=ids, labels=ids).loss.backward()

    probe = precision.probe_pass(model, backward)
    torch.manual_seed(7)
    before = torch.get_rng_state()
    for bf16 in (False, True):
        probe(bf16)
    assert torch.equal(torch.get_rng_state(), before)  # dropout's draws given back
    assert all(p.grad is None for p in model.parameters())
    assert precision.probe_rows(model, 16, 16) == 16  # a small pass: every row
    assert precision.probe_rows(model, 16, 10**9) == 1  # too much work: one row


def test_the_demo_recipe_builds_its_start_in_the_precision_asked(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """`--recipe.bf16 true` builds both stages in bf16, cached apart from the `auto` start."""
    import importlib

    from tracerl.demo import CalculatorRecipe, _build_calculator_model

    # The package exports functions of the same names as these modules: import them by path.
    sft_module = importlib.import_module("tracerl.models.sft")
    tiny_module = importlib.import_module("tracerl.models.tiny")
    seen: list[object] = []
    monkeypatch.setattr(tiny_module, "build_tiny_model", lambda *a, **k: None)
    monkeypatch.setattr(sft_module, "sft", lambda base, demos, out, cfg, **k: seen.append(cfg.bf16))
    recipe = CalculatorRecipe(demos=8, bf16=True)
    assert recipe.name() != CalculatorRecipe(demos=8).name() and recipe.name().endswith("-bf16")
    assert CalculatorRecipe(bf16=False).skill_name().endswith("-fp32")
    _build_calculator_model(recipe, tmp_path, tmp_path / recipe.name(), rebuild=True)
    assert seen == [True, True]  # the skill stage, then the habit stage


def test_the_trainer_times_its_own_loss_on_sample_rows(  # type: ignore[no-untyped-def]
    cpu, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """On native hardware the trainer's `auto` runs `loss_and_grads` (its own step's code) in
    both precisions on sample rows, leaves no gradient, and records what it measured."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import tracerl.trainer.trainer as trainer_module
    from tracerl.trainer.gradients import loss_and_grads

    cpu(True, True, "AVX512")
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    asked: list[bool] = []

    def spy(model, rows, cfg, **kw):  # type: ignore[no-untyped-def]
        asked.append(cfg.bf16)
        assert all(len(r.input_ids) == 128 for r in rows)  # capped at the model's positions
        return loss_and_grads(model, rows, cfg, **kw)

    monkeypatch.setattr(trainer_module, "loss_and_grads", spy)
    trainer = trainer_module.Trainer(tmp_path, TrainerConfig(), "cpu")
    assert sorted(set(asked)) == [False, True] and len(asked) == 2 * (1 + precision.PROBE_ROUNDS)
    assert trainer.precision.step_s_fp32 and trainer.precision.step_s_bf16
    assert trainer.cfg.bf16 is trainer.precision.bf16
    assert all(p.grad is None for p in trainer.model.parameters())
