"""TRL's GRPOTrainer against tracerl's synchronous loop: time per step and reward curves.

Both train the same warm-started tiny calculator model (tracerl.demo) from the same weights
on the same single-turn task: the first turn of the calculator conversation (system prompt
with the calculator tool, then "What is 37+48?"), where the model should call
calculator(expression). The reward is 1 when the call's expression is the question's
arithmetic (same operands, same operator), else 0; the demo's warm start calls the tool on
about a third of first turns at temperature 1 (it mostly answers lazily), so the curves have
room to move. `--partial-credit` gives 1/3 each for the left operand, the operator and the
right operand instead.

Same on both sides: tasks per step x group size rollouts per step, max completion tokens,
temperature 1, lr, AdamW betas, grad clip 1, constant schedule, no KL, clip 0.2 / 0.28, one
optimizer step per batch, per-sequence token mean then mean over sequences (TRL
loss_type="grpo" = tracerl normalize="token" + aggregation="token"), group-std scaled
advantages, bf16 autocast for training and fp32 sampling, the same torch thread count.

- tracerl: store + engine + gateway (start_stack), a runner calling an agent that makes
  ONE chat completion through the gateway with the openai client. It runs twice:
  - sync: the Pipeline in sync mode, for `step_time_ratio`;
  - async: as a user runs it, the async pipeline (`max_staleness` steps of lag allowed), for
    `time_to_target_ratio`.
  Generation runs in an engine server process of its own (`--engine-kind hf_server`, the
  default: `tracerl train --engine.kind hf_server`), off the trainer's process and GIL;
  `--engine-kind hf` keeps it in the trainer's process. A step is timed around
  Pipeline.run_step (generate or collect, credit, train, publish weights).
- TRL: GRPOTrainer on CPU (use_vllm False, gradient checkpointing off, no saving, no
  reporting), prompts pre-rendered with the model's chat template and tools; its reward
  parses the completion ids exactly as the gateway parses a reply. A step is timed
  between consecutive on_step_end callbacks.

The first step of each is warm-up and is left out of the times; step time is the median
of the rest (robust to other work on a shared machine). Time to target is the training
clock (the sum of step times, warm-up included, model loading excluded on both sides) at the
end of the first step whose mean reward reaches `--target-reward`. Prints per-step tables,
then one JSON line: step_time_ratio (TRL / tracerl sync), time_to_target_ratio (TRL /
tracerl async), reward_tracerl, reward_trl (mean of the last `--final-window` steps of each
curve), tracerl_step_s, trl_step_s, steps, and more. CPU
seconds per step (all threads) are reported beside wall time: on a shared machine they
move less with other people's work.

    OMP_NUM_THREADS=1 .venv/bin/python bench/vs_trl.py --steps 20
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from openai import DefaultHttpxClient, OpenAI
from pydantic import BaseModel, ConfigDict

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "calculator"))
from agent import SYSTEM_PROMPT, TOOLS  # noqa: E402
from tasks import make_tasks  # noqa: E402

from tracerl.agents import python_agent  # noqa: E402
from tracerl.algorithms.config import AlgorithmConfig  # noqa: E402
from tracerl.algorithms.curation import Curation  # noqa: E402
from tracerl.demo import ensure_calculator_model  # noqa: E402
from tracerl.engines.config import EngineConfig  # noqa: E402
from tracerl.gateway.chat import parse_reply  # noqa: E402
from tracerl.pipeline.async_source import AsyncSource  # noqa: E402
from tracerl.pipeline.checkpoints import Checkpoints  # noqa: E402
from tracerl.pipeline.config import PipelineConfig  # noqa: E402
from tracerl.pipeline.sources import Agents, SyncSource, TaskOrder  # noqa: E402
from tracerl.pipeline.step import Pipeline, Policy  # noqa: E402
from tracerl.runner import RunnerConfig  # noqa: E402
from tracerl.stack import start_stack  # noqa: E402
from tracerl.trainer.config import TrainerConfig  # noqa: E402
from tracerl.trainer.trainer import Trainer  # noqa: E402
from tracerl.types import Task  # noqa: E402

EXPRESSION = re.compile(r"^\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*$")


class BenchConfig(BaseModel):
    """The settings both trainers share."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = ""
    """Local model dir; default: the warm-started calculator model (built once, cached)."""
    steps: int = 20
    """Training steps of each trainer."""
    tasks_per_step: int = 16
    """Prompts per step; each is sampled group_size times."""
    group_size: int = 8
    """Completions per prompt sharing a baseline (TRL num_generations)."""
    max_tokens: int = 32
    """Most tokens per completion (a correct call is ~23)."""
    lr: float = 5e-4
    """AdamW learning rate, constant."""
    threads: int = 1
    """torch intra-op threads for both."""
    concurrency: int = 0
    """tracerl rollouts in flight (runner workers); 0: all of a step's rollouts at once, as
    TRL samples its whole batch in one generate call."""
    bf16: bool = True
    """bf16 autocast for the training forward/backward of both (sampling stays fp32)."""
    partial_credit: bool = False
    """Reward 1/3 per matching operand/operator instead of 1 for the exact expression."""
    final_window: int = 3
    """Final reward = mean of the last this many steps of a curve."""
    seed: int = 0
    """Seed of both runs (task order, sampling, init of anything random)."""
    engine_kind: str = "hf_server"
    """Where tracerl generates: 'hf_server' (a server process of its own) or 'hf' (in the
    trainer's process)."""
    max_staleness: int = 2
    """The async run's allowed lag: a rollout sampled by a policy this many versions old is
    still trained on."""
    target_reward: float = 0.8
    """The mean step reward whose first reaching is timed (time_to_target_ratio)."""


class Curve(BaseModel):
    """One trainer's run: wall time and mean reward of every step."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    """'tracerl' or 'trl'."""
    step_s: list[float]
    """Wall seconds of each step, in order (the first one is warm-up)."""
    cpu_s: list[float]
    """CPU seconds of the whole process (all threads) during each step."""
    rewards: list[float]
    """Mean reward of each step's rollouts (sampled before that step's update)."""

    def step_time(self) -> float:
        """Median wall time of a step after the warm-up step."""
        return statistics.median(self.step_s[1:] or self.step_s)

    def cpu_time(self) -> float:
        """Median CPU time of a step after the warm-up step."""
        return statistics.median(self.cpu_s[1:] or self.cpu_s)

    def final_reward(self, window: int) -> float:
        """Mean reward over the last `window` steps."""
        return statistics.fmean(self.rewards[-window:])

    def time_to(self, target: float) -> float | None:
        """Training seconds until the end of the first step whose reward reached `target`
        (None: never reached)."""
        clock = 0.0
        for seconds, value in zip(self.step_s, self.rewards, strict=True):
            clock += seconds
            if value >= target:
                return clock
        return None


class BenchResult(BaseModel):
    """The last line the bench prints."""

    model_config = ConfigDict(extra="forbid")

    step_time_ratio: float
    """TRL step time / tracerl step time (> 1: tracerl is faster)."""
    reward_tracerl: float
    """tracerl's final reward (mean of the last final_window steps)."""
    reward_trl: float
    """TRL's final reward (same window)."""
    tracerl_step_s: float
    """tracerl median step time after warm-up, seconds."""
    trl_step_s: float
    """TRL median step time after warm-up, seconds."""
    cpu_time_ratio: float
    """TRL / tracerl median CPU seconds (all threads) per step: less sensitive than wall
    time to other work on a shared machine."""
    steps: int
    """Steps each trainer ran."""
    rollouts_per_step: int
    """tasks_per_step x group_size."""
    start_reward_tracerl: float
    """tracerl's first-step reward (the initial policy)."""
    start_reward_trl: float
    """TRL's first-step reward (the initial policy)."""
    time_to_target_ratio: float | None
    """TRL's / tracerl async's training seconds to the first step with mean reward >=
    target_reward (> 1: tracerl gets there sooner); None when either never got there."""
    tracerl_async_time_to_target_s: float | None
    """tracerl (async pipeline) seconds to target."""
    tracerl_sync_time_to_target_s: float | None
    """tracerl (sync pipeline) seconds to target."""
    trl_time_to_target_s: float | None
    """TRL seconds to target."""
    reward_tracerl_async: float
    """The async run's final reward (same window)."""
    target_reward: float
    """The reward timed to."""
    engine_kind: str
    """Where tracerl generated (hf_server: its own process)."""


# ---- the shared task and reward ---------------------------------------------------------


def prompt_messages(question: str) -> list[dict[str, str]]:
    """The first turn of the calculator conversation."""
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]


def bench_tasks(cfg: BenchConfig) -> list[Task]:
    """One epoch's worth of calculator train tasks: each is seen once by each trainer."""
    n = cfg.steps * cfg.tasks_per_step
    return [Task.model_validate(t) for t in make_tasks(n, "train", cfg.seed)]


def tasks_in_step_order(cfg: BenchConfig) -> list[Task]:
    """The tasks in the order tracerl's pipeline takes them, step by step, so that TRL
    (its sampler unshuffled) trains on the same prompts at the same step."""
    order = TaskOrder(bench_tasks(cfg), cfg.tasks_per_step, cfg.seed)
    return [t for step in range(cfg.steps) for t in order.at(step)]


def call_expression(tool_calls: list[dict[str, Any]]) -> str:
    """The `expression` argument of the first tool call ('' when there is none)."""
    if not tool_calls:
        return ""
    args = tool_calls[0].get("arguments")
    return str(args.get("expression", "")) if isinstance(args, dict) else ""


def reward(task: dict[str, Any], expression: str, partial: bool = False) -> float:
    """1 when `expression` is the question's arithmetic, else 0; with `partial`, 1/3 each
    for the left operand, the operator and the right operand."""
    want = EXPRESSION.match(str(task["input"]["question"]).removeprefix("What is ").rstrip("?"))
    got = EXPRESSION.match(expression)
    if want is None or got is None:
        return 0.0
    hits = [a == b for a, b in zip(want.groups(), got.groups(), strict=True)]
    return sum(hits) / 3 if partial else float(all(hits))


# ---- tracerl ----------------------------------------------------------------------------


def first_call_agent(
    task_input: dict[str, Any],
    *,
    base_url: str,
    api_key: str,
    model: str,
    max_tokens: int,
    http: DefaultHttpxClient,
) -> str:
    """One chat completion through the gateway; returns the called expression."""
    # A shared HTTP client: building one per OpenAI() costs ~35 ms of CPU (SSL context).
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=http)
    reply = client.chat.completions.create(
        model=model,
        messages=prompt_messages(str(task_input["question"])),  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        temperature=1.0,
    )
    calls = reply.choices[0].message.tool_calls or []
    parsed = [
        {"arguments": _json_object(c.function.arguments)} for c in calls if c.type == "function"
    ]
    return call_expression(parsed)


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def run_tracerl(cfg: BenchConfig, model_dir: Path, work: Path, mode: str = "sync") -> Curve:
    """The `mode` pipeline for cfg.steps steps; each step timed around Pipeline.run_step."""
    torch.manual_seed(cfg.seed)
    work.mkdir(parents=True, exist_ok=True)
    batch = cfg.tasks_per_step * cfg.group_size
    concurrency = cfg.concurrency or batch
    engine_cfg = EngineConfig(
        kind=cfg.engine_kind,  # type: ignore[arg-type]
        max_batch_size=batch,
        default_max_tokens=cfg.max_tokens,
        seed=cfg.seed,
        log_dir=str(work / "engine-logs"),
    )
    stack = start_stack(model_dir, work / "traces.db", engine_cfg)
    threads = ThreadPoolExecutor(concurrency)
    http = DefaultHttpxClient()
    source: SyncSource | AsyncSource | None = None
    try:
        call = functools.partial(first_call_agent, max_tokens=cfg.max_tokens, http=http)
        agent = python_agent(call, threads)
        pipe_cfg = PipelineConfig(
            steps=cfg.steps,
            tasks_per_step=cfg.tasks_per_step,
            group_size=cfg.group_size,
            eval_every=0,
            checkpoint_every=cfg.steps,  # like TRL with saving off: one save, at the end
            seed=cfg.seed,
        )
        trainer_cfg = TrainerConfig(lr=cfg.lr, bf16=cfg.bf16, seed=cfg.seed)
        rewarder = functools.partial(reward, partial=cfg.partial_credit)
        agents = Agents(stack.url, agent, rewarder, RunnerConfig(concurrency=concurrency))
        order = TaskOrder(bench_tasks(cfg), pipe_cfg.tasks_per_step, pipe_cfg.seed)
        curation = Curation([], pipe_cfg.group_size)
        trainer = Trainer(model_dir, trainer_cfg)
        source = SyncSource("bench", stack.store, agents, order, curation)
        if mode == "async":  # keeps generating while the trainer trains
            source = AsyncSource(
                "bench", stack.store, agents, order, curation, lambda: trainer.version,
                max_staleness=cfg.max_staleness,
            )  # fmt: skip
        policy = Policy("policy", trainer, stack.engine, ["policy"])
        pipeline = Pipeline(
            source,
            stack.store,
            [policy],
            AlgorithmConfig().build(),
            curation,
            Checkpoints(work / "run", keep=1),
            pipe_cfg,
        )
        step_s, cpu_s, rewards = [], [], []
        for _ in range(cfg.steps):
            started, cpu = time.perf_counter(), time.process_time()
            report = pipeline.run_step()
            step_s.append(time.perf_counter() - started)
            cpu_s.append(time.process_time() - cpu)
            rewards.append(report.reward)
            _progress(f"tracerl {mode}", len(rewards), cfg.steps, step_s[-1], report.reward)
        return Curve(name=f"tracerl {mode}", step_s=step_s, cpu_s=cpu_s, rewards=rewards)
    finally:
        if source is not None:
            source.close()
        threads.shutdown(wait=False, cancel_futures=True)
        http.close()
        stack.close()


# ---- TRL --------------------------------------------------------------------------------


def gateway_text(tokenizer: Any, ids: list[int]) -> str:
    """The completion text as the gateway hands it to parse_reply (tool-call tags kept)."""
    text = tokenizer.decode(ids, skip_special_tokens=False)
    for token in tokenizer.all_special_tokens:
        if "tool_call" not in token:
            text = text.replace(token, "")
    return text


def run_trl(cfg: BenchConfig, model_dir: Path, work: Path) -> Curve:
    """GRPOTrainer for cfg.steps steps; each step timed between on_step_end callbacks."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tasks = tasks_in_step_order(cfg)
    rows = [
        {
            # Pre-rendered: TRL's `tools` argument would also run the calls (multi-turn).
            "prompt": tokenizer.apply_chat_template(
                prompt_messages(str(t.input["question"])),
                tools=TOOLS,
                add_generation_prompt=True,
                tokenize=False,
            ),
            "question": t.input["question"],
        }
        for t in tasks
    ]

    def calculator_reward(completion_ids: list[list[int]], question: list[str], **_: Any):
        out = []
        for ids, q in zip(completion_ids, question, strict=True):
            reply = parse_reply(gateway_text(tokenizer, ids), tools_given=True)
            task = {"input": {"question": q}}
            out.append(reward(task, call_expression(reply.tool_calls), cfg.partial_credit))
        return out

    clock = _StepClock(TrainerCallback)
    batch = cfg.tasks_per_step * cfg.group_size
    args = GRPOConfig(
        output_dir=str(work / "trl"),
        use_cpu=True,
        use_vllm=False,
        bf16=cfg.bf16,
        gradient_checkpointing=False,
        max_steps=cfg.steps,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        shuffle_dataset=False,  # the dataset is already in tracerl's step order
        num_generations=cfg.group_size,
        max_completion_length=cfg.max_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=cfg.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=0.9,
        adam_beta2=0.99,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="grpo",
        scale_rewards="group",
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=cfg.seed,
        data_seed=cfg.seed,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=calculator_reward,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[clock.callback],
    )
    trainer.remove_callback(PrinterCallback)  # it prints every log dict; we print our own line
    clock.total = cfg.steps
    trainer.train()
    return Curve(name="trl", step_s=clock.step_s, cpu_s=clock.cpu_s, rewards=clock.rewards)


class _StepClock:
    """Step wall times and logged rewards from TRL's callbacks."""

    def __init__(self, base: type) -> None:
        self.step_s: list[float] = []
        self.cpu_s: list[float] = []
        self.rewards: list[float] = []
        self.total = 0
        self._last = (0.0, 0.0)
        clock = self

        class Callback(base):  # type: ignore[misc, valid-type]
            def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                clock._last = (time.perf_counter(), time.process_time())

            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                now = (time.perf_counter(), time.process_time())
                clock.step_s.append(now[0] - clock._last[0])
                clock.cpu_s.append(now[1] - clock._last[1])
                clock._last = now

            def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any):
                if logs and "reward" in logs:
                    clock.rewards.append(float(logs["reward"]))
                    n = len(clock.rewards)
                    _progress("trl", n, clock.total, clock.step_s[n - 1], clock.rewards[-1])

        self.callback = Callback()


# ---- the comparison ---------------------------------------------------------------------


def _progress(name: str, step: int, total: int, seconds: float, value: float) -> None:
    print(f"  {name:8s} step {step:3d}/{total}  {seconds:6.2f} s  reward {value:.3f}", flush=True)


def compare(cfg: BenchConfig, work: Path) -> BenchResult:
    """Run both trainers and put their numbers side by side."""
    torch.set_num_threads(cfg.threads)
    model_dir = Path(cfg.model) if cfg.model else ensure_calculator_model()
    ours = run_tracerl(cfg, model_dir, work / "tracerl")
    asynchronous = run_tracerl(cfg, model_dir, work / "tracerl-async", mode="async")
    theirs = run_trl(cfg, model_dir, work / "trl")
    if len(theirs.rewards) != cfg.steps or len(theirs.step_s) != cfg.steps:
        raise RuntimeError(f"TRL logged {len(theirs.rewards)} rewards in {cfg.steps} steps")
    print_table(ours, theirs)
    print_table(asynchronous, theirs)
    w = max(1, min(cfg.final_window, cfg.steps))
    t_async, t_trl = asynchronous.time_to(cfg.target_reward), theirs.time_to(cfg.target_reward)
    return BenchResult(
        step_time_ratio=theirs.step_time() / ours.step_time(),
        reward_tracerl=ours.final_reward(w),
        reward_trl=theirs.final_reward(w),
        tracerl_step_s=ours.step_time(),
        trl_step_s=theirs.step_time(),
        cpu_time_ratio=theirs.cpu_time() / ours.cpu_time(),
        steps=cfg.steps,
        rollouts_per_step=cfg.tasks_per_step * cfg.group_size,
        start_reward_tracerl=ours.rewards[0],
        start_reward_trl=theirs.rewards[0],
        time_to_target_ratio=t_trl / t_async if t_trl and t_async else None,
        tracerl_async_time_to_target_s=t_async,
        tracerl_sync_time_to_target_s=ours.time_to(cfg.target_reward),
        trl_time_to_target_s=t_trl,
        reward_tracerl_async=asynchronous.final_reward(w),
        target_reward=cfg.target_reward,
        engine_kind=cfg.engine_kind,
    )


def print_table(ours: Curve, theirs: Curve) -> None:
    """Per-step rewards, wall and CPU seconds of both, side by side."""
    print(f"{ours.name} against {theirs.name}")
    head = ["step", "reward tracerl", "reward trl", "wall tracerl", "wall trl"]
    print("  ".join(f"{h:>14}" for h in [*head, "cpu tracerl", "cpu trl"]))
    columns = (ours.rewards, theirs.rewards, ours.step_s, theirs.step_s, ours.cpu_s, theirs.cpu_s)
    for i, values in enumerate(zip(*columns, strict=True), start=1):
        print(f"{i:>14}  " + "  ".join(f"{v:>14.3f}" for v in values))
    print(
        f"median after warm-up: tracerl {ours.step_time():.2f} s wall {ours.cpu_time():.2f} s cpu,"
        f" trl {theirs.step_time():.2f} s wall {theirs.cpu_time():.2f} s cpu"
    )


def main(argv: list[str] | None = None) -> BenchResult:
    """Parse flags (one per BenchConfig field), run, print the table and the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, field in BenchConfig.model_fields.items():
        flag = f"--{name.replace('_', '-')}"
        if field.annotation is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=field.description)
        else:
            parse = {int: int, float: float}.get(field.annotation, str)  # type: ignore[arg-type]
            parser.add_argument(flag, type=parse, help=field.description)
    given = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
    cfg = BenchConfig(**given)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory(prefix="tracerl-vs-trl-") as tmp:
        result = compare(cfg, Path(tmp))
    print(result.model_dump_json())
    return result


if __name__ == "__main__":
    main()
