"""The whole synchronous RL algorithm, top to bottom, in one screen.

This is what tracerl's pipeline does, without the machinery (packing, LoRA, checkpoints,
metrics, resumption): run the agent through the gateway, merge each rollout's calls into one
sequence whose loss mask covers only sampled tokens, give each rollout a GRPO advantage
within its group, and take one PPO-clip step with truncated importance sampling against the
engine's log-probs. tests/test_loop_minimal.py checks that `update` here and the full
trainer produce the same weights from the same batch.
"""

from __future__ import annotations

import statistics
import uuid
from concurrent.futures import ThreadPoolExecutor

import torch
from transformers import AutoModelForCausalLM

from tracerl.evaluate import run_rollouts
from tracerl.runner import python_agent
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


def rl_loop(
    model_dir: str,
    agent,  # type: ignore[no-untyped-def]  # run(task_input, *, base_url, api_key, model)
    reward,  # type: ignore[no-untyped-def]  # reward(task, answer) -> float
    tasks: list[Task],
    steps: int = 10,
    tasks_per_step: int = 8,
    group_size: int = 8,
    lr: float = 1e-4,
    store_path: str = ":memory:",
) -> None:
    """Train `model_dir` on the agent's tasks: generate, credit, update, publish; repeat."""
    stack = start_stack(model_dir, store_path)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    with ThreadPoolExecutor(32) as threads:
        for step in range(steps):
            batch = [tasks[(step * tasks_per_step + k) % len(tasks)] for k in range(tasks_per_step)]
            rollouts = []
            for task in batch:  # one group per task: its attempts share a baseline
                rollouts += run_rollouts(
                    stack.store, stack.url, python_agent(agent, threads), reward, [task],
                    repeats=group_size, group_id=uuid.uuid4().hex, desc=f"step {step}",
                )  # fmt: skip
            data = [(r.group_id or "", stack.store.spans(r.id), r.reward or 0.0) for r in rollouts]
            loss = update(model, opt, data)
            stack.engine.load_state_dict(model.state_dict(), step + 1)  # type: ignore[attr-defined]
            mean_reward = statistics.fmean(d[2] for d in data)
            print(f"step {step}: reward {mean_reward:.3f} loss {loss:.4f}")
    stack.close()
