"""Shared-prefix (tree) training against one row per rollout, on a framework-style agent.

Rows (built synthetically, token ids from the tiny model's own tokenizer and chat template):
each group is one task of an agent whose system prompt is what agent frameworks send on
every call: instructions plus the full JSON schemas of a dozen tools, ~1,500 tokens, then
the task. The group's `group_size` rollouts then differ: 2-4 tool calls (sampled, mask 1),
each followed by the tool's result (mask 0), then a final answer (sampled): ~100-300
tokens each. Behaviour log-probs are the model's own plus noise (a slightly stale policy);
GRPO writes the advantages from random rewards.

The same rows are trained two ways: `TrainerConfig.prefix_sharing` off (each row forwards
its whole prompt) and on (tracerl.trainer.prefix: the shared prefix once per tree, each
branch on its broadcast KV cache).

Measures
- token_ratio: tokens forwarded off / on (`Gradients.tokens`, padding excluded).
- step_time_ratio: median over alternating pairs of `Trainer.train` wall time, off / on
  (one warm-up step each first; fp32, as for the differences).
- max_rel_loss_diff: |loss_on - loss_off| / |loss_off| from `loss_and_grads`, on each
  half of the shuffled rows (the mini-batches of `minibatches=2`). On the whole batch the
  PPO ratio is 1 and each rollout's weight is 1 while GRPO's advantages sum to zero over
  each group, so the loss is a sum of terms ~1 that cancel to ~1e-4: its relative
  difference measures fp32 rounding of that sum, not the method. It is reported apart
  (`rel_loss_diff_full_batch`), beside the plain path compared with itself at half the
  micro-batch budget (`rel_loss_diff_plain_rebatched`) and with float64 weights.
- max_rel_grad_diff: the largest over parameter tensors of |g_on - g_off| / |g_off| (L2),
  before clipping and AdamW, which would hide differences; over the whole batch and both
  halves. Repeated with float64 weights (`*_fp64`).
The last line printed is one JSON object (PrefixReport).

--recorded: the rows are recorded, not built. A gateway stack (tracerl.stack, in-process
hf engine) serves the long-context test model (tracerl.models.longctx: 32k positions, an
8k-token vocabulary); smolagents' ToolCallingAgent, unchanged, with its own system prompt
(instructions and four workspace tools' descriptions: ~1,450 tokens with the task in this
tokenizer), plays `group_size` rollouts of each of `groups` tasks through tracerl's runner,
at temperature 1, `max_tokens` per call, `max_steps` steps (then smolagents' own
final-answer call). The spans in the store become rows as a training step makes them
(`rows_for`, GRPO; rewards 0/1 alternating in finishing order, so every group's advantages
are nonzero), behaviour log-probs as recorded. A rollout gives one row per run of calls
that extend each other: the calls after a truncated tool call and the final-answer call
(a system prompt of its own) start new rows. The same measures then run on the
long-context model; `prefix_tokens` is the longest prefix two rows of a group share (the
least over groups): the framework's system prompt and the task.

    .venv/bin/python bench/prefix_tree.py [--groups 2 --group-size 8 --reps 3 --threads 2]
    .venv/bin/python bench/prefix_tree.py --recorded [--max-tokens 96 --max-steps 2]

Runs with OMP_WAIT_POLICY=PASSIVE unless the caller sets it (see `tracerl.ensure_passive_omp`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.utils import logging as hf_logging

from tracerl import ensure_passive_omp
from tracerl.agents import python_agent
from tracerl.algorithms import GRPO, compute_advantages
from tracerl.algorithms.rows import rows_for
from tracerl.models import TinyModelConfig, build_tiny_model, format_tool_call, render_chat
from tracerl.models.longctx import ensure_long_context_model
from tracerl.pipeline.sources import issue_group, read_finished
from tracerl.runner import Runner, RunnerConfig
from tracerl.stack import start_stack
from tracerl.trainer.gradients import forward_logprobs, loss_and_grads
from tracerl.trainer.packing import pack
from tracerl.trainer.trainer import Trainer, TrainerConfig
from tracerl.types import Group, Task, Transition

WORDS = [
    *("file", "path", "query", "result", "user", "repository", "branch", "commit", "issue"),
    *("page", "limit", "offset", "format", "timeout", "language", "pattern", "recursive"),
    *("encoding", "content", "line", "column", "range", "status", "token"),
]


class PrefixConfig(BaseModel):
    """What to measure; every field is also a --flag."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    groups: int = 2
    """Tasks in the batch, each with group_size rollouts."""
    group_size: int = 8
    """Rollouts per task (GRPO group)."""
    tools: int = 5
    """Tool schemas in the system prompt (sets the prefix length, ~260 tokens each)."""
    reps: int = 3
    """Timed Trainer.train steps per form (after one warm-up each), alternating forms."""
    micro_batch_tokens: int = 8192
    """Trainer micro-batch budget, as TrainerConfig's default."""
    threads: int = 2
    """torch threads."""
    device: str = "cpu"
    """Where the model trains ('cuda' on a GPU machine)."""
    seed: int = 0
    """Seed of tools, tasks, branches and noise, and of the halves' shuffle."""
    recorded: bool = False
    """Rows recorded from a real framework agent through the gateway (see the docstring),
    not built synthetically."""
    max_tokens: int = 96
    """Recorded: sampled tokens per model call at most."""
    max_steps: int = 2
    """Recorded: the agent's step cap (smolagents adds a final-answer call after it)."""


class PrefixReport(BaseModel):
    """The bench's result, printed as the last line."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    token_ratio: float
    """Tokens forwarded one row per rollout / with the shared prefix."""
    step_time_ratio: float
    """Median over alternating pairs of Trainer.train wall time, off / on."""
    max_rel_loss_diff: float
    """|loss_on - loss_off| / |loss_off| (`loss_and_grads`, fp32)."""
    max_rel_grad_diff: float
    """Largest per-tensor |g_on - g_off| / |g_off| (fp32)."""
    max_abs_logp_diff: float
    """Largest difference of a token's log-prob between the two forms."""
    rel_loss_diff_full_batch: float
    """|loss_on - loss_off| / |loss_off| over the whole batch (a cancelled sum, fp32)."""
    rel_loss_diff_fp64: float
    """The whole batch's loss difference with float64 weights (log-softmax still fp32)."""
    max_rel_grad_diff_fp64: float
    """The per-tensor gradient difference with float64 weights."""
    rel_loss_diff_plain_rebatched: float
    """The plain path against itself with half the micro-batch budget, whole batch (fp32):
    the rounding that batch shapes alone cause, for scale."""
    loss_full_batch: float
    """The whole batch's loss (prefix sharing off)."""
    loss_halves: list[float]
    """Each half's loss (prefix sharing off)."""
    tokens_off: int
    """Tokens forwarded one row per rollout."""
    tokens_on: int
    """Tokens forwarded with the shared prefix."""
    prefix_tokens: int
    """Tokens of the system prompt + tools (before the task); recorded: the longest prefix two
    rows of a group share (the least over groups)."""
    mean_branch_tokens: float
    """Mean tokens of a rollout after its group's prompt (recorded: of a row after the
    tokens it shares)."""
    step_s_off: float
    """Median Trainer.train wall time, prefix sharing off."""
    step_s_on: float
    """Median Trainer.train wall time, prefix sharing on."""
    micro_batches_off: int
    """Micro-batches (forward passes) per step, off."""
    micro_batches_on: int
    """Micro-batches (trees or plain) per step, on."""
    rows: int
    """Rows in the batch (groups x group_size)."""
    device: str
    """Where it ran."""
    threads: int
    """torch threads."""
    load_avg_1m: float
    """1-minute load average at the end (the machine is shared: > threads means noise)."""
    mode: str = "synthetic"
    """"synthetic" (rows built here) or "recorded" (rows from an agent's recorded spans)."""
    framework: str = ""
    """Recorded: the agent framework whose rollouts were recorded."""
    rollouts: int = 0
    """Recorded: rollouts with an outcome (each gives one or more rows)."""
    calls_per_rollout: float = 0.0
    """Recorded: model calls per rollout."""
    wall_s_record: float = 0.0
    """Recorded: wall time of playing the rollouts."""


# ---------------------------------------------------------------- rows


def tool_schemas(rng: random.Random, n: int) -> list[dict]:
    """n OpenAI-style function tools with several described parameters each."""
    tools = []
    for k in range(n):
        props = {
            w: {"type": rng.choice(["string", "integer", "boolean"]), "description": _says(rng)}
            for w in rng.sample(WORDS, rng.randint(3, 5))
        }
        fn = {"name": f"{rng.choice(WORDS)}_{rng.choice(WORDS)}_{k}", "description": _says(rng)}
        fn["parameters"] = {"type": "object", "properties": props, "required": list(props)[:1]}
        tools.append({"type": "function", "function": fn})
    return tools


def _says(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 10))).capitalize() + "."


def system_prompt(tools: list[dict]) -> str:
    """Instructions plus every tool's full JSON schema, as agent frameworks send them."""
    rules = "Think step by step. Call one tool at a time and wait for its result. "
    return (rules * 3) + "You have access to these tools:\n" + json.dumps(tools, indent=1)


def rollout(rng: random.Random, tools: list[dict]) -> list[dict]:
    """The messages after the task: 2-4 tool calls with their results, then an answer."""
    msgs: list[dict] = []
    for _ in range(rng.randint(2, 4)):
        fn = rng.choice(tools)["function"]
        args = {p: rng.choice(WORDS) for p in fn["parameters"]["properties"]}
        msgs.append({"role": "assistant", "content": format_tool_call(fn["name"], args)})
        msgs.append({"role": "tool", "content": _says(rng) + " " + _says(rng)})
    msgs.append({"role": "assistant", "content": _says(rng)})
    return msgs


def encode(tok: AutoTokenizer, prompt: list[dict], after: list[dict], tools: list[dict]):
    """input_ids and loss_mask: the prompt, then each message tokenized on its own, mask 1
    on the assistant's text (not its role header)."""
    ids = tok(render_chat(prompt, tools), add_special_tokens=False)["input_ids"]
    mask = [0] * len(ids)
    for m in after:
        piece = tok(render_chat([m]), add_special_tokens=False)["input_ids"]
        ids += piece
        sampled = m["role"] == "assistant"
        mask += [0] + [int(sampled)] * (len(piece) - 1)
    return ids, mask


def build_rows(cfg: PrefixConfig, out_dir: Path) -> tuple[Path, list[Transition], int]:
    """The tiny model (tokenizer trained on these conversations) and the batch's rows."""
    rng = random.Random(cfg.seed)
    tools = tool_schemas(rng, cfg.tools)
    system = {"role": "system", "content": system_prompt(tools)}
    tasks = [{"role": "user", "content": _says(rng) + " " + _says(rng)} for _ in range(cfg.groups)]
    convs = [[rollout(rng, tools) for _ in range(cfg.group_size)] for _ in tasks]
    texts = [
        render_chat([system, t, *c], tools) for t, cs in zip(tasks, convs, strict=True) for c in cs
    ]
    mcfg = TinyModelConfig(max_position=4096, seed=cfg.seed)
    model_dir = build_tiny_model(out_dir / "model", texts, mcfg)
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = []
    for g, (task, cs) in enumerate(zip(tasks, convs, strict=True)):
        for k, after in enumerate(cs):
            ids, mask = encode(tok, [system, task], after, tools)
            rows.append(_row(f"g{g}", f"g{g}-r{k}", ids, mask, float(rng.random() < 0.5)))
    prefix_tokens = len(tok(render_chat([system], tools), add_special_tokens=False)["input_ids"])
    return model_dir, compute_advantages(GRPO(), rows), prefix_tokens


def _row(gid: str, rid: str, ids: list[int], mask: list[int], reward: float) -> Transition:
    return Transition(
        rollout_id=rid, group_id=gid, task_id=gid, role="policy", input_ids=ids,
        loss_mask=mask, behaviour_logprobs=[0.0] * len(ids),
        versions=[0 if k else -1 for k in mask], advantages=[0.0] * len(ids),
        reward=reward, span_ids=[rid], num_spans=1,
    )  # fmt: skip


def with_behaviour(model: PreTrainedModel, rows: list[Transition], seed: int) -> list[Transition]:
    """Behaviour log-probs = the model's own + U(-0.05, 0.05) on sampled tokens."""
    rng, out = random.Random(seed), list(rows)
    with torch.no_grad():
        for mb in pack(rows, 8192):
            logp_BT = forward_logprobs(model, mb, bf16=False).cpu()
            for b, i in enumerate(mb.row_indices):
                m = rows[i].loss_mask
                beh = [
                    (float(x) + rng.uniform(-0.05, 0.05)) * k
                    for x, k in zip(logp_BT[b], m, strict=False)
                ]
                out[i] = rows[i].model_copy(update={"behaviour_logprobs": beh})
    return out


# ---------------------------------------------------------------- recorded rows

TASKS = [
    "Read src/app.py and summarise what it does.",
    "Find where the command-line parser is defined and list its options.",
    "Run the tests of the parser and report which ones fail.",
    "Search the repository for TODO comments and list the files holding them.",
]


def smolagents_agent(p: PrefixConfig) -> Callable[..., str]:
    """A tracerl agent function running smolagents' ToolCallingAgent, unchanged, against
    `base_url` (which carries the rollout), with four workspace tools."""
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    @tool
    def read_file(path: str) -> str:
        """Read a file of the workspace and return its text.

        Args:
            path: The file's path, relative to the workspace root.
        """
        return "def main():\n    return 0\n"

    @tool
    def list_directory(path: str, recursive: bool) -> str:
        """List the files and folders under a directory of the workspace.

        Args:
            path: The directory's path, relative to the workspace root.
            recursive: Whether to list sub-directories' contents too.
        """
        return "src/app.py\nsrc/cli.py\ntests/test_parser.py\n"

    @tool
    def search_code(pattern: str, path: str) -> str:
        """Search the workspace's files for a regular expression; returns matching lines.

        Args:
            pattern: The regular expression to look for.
            path: The directory to search in, relative to the workspace root.
        """
        return "src/cli.py:12: parser = argparse.ArgumentParser()\n"

    @tool
    def run_tests(path: str, timeout: int) -> str:
        """Run the test suite (or one test file) and return its summary line.

        Args:
            path: A test file or directory, relative to the workspace root.
            timeout: Seconds the run may take.
        """
        return "3 passed, 1 failed in 0.4s"

    tools = [read_file, list_directory, search_code, run_tests]

    def run(task_input: dict, *, base_url: str, api_key: str, model: str) -> str:
        llm = OpenAIServerModel(
            model_id=model, api_base=base_url, api_key=api_key,
            client_kwargs={"max_retries": 0}, max_tokens=p.max_tokens, temperature=1.0,
        )  # fmt: skip
        agent = ToolCallingAgent(tools=tools, model=llm, max_steps=p.max_steps, verbosity_level=-1)
        return str(agent.run(str(task_input["prompt"])))

    return run


def record_rows(p: PrefixConfig, out_dir: Path) -> tuple[Path, list[Transition], dict]:
    """The long-context model and rows made, as a training step makes them, from
    `group_size` recorded smolagents rollouts of each of `groups` tasks."""
    model_dir = ensure_long_context_model()
    finished: dict[str, int] = {}
    lock = threading.Lock()

    def reward(task: dict, answer: str) -> float:
        """1 for every other rollout of a task to finish: each group holds both rewards, so
        GRPO's advantages are nonzero (the answer is not judged)."""
        with lock:
            k = finished[task["id"]] = finished.get(task["id"], -1) + 1
        return float(k % 2)

    stack = start_stack(model_dir, out_dir / "traces.db")
    threads = ThreadPoolExecutor(p.group_size * p.groups)
    started = time.perf_counter()
    try:
        tasks = [Task(id=f"t{g}", input={"prompt": TASKS[g % len(TASKS)]}) for g in range(p.groups)]
        for task in tasks:
            issue_group(stack.store, f"g-{task.id}", task, p.group_size, max_attempts=1)
        agent = python_agent(smolagents_agent(p), threads)
        cfg = RunnerConfig(concurrency=p.group_size * p.groups, timeout_s=600)
        asyncio.run(Runner(stack.store, stack.url, agent, reward, cfg).run(until_idle=True))
        groups = [
            Group(id=f"g-{t.id}", task=t, rollouts=[
                read_finished(stack.store, r) for r in stack.store.rollouts(group_id=f"g-{t.id}")
            ]) for t in tasks
        ]  # fmt: skip
    finally:
        wall = time.perf_counter() - started
        threads.shutdown()
        stack.close()
    done = [f for g in groups for f in g.with_outcome()]
    info = {
        "framework": "smolagents.ToolCallingAgent",
        "rollouts": len(done),
        "calls_per_rollout": sum(len(f.spans) for f in done) / max(len(done), 1),
        "wall_s_record": wall,
    }
    return model_dir, rows_for(groups, GRPO()), info


def shared_prefixes(rows: list[Transition]) -> list[int]:
    """Per row: the most tokens it starts with in common with another row of its group (what
    a tree can forward once for it). Not one prefix per group: a framework's later calls
    (smolagents' final-answer call has a system prompt of its own) start other trees."""
    out = []
    for r in rows:
        mates = [o.input_ids for o in rows if o.group_id == r.group_id and o is not r]
        out.append(max((_common(r.input_ids, o) for o in mates), default=0))
    return out


def _common(a: list[int], b: list[int]) -> int:
    return next(
        (k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


# ---------------------------------------------------------------- measures


def diffs(
    model: PreTrainedModel, rows: list[Transition], cfg: TrainerConfig, other: TrainerConfig
) -> dict:
    """Loss, gradient and log-prob differences of `other` against `cfg`, and tokens."""
    outs, grads = [], []
    for c in (cfg, other):
        model.zero_grad(set_to_none=True)
        outs.append(loss_and_grads(model, rows, c))
        grads.append([p.grad.detach().clone() for p in model.parameters() if p.grad is not None])
    off, on = outs
    rel_g = max(float((b - a).norm() / a.norm()) for a, b in zip(*grads, strict=True))
    logp = max(float((a - b).abs().max()) for a, b in zip(off.logp_rows, on.logp_rows, strict=True))
    return {
        "max_rel_loss_diff": abs(on.loss - off.loss) / abs(off.loss),
        "loss": off.loss,
        "max_rel_grad_diff": rel_g,
        "max_abs_logp_diff": logp,
        "tokens_off": off.tokens,
        "tokens_on": on.tokens,
        "micro_batches_off": len(off.metrics),
        "micro_batches_on": len(on.metrics),
    }


def timed_steps(model_dir: Path, rows: list[Transition], cfg: TrainerConfig, p: PrefixConfig):
    """Median Trainer.train seconds per form and the median of the pairs' ratios off / on."""
    trainers = [
        Trainer(model_dir, cfg.model_copy(update={"prefix_sharing": on}), p.device)
        for on in (False, True)
    ]
    for t in trainers:
        t.train(rows)  # warm-up
    pairs = [[t.train(rows).wall_s for t in trainers] for _ in range(p.reps)]
    off, on = zip(*pairs, strict=True)
    ratio = statistics.median(a / b for a, b in pairs)
    return statistics.median(off), statistics.median(on), ratio


def measure(p: PrefixConfig, model: PreTrainedModel, model_dir: Path, rows: list[Transition]):
    """Every measure of the report on these rows, prefix sharing off against on."""
    cfg = TrainerConfig(bf16=False, micro_batch_tokens=p.micro_batch_tokens)
    tree = cfg.model_copy(update={"prefix_sharing": True})
    d = diffs(model, rows, cfg, tree)
    order = random.Random(p.seed).sample(range(len(rows)), len(rows))
    halves = [[rows[i] for i in order[k::2]] for k in (0, 1)]
    dh = [diffs(model, h, cfg, tree) for h in halves]
    half = cfg.model_copy(update={"micro_batch_tokens": p.micro_batch_tokens // 2})
    rebatched = diffs(model, rows, cfg, half)["max_rel_loss_diff"]
    fp64 = diffs(model.double(), rows, cfg, tree)
    s_off, s_on, ratio = timed_steps(model_dir, rows, cfg, p)
    whole = d.pop("max_rel_loss_diff"), d.pop("max_rel_grad_diff"), d.pop("loss")
    return {
        "token_ratio": d["tokens_off"] / d["tokens_on"],
        "step_time_ratio": ratio,
        "max_rel_loss_diff": max(x["max_rel_loss_diff"] for x in dh),
        "max_rel_grad_diff": max(whole[1], *(x["max_rel_grad_diff"] for x in dh)),
        "rel_loss_diff_full_batch": whole[0],
        "loss_full_batch": whole[2],
        "loss_halves": [x["loss"] for x in dh],
        **d,
        "rel_loss_diff_fp64": fp64["max_rel_loss_diff"],
        "max_rel_grad_diff_fp64": fp64["max_rel_grad_diff"],
        "rel_loss_diff_plain_rebatched": rebatched,
        "step_s_off": s_off,
        "step_s_on": s_on,
    }


def run(p: PrefixConfig) -> PrefixReport:
    torch.set_num_threads(p.threads)
    hf_logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmp:
        if p.recorded:
            model_dir, rows, about = record_rows(p, Path(tmp))
            model = _trainable(model_dir, p.device)
            shared = shared_prefixes(rows)
            prefix_tokens = min(
                max(k for r, k in zip(rows, shared, strict=True) if r.group_id == g)
                for g in {r.group_id for r in rows}
            )
            branch = statistics.mean(
                len(r.input_ids) - k for r, k in zip(rows, shared, strict=True)
            )
            about["mode"] = "recorded"
        else:
            model_dir, rows, prefix_tokens = build_rows(p, Path(tmp))
            model = _trainable(model_dir, p.device)
            rows = with_behaviour(model, rows, p.seed)
            prompt = min(len(r.input_ids) - _branch_len(r) for r in rows)
            branch = statistics.mean(len(r.input_ids) - prompt for r in rows)
            about = {}
        measured = measure(p, model, model_dir, rows)
    return PrefixReport(
        **measured,
        prefix_tokens=prefix_tokens,
        mean_branch_tokens=branch,
        rows=len(rows),
        device=p.device,
        threads=p.threads,
        load_avg_1m=os.getloadavg()[0],
        **about,
    )


def _trainable(model_dir: Path, device: str) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.to(device).train()  # type: ignore[arg-type]


def _branch_len(row: Transition) -> int:
    """Tokens from the row's first sampled token on (its prompt is what comes before)."""
    return len(row.input_ids) - row.loss_mask.index(1) + 1


def _parse_args() -> PrefixConfig:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, field in PrefixConfig.model_fields.items():
        flag = f"--{name.replace('_', '-')}"
        if isinstance(field.default, bool):
            parser.add_argument(flag, action="store_true", default=None)
        else:
            parser.add_argument(flag, type=type(field.default))
    given = {k: v for k, v in vars(parser.parse_args()).items() if v is not None}
    return PrefixConfig(**given)


def main() -> None:
    ensure_passive_omp()
    hf_logging.disable_progress_bar()
    r = run(_parse_args())
    if r.mode == "recorded":
        print(
            f"{r.framework}: {r.rollouts} rollouts, {r.calls_per_rollout:.1f} calls each,"
            f" recorded in {r.wall_s_record:.0f}s"
        )
    print(
        f"{r.rows} rows, prefix {r.prefix_tokens} tokens, branches {r.mean_branch_tokens:.0f}:"
        f" tokens {r.tokens_off} -> {r.tokens_on} ({r.token_ratio:.2f}x), step"
        f" {r.step_s_off:.2f}s -> {r.step_s_on:.2f}s ({r.step_time_ratio:.2f}x), loss rel diff"
        f" {r.max_rel_loss_diff:.1e} (whole batch {r.rel_loss_diff_full_batch:.1e}, fp64"
        f" {r.rel_loss_diff_fp64:.1e}, plain vs plain {r.rel_loss_diff_plain_rebatched:.1e}), grad rel diff {r.max_rel_grad_diff:.1e}"
        f" (fp64 {r.max_rel_grad_diff_fp64:.1e})"
    )
    print(r.model_dump_json())


if __name__ == "__main__":
    main()
