"""The whole synchronous RL algorithm, top to bottom, in one screen.

This is what tracerl's pipeline does, without the machinery (packing, LoRA, checkpoints,
metrics, resumption): run the agent through the gateway, merge each rollout's calls into one
sequence whose loss mask covers only sampled tokens, give each rollout a GRPO advantage
within its group, and take one PPO-clip step with truncated importance sampling against the
engine's log-probs. tests/test_loop_minimal.py checks that `update` here and the full
trainer produce the same weights from the same batch, and runs this file for two steps.

    python -m tracerl.loop_minimal [--model DIR] [--steps 3] [--agent file.py:run] ...
"""

from __future__ import annotations

import functools
import statistics
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from pydantic import Field
from pydantic_settings import BaseSettings, CliApp, SettingsConfigDict
from transformers import AutoModelForCausalLM, AutoTokenizer

from tracerl.agents import load_callable, python_agent
from tracerl.demo import example_module
from tracerl.evaluate import run_rollouts
from tracerl.models.template import render_chat
from tracerl.models.tiny import TinyModelConfig, build_tiny_model
from tracerl.stack import start_stack
from tracerl.types import Span, Task


def sequences(spans: list[Span]) -> list[tuple[list[int], list[float], list[float]]]:
    """Calls -> (ids, mask, behaviour log-probs); a call extending the last one is merged."""
    rows: list[tuple[list[int], list[float], list[float]]] = []
    for s in spans:
        if rows and s.prompt_ids[: len(rows[-1][0])] == rows[-1][0]:
            ids, mask, logp = rows[-1]
            new = s.prompt_ids[len(ids) :]  # tool results, user turns: context only
        else:
            ids, mask, logp = [], [], []
            rows.append((ids, mask, logp))
            new = s.prompt_ids
        ids += new + s.completion_ids
        mask += [0.0] * len(new) + [1.0] * len(s.completion_ids)
        logp += [0.0] * len(new) + list(s.logprobs)
    return rows


def grpo(rewards: list[float], eps: float = 1e-6) -> list[float]:
    """(R - mean) / (sample std + eps) within one group; all zero if the group agrees."""
    if len(rewards) < 2 or len(set(rewards)) == 1:
        return [0.0] * len(rewards)
    mean, std = statistics.fmean(rewards), statistics.stdev(rewards)
    return [(r - mean) / (std + eps) for r in rewards]


def update(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batch: list[tuple[str, list[Span], float]],
    clip: tuple[float, float] = (0.2, 0.28),
    tis_cap: float = 2.0,
    max_grad_norm: float = 1.0,
) -> float:
    """One optimizer step on (group id, spans, reward) rollouts; returns the loss."""
    groups: dict[str, list[int]] = {}
    for i, (gid, _, _) in enumerate(batch):
        groups.setdefault(gid, []).append(i)
    adv = [0.0] * len(batch)
    for members in groups.values():
        for i, a in zip(members, grpo([batch[i][2] for i in members]), strict=True):
            adv[i] = a
    total = torch.zeros(())
    weight_sum = 0.0
    for i, (_, spans, _) in enumerate(batch):
        rows = sequences(spans)
        sampled = sum(sum(mask) for _, mask, _ in rows)
        for ids, mask, behaviour in rows:
            x = torch.tensor([ids])
            logits = model(input_ids=x).logits[0, :-1].float()
            logp = torch.log_softmax(logits, -1).gather(1, x[0, 1:, None])[:, 0]
            m, b = torch.tensor(mask[1:]), torch.tensor(behaviour[1:])
            ratio = torch.exp(logp - logp.detach())  # proximal = current weights
            surrogate = -torch.minimum(
                ratio * adv[i], ratio.clamp(1 - clip[0], 1 + clip[1]) * adv[i]
            )
            tis = torch.exp(logp.detach() - b).clamp(max=tis_cap)
            w = m / sampled  # each rollout weighs the same, however many calls it made
            total = total + (w * tis * surrogate).sum()
            weight_sum += float(w.sum())
    loss = total / weight_sum
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def rl_loop(cfg: MinimalConfig, model_dir: str, agent: Any, reward: Any, tasks: list[Task]) -> None:
    """Train `model_dir` on the agent's tasks: generate, credit, update, publish; repeat.

    agent: run(task_input, *, base_url, api_key, model); reward: reward(task, answer).
    """
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    stack = start_stack(model_dir, Path(cfg.out) / "traces.db")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    with ThreadPoolExecutor(32) as threads:
        for step in range(cfg.steps):
            k0 = step * cfg.tasks_per_step
            rollouts = []
            for k in range(k0, k0 + cfg.tasks_per_step):  # one group per task: one baseline
                rollouts += run_rollouts(
                    stack.store, stack.url, python_agent(agent, threads), reward,
                    [tasks[k % len(tasks)]], repeats=cfg.group_size, group_id=uuid.uuid4().hex,
                    desc=f"step {step}",
                )  # fmt: skip
            data = [(r.group_id or "", stack.store.spans(r.id), r.reward or 0.0) for r in rollouts]
            loss = update(model, opt, data)
            version = stack.store.issue_version(["policy"])  # never one spans already carry
            stack.engine.load_state_dict(model.state_dict(), version)
            mean_reward = statistics.fmean(d[2] for d in data)
            print(f"step {step}: reward {mean_reward:.3f} loss {loss:.6g} version {version}")
    model.save_pretrained(Path(cfg.out) / "model")
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(Path(cfg.out) / "model")
    stack.close()


class MinimalConfig(BaseSettings):
    """The one-screen RL loop on the calculator task (examples/calculator), on the CPU."""

    model_config = SettingsConfigDict(
        cli_prog_name="python -m tracerl.loop_minimal", use_attribute_docstrings=True,
        extra="forbid", cli_kebab_case=False, cli_implicit_flags=True, cli_hide_none_type=True,
    )  # fmt: skip

    @classmethod
    def settings_customise_sources(cls, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        # Flags and defaults only: an environment variable such as MODEL must not pick a field.
        return (kwargs["init_settings"],)

    model: str | None = None
    """A local Hugging Face model dir to train (never downloaded); None: a random-init tiny
    model built in `out` (seconds; it learns little, but every stage runs)."""
    out: str = "runs/minimal"
    """Where the store (traces.db), the built model and the trained one (model/) go."""
    agent: str | None = None
    """'file.py:function' called as run(task_input, *, base_url, api_key, model); None:
    the calculator agent."""
    reward: str | None = None
    """'file.py:function' called as reward(task, answer) -> float; None: the calculator's."""
    steps: int = Field(default=3, ge=1)
    """Updates (policy versions published)."""
    tasks_per_step: int = Field(default=4, ge=1)
    """Tasks per step; each is one group."""
    group_size: int = Field(default=4, ge=2)
    """Rollouts per task, compared with each other by GRPO."""
    lr: float = Field(default=1e-4, gt=0)
    """AdamW learning rate."""
    seed: int = 0
    """Seed of the calculator tasks and of the built model."""

    def cli_cmd(self) -> None:
        """Build or take the model, load agent, reward and tasks, train."""
        out = Path(self.out)
        model = self.model or str(_tiny_model(out / "tiny-model", self.seed))
        example = functools.partial(example_module, "calculator")
        agent = load_callable(self.agent) if self.agent else example("agent").run
        reward = load_callable(self.reward) if self.reward else example("reward").reward
        tasks = example("tasks").make_tasks(64, "train", self.seed)
        rl_loop(self, model, agent, reward, [Task.model_validate(t) for t in tasks])


def _tiny_model(out: Path, seed: int) -> Path:
    """A random-init tiny Llama whose tokenizer knows the calculator conversations."""
    demos = example_module("calculator", "expert").demonstrations(300, seed=7)
    texts = [render_chat(d["messages"], d["tools"]) for d in demos]
    return build_tiny_model(out, texts, TinyModelConfig(hidden_size=64, num_layers=2, seed=seed))


if __name__ == "__main__":
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    CliApp.run(MinimalConfig)
