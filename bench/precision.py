"""The precision `auto` chooses on this machine, and SFT speed in fp32, bf16 and that choice.

bf16 autocast pays only where the hardware computes bf16 (AVX512-BF16, AMX, a CUDA GPU that
supports it); on an AVX2-only CPU torch emulates it, many times slower than fp32. This bench
times the demo's skill SFT (the tiny calculator model, batch 16, the demo's lr) for a few
steps in fp32, in bf16 and under `auto`, in one process on the same data, and reports what
`auto` chose there (on native hardware it times the model in both precisions first: a small
model can be slower in bf16 even on a CPU with AMX). bf16 runs fewer steps where it is
emulated (a step takes seconds there).
Prints a line per precision, then one JSON line: `chosen` must never be slower than fp32.
Usage: python bench/precision.py [steps]   (default 20; a few minutes on an AVX2 CPU)
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from tracerl.demo import calculator_demos
from tracerl.models import SftConfig, SftResult, build_tiny_model, render_chat, sft
from tracerl.precision import Bf16Setting, choose_precision


def steps_per_s(
    base: Path, demos: list, out: Path, bf16: Bf16Setting, steps: int
) -> tuple[float, SftResult]:
    """Optimizer steps per second of `steps` SFT steps after two untimed warm-up steps (the
    training loop's time: `auto`'s probe is not in it), and the timed run's result."""
    warm = SftConfig(steps=2, bf16=bf16, progress=False, checkpoint_every=0)
    sft(base, demos, out / "warm", warm)
    cfg = SftConfig(steps=steps, bf16=bf16, progress=False, checkpoint_every=0)
    start = time.perf_counter()
    result = sft(base, demos, out / "timed", cfg)
    wall = result.wall_s or (time.perf_counter() - start)
    return result.steps / wall, result


def main(steps: int) -> None:
    hardware = choose_precision("auto", "cpu")  # the hardware alone, before timing a model
    demos = calculator_demos(400, seed=1000)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base = build_tiny_model(work / "base", [render_chat(d.messages, d.tools) for d in demos])
        # fp32 and auto alternate, best of two each: the machine is shared and noisy.
        fp32 = auto = 0.0
        for i in range(2):
            fp32 = max(fp32, steps_per_s(base, demos, work / f"fp32-{i}", False, steps)[0])
            speed, chosen = steps_per_s(base, demos, work / f"auto-{i}", "auto", steps)
            auto = max(auto, speed)
        print(chosen.precision_reason)
        # Emulated bf16 takes seconds a step: a few steps tell its speed.
        bf16_steps = steps if hardware.bf16 else max(2, steps // 10)
        bf16 = steps_per_s(base, demos, work / "bf16", True, bf16_steps)[0]
    for name, value in (("fp32", fp32), ("bf16", bf16), (f"auto ({chosen.precision})", auto)):
        print(f"sft steps/s {name:12s} {value:7.2f}  ({1 / value:.2f} s a step)")
    row = {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "hardware": hardware.hardware,
        "chosen": chosen.precision,
        "sft_steps_per_s_chosen": round(auto, 3),
        "sft_steps_per_s_fp32": round(fp32, 3),
        "sft_steps_per_s_bf16": round(bf16, 3),
        "chosen_over_fp32": round(auto / fp32, 2),
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(row))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
