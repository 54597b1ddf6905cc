"""Trainer model-FLOPs utilisation on this CPU: forward+backward FLOP/s over measured matmul peak.

Peak: large square torch matmuls in this process (fp32 and bf16, several sizes, best of
several runs), with the same thread count as the trainer. This CPU has AMX-BF16, so the
bf16 peak is several times the fp32 one.

Trainer: `Trainer.train` (one optimizer step: no separate proximal pass) on rows of
calculator length (uniform 100-300 tokens, ~half of them sampled), for the tiny model
(hidden 192, 4 layers) and a ~20M-parameter Llama (hidden 512, 8 layers, 8 heads, SwiGLU
1024), both with the tiny model's tokenizer (vocab ~400). A warm-up step on a quarter of
the rows comes first; the fastest of the timed steps is kept, as for the peak. MFU compares
like with like: the trainer's default bf16 autocast against the bf16 peak (`mfu_tiny`,
`mfu_20m`), and bf16 off against the fp32 peak (`*_fp32`).

Model FLOPs of a step (padding excluded, as the tokens/s the trainer reports):
  6 * N_mm * n  +  6 * L * d * n * (n + 1)      per row of n tokens
N_mm = weights of every Linear, the output head included (a tied head is still a
[d, V] matmul) and the embedding lookup excluded; the second term is causal attention
(QK^T and AV: 4*d FLOPs per query-key pair and layer forward, x3 for forward+backward,
n(n+1)/2 pairs). Norms, activations, rotary, softmax and the loss are not counted.

Where the time goes (`breakdown`): one micro-batch timed stage by stage as the trainer runs
it: forward (autocast), token_logprobs, policy_loss, backward, then clip + AdamW.
`--profile` prints torch.profiler's top operators; `--compile` also times the trainer with
the model wrapped by torch.compile (compilation takes minutes here, so it is opt-in).
The last line printed is one JSON object (MfuReport).

    .venv/bin/python bench/mfu.py [--threads 2 --profile --compile]
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
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict
from transformers import PreTrainedModel
from transformers.utils import logging as hf_logging

from tracerl.models import TinyModelConfig, build_tiny_model, render_chat
from tracerl.trainer.loss import policy_loss, token_logprobs
from tracerl.trainer.packing import MicroBatch, pack
from tracerl.trainer.trainer import Trainer, TrainerConfig
from tracerl.types import Transition

CALC = Path(__file__).resolve().parent.parent / "examples" / "calculator"
sys.path.insert(0, str(CALC))
from expert import demonstrations  # noqa: E402

TINY = TinyModelConfig()
M20 = TinyModelConfig(hidden_size=512, num_layers=8, num_heads=8, intermediate_size=1024)


class MfuConfig(BaseModel):
    """What to measure; every field is also a --flag."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    rows_tiny: int = 64
    """Rows per step for the tiny model (~13k tokens)."""
    rows_20m: int = 32
    """Rows per step for the 20M model (~6.4k tokens; a step takes seconds)."""
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
    """Also time the trainer with torch.compile(model) (slow to compile)."""
    seed: int = 0
    """Seed of the rows."""


class Timing(BaseModel):
    """One trainer configuration measured."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    name: str
    """Which model and setting."""
    bf16: bool
    """Whether bf16 autocast was on."""
    tokens_per_s: float
    """Non-padding tokens per second of the fastest step."""
    gflops: float
    """Model GFLOP/s of that step."""
    mfu: float
    """gflops over the matching peak (bf16 or fp32)."""
    step_s: float
    """Wall time of the fastest step."""


class Breakdown(BaseModel):
    """One micro-batch, stage by stage (seconds); the optimizer runs once per step."""

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
    matmul_share: float
    """Model FLOPs of the micro-batch at peak speed / its forward+backward time: the share
    of that time the matmuls would need if they ran at peak."""


class MfuReport(BaseModel):
    """The bench's result, printed as the last line."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    mfu_tiny: float
    """Tiny model, trainer default (bf16 autocast), over the bf16 peak."""
    mfu_20m: float
    """20M model, trainer default (bf16 autocast), over the bf16 peak."""
    peak_fp32_gflops: float
    """Best fp32 square matmul GFLOP/s."""
    peak_bf16_gflops: float
    """Best bf16 square matmul GFLOP/s."""
    tokens_per_s_tiny: float
    """Tiny model, bf16 autocast."""
    tokens_per_s_20m: float
    """20M model, bf16 autocast."""
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


# ---------------------------------------------------------------- peak


def matmul_peak(dtype: torch.dtype, sizes: list[int], reps: int = 5) -> float:
    """Best GFLOP/s of n x n @ n x n over sizes and repetitions."""
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        a @ b  # warm-up: kernel selection, page faults
        for _ in range(reps):
            start = time.perf_counter()
            a @ b
            best = max(best, 2 * n**3 / (time.perf_counter() - start) / 1e9)
    return best


# ---------------------------------------------------------------- rows and FLOPs


def calculator_rows(rng: random.Random, n: int, cfg: MfuConfig, vocab: int) -> list[Transition]:
    """Rows of calculator length; token values do not change the FLOPs."""
    rows = []
    for i in range(n):
        length = rng.randint(cfg.min_len, cfg.max_len)
        mask = [0] + [int(rng.random() < 0.55) for _ in range(length - 1)]
        rows.append(
            Transition(
                rollout_id=f"r{i}",
                group_id="g",
                task_id="t",
                role="policy",
                input_ids=[rng.randrange(vocab) for _ in range(length)],
                loss_mask=mask,
                behaviour_logprobs=[-6.0 * m for m in mask],
                versions=[0 if m else -1 for m in mask],
                advantages=[rng.uniform(-1.0, 1.0) * m for m in mask],
                reward=0.0,
                span_ids=[f"s{i}"],
                num_spans=1,
                weight=1.0 / max(1, sum(mask)),
            )
        )
    return rows


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
    name: str,
    model_dir: Path,
    rows: list[Transition],
    tcfg: TrainerConfig,
    cfg: MfuConfig,
    peak: float,
    compile_model: bool = False,
) -> Timing:
    """Fastest of cfg.steps Trainer.train steps after a warm-up on a quarter of the rows."""
    trainer = Trainer(model_dir, tcfg)
    if compile_model:
        trainer.model.compile(dynamic=True)
        trainer.train(rows)  # compiles every shape the timed steps will see
    trainer.train(rows[: max(1, len(rows) // 4)])
    best = min(trainer.train(rows).wall_s for _ in range(cfg.steps))
    flops = step_flops(trainer.model, [len(r.input_ids) for r in rows])
    gflops = flops / best / 1e9
    tokens = sum(len(r.input_ids) for r in rows)
    return Timing(
        name=name,
        bf16=tcfg.bf16,
        tokens_per_s=tokens / best,
        gflops=gflops,
        mfu=gflops / peak,
        step_s=best,
    )


def _stages(trainer: Trainer, mb: MicroBatch) -> list[float]:
    """Stage times of one micro-batch, as Trainer._optimizer_step runs it."""
    marks = [time.perf_counter()]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=trainer.cfg.bf16):
        logits = trainer.model(input_ids=mb.input_ids_BT, attention_mask=mb.attention_mask_BT)
    marks.append(time.perf_counter())
    logp_BT = token_logprobs(logits.logits, mb.input_ids_BT, mb.temperature_B)
    marks.append(time.perf_counter())
    loss, _ = policy_loss(
        logp_BT,
        logp_BT.detach(),
        mb.behaviour_logp_BT,
        mb.adv_BT,
        mb.loss_mask_BT,
        trainer.cfg.loss,
        mb.weight_BT,
    )
    marks.append(time.perf_counter())
    loss.backward()
    marks.append(time.perf_counter())
    torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), trainer.cfg.grad_clip)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    marks.append(time.perf_counter())
    return [b - a for a, b in zip(marks, marks[1:], strict=False)]


def breakdown(model_dir: Path, rows: list[Transition], cfg: MfuConfig, peak: float) -> Breakdown:
    """Stage times of the first micro-batch (bf16), second of two runs."""
    trainer = Trainer(model_dir, TrainerConfig(micro_batch_tokens=cfg.micro_batch_tokens))
    mb = pack(rows, cfg.micro_batch_tokens)[0]
    _stages(trainer, mb)
    fwd, logp, loss, bwd, opt = _stages(trainer, mb)
    lengths = [int(n) for n in mb.attention_mask_BT.sum(dim=1)]
    ideal = step_flops(trainer.model, lengths) / (peak * 1e9)
    return Breakdown(
        forward_s=fwd,
        logprobs_s=logp,
        loss_s=loss,
        backward_s=bwd,
        optimizer_s=opt,
        matmul_share=ideal / (fwd + logp + loss + bwd),
    )


def print_profile(model_dir: Path, rows: list[Transition], cfg: MfuConfig) -> None:
    """torch.profiler's top operators by self CPU time for one bf16 micro-batch."""
    from torch.profiler import ProfilerActivity, profile

    trainer = Trainer(model_dir, TrainerConfig(micro_batch_tokens=cfg.micro_batch_tokens))
    mb = pack(rows, cfg.micro_batch_tokens)[0]
    _stages(trainer, mb)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _stages(trainer, mb)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def build_models(out: Path) -> tuple[Path, Path]:
    """The tiny model and the 20M model, sharing a tokenizer trained on calculator demos."""
    texts = [render_chat(d["messages"], d["tools"]) for d in demonstrations(500, seed=7)]
    return build_tiny_model(out / "tiny", texts, TINY), build_tiny_model(out / "m20", texts, M20)


def _param_count(model_dir: Path) -> tuple[int, int]:
    model = Trainer(model_dir, TrainerConfig()).model
    return sum(p.numel() for p in model.parameters()), matmul_params(model)


def run(cfg: MfuConfig) -> MfuReport:
    """Measure the peaks, then the trainer on both models."""
    torch.set_num_threads(cfg.threads)
    sizes = [int(s) for s in cfg.peak_sizes.split(",")]
    peak32, peak16 = matmul_peak(torch.float32, sizes), matmul_peak(torch.bfloat16, sizes)
    rng = random.Random(cfg.seed)
    with tempfile.TemporaryDirectory() as tmp:
        tiny_dir, m20_dir = build_models(Path(tmp))
        vocab = Trainer(tiny_dir, TrainerConfig()).model.config.vocab_size
        tiny_rows = calculator_rows(rng, cfg.rows_tiny, cfg, vocab)
        m20_rows = calculator_rows(rng, cfg.rows_20m, cfg, vocab)

        def timed(
            name: str, d: Path, rows: list[Transition], bf16: bool, mbt: int, comp: bool = False
        ) -> Timing:
            tcfg = TrainerConfig(bf16=bf16, micro_batch_tokens=mbt)
            return time_trainer(name, d, rows, tcfg, cfg, peak16 if bf16 else peak32, comp)

        mbt, big = cfg.micro_batch_tokens, cfg.big_micro_batch_tokens
        timings = [
            timed("tiny", tiny_dir, tiny_rows, True, mbt),
            timed("tiny_fp32", tiny_dir, tiny_rows, False, mbt),
            timed("tiny_big_batch", tiny_dir, tiny_rows, True, big),
            timed("20m", m20_dir, m20_rows, True, mbt),
            timed("20m_fp32", m20_dir, m20_rows, False, mbt),
        ]
        if cfg.compile:
            timings.append(timed("tiny_compiled", tiny_dir, tiny_rows, True, mbt, comp=True))
            timings.append(timed("20m_compiled", m20_dir, m20_rows, True, mbt, comp=True))
        bd_tiny = breakdown(tiny_dir, tiny_rows, cfg, peak16)
        bd_20m = breakdown(m20_dir, m20_rows, cfg, peak16)
        if cfg.profile:
            print_profile(tiny_dir, tiny_rows, cfg)
        (p_tiny, mm_tiny), (p_20m, mm_20m) = _param_count(tiny_dir), _param_count(m20_dir)
    by = {t.name: t for t in timings}
    return MfuReport(
        mfu_tiny=by["tiny"].mfu,
        mfu_20m=by["20m"].mfu,
        peak_fp32_gflops=peak32,
        peak_bf16_gflops=peak16,
        tokens_per_s_tiny=by["tiny"].tokens_per_s,
        tokens_per_s_20m=by["20m"].tokens_per_s,
        mfu_tiny_fp32=by["tiny_fp32"].mfu,
        mfu_20m_fp32=by["20m_fp32"].mfu,
        tokens_per_s_tiny_fp32=by["tiny_fp32"].tokens_per_s,
        tokens_per_s_20m_fp32=by["20m_fp32"].tokens_per_s,
        mfu_tiny_big_batch=by["tiny_big_batch"].mfu,
        mfu_tiny_compiled=by["tiny_compiled"].mfu if "tiny_compiled" in by else None,
        mfu_20m_compiled=by["20m_compiled"].mfu if "20m_compiled" in by else None,
        params_tiny=p_tiny,
        params_20m=p_20m,
        matmul_params_tiny=mm_tiny,
        matmul_params_20m=mm_20m,
        breakdown_tiny=bd_tiny,
        breakdown_20m=bd_20m,
        timings=timings,
        threads=cfg.threads,
        load_avg_1m=os.getloadavg()[0],
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
    print(f"peak matmul: fp32 {r.peak_fp32_gflops:.0f} GFLOP/s, bf16 {r.peak_bf16_gflops:.0f}")
    print(f"params: tiny {r.params_tiny:,} (matmul {r.matmul_params_tiny:,}), "
          f"20m {r.params_20m:,} (matmul {r.matmul_params_20m:,})")
    for t in r.timings:
        print(
            f"  {t.name:15s} {'bf16' if t.bf16 else 'fp32'}  {t.tokens_per_s:8.0f} tok/s  "
            f"{t.gflops:7.1f} GFLOP/s  MFU {100 * t.mfu:5.1f}%  ({t.step_s:.2f}s/step)"
        )
    for name, b in (("tiny", r.breakdown_tiny), ("20m", r.breakdown_20m)):
        print(
            f"  {name} micro-batch (bf16): fwd {b.forward_s:.3f}s  logp {b.logprobs_s:.3f}s  "
            f"loss {b.loss_s:.3f}s  bwd {b.backward_s:.3f}s  opt {b.optimizer_s:.3f}s  "
            f"matmuls at peak would take {100 * b.matmul_share:.0f}% of fwd+bwd"
        )
    print(f"  {r.threads} threads, load {r.load_avg_1m:.1f}")


def main() -> None:
    hf_logging.disable_progress_bar()
    cfg = _parse_args()
    started = time.perf_counter()
    report = run(cfg)
    _print(report)
    print(f"  {time.perf_counter() - started:.0f}s total")
    print(json.dumps(report.model_dump()))


if __name__ == "__main__":
    main()
