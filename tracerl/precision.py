"""Which arithmetic training runs in: bf16 autocast only where the hardware does bf16 natively.

bf16 autocast is a win only on hardware with bf16 arithmetic: a CUDA device that supports
it, or a CPU with AVX512-BF16 or AMX tiles. Elsewhere torch emulates it, and on an AVX2 CPU
that was measured 80x slower per matmul and ~30x slower per SFT step than fp32 (one 2-core
machine of the same kind: 10-12 s a step against 0.25-0.4 s). So every place that trains
takes a setting `auto | true | false`, and `auto` asks the hardware, never a machine someone
measured once. The choice is printed once per command and recorded with its outputs
(`sft.json`, `summary.json`).

The setting type is torch-free (configs import it); the hardware is asked lazily.
"""

from __future__ import annotations

import functools
import warnings
from typing import Literal

from pydantic import BaseModel, ConfigDict

__all__ = ["Bf16Setting", "Precision", "choose_precision", "native_bf16", "use_bf16"]

Bf16Setting = Literal["auto"] | bool
"""bf16 autocast: 'auto' (where the hardware has native bf16), true (always), false (fp32)."""


class Precision(BaseModel):
    """The arithmetic one trainer or SFT run uses, and why."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    bf16: bool
    """Whether forward/backward run under bf16 autocast (weights and log-probs stay fp32)."""
    setting: str
    """What was asked: 'auto', 'true' or 'false'."""
    device: str
    """The device trained on."""
    hardware: str
    """What the device offers, e.g. 'CPU has AVX2 only' or 'CPU has AVX512-BF16'."""
    emulated: bool
    """bf16 was forced on hardware that only emulates it (slow: see `line`)."""

    @property
    def name(self) -> str:
        """'bf16' or 'fp32', as summaries record it."""
        return "bf16" if self.bf16 else "fp32"

    def line(self) -> str:
        """The one line a command prints, e.g. 'precision: fp32 (CPU has AVX2 only; bf16
        would be emulated)'."""
        if self.emulated:
            return (
                f"precision: bf16 as asked, but {self.hardware}: bf16 is emulated there, "
                "many times slower than fp32 (--bf16 auto picks fp32 here)"
            )
        if self.bf16:
            return f"precision: bf16 autocast ({self.hardware})"
        why = "bf16 would be emulated" if self.setting == "auto" else "bf16 off as asked"
        return f"precision: fp32 ({self.hardware}; {why})"


@functools.cache
def native_bf16(device: str) -> tuple[bool, str]:
    """(whether `device` computes bf16 natively, what it has in words)."""
    import torch

    kind = torch.device(device).type
    if kind == "cuda":
        ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        name = torch.cuda.get_device_name(torch.device(device)) if ok else "CUDA device"
        return ok, f"{name} {'supports' if ok else 'lacks'} bf16"
    if kind != "cpu":
        return False, f"{kind} device, bf16 not known to be native"
    if torch.cpu._is_amx_tile_supported():
        return True, "CPU has AMX"
    if torch.cpu._is_avx512_bf16_supported():
        return True, "CPU has AVX512-BF16"
    return False, f"CPU has {torch.backends.cpu.get_cpu_capability()} only"


def choose_precision(setting: Bf16Setting, device: str = "cpu") -> Precision:
    """The precision `setting` means on `device` (warns when bf16 is forced but emulated)."""
    native, hardware = native_bf16(device)
    bf16 = native if setting == "auto" else bool(setting)
    precision = Precision(
        bf16=bf16,
        setting=str(setting).lower(),
        device=str(device),
        hardware=hardware,
        emulated=bf16 and not native,
    )
    if precision.emulated:
        warnings.warn(precision.line(), stacklevel=2)
    return precision


def use_bf16(setting: Bf16Setting, device: object) -> bool:
    """Whether to autocast to bf16 on `device` (a name or torch.device): 'auto' asks the
    hardware (once per device), true and false are obeyed."""
    return native_bf16(str(device))[0] if setting == "auto" else bool(setting)
