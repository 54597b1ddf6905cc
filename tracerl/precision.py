"""Which arithmetic training runs in: bf16 autocast only where the hardware does bf16 natively.

bf16 autocast is a win only on hardware with bf16 arithmetic: a CUDA device that supports
it, or a CPU with AVX512-BF16 or AMX tiles. Elsewhere torch emulates it, and on an AVX2 CPU
that was measured 80x slower per matmul and ~30x slower per SFT step than fp32 (one 2-core
machine of the same kind: 10-12 s a step against 0.25-0.4 s). So every place that trains
takes a setting `auto | true | false`, and `auto` asks the hardware, never a machine someone
measured once. The choice is printed once per command and recorded with its outputs
(`sft.json`, `summary.json`).

Native is not enough: autocast casts every weight and activation, and on a small model those
casts cost more than the bf16 matmuls save (the demo's 1.8M-parameter model on a CPU with AMX:
0.86x fp32's speed). So where the caller hands over a probe, `auto` on native hardware also
times a few forward+backward passes of its own training code on a sample batch in each
precision and keeps bf16 only when it is clearly faster; near a tie it keeps fp32, the exact
arithmetic. (A generic pass of the model's own loss is no stand-in: on the demo's model it
said bf16 was 15% faster, the SFT loop's own pass 14% slower.) A run that must not depend
on a measurement sets true or false.

The setting type is torch-free (configs import it); the hardware is asked lazily.
"""

from __future__ import annotations

import functools
import statistics
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    import torch

__all__ = [
    "Bf16Setting",
    "Precision",
    "choose_precision",
    "native_bf16",
    "probe_pass",
    "probe_rows",
    "use_bf16",
]

BF16_MARGIN = 0.7
"""`auto` keeps bf16 only when a measured step takes at most this share of fp32's time: a
clear win (SmolLM2's SFT on an AMX CPU: 0.57), not a near tie that the machine's load moves
(the demo's model in the RL trainer on that CPU: 0.83 quiet, 0.72-0.75 beside other jobs),
which keeps the exact arithmetic."""
PROBE_ROUNDS = 3
"""Timed passes in each precision (after one untimed warm-up each); the median counts."""
PROBE_FLOPS = 2e10
"""Most work of one probe pass (6 x parameters x tokens), so that timing both precisions
costs seconds, not minutes: 12 rows of the demo's SFT batch of 16, 3 of the trainer's 16
rows of 512 tokens on the demo's model, one row on SmolLM2. A smaller pass favours bf16 less,
so a cut probe errs towards fp32."""

Probe = Callable[[bool], None]
"""One forward+backward pass of the model to be trained, under bf16 autocast when True."""

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
    step_s_fp32: float | None = None
    """Seconds of one probe pass in fp32, when `auto` timed the model (else None)."""
    step_s_bf16: float | None = None
    """Seconds of the same pass under bf16 autocast, when `auto` timed the model."""

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
        timed = self._timed()
        if self.bf16:
            return f"precision: bf16 autocast ({self.hardware}{timed})"
        if timed:
            return f"precision: fp32 ({self.hardware}, but bf16 is not clearly faster on this model{timed})"
        why = "bf16 would be emulated" if self.setting == "auto" else "bf16 off as asked"
        return f"precision: fp32 ({self.hardware}; {why})"

    def _timed(self) -> str:
        """'; a step 0.11 s in bf16, 0.09 s in fp32' when `auto` measured, else ''."""
        if self.step_s_bf16 is None or self.step_s_fp32 is None:
            return ""
        return f"; a step {self.step_s_bf16:.3g} s in bf16, {self.step_s_fp32:.3g} s in fp32"


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


def choose_precision(
    setting: Bf16Setting, device: str = "cpu", probe: Probe | None = None
) -> Precision:
    """The precision `setting` means on `device` (warns when bf16 is forced but emulated).
    With `probe` (see `probe_pass`), `auto` on native hardware times the training step in both
    precisions and keeps bf16 only when it is clearly faster."""
    native, hardware = native_bf16(device)
    bf16 = native if setting == "auto" else bool(setting)
    fp32_s = bf16_s = None
    if setting == "auto" and native and probe is not None:
        fp32_s, bf16_s = _time_both(probe, str(device))
        bf16 = bf16_s <= BF16_MARGIN * fp32_s
    precision = Precision(
        bf16=bf16,
        setting=str(setting).lower(),
        device=str(device),
        hardware=hardware,
        emulated=bf16 and not native,
        step_s_fp32=fp32_s,
        step_s_bf16=bf16_s,
    )
    if precision.emulated:
        warnings.warn(precision.line(), stacklevel=2)
    return precision


def _time_both(probe: Probe, device: str) -> tuple[float, float]:
    """Median seconds of `probe` in fp32 and in bf16, alternating so that a load on the
    machine falls on both alike."""
    import torch

    def once(bf16: bool) -> float:
        start = time.perf_counter()
        probe(bf16)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    once(False), once(True)  # warm-up: first-call allocations and kernel choice
    runs: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(PROBE_ROUNDS):
        for bf16 in (False, True):
            runs[bf16].append(once(bf16))
    return statistics.median(runs[False]), statistics.median(runs[True])


def probe_rows(model: torch.nn.Module, rows: int, seq: int) -> int:
    """`rows`, or fewer (at least one) where a pass of `rows` x `seq` tokens through `model`
    would exceed PROBE_FLOPS."""
    params = sum(p.numel() for p in model.parameters())
    return max(1, min(rows, int(PROBE_FLOPS / (6 * params * max(seq, 1)))))


def probe_pass(model: torch.nn.Module, backward: Probe) -> Probe:
    """A `Probe` from `backward(bf16)`, the caller's own forward and backward pass of a sample
    batch (the same code its training steps run, so the timing is theirs): it leaves no
    gradient behind and does not move the global RNG (dropout draws are given back)."""
    import torch

    device = next(model.parameters()).device
    devices = [device] if device.type == "cuda" else []

    def probe(bf16: bool) -> None:
        with torch.random.fork_rng(devices=devices):
            backward(bf16)
        model.zero_grad(set_to_none=True)

    return probe


def use_bf16(setting: Bf16Setting, device: object) -> bool:
    """Whether to autocast to bf16 on `device` (a name or torch.device): 'auto' asks the
    hardware (once per device), true and false are obeyed."""
    return native_bf16(str(device))[0] if setting == "auto" else bool(setting)
