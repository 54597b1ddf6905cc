"""Supervised warm start: fine-tune a causal LM on demonstration conversations.

Loss falls only on what the model would have sampled: the assistant turns' content,
tool-call text and closing end token. The mask is exact by construction: each conversation
is rendered prefix by prefix with the model's own chat template, every segment is tokenized
on its own, and the ids are concatenated — the same ids the gateway's token-in/token-out
would hand the trainer. Works for any local HF model dir whose template is prefix-stable.

Examples that already are ids (`EncodedDemo`: recorded traces, ADP with its token ids)
skip rendering and are trained on as they are (`tracerl sft --from-traces`). The records,
their loading and their encoding live in tracerl.models.demos; checkpoints and resuming in
tracerl.models.sft_state.

With `holdout` a seeded share of the examples is kept out of training and scored every
`eval_every` steps (`score_held_out`); with `target` training stops once that score reaches
it, and `steps` is only a cap that the learning-rate schedule does not depend on. The loss
and the scores come from `target_logprobs`, which never materialises a big vocabulary's
full logits.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from tracerl.models.demos import (
    Demo,
    EncodedDemo,
    _Record,
    collate,
    encode_all,
    encode_demo,
    load_demos,
    pad_token_id,
)
from tracerl.models.heads import shared_prefix_logprobs, target_logprobs
from tracerl.models.sft_scoring import exact_match, mean_loss, score_held_out, split_holdout
from tracerl.models.sft_state import Checkpointer, HeldOutCheck, SftState
from tracerl.models.template import render_chat
from tracerl.models.tiny import TinyModelConfig, build_tiny_model
from tracerl.precision import (
    Bf16Setting,
    Precision,
    Probe,
    choose_precision,
    probe_pass,
    probe_rows,
)
from tracerl.trainer.config import LoraSettings
from tracerl.trainer.lora import with_lora

__all__ = [
    "Demo",
    "EncodedDemo",
    "HeldOutCheck",
    "SftConfig",
    "SftResult",
    "collate",
    "encode_demo",
    "exact_match",
    "load_demos",
    "mean_loss",
    "score_held_out",
    "sft",
    "sft_new_or_base",
    "split_holdout",
]

Say = Callable[[str], None]
"""Where `sft` says what it does (a console's print, or nothing)."""


class SftConfig(_Record):
    """How to fine-tune."""

    steps: int = Field(default=1000, ge=1)
    """Optimizer steps. Without a `target`, the steps trained, which the cosine schedule
    spans. With a `target`, only a cap (a safety limit): the schedule does not depend on it."""
    stop_loss: float | None = None
    """Stop once the mean loss of the last log_every steps is below this; None trains
    all `steps`."""
    holdout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Share of the examples kept out of training (chosen with `seed`) and scored every
    eval_every steps and at the end; 0 holds none out."""
    target: float | None = Field(default=None, gt=0.0, le=1.0)
    """Stop at the first check whose held-out score (`target_metric`) is at least this
    (needs a holdout); `steps` is then the cap. None trains all `steps`."""
    target_metric: Literal["exact", "sampled"] = "exact"
    """The held-out score `target` is about: 'exact', the share of held-out examples whose
    every assistant token is the model's top choice (greedy decoding copies them); or
    'sampled', the mean probability that sampling at temperature 1 copies an example whole
    (what an agent sampling at temperature 1 gets; stricter)."""
    eval_every: int = Field(default=50, ge=1)
    """Steps between held-out checks."""
    cooldown: int = Field(default=0, ge=0)
    """With a `target`: once it is reached (or the cap), this many more steps with the rate
    decaying linearly to zero, then a last check: the polish a decaying rate gives, without a
    schedule that depends on the cap. 0 stops at once."""
    batch_size: int = Field(default=16, ge=1)
    """Conversations per step."""
    lora: LoraSettings | None = None
    """Train a LoRA adapter instead of all weights (peft); the output is still a plain model
    dir, the adapter merged in (and kept in <out>/adapter)."""
    prefix_sharing: bool = True
    """Forward the prefix a step's conversations share (system prompt, tool schemas) once,
    not once per conversation: the same loss and gradients, fewer tokens forwarded."""
    lr: float = Field(default=2e-3, gt=0)
    """Peak learning rate (AdamW); 3e-3 already makes the tiny model's runs erratic."""
    warmup: int = Field(default=10, ge=0)
    """Steps of linear warmup. Then: cosine decay to zero over `steps` without a target;
    a constant rate with one (so a larger cap changes nothing before it is reached)."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay."""
    grad_clip: float = 1.0
    """Max global gradient norm."""
    max_len: int = Field(default=256, ge=2)
    """Conversations are truncated to this many tokens."""
    seed: int = 0
    """Seed of the data order (and of the holdout)."""
    bf16: Bf16Setting = "auto"
    """bf16 autocast for forward/backward (weights stay fp32): 'auto' where the device does
    bf16 natively (a CUDA GPU that supports it, a CPU with AVX512-BF16 or AMX), else fp32.
    On an AVX2 CPU bf16 is emulated and ~30x slower (tracerl.precision)."""
    device: str = "cpu"
    """Where to train: 'cpu', 'cuda', 'cuda:1', ..."""
    threads: int | None = Field(default=None, ge=1)
    """torch CPU threads; None keeps torch's default (the machine's cores)."""
    checkpoint_every: int = Field(default=100, ge=0)
    """Steps between checkpoints in <out>/.sft-checkpoint (weights, optimizer, schedule,
    step, scores), so an interrupted run resumes (`resume`); 0 never checkpoints."""
    log_every: int = Field(default=10, ge=1)
    """Steps between progress-bar loss updates; final_loss averages the last this many."""
    progress: bool = True
    """Show a tqdm progress bar and say what the run does (data, schedule, precision, the
    expected time once the first steps are timed)."""


class SftResult(_Record):
    """What one fine-tuning run did."""

    out_dir: str
    """The saved HF model dir (model + tokenizer)."""
    steps: int
    """Optimizer steps taken."""
    stopped_early: bool
    """Whether stop_loss or target ended training before cfg.steps."""
    final_loss: float
    """Mean loss per assistant token over the last log_every steps."""
    losses: list[float]
    """Loss of every step, in order."""
    wall_s: float
    """Wall time of the training loop, held-out checks included (loading and saving
    excluded; across resumes, the sum of each part's)."""
    tokens_per_s: float
    """Non-padding tokens trained on per second (held-out checks excluded)."""
    held_out: list[HeldOutCheck] = Field(default_factory=list)
    """Held-out scores at each check, in order; empty without a holdout."""
    target: float | None = None
    """cfg.target: the held-out score that was to end training; None without one."""
    target_metric: str = "exact"
    """cfg.target_metric: which score `target` was about."""
    target_reached: bool | None = None
    """Whether a check reached `target` before the step cap; None without a target."""
    precision: str = "fp32"
    """'bf16' (autocast) or 'fp32', as chosen from cfg.bf16 and the hardware."""
    precision_reason: str = ""
    """Why: the line the run printed (e.g. 'precision: fp32 (CPU has AVX2 only; ...)')."""
    device: str = "cpu"
    """The device trained on."""
    train_examples: int = 0
    """Examples trained on."""
    held_out_examples: int = 0
    """Examples held out and scored."""
    resumed_at: int | None = None
    """The step a checkpoint resumed this run from; None when it ran from the start."""


def _order(n: int, steps: int, batch_size: int, seed: int) -> list[list[int]]:
    """Batches of demo indices: reshuffled epochs, as many as the steps need."""
    rng = random.Random(seed)
    flat: list[int] = []
    while len(flat) < steps * batch_size:
        epoch = list(range(n))
        rng.shuffle(epoch)
        flat += epoch
    return [flat[s * batch_size : (s + 1) * batch_size] for s in range(steps)]


def _lr_factor(cfg: SftConfig, state: SftState) -> Callable[[int], float]:
    """The schedule: warmup, then cosine to zero over `steps` (no target), or constant (a
    target, where `steps` is only a cap) until the cooldown `state` says has begun, then
    linear to zero over cfg.cooldown steps."""

    def factor(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        if cfg.target is not None:
            if state.cooldown_from is None:
                return 1.0
            done = (step - state.cooldown_from) / max(1, cfg.cooldown)
            return min(1.0, max(0.0, 1.0 - done))
        progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def schedule_words(cfg: SftConfig) -> str:
    """The schedule in words, for the run's header."""
    warm = f"{cfg.warmup} warmup steps, then " if cfg.warmup else ""
    if cfg.target is not None:
        cool = f", then {cfg.cooldown} steps linear to 0" if cfg.cooldown else ""
        return f"{warm}constant until the target (the {cfg.steps}-step cap does not shape it){cool}"
    return f"{warm}cosine to 0 over {cfg.steps} steps"


def _step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    cfg: SftConfig,
    bf16: bool,
) -> float:
    """One optimizer step on a collated batch; its loss (mean over the masked tokens)."""
    loss = _loss(model, batch, cfg, bf16)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    schedule.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def _loss(
    model: torch.nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    cfg: SftConfig,
    bf16: bool,
) -> torch.Tensor:
    """The mean negative log-prob of a collated batch's masked tokens."""
    shared = shared_prefix_logprobs(model, *batch, bf16=bf16) if cfg.prefix_sharing else None
    logp_N = shared if shared is not None else target_logprobs(model, *batch, bf16=bf16).logp_N
    return -logp_N.mean() if logp_N.numel() else logp_N.sum()


def _ignore(line: str) -> None:
    pass


def sft(
    base_dir: str | Path,
    demos: Sequence[Demo | EncodedDemo],
    out_dir: str | Path,
    cfg: SftConfig | None = None,
    resume: bool = False,
    say: Say | None = None,
    score_on: Sequence[Demo | EncodedDemo] = (),
) -> SftResult:
    """Fine-tune the HF model in `base_dir` on `demos` and save model + tokenizer to `out_dir`
    (with cfg.holdout, on the demos it does not hold out).

    score_on: examples to score at each check instead of a held-out share of `demos` (which
    needs cfg.holdout 0): e.g. clean demos, while training on a mixture of other ones.

    resume: continue from `out_dir`'s checkpoint when there is one (ValueError when it was
    made with other settings), and return the finished result when `out_dir` already holds
    one of these settings. `say` hears the run's header and timing (default: printed when
    cfg.progress)."""
    cfg = cfg or SftConfig()
    if not demos:
        raise ValueError("no demonstrations")
    if cfg.target is not None and cfg.holdout <= 0 and not score_on:
        raise ValueError("a held-out target needs a holdout share above 0")
    if score_on and cfg.holdout > 0:
        raise ValueError("score on a holdout share or on given examples, not both")
    say = say or (tqdm.write if cfg.progress else _ignore)
    out = Path(out_dir)
    checkpointer = Checkpointer(out, cfg.model_dump_json(exclude={"progress"}))
    if resume and (done := checkpointer.finished()) is not None:
        say(f"sft: {out} is already trained with these settings ({done.steps} steps)")
        return SftResult.model_validate_json(done.model_dump_json())
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = with_lora(base, cfg.lora)
    model.to(torch.device(cfg.device))  # type: ignore[arg-type]
    encoded, held = split_holdout(encode_all(tokenizer, demos), cfg.holdout, cfg.seed)
    probe = _probe(model, cfg, encoded, pad_token_id(tokenizer))
    precision = choose_precision(cfg.bf16, cfg.device, probe)
    held = held or (encode_all(tokenizer, score_on) if score_on else [])
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    state = SftState()  # the schedule reads its cooldown; a checkpoint fills it in place
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_factor(cfg, state))
    if resume and (saved := checkpointer.load(model, optimizer, schedule)) is not None:
        for key in SftState.model_fields:
            setattr(state, key, getattr(saved, key))
    say(_header(cfg, precision, len(encoded), len(held), state))
    loop = _Loop(cfg, model, optimizer, schedule, pad_token_id(tokenizer), encoded, held)
    state = loop.run(state, precision.bf16, checkpointer, say)
    _save(model, out, cfg.lora is not None)
    tokenizer.save_pretrained(out)
    result = _result(cfg, out, state, precision, len(encoded), len(held))
    checkpointer.finish(result)
    return result


def _probe(model: torch.nn.Module, cfg: SftConfig, encoded: list, pad_id: int) -> Probe:
    """For `auto`: the training step's own forward and backward pass on this run's first
    examples, as many as a batch holds (fewer on a large model: precision.PROBE_FLOPS)."""
    longest = max(len(e.input_ids) for e in encoded[: cfg.batch_size])
    rows = probe_rows(model, cfg.batch_size, min(longest, cfg.max_len))
    batch = tuple(t.to(cfg.device) for t in collate(encoded[:rows], pad_id, cfg.max_len))
    return probe_pass(model, lambda bf16: _loss(model, batch, cfg, bf16).backward())  # type: ignore[arg-type]


def _save(model: torch.nn.Module, out: Path, lora: bool) -> None:
    """The trained model as a plain HF dir; with LoRA the adapter merged in, and the adapter
    itself (a peft dir) in <out>/adapter, so every later command takes `out` as it is."""
    model.eval()
    if lora:
        model.save_pretrained(out / "adapter")  # type: ignore[operator]
        model = model.merge_and_unload()  # type: ignore[operator]
    model.save_pretrained(out)  # type: ignore[operator]


def _header(
    cfg: SftConfig, precision: Precision, n_train: int, n_held: int, state: SftState
) -> str:
    """What the run will do, said once before its progress bar."""
    held = f", {n_held} held out (scored every {cfg.eval_every} steps)" if n_held else ""
    goal = (
        f"until held-out {cfg.target_metric} match >= {cfg.target:g}, at most {cfg.steps} steps"
        + (f" (then {cfg.cooldown} to cool down)" if cfg.cooldown else "")
        if cfg.target is not None
        else f"{cfg.steps} steps"
    )
    threads = f", {torch.get_num_threads()} threads" if precision.device == "cpu" else ""
    what = (
        f"LoRA r={cfg.lora.r} on {', '.join(cfg.lora.target_modules)}"
        if cfg.lora
        else "all weights"
    )
    lines = [
        f"sft: {n_train} examples trained on{held}; batch {cfg.batch_size}, {goal}; {what}",
        f"sft: lr {cfg.lr:g}, {schedule_words(cfg)}; device {cfg.device}{threads}",
        f"sft: {precision.line()}",
    ]
    if state.step:
        lines.append(f"sft: resuming at step {state.step} from the checkpoint")
    return "\n".join(lines)


class _Loop:
    """The training loop's fixed parts; `run` advances a state to the end."""

    def __init__(
        self,
        cfg: SftConfig,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        schedule: torch.optim.lr_scheduler.LRScheduler,
        pad_id: int,
        encoded: list[EncodedDemo],
        held: list[EncodedDemo],
    ) -> None:
        self.cfg, self.model, self.pad_id = cfg, model, pad_id
        self.optimizer, self.schedule = optimizer, schedule
        self.encoded, self.held = encoded, held

    def run(self, state: SftState, bf16: bool, checkpointer: Checkpointer, say: Say) -> SftState:
        cfg = self.cfg
        self.model.train()
        last = cfg.steps + (cfg.cooldown if cfg.target is not None else 0)
        order = _order(len(self.encoded), last, cfg.batch_size, cfg.seed)
        bar = tqdm(total=cfg.steps, initial=state.step, disable=not cfg.progress, desc="sft")
        start, timed = time.perf_counter() - state.wall_s, None
        while state.step < last and not state.done:
            batch = collate([self.encoded[i] for i in order[state.step]], self.pad_id, cfg.max_len)
            batch = tuple(t.to(cfg.device) for t in batch)  # type: ignore[assignment]
            t0 = time.perf_counter()
            state.losses.append(_step(self.model, self.optimizer, self.schedule, batch, cfg, bf16))
            state.train_s += time.perf_counter() - t0
            state.tokens += int(batch[1].sum())
            state.step += 1
            bar.update(1)
            self._after_step(state, bar)
            state.wall_s = time.perf_counter() - start
            if timed is None and state.step >= min(cfg.steps, 10 + (state.resumed or 0)):
                timed = True
                say(_expected_time(cfg, state))
            if cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0 and not state.done:
                checkpointer.save(self.model, self.optimizer, self.schedule, state)
        bar.close()
        return state

    def _after_step(self, state: SftState, bar: tqdm) -> None:
        """Loss on the bar, a held-out check when due, and whether to stop or cool down."""
        cfg = self.cfg
        recent = sum(state.losses[-cfg.log_every :]) / min(cfg.log_every, len(state.losses))
        postfix = {"loss": f"{recent:.3f}"}
        cooled = (
            state.cooldown_from is not None and state.step >= state.cooldown_from + cfg.cooldown
        )
        due = state.step % cfg.eval_every == 0 or state.step == cfg.steps or cooled
        if self.held and due:
            exact, sampled = score_held_out(self.model, self.held, self.pad_id, cfg.max_len)
            state.checks.append(
                HeldOutCheck(step=state.step, exact_match=exact, sampled_match=sampled)
            )
            score = exact if cfg.target_metric == "exact" else sampled
            if cfg.target is not None and score >= cfg.target and state.cooldown_from is None:
                self._stable_phase_over(state)
        if cfg.target is not None and state.step == cfg.steps and state.cooldown_from is None:
            self._stable_phase_over(state)  # the cap: cool down all the same
        state.done = state.done or cooled
        if state.checks:
            last = state.checks[-1]
            postfix["held_out"] = f"{last.exact_match:.3f}"
            postfix["sampled"] = f"{last.sampled_match or 0:.3f}"
        bar.set_postfix(postfix, refresh=False)
        if cfg.stop_loss is not None and len(state.losses) >= cfg.log_every:
            state.done = state.done or recent < cfg.stop_loss

    def _stable_phase_over(self, state: SftState) -> None:
        """The target is reached (or the cap): cool down, or stop when there is none."""
        if self.cfg.cooldown:
            state.cooldown_from = state.step
        else:
            state.done = True


def _expected_time(cfg: SftConfig, state: SftState) -> str:
    """The expected time, once the first steps are timed."""
    per_step = state.train_s / max(1, state.step - (state.resumed or 0))
    left = (cfg.steps - state.step) * per_step
    cap = "the cap" if cfg.target is not None else "the end"
    return (
        f"sft: {per_step:.2f} s a step here: {cap} ({cfg.steps} steps) in at most "
        f"{left / 60:.1f} min more, held-out checks besides"
    )


def _result(
    cfg: SftConfig, out: Path, state: SftState, precision: Precision, n_train: int, n_held: int
) -> SftResult:
    tail = state.losses[-cfg.log_every :]
    reached = None
    if cfg.target is not None:
        key = "exact_match" if cfg.target_metric == "exact" else "sampled_match"
        reached = any((getattr(c, key) or 0.0) >= cfg.target for c in state.checks)
    return SftResult(
        out_dir=str(out),
        steps=state.step,
        stopped_early=state.step < cfg.steps
        or (state.cooldown_from is not None and state.cooldown_from < cfg.steps),
        final_loss=sum(tail) / len(tail) if tail else math.nan,
        losses=state.losses,
        wall_s=state.wall_s,
        tokens_per_s=state.tokens / state.train_s if state.train_s > 0 else 0.0,
        held_out=state.checks,
        target=cfg.target,
        target_metric=cfg.target_metric,
        target_reached=reached,
        precision=precision.name,
        precision_reason=precision.line(),
        device=cfg.device,
        train_examples=n_train,
        held_out_examples=n_held,
        resumed_at=state.resumed,
    )


def sft_new_or_base(
    demos: Sequence[Demo | EncodedDemo],
    out_dir: str | Path,
    base_dir: str | Path | None,
    cfg: SftConfig,
    resume: bool = False,
    say: Say | None = None,
) -> SftResult:
    """`sft` from `base_dir`, or with none from a new tiny model whose tokenizer is trained on
    the demos' text, saved beside the output as <out_dir>-base (what `tracerl sft` does).
    Examples given as ids need the base whose tokenizer made them."""
    if base_dir is None:
        if any(isinstance(d, EncodedDemo) for d in demos):
            raise ValueError("examples given as token ids need --base (the model that made them)")
        out = Path(out_dir)
        base_dir = out.with_name(out.name + "-base")
        if not (resume and (base_dir / "config.json").exists()):
            texts = [render_chat(d.messages, d.tools) for d in demos if isinstance(d, Demo)]
            build_tiny_model(base_dir, texts, TinyModelConfig())
    return sft(base_dir, demos, out_dir, cfg, resume=resume, say=say)
