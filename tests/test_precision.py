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
