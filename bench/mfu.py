"""Trainer model-FLOPs utilisation on this CPU: forward+backward FLOP/s over measured matmul peak.

Peak: large square torch matmuls in this process (fp32 and bf16, several sizes, best of
several runs, measured before and after the trainer runs and the best kept), with the same
thread count as the trainer. This CPU has AMX-BF16, so the bf16 peak is ~10x the fp32 one.

Trainer: `Trainer.train` (one optimizer step: no separate proximal pass) on rows of
calculator length (uniform 100-300 tokens, ~half of them sampled), for the tiny model
(hidden 192, 4 layers) and a ~20M-parameter Llama (hidden 512, 8 layers, 8 heads, SwiGLU
1024), both with the tiny model's tokenizer (vocab ~400). A warm-up step on a quarter of
the rows comes first; the fastest of the timed steps is kept, as for the peak. MFU compares
like with like: the trainer's default bf16 autocast against the bf16 peak (`mfu_tiny`,
`mfu_20m`), and bf16 off against the fp32 peak (`*_fp32`). The machine is shared, so each
MFU is also given per CPU second (`mfu_cpu_*`: model FLOPs per second of process CPU time
over the matmul's FLOPs per CPU second), which discounts the time other processes held the
cores; `cpu_share` says how much of the cores the step got.

Model FLOPs of a step (padding excluded, as the tokens/s the trainer reports):
  6 * N_mm * n  +  6 * L * d * n * (n + 1)      per row of n tokens
N_mm = weights of every Linear, the output head included (a tied head is still a
[d, V] matmul) and the embedding lookup excluded; the second term is causal attention
(QK^T and AV: 4*d FLOPs per query-key pair and layer forward, x3 for forward+backward,
n(n+1)/2 pairs). Norms, activations, rotary, softmax and the loss are not counted.

Where the time goes (`breakdown`): one micro-batch timed stage by stage inside the trainer's
own step (`loss_and_grads` reports the end of each stage): forward (autocast),
token_logprobs, policy_loss, backward, then `Trainer.apply_gradients` (clip + AdamW).
Experiments: a 16k-token micro-batch budget (tiny model); one thread instead of two (both
models), rated against one core's peak.
`--profile` prints torch.profiler's top operators; `--compile` also times the trainer with
the model wrapped by torch.compile (compilation takes minutes here, so it is opt-in).
The last line printed is one JSON object (MfuReport).

    .venv/bin/python bench/mfu.py [--threads 2 --profile --compile]

Runs with OMP_WAIT_POLICY=PASSIVE unless the caller sets it (see `tracerl.ensure_passive_omp`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
from pydantic import BaseModel, ConfigDict
from transformers import PreTrainedModel
from transformers.utils import logging as hf_logging

from tracerl import ensure_passive_omp
from tracerl.models import TinyModelConfig, build_tiny_model, render_chat
from tracerl.trainer.gradients import loss_and_grads
from tracerl.trainer.packing import pack
from tracerl.trainer.trainer import Trainer, TrainerConfig
from tracerl.types import Transition

CALC = Path(__file__).resolve().parent.parent / "examples" / "calculator"
sys.path.insert(0, str(CALC))
from expert import demonstrations  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trainer_rows  # noqa: E402

TINY = TinyModelConfig()
M20 = TinyModelConfig(hidden_size=512, num_layers=8, num_heads=8, intermediate_size=1024)


class MfuConfig(BaseModel):
    """What to measure; every field is also a --flag."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    rows_tiny: int = 64
    """Rows per step for the tiny model (~13k tokens)."""
    rows_20m: int = 16
    """Rows per step for the 20M model (~3.2k tokens; a step takes seconds)."""
    min_len: int = 100
    """Shortest row."""
    max_len: int = 300
    """Longest row."""
    micro_batch_tokens: int = 8192
    """Trainer micro-batch budget (TrainerConfig's default)."""
    big_micro_batch_tokens: int = 16384
    """Second budget tried on the tiny model (bf16), to see if bigger batches help."""
    steps: int = 2
    """Timed steps per measurement (after one warm-up); the fastest is kept."""
    peak_sizes: str = "1024,2048"
    """Square matmul sizes tried for the peak."""
    threads: int = 2
    """torch threads (trainer and peak alike)."""
    profile: bool = False
    """Print torch.profiler's top operators for one tiny-model micro-batch (bf16)."""
    compile: bool = False
    """Also time the trainer with torch.compile(model) (minutes to compile here)."""
    seed: int = 0
    """Seed of the rows."""


class Timing(BaseModel):
    """One trainer configuration measured (its fastest step)."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    name: str
    """Which model and setting."""
    bf16: bool
    """Whether bf16 autocast was on."""
    threads: int
    """torch threads of the run; a 1-thread run is rated against one core's peak (the
    peak per CPU second)."""
    tokens_per_s: float
    """Non-padding tokens per wall second."""
    gflops: float
    """Model GFLOP per wall second."""
    gflops_per_cpu_s: float
    """Model GFLOP per second of process CPU time (fastest step by CPU time)."""
    mfu: float = 0.0
    """gflops over the matching peak (bf16 or fp32); rated once the peaks are final."""
    mfu_cpu: float = 0.0
    """gflops_per_cpu_s over the matching peak's gflops_per_cpu_s."""
    cpu_share: float
    """CPU time / (wall time x threads) of the fastest step: below 1, other processes had
    the cores (or threads waited on each other)."""
    step_s: float
    """Wall time of the fastest step."""


class Breakdown(BaseModel):
    """One micro-batch, stage by stage (wall seconds); the optimizer runs once per step."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    forward_s: float
    """Model forward under autocast, to logits."""
    logprobs_s: float
    """token_logprobs (fp32 log-softmax over the vocabulary)."""
    loss_s: float
    """policy_loss and its metrics."""
    backward_s: float
    """loss.backward()."""
    optimizer_s: float
    """Gradient clipping and the AdamW step."""
    model_gflop: float
    """Model GFLOP of the micro-batch (padding excluded)."""
    matmul_share: float = 0.0
    """model_gflop at the bf16 peak / the forward..backward wall time: the share of that
    time the matmuls would need at peak; rated once the peaks are final."""


class MfuReport(BaseModel):
    """The bench's result, printed as the last line."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    mfu_tiny: float
    """Tiny model, trainer default (bf16 autocast), over the bf16 peak (wall time)."""
    mfu_20m: float
    """20M model, trainer default (bf16 autocast), over the bf16 peak (wall time)."""
    peak_fp32_gflops: float
    """Best fp32 square matmul GFLOP/s."""
    peak_bf16_gflops: float
    """Best bf16 square matmul GFLOP/s."""
    tokens_per_s_tiny: float
    """Tiny model, bf16 autocast."""
    tokens_per_s_20m: float
    """20M model, bf16 autocast."""
    mfu_cpu_tiny: float
    """As mfu_tiny, in GFLOP per CPU second on both sides (less sensitive to load)."""
    mfu_cpu_20m: float
    """As mfu_20m, in GFLOP per CPU second on both sides."""
    peak_fp32_gflops_per_cpu_s: float
    """Best fp32 matmul GFLOP per CPU second (about one core's peak)."""
    peak_bf16_gflops_per_cpu_s: float
    """Best bf16 matmul GFLOP per CPU second."""
    mfu_tiny_fp32: float
    """Tiny model, bf16 off, over the fp32 peak."""
    mfu_20m_fp32: float
    """20M model, bf16 off, over the fp32 peak."""
    tokens_per_s_tiny_fp32: float
    """Tiny model, bf16 off."""
    tokens_per_s_20m_fp32: float
    """20M model, bf16 off."""
    mfu_tiny_big_batch: float
    """Tiny model, bf16, with big_micro_batch_tokens."""
    mfu_tiny_1thread: float
    """Tiny model, bf16, one thread, over one core's bf16 peak."""
    tokens_per_s_tiny_1thread: float
    """Tiny model, bf16, one thread."""
    mfu_20m_1thread: float
    """20M model, bf16, one thread, over one core's bf16 peak."""
    tokens_per_s_20m_1thread: float
    """20M model, bf16, one thread."""
    mfu_tiny_compiled: float | None
    """Tiny model, bf16, torch.compile'd model (None unless --compile)."""
    mfu_20m_compiled: float | None
    """20M model, bf16, torch.compile'd model (None unless --compile)."""
    params_tiny: int
    """All parameters of the tiny model (tied head counted once)."""
    params_20m: int
    """All parameters of the 20M model."""
    matmul_params_tiny: int
    """N_mm of the tiny model (Linear weights, head included)."""
    matmul_params_20m: int
    """N_mm of the 20M model."""
    breakdown_tiny: Breakdown
    """Tiny model, bf16, one micro-batch."""
    breakdown_20m: Breakdown
    """20M model, bf16, one micro-batch."""
    timings: list[Timing]
    """Every trainer measurement."""
    threads: int
    """torch threads."""
    load_avg_1m: float
    """1-minute load average at the end (the machine is shared: > threads means noise)."""
    omp_wait_policy: str
    """OMP_WAIT_POLICY of the run (see `tracerl.ensure_passive_omp`)."""


# ---------------------------------------------------------------- peak


class Peak(BaseModel):
    """Best square-matmul speed of one dtype."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    gflops: float
    """Best GFLOP/s of wall time."""
    gflops_per_cpu_s: float
    """Best GFLOP per second of process CPU time (all threads summed): the speed while
    the threads actually run, much less sensitive to other processes on the machine."""

    def best(self, other: Peak) -> Peak:
        return Peak(
            gflops=max(self.gflops, other.gflops),
            gflops_per_cpu_s=max(self.gflops_per_cpu_s, other.gflops_per_cpu_s),
        )


def matmul_peak(dtype: torch.dtype, sizes: list[int], reps: int = 5) -> Peak:
    """Best speed of n x n @ n x n over sizes and repetitions."""
    wall, cpu = 0.0, 0.0
    for n in sizes:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        a @ b  # warm-up: kernel selection, page faults
        for _ in range(reps):
            w, c = time.perf_counter(), time.process_time()
            a @ b
            wall = max(wall, 2 * n**3 / (time.perf_counter() - w) / 1e9)
            cpu = max(cpu, 2 * n**3 / max(time.process_time() - c, 1e-6) / 1e9)
    return Peak(gflops=wall, gflops_per_cpu_s=cpu)


# ---------------------------------------------------------------- rows and FLOPs


def calculator_rows(rng: random.Random, n: int, cfg: MfuConfig, vocab: int) -> list[Transition]:
    """Rows of calculator length, each weighted 1 / its sampled tokens."""
    return trainer_rows.calculator_rows(
        rng, n, vocab, lambda mask: 1.0 / max(1, sum(mask)), cfg.min_len, cfg.max_len
    )


def matmul_params(model: PreTrainedModel) -> int:
    """Weights of every Linear (output head included, tied or not)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def step_flops(model: PreTrainedModel, lengths: list[int]) -> float:
    """Forward+backward model FLOPs of rows of these lengths (see the module docstring)."""
    n_mm = matmul_params(model)
    layers, d = model.config.num_hidden_layers, model.config.hidden_size
    return float(sum(6 * n_mm * n + 6 * layers * d * n * (n + 1) for n in lengths))


# ---------------------------------------------------------------- measurements


def time_trainer(
    name: str, trainer: Trainer, rows: list[Transition], cfg: MfuConfig, compile_model: bool
) -> Timing:
    """Fastest of cfg.steps Trainer.train steps after a warm-up on a quarter of the rows."""
    if compile_model:
        trainer.model.compile(dynamic=True)
        trainer.train(rows)  # compiles every shape the timed steps will see
    trainer.train(rows[: max(1, len(rows) // 4)])
    walls, cpus = [], []
    for _ in range(cfg.steps):
        w, c = time.perf_counter(), time.process_time()
        trainer.train(rows)
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    flops = step_flops(trainer.model, [len(r.input_ids) for r in rows])
    wall, k = min((w, i) for i, w in enumerate(walls))
    cpu = min(cpus)
    return Timing(
        name=name,
        bf16=trainer.cfg.bf16,
        threads=torch.get_num_threads(),
        tokens_per_s=sum(len(r.input_ids) for r in rows) / wall,
        gflops=flops / wall / 1e9,
        gflops_per_cpu_s=flops / cpu / 1e9,
        cpu_share=cpus[k] / (wall * torch.get_num_threads()),
        step_s=wall,
    )


def _stages(trainer: Trainer, rows: list[Transition]) -> dict[str, float]:
    """Wall time of each stage of the trainer's own step on `rows`: `loss_and_grads` reports
    the end of each stage (pack, forward, logprobs, loss, backward), then `apply_gradients`
    (clip + AdamW); keyed by stage, packing excluded."""
    marks = [("start", time.perf_counter())]
    loss_and_grads(
        trainer.model,
        rows,
        trainer.cfg,
        stage=lambda name: marks.append((name, time.perf_counter())),
    )
    trainer.apply_gradients()
    marks.append(("optimizer", time.perf_counter()))
    return {b: tb - ta for (_, ta), (b, tb) in zip(marks, marks[1:], strict=False) if b != "pack"}


def _first_micro_batch(trainer: Trainer, rows: list[Transition]) -> list[Transition]:
    """The rows the trainer packs into its first (largest) micro-batch."""
    mb = pack(rows, trainer.cfg.micro_batch_tokens)[0]
    return [rows[i] for i in mb.row_indices]


def breakdown(trainer: Trainer, rows: list[Transition]) -> Breakdown:
    """Stage times of the first (largest) micro-batch, on an already warm trainer."""
    first = _first_micro_batch(trainer, rows)
    t = _stages(trainer, first)
    return Breakdown(
        forward_s=t["forward"],
        logprobs_s=t["logprobs"],
        loss_s=t["loss"],
        backward_s=t["backward"],
        optimizer_s=t["optimizer"],
        model_gflop=step_flops(trainer.model, [len(r.input_ids) for r in first]) / 1e9,
    )


def print_profile(trainer: Trainer, rows: list[Transition]) -> None:
    """torch.profiler's top operators by self CPU time for one micro-batch."""
    from torch.profiler import ProfilerActivity, profile

    first = _first_micro_batch(trainer, rows)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _stages(trainer, first)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def build_models(out: Path) -> tuple[Path, Path]:
    """The tiny model and the 20M model, sharing a tokenizer trained on calculator demos."""
    texts = [render_chat(d["messages"], d["tools"]) for d in demonstrations(500, seed=7)]
    return build_tiny_model(out / "tiny", texts, TINY), build_tiny_model(out / "m20", texts, M20)


def measure_peaks(cfg: MfuConfig) -> tuple[Peak, Peak]:
    """(fp32, bf16) peaks."""
    sizes = [int(s) for s in cfg.peak_sizes.split(",")]
    return matmul_peak(torch.float32, sizes), matmul_peak(torch.bfloat16, sizes)


class _Measured(BaseModel):
    """What run() gathers before the report is assembled."""

    timings: dict[str, Timing]
    breakdowns: dict[str, Breakdown]
    params: dict[str, tuple[int, int]]


class _Case(NamedTuple):
    name: str
    model: str
    bf16: bool = True
    micro_batch_tokens: int | None = None
    threads: int | None = None
    compile: bool = False


def _cases(cfg: MfuConfig) -> list[_Case]:
    """The trainer defaults for both models, then the experiments."""
    cases = [
        _Case("tiny", "tiny"),
        _Case("tiny_fp32", "tiny", bf16=False),
        _Case("tiny_big_batch", "tiny", micro_batch_tokens=cfg.big_micro_batch_tokens),
        # On a shared machine a thread that is descheduled stalls every parallel op.
        _Case("tiny_1thread", "tiny", threads=1),
        _Case("20m", "20m"),
        _Case("20m_fp32", "20m", bf16=False),
        _Case("20m_1thread", "20m", threads=1),
    ]
    if cfg.compile:
        cases += [
            _Case("tiny_compiled", "tiny", compile=True),
            _Case("20m_compiled", "20m", compile=True),
        ]
    return cases


def _measure(cfg: MfuConfig, out: Path) -> _Measured:
    dirs = dict(zip(("tiny", "20m"), build_models(out), strict=True))
    n_rows = {"tiny": cfg.rows_tiny, "20m": cfg.rows_20m}
    rng = random.Random(cfg.seed)
    m = _Measured(timings={}, breakdowns={}, params={})
    rows: dict[str, list[Transition]] = {}
    for case in _cases(cfg):
        mbt = case.micro_batch_tokens or cfg.micro_batch_tokens
        trainer = Trainer(dirs[case.model], TrainerConfig(bf16=case.bf16, micro_batch_tokens=mbt))
        vocab = trainer.model.config.vocab_size
        picked = rows.setdefault(case.model, calculator_rows(rng, n_rows[case.model], cfg, vocab))
        torch.set_num_threads(case.threads or cfg.threads)
        m.timings[case.name] = time_trainer(case.name, trainer, picked, cfg, case.compile)
        if case.name == case.model:  # the trainer defaults: where does the time go?
            m.breakdowns[case.name] = breakdown(trainer, picked)
            n_all = sum(p.numel() for p in trainer.model.parameters())
            m.params[case.name] = (n_all, matmul_params(trainer.model))
        if case.name == "tiny" and cfg.profile:
            print_profile(trainer, picked)
        torch.set_num_threads(cfg.threads)
    return m


def _rate(t: Timing, p32: Peak, p16: Peak) -> Timing:
    peak = p16 if t.bf16 else p32
    per_core = peak.gflops_per_cpu_s
    wall_peak = per_core if t.threads == 1 else peak.gflops
    return t.model_copy(
        update={"mfu": t.gflops / wall_peak, "mfu_cpu": t.gflops_per_cpu_s / per_core}
    )


def run(cfg: MfuConfig) -> MfuReport:
    """Measure the peaks (before and after, best kept), then the trainer on both models."""
    torch.set_num_threads(cfg.threads)
    p32, p16 = measure_peaks(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        m = _measure(cfg, Path(tmp))
    a32, a16 = measure_peaks(cfg)
    p32, p16 = p32.best(a32), p16.best(a16)
    t = {k: _rate(v, p32, p16) for k, v in m.timings.items()}
    b = {
        k: v.model_copy(
            update={
                "matmul_share": v.model_gflop
                / p16.gflops
                / (v.forward_s + v.logprobs_s + v.loss_s + v.backward_s)
            }
        )
        for k, v in m.breakdowns.items()
    }
    return MfuReport(
        mfu_tiny=t["tiny"].mfu,
        mfu_20m=t["20m"].mfu,
        peak_fp32_gflops=p32.gflops,
        peak_bf16_gflops=p16.gflops,
        tokens_per_s_tiny=t["tiny"].tokens_per_s,
        tokens_per_s_20m=t["20m"].tokens_per_s,
        mfu_cpu_tiny=t["tiny"].mfu_cpu,
        mfu_cpu_20m=t["20m"].mfu_cpu,
        peak_fp32_gflops_per_cpu_s=p32.gflops_per_cpu_s,
        peak_bf16_gflops_per_cpu_s=p16.gflops_per_cpu_s,
        mfu_tiny_fp32=t["tiny_fp32"].mfu,
        mfu_20m_fp32=t["20m_fp32"].mfu,
        tokens_per_s_tiny_fp32=t["tiny_fp32"].tokens_per_s,
        tokens_per_s_20m_fp32=t["20m_fp32"].tokens_per_s,
        mfu_tiny_big_batch=t["tiny_big_batch"].mfu,
        mfu_tiny_1thread=t["tiny_1thread"].mfu,
        tokens_per_s_tiny_1thread=t["tiny_1thread"].tokens_per_s,
        mfu_20m_1thread=t["20m_1thread"].mfu,
        tokens_per_s_20m_1thread=t["20m_1thread"].tokens_per_s,
        mfu_tiny_compiled=t["tiny_compiled"].mfu if "tiny_compiled" in t else None,
        mfu_20m_compiled=t["20m_compiled"].mfu if "20m_compiled" in t else None,
        params_tiny=m.params["tiny"][0],
        params_20m=m.params["20m"][0],
        matmul_params_tiny=m.params["tiny"][1],
        matmul_params_20m=m.params["20m"][1],
        breakdown_tiny=b["tiny"],
        breakdown_20m=b["20m"],
        timings=list(t.values()),
        threads=cfg.threads,
        load_avg_1m=os.getloadavg()[0],
        omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "default"),
    )


def _parse_args() -> MfuConfig:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    for name, field in MfuConfig.model_fields.items():
        flag = f"--{name.replace('_', '-')}"
        if isinstance(field.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default)
        else:
            kind: Any = type(field.default)
            parser.add_argument(flag, type=kind, default=field.default)
    return MfuConfig(**vars(parser.parse_args()))


def _print(r: MfuReport) -> None:
    print(
        f"peak matmul GFLOP/s: fp32 {r.peak_fp32_gflops:.0f} ({r.peak_fp32_gflops_per_cpu_s:.0f}"
        f" per CPU s), bf16 {r.peak_bf16_gflops:.0f} ({r.peak_bf16_gflops_per_cpu_s:.0f} per CPU s)"
    )
    print(
        f"params: tiny {r.params_tiny:,} (matmul {r.matmul_params_tiny:,}), "
        f"20m {r.params_20m:,} (matmul {r.matmul_params_20m:,})"
    )
    for t in r.timings:
        print(
            f"  {t.name:15s} {'bf16' if t.bf16 else 'fp32'} x{t.threads} {t.tokens_per_s:6.0f} tok/s "
            f"{t.gflops:6.1f} GFLOP/s  MFU {100 * t.mfu:5.1f}%  per CPU s {100 * t.mfu_cpu:5.1f}%"
            f"  CPU share {100 * t.cpu_share:3.0f}%  ({t.step_s:.2f}s/step)"
        )
    for name, b in (("tiny", r.breakdown_tiny), ("20m", r.breakdown_20m)):
        print(
            f"  {name} micro-batch (bf16): fwd {b.forward_s:.3f}s  logp {b.logprobs_s:.3f}s  "
            f"loss {b.loss_s:.3f}s  bwd {b.backward_s:.3f}s  opt {b.optimizer_s:.3f}s; "
            f"matmuls at peak would take {100 * b.matmul_share:.0f}% of fwd..bwd"
        )
    print(f"  {r.threads} threads (OMP_WAIT_POLICY={r.omp_wait_policy}), load {r.load_avg_1m:.1f}")


def main() -> None:
    ensure_passive_omp()
    hf_logging.disable_progress_bar()
    cfg = _parse_args()
    started = time.perf_counter()
    report = run(cfg)
    _print(report)
    print(f"  {time.perf_counter() - started:.0f}s total")
    print(json.dumps(report.model_dump()))


if __name__ == "__main__":
    main()
