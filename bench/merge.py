"""Prefix merging: merged multi-turn rows against one row per span, on 4-turn calculator traces.

Traces: each task is a three-operation question ("What is ((37+48)*3)-12?"); the agent makes
four model calls — three calculator tool calls, each followed by the tool's result, then the
final answer. A per-step mistake rate (a mistyped digit, which the chain then carries)
gives varied rewards (1 for the right final number, else 0). Prompts are built by the
gateway's own token-in/token-out code (`tracerl.gateway.tito.PromptBuilder` with the
History it keeps), so call k+1's prompt ids are call k's prompt + sampled ids + the new
tool turn + the assistant header, exactly as recorded in production. Behaviour log-probs
are the tiny model's own (score_completion at T=1) plus small noise, so the truncated-IS
weights are not all 1.

Two forms of the same spans:
- merged: `spans_to_transitions` as is (one row per rollout);
- per-span: one row per span (its prompt as context, mask 0; its completion, mask 1).
Both go through `compute_advantages(GRPO(), ...)`; the bench checks that every sampled
token gets the same advantage, weight and behaviour log-prob in both.

Measures
- token_ratio: tokens forwarded per-span / merged.
- step_time_ratio: wall time of `Trainer.train` per-span / merged (fresh Trainer from the
  same weights each time, bf16 off as for the losses, one warm-up step per form first; the
  forms alternate and the median of the pairs' ratios is kept, since the machine is shared).
- max_rel_loss_diff: the loss of the two forms, from `Trainer.train` and from
  `loss_and_grads`, relative to the merged loss. At the first step the PPO ratio is 1 and
  GRPO's advantages sum to zero over each group, so the loss is a small sum of cancelling
  terms (~1e-3) and its relative difference is the strictest of the three checks.
- max_rel_grad_diff: gradients from the trainer's own `loss_and_grads` (what
  `Trainer.train` runs for each optimizer step: pack, token_logprobs, policy_loss with one
  denominator over all micro-batches, backward), taken before clip/AdamW, which would hide
  differences (Adam's first step is about lr * sign(g)). Reported as the largest over
  parameter tensors of |g_span - g_merged| / |g_merged| (L2 norms), and the same over the
  whole flattened gradient. Both are repeated with float64 weights (`*_fp64`): what remains
  at fp32 is rounding from different matmul shapes, not a difference in what is computed.
The last line printed is one JSON object (MergeReport).

    .venv/bin/python bench/merge.py [--rollouts 64 --group-size 8 --reps 3 --threads 2]

Runs with OMP_WAIT_POLICY=PASSIVE unless the caller sets it (see `tracerl.ensure_passive_omp`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.utils import logging as hf_logging

from tracerl import ensure_passive_omp
from tracerl.algorithms import GRPO, compute_advantages
from tracerl.algorithms.transitions import spans_to_transitions
from tracerl.engines.scoring import score_completion
from tracerl.gateway.chat import (
    Message,
    ToolSpec,
    canonical_reply,
    normalize_message,
    parse_reply,
    wire_message,
)
from tracerl.gateway.tito import History, PromptBuilder, Turn
from tracerl.models import TinyModelConfig, build_tiny_model, format_tool_call, render_chat
from tracerl.trainer.gradients import loss_and_grads
from tracerl.trainer.trainer import Trainer, TrainerConfig
from tracerl.types import Span, Transition

CALC = Path(__file__).resolve().parent.parent / "examples" / "calculator"
sys.path.insert(0, str(CALC))
from agent import SYSTEM_PROMPT, TOOLS, calculate  # noqa: E402


class MergeConfig(BaseModel):
    """What to measure; every field is also a --flag."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    rollouts: int = 64
    """Rollouts in the batch (groups x group_size)."""
    group_size: int = 8
    """Rollouts per task (GRPO group)."""
    mistake_rate: float = 0.25
    """Chance that each calculator call mistypes a digit (varies the rewards)."""
    logprob_noise: float = 0.05
    """Behaviour log-prob = model log-prob + U(-noise, noise): a slightly stale policy."""
    reps: int = 3
    """Timed Trainer.train steps per form (after one warm-up each), alternating forms."""
    micro_batch_tokens: int = 8192
    """Trainer micro-batch budget, as TrainerConfig's default."""
    hidden_size: int = 192
    """Tiny model width (TinyModelConfig default)."""
    num_layers: int = 4
    """Tiny model depth (TinyModelConfig default)."""
    threads: int = 2
    """torch threads."""
    seed: int = 0
    """Seed of tasks, mistakes and noise."""


class MergeReport(BaseModel):
    """The bench's result, printed as the last line."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    token_ratio: float
    """Tokens forwarded one-row-per-span / merged."""
    step_time_ratio: float
    """Median over alternating pairs of Trainer.train wall time, per-span / merged."""
    max_rel_loss_diff: float
    """Largest |loss_span - loss_merged| / |loss_merged| (Trainer.train and loss_and_grads)."""
    max_rel_grad_diff: float
    """Largest per-tensor |g_span - g_merged| / |g_merged|."""
    global_rel_grad_diff: float
    """|g_span - g_merged| / |g_merged| over all parameters flattened."""
    rel_loss_diff_fp64: float
    """The loss difference with float64 weights (log-softmax still fp32)."""
    max_rel_grad_diff_fp64: float
    """The per-tensor gradient difference with float64 weights."""
    max_abs_logp_diff: float
    """Largest difference of a sampled token's log-prob between the two forms."""
    loss_merged: float
    """Loss of the merged form (`loss_and_grads`)."""
    loss_per_span: float
    """Loss of the per-span form (`loss_and_grads`)."""
    merged_tokens: int
    """Tokens in the merged rows."""
    per_span_tokens: int
    """Tokens in the per-span rows."""
    sampled_tokens: int
    """Tokens with mask 1 (the same in both forms)."""
    merged_rows: int
    """Rows in the merged form (one per rollout)."""
    per_span_rows: int
    """Rows in the per-span form (one per model call)."""
    merged_step_s: float
    """Median Trainer.train wall time, merged."""
    per_span_step_s: float
    """Median Trainer.train wall time, per-span."""
    mean_reward: float
    """Mean final reward over rollouts."""
    rollouts: int
    """Rollouts in the batch."""
    spans_per_rollout: float
    """Model calls per rollout."""
    threads: int
    """torch threads."""
    load_avg_1m: float
    """1-minute load average at the end (the machine is shared: > threads means noise)."""
    omp_wait_policy: str
    """OMP_WAIT_POLICY of the run (see `tracerl.ensure_passive_omp`)."""


# ---------------------------------------------------------------- traces


def chain_task(rng: random.Random) -> tuple[str, list[tuple[str, int]], int]:
    """A question with three operations, its (op, operand) steps, and its start number."""
    start = rng.randint(2, 99)
    steps = [
        (rng.choice("+-"), rng.randint(2, 99)),
        ("*", rng.randint(2, 9)),
        (rng.choice("+-"), rng.randint(2, 99)),
    ]
    (op1, x1), (op2, x2), (op3, x3) = steps
    return f"What is (({start}{op1}{x1}){op2}{x2}){op3}{x3}?", steps, start


def _typo(rng: random.Random, text: str) -> str:
    i = rng.choice([k for k, ch in enumerate(text) if ch.isdigit()])
    return text[:i] + rng.choice([d for d in "0123456789" if d != text[i]]) + text[i + 1 :]


def agent_replies(
    rng: random.Random, steps: list[tuple[str, int]], start: int, mistake_rate: float
) -> tuple[list[str], str]:
    """The model texts of the four calls (three tool calls, then the answer) and the answer.

    A mistake mistypes a digit of the expression; the agent then carries the wrong result.
    """
    texts, value = [], str(start)
    for op, x in steps:
        expression = f"{value}{op}{x}"
        if rng.random() < mistake_rate:
            expression = _typo(rng, expression)
        texts.append(format_tool_call("calculator", {"expression": expression}))
        value = calculate(expression)
    texts.append(value)
    return texts, value


def _wire_tools() -> list[dict]:
    """TOOLS as the gateway hands them to the chat template."""
    return [ToolSpec.model_validate(t).model_dump(exclude_none=True) for t in TOOLS]


def conversation(question: str, texts: list[str]) -> list[dict]:
    """The full OpenAI-format conversation of one rollout (for the tokenizer's corpus)."""
    messages: list[dict] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": question},
    ]
    for k, text in enumerate(texts):
        reply = parse_reply(text, tools_given=True)
        messages.append(wire_message(reply, [f"call_{k}"] * len(reply.tool_calls)))
        for call in reply.tool_calls:
            expression = str(call["arguments"]["expression"])  # type: ignore[index,call-overload]
            messages.append(
                {"role": "tool", "tool_call_id": f"call_{k}", "content": calculate(expression)}
            )
    return messages


def record_rollout(
    builder: PromptBuilder,
    model: PreTrainedModel,
    rng: random.Random,
    question: str,
    texts: list[str],
    rollout_id: str,
    noise: float,
) -> list[Span]:
    """Replay the agent's calls through the gateway's prompt building; one Span per call."""
    tools = _wire_tools()
    messages: list[Message] = [
        normalize_message({"role": "system", "content": SYSTEM_PROMPT}),
        normalize_message({"role": "user", "content": question}),
    ]
    prev: History | None = None
    spans = []
    for seq, text in enumerate(texts):
        prompt = builder.build(messages, tools, prev)
        if seq > 0 and not prompt.reused:
            raise RuntimeError(f"token-in/token-out broke at call {seq}: {prompt.prefix_break}")
        # What the engine would have sampled: the reply's tokens and the end token.
        completion = [*builder.encode(text), builder.eos_id]
        reply = parse_reply(text, tools_given=True)
        call_ids = [f"call_{rollout_id}_{seq}"] * len(reply.tool_calls)
        turn = Turn(ids=prompt.ids + completion, reply=canonical_reply(reply, call_ids), end="eos")
        prev = History(messages=messages, tools=tools, turns=[turn])
        logp = score_completion(model, prompt.ids, completion)
        spans.append(
            Span(
                id=f"{rollout_id}-{seq}",
                rollout_id=rollout_id,
                attempt=1,
                seq=seq,
                role="policy",
                policy_version=0,
                prompt_ids=prompt.ids,
                completion_ids=completion,
                logprobs=[x + rng.uniform(-noise, noise) for x in logp],
                prefix_reused=prompt.reused,
                prefix_break=prompt.prefix_break,
            )
        )
        # The agent echoes the returned message and appends each tool result.
        messages = [*messages, normalize_message(wire_message(reply, call_ids))]
        for call, cid in zip(reply.tool_calls, call_ids, strict=True):
            result = calculate(str(call["arguments"]["expression"]))  # type: ignore[index,call-overload]
            messages.append(
                normalize_message({"role": "tool", "tool_call_id": cid, "content": result})
            )
    return spans


class Rollouts(BaseModel):
    """The recorded batch: spans per rollout, with group, task and reward."""

    model_config = ConfigDict(frozen=True)

    spans: list[list[Span]]
    """Each rollout's spans, in call order."""
    groups: list[str]
    """Each rollout's group id (= its task id)."""
    rewards: list[float]
    """Each rollout's final reward."""


def build_model_and_traces(cfg: MergeConfig, out_dir: Path) -> tuple[Path, Rollouts]:
    """Tiny model trained-tokenizer on the traces' conversations; the traces recorded on it."""
    rng = random.Random(cfg.seed)
    plans = []
    for g in range(cfg.rollouts // cfg.group_size):
        question, steps, start = chain_task(rng)
        for _ in range(cfg.group_size):
            texts, answer = agent_replies(rng, steps, start, cfg.mistake_rate)
            plans.append((f"g{g}", question, texts, answer, steps, start))
    corpus = [render_chat(conversation(q, t), TOOLS) for _, q, t, *_ in plans]
    model_dir = build_tiny_model(
        out_dir,
        corpus,
        TinyModelConfig(hidden_size=cfg.hidden_size, num_layers=cfg.num_layers, seed=cfg.seed),
    )
    builder = PromptBuilder(AutoTokenizer.from_pretrained(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    spans, groups, rewards = [], [], []
    for i, (group, question, texts, answer, steps, start) in enumerate(plans):
        spans.append(
            record_rollout(builder, model, rng, question, texts, f"r{i}", cfg.logprob_noise)
        )
        groups.append(group)
        _, truth = agent_replies(rng, steps, start, mistake_rate=0.0)
        rewards.append(1.0 if answer == truth else 0.0)
    return model_dir, Rollouts(spans=spans, groups=groups, rewards=rewards)


# ---------------------------------------------------------------- the two forms


def merged_rows(batch: Rollouts) -> list[Transition]:
    """spans_to_transitions as is, then GRPO advantages and per-rollout weights."""
    rows = [
        row
        for spans, g, r in zip(batch.spans, batch.groups, batch.rewards, strict=True)
        for row in spans_to_transitions(spans, r, group_id=g, task_id=g)
    ]
    return compute_advantages(GRPO(), rows)


def per_span_rows(batch: Rollouts) -> list[Transition]:
    """One row per span (a lone span cannot merge with anything), same algorithm."""
    rows = [
        row
        for spans, g, r in zip(batch.spans, batch.groups, batch.rewards, strict=True)
        for span in spans
        for row in spans_to_transitions([span], r, group_id=g, task_id=g)
    ]
    return compute_advantages(GRPO(), rows)


def sampled_view(rows: list[Transition]) -> dict[str, list[tuple[int, float, float, float]]]:
    """Per rollout, its sampled tokens in call order: (id, advantage, weight, behaviour)."""
    out: dict[str, list[tuple[int, float, float, float]]] = {}
    seq = {s: k for k, s in enumerate(sid for r in rows for sid in r.span_ids)}
    for row in sorted(rows, key=lambda r: (r.rollout_id, seq[r.span_ids[0]])):
        out.setdefault(row.rollout_id, []).extend(
            (t, a, row.weight, b)
            for t, m, a, b in zip(
                row.input_ids, row.loss_mask, row.advantages, row.behaviour_logprobs, strict=True
            )
            if m
        )
    return out


# ---------------------------------------------------------------- loss, gradients, time


def grads_of(
    model: PreTrainedModel, rows: list[Transition], cfg: TrainerConfig
) -> tuple[float, list[torch.Tensor], dict[str, list[float]]]:
    """The trainer's single-step loss and its gradients, without the optimizer step.

    `loss_and_grads` is what Trainer.train runs for each optimizer step (proximal = current
    weights, one denominator over all micro-batches); clipping and AdamW come after it.
    Also returns each row's sampled-token log-probs, keyed by its span ids.
    """
    model.zero_grad(set_to_none=True)
    out = loss_and_grads(model, rows, cfg)
    logps = {
        "|".join(row.span_ids): logp[torch.tensor(row.loss_mask, dtype=torch.bool)].tolist()
        for row, logp in zip(rows, out.logp_rows, strict=True)
    }
    grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    return out.loss, grads, logps


def grad_diffs(ref: list[torch.Tensor], other: list[torch.Tensor]) -> tuple[float, float]:
    """(max per-tensor, global) relative L2 difference of other to ref."""
    per = [
        float((o - r).norm() / r.norm().clamp(min=1e-30)) for r, o in zip(ref, other, strict=True)
    ]
    flat_r = torch.cat([r.flatten() for r in ref])
    flat_o = torch.cat([o.flatten() for o in other])
    return max(per), float((flat_o - flat_r).norm() / flat_r.norm())


def logp_diff(merged: dict[str, list[float]], per_span: dict[str, list[float]]) -> float:
    """Largest |logp| difference per sampled token, matching spans by id."""
    worst = 0.0
    for key, values in merged.items():
        split = [x for sid in key.split("|") for x in per_span[sid]]
        worst = max(worst, max(abs(a - b) for a, b in zip(values, split, strict=True)))
    return worst


class Timed(BaseModel):
    """Trainer.train wall times of both forms, measured in alternation."""

    merged_s: list[float]
    """Each timed step of the merged form."""
    per_span_s: list[float]
    """Each timed step of the per-span form, taken right after the merged one."""
    merged_loss: float
    """TrainMetrics.loss of the merged form's first step (initial weights)."""
    per_span_loss: float
    """TrainMetrics.loss of the per-span form's first step (initial weights)."""


def timed_steps(
    model_dir: Path,
    merged: list[Transition],
    split: list[Transition],
    cfg: TrainerConfig,
    reps: int,
) -> Timed:
    """`reps` Trainer.train calls per form, each on a fresh Trainer (same weights), after one
    warm-up each; the forms alternate so that load from other processes hits both alike."""
    for rows in (merged, split):
        Trainer(model_dir, cfg).train(rows)  # warm-up: allocator, oneDNN kernels
    runs = [
        (Trainer(model_dir, cfg).train(merged), Trainer(model_dir, cfg).train(split))
        for _ in range(reps)
    ]
    return Timed(
        merged_s=[m.wall_s for m, _ in runs],
        per_span_s=[s.wall_s for _, s in runs],
        merged_loss=runs[0][0].loss,
        per_span_loss=runs[0][1].loss,
    )


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def run(cfg: MergeConfig) -> MergeReport:
    """Build traces, compare the two forms, time them."""
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, batch = build_model_and_traces(cfg, Path(tmp) / "model")
        merged, split = merged_rows(batch), per_span_rows(batch)
        if sampled_view(merged) != sampled_view(split):
            raise AssertionError("advantages, weights or behaviour log-probs differ per token")
        tcfg = TrainerConfig(bf16=False, micro_batch_tokens=cfg.micro_batch_tokens)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
        loss_m, grads_m, logp_m = grads_of(model, merged, tcfg)
        loss_s, grads_s, logp_s = grads_of(model, split, tcfg)
        max_grad, global_grad = grad_diffs(grads_m, grads_s)
        # The same in float64 weights: what is left of the difference is fp32 rounding.
        model.double()
        loss_m64, grads_m64, _ = grads_of(model, merged, tcfg)
        loss_s64, grads_s64, _ = grads_of(model, split, tcfg)
        max_grad64, _ = grad_diffs(grads_m64, grads_s64)
        timed = timed_steps(model_dir, merged, split, tcfg, cfg.reps)
    tokens_m = sum(len(r.input_ids) for r in merged)
    tokens_s = sum(len(r.input_ids) for r in split)
    pairs = zip(timed.per_span_s, timed.merged_s, strict=True)
    return MergeReport(
        token_ratio=tokens_s / tokens_m,
        step_time_ratio=statistics.median(s / m for s, m in pairs),
        max_rel_loss_diff=max(rel(loss_s, loss_m), rel(timed.per_span_loss, timed.merged_loss)),
        max_rel_grad_diff=max_grad,
        global_rel_grad_diff=global_grad,
        rel_loss_diff_fp64=rel(loss_s64, loss_m64),
        max_rel_grad_diff_fp64=max_grad64,
        max_abs_logp_diff=logp_diff(logp_m, logp_s),
        loss_merged=loss_m,
        loss_per_span=loss_s,
        merged_tokens=tokens_m,
        per_span_tokens=tokens_s,
        sampled_tokens=sum(sum(r.loss_mask) for r in merged),
        merged_rows=len(merged),
        per_span_rows=len(split),
        merged_step_s=statistics.median(timed.merged_s),
        per_span_step_s=statistics.median(timed.per_span_s),
        mean_reward=statistics.fmean(batch.rewards),
        rollouts=len(batch.spans),
        spans_per_rollout=statistics.fmean(len(s) for s in batch.spans),
        threads=cfg.threads,
        load_avg_1m=os.getloadavg()[0],
        omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "default"),
    )


def _parse_args() -> MergeConfig:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, field in MergeConfig.model_fields.items():
        kind: Any = type(field.default)
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=field.default)
    return MergeConfig(**vars(parser.parse_args()))


def main() -> None:
    ensure_passive_omp()
    hf_logging.disable_progress_bar()
    cfg = _parse_args()
    started = time.perf_counter()
    report = run(cfg)
    r = report
    print(
        f"{r.rollouts} rollouts x {r.spans_per_rollout:.0f} calls, mean reward {r.mean_reward:.2f}"
    )
    print(
        f"  tokens   merged {r.merged_tokens:6d} ({r.merged_rows} rows)  per-span "
        f"{r.per_span_tokens:6d} ({r.per_span_rows} rows)  ratio {r.token_ratio:.2f}x"
    )
    print(
        f"  step     merged {r.merged_step_s:6.2f}s  per-span {r.per_span_step_s:6.2f}s  "
        f"ratio {r.step_time_ratio:.2f}x"
    )
    print(
        f"  loss     merged {r.loss_merged:.6g}  per-span {r.loss_per_span:.6g}  "
        f"rel diff {r.max_rel_loss_diff:.1e}; grad rel diff max/tensor {r.max_rel_grad_diff:.1e}"
        f" global {r.global_rel_grad_diff:.1e}; logp max diff {r.max_abs_logp_diff:.1e}"
    )
    print(
        f"  float64 weights: loss rel diff {r.rel_loss_diff_fp64:.1e}, grad rel diff max/tensor "
        f"{r.max_rel_grad_diff_fp64:.1e}"
    )
    print(
        f"  {cfg.threads} threads (OMP_WAIT_POLICY={r.omp_wait_policy}), load {r.load_avg_1m:.1f}, "
        f"{time.perf_counter() - started:.0f}s total"
    )
    print(json.dumps(report.model_dump()))


if __name__ == "__main__":
    main()
