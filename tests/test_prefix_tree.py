"""Shared-prefix (tree) training changes the tokens forwarded, not the update.

With `TrainerConfig.prefix_sharing` the rows that share a prefix are forwarded as trees
(tracerl.trainer.prefix): the prefix once, each row's branch on its broadcast KV cache.
Every token keeps its context and position, so the loss, every parameter's gradient and
each row's log-probs must equal those of one row per rollout (the plain path), in fp32,
on the production function `loss_and_grads` and on a whole `Trainer.train` step.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from tracerl.trainer.config import LossConfig, TrainerConfig
from tracerl.trainer.gradients import (
    Gradients,
    backward_micro_batches,
    forward_logprobs,
    loss_and_grads,
    loss_denominator,
)
from tracerl.trainer.packing import pack
from tracerl.trainer.prefix import TreeBatch, forwarded_tokens, plan
from tracerl.trainer.trainer import Trainer
from tracerl.types import Transition

TOL = 1e-5
# Small enough that a step spans several micro-batches and trees.
CFG = TrainerConfig(bf16=False, micro_batch_tokens=640)


def _row(rid: str, ids: list[int], mask: list[int], rng: random.Random) -> Transition:
    adv = rng.choice([-1.0, 1.0]) * rng.uniform(0.5, 1.5)
    return Transition(
        rollout_id=rid, group_id=rid[:2], task_id=rid[:2], role="policy", input_ids=ids,
        loss_mask=mask, behaviour_logprobs=[0.0] * len(ids),
        versions=[0 if k else -1 for k in mask], advantages=[adv * k for k in mask],
        reward=0.0, span_ids=[rid], num_spans=1, weight=rng.uniform(0.5, 1.0),
    )  # fmt: skip


def _branch(rng: random.Random, vocab: int, turns: int) -> tuple[list[int], list[int]]:
    """Alternating sampled turns (mask 1) and tool results (mask 0)."""
    ids: list[int] = []
    mask: list[int] = []
    for t in range(turns):
        n = rng.randint(3, 12)
        ids += [rng.randrange(vocab) for _ in range(n)]
        mask += [1 - t % 2] * n
    return ids, mask


def _group(
    rng: random.Random, vocab: int, gid: str, prefix: list[int], size: int
) -> list[Transition]:
    """`size` rollouts of one task: the shared prefix (no sampled token), then branches."""
    rows = []
    for k in range(size):
        ids, mask = _branch(rng, vocab, rng.randint(1, 5))
        rows.append(_row(f"{gid}-{k}", prefix + ids, [0] * len(prefix) + mask, rng))
    return rows


def _with_behaviour(model: PreTrainedModel, rows: list[Transition]) -> list[Transition]:
    """Behaviour log-probs = the model's own + noise: a slightly stale policy."""
    rng = random.Random(1)
    out = list(rows)
    with torch.no_grad():
        for mb in pack(rows, 4096):
            logp_BT = forward_logprobs(model, mb, bf16=False)
            for b, i in enumerate(mb.row_indices):
                r = rows[i]
                beh = [
                    (float(x) + rng.uniform(-0.3, 0.3)) * k
                    for x, k in zip(logp_BT[b], r.loss_mask, strict=False)
                ]
                out[i] = r.model_copy(update={"behaviour_logprobs": beh})
    return out


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> PreTrainedModel:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).train()


@pytest.fixture(scope="module")
def rows(model: PreTrainedModel) -> list[Transition]:
    """Three groups of 6: a long system prompt shared by all, then each group's task."""
    rng, vocab = random.Random(0), model.config.vocab_size
    system = [rng.randrange(vocab) for _ in range(120)]
    out = []
    for g in range(3):
        task = [rng.randrange(vocab) for _ in range(rng.randint(10, 30))]
        out += _group(rng, vocab, f"g{g}", system + task, 6)
    return _with_behaviour(model, out)


def _grads(
    model: PreTrainedModel, rows: list[Transition], cfg: TrainerConfig
) -> tuple[Gradients, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = loss_and_grads(model, rows, cfg)
    return out, [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def _assert_same(model: PreTrainedModel, rows: list[Transition], cfg: TrainerConfig) -> None:
    """The tree path (prefix_sharing on) gives the plain path's loss, gradients, log-probs."""
    plain, g_plain = _grads(model, rows, cfg)
    tree, g_tree = _grads(model, rows, cfg.model_copy(update={"prefix_sharing": True}))
    assert abs(plain.loss) > 1e-4 and all(float(g.norm()) > 0 for g in g_plain)
    assert abs(tree.loss - plain.loss) <= TOL * abs(plain.loss)
    assert len(g_tree) == len(g_plain)
    for a, b in zip(g_plain, g_tree, strict=True):
        assert float((b - a).norm() / a.norm()) <= TOL
    for a, b in zip(plain.logp_rows, tree.logp_rows, strict=True):
        assert a.shape == b.shape and float((a - b).abs().max()) <= TOL


@pytest.mark.parametrize(
    "loss",
    [LossConfig(), LossConfig(aggregation="sequence", is_mode="filter", is_low=0.9)],
    ids=["token", "sequence-filter"],
)
def test_tree_gives_the_same_loss_and_gradients(
    model: PreTrainedModel, rows: list[Transition], loss: LossConfig
) -> None:
    cfg = CFG.model_copy(update={"loss": loss})
    trees = plan(rows, cfg.micro_batch_tokens)
    # The rows really are forwarded as several trees, with far fewer tokens.
    assert sum(tb.shared > 0 for tb in trees) >= 3
    assert sum(map(forwarded_tokens, trees)) < 0.6 * sum(len(r.input_ids) for r in rows)
    _assert_same(model, rows, cfg)


def test_rows_sharing_only_a_few_tokens_stay_exact(model: PreTrainedModel) -> None:
    rng, vocab = random.Random(2), model.config.vocab_size
    rows = []
    for k in range(8):  # a 3-token header in common, then unrelated conversations
        ids, mask = _branch(rng, vocab, rng.randint(2, 6))
        rows.append(_row(f"h{k}", [5, 6, 7] + ids, [0, 0, 0] + mask, rng))
    rows = _with_behaviour(model, rows)
    # The planner forwards such rows plainly (the padding would cost more than 2 tokens
    # save), which is exact by construction ...
    assert not any(tb.shared for tb in plan(rows, CFG.micro_batch_tokens))
    _assert_same(model, rows, CFG)
    # ... and a tree forced on them (a 2-token prefix, then ragged branches) is exact too.
    (mb,) = pack(rows, 100_000)
    plain, g_plain = _grads(model, rows, CFG)
    model.zero_grad(set_to_none=True)
    denom = loss_denominator([mb], CFG)
    tree = backward_micro_batches(model, rows, [TreeBatch(mb, 2)], CFG, denom)
    g_tree = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    assert abs(tree.loss - plain.loss) <= TOL * abs(plain.loss)
    for a, b in zip(g_plain, g_tree, strict=True):
        assert float((b - a).norm() / a.norm()) <= TOL
    assert tree.tokens == plain.tokens - 2 * (len(rows) - 1)


def test_a_prefix_with_sampled_tokens_stays_exact(model: PreTrainedModel) -> None:
    # Rows of one rollout's growing calls share sampled tokens: the shared prefix holds
    # tokens with loss (each row with its own advantage), which must count once per row.
    rng, vocab = random.Random(3), model.config.vocab_size
    head = [rng.randrange(vocab) for _ in range(40)]
    head_mask = [0] * 20 + [1] * 10 + [0] * 10
    rows = []
    for k in range(6):
        ids, mask = _branch(rng, vocab, rng.randint(1, 4))
        rows.append(_row(f"s{k}", head + ids, head_mask + mask, rng))
    rows = _with_behaviour(model, rows)
    trees = plan(rows, CFG.micro_batch_tokens)
    assert any(tb.shared >= 30 for tb in trees)  # the sampled tokens are inside the prefix
    _assert_same(model, rows, CFG)


def test_plan_keeps_every_row_once_within_the_budget(rows: list[Transition]) -> None:
    hot = [r.model_copy(update={"temperature": 0.7}) for r in rows[:4]]
    mixed = hot + rows[4:]
    for budget in (200, 640, 100_000):
        trees = plan(mixed, budget)
        seen = sorted(i for tb in trees for i in tb.mb.row_indices)
        assert seen == list(range(len(mixed)))
        for tb in trees:
            B, T = tb.mb.input_ids_BT.shape
            temps = {mixed[i].temperature for i in tb.mb.row_indices}
            if tb.shared:
                assert tb.shared + B * (T - tb.shared) <= budget and len(temps) == 1
                ids = [mixed[i].input_ids[: tb.shared + 1] for i in tb.mb.row_indices]
                assert all(x == ids[0] for x in ids)


@pytest.mark.parametrize("minibatches", [1, 2])
def test_a_trainer_step_with_prefix_sharing_equals_one_without(
    tiny_model_dir: Path, rows: list[Transition], minibatches: int
) -> None:
    cfg = CFG.model_copy(update={"minibatches": minibatches, "lr": 1e-3})
    plain, tree = (
        Trainer(tiny_model_dir, cfg.model_copy(update={"prefix_sharing": on}))
        for on in (False, True)
    )
    m_plain, m_tree = plain.train(rows), tree.train(rows)
    assert m_tree.loss == pytest.approx(m_plain.loss, rel=TOL)
    assert m_tree.grad_norm == pytest.approx(m_plain.grad_norm, rel=TOL)
    assert m_tree.optimizer_steps == m_plain.optimizer_steps == minibatches
    before = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    w0 = before.state_dict()
    wa, wb = plain.model.state_dict(), tree.model.state_dict()
    for k, v in wa.items():
        moved = float((v - w0[k]).norm())
        assert moved > 0
        assert float((wb[k] - v).norm()) <= 1e-4 * moved


@pytest.mark.slow
def test_the_bench_runs_and_its_forms_agree() -> None:
    # bench/prefix_tree.py on small settings: its rows share a real system prompt, so the
    # tree forwards fewer tokens, and the two forms it times compute the same update.
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location(
        "bench_prefix_tree", root / "bench/prefix_tree.py"
    )
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    try:
        r = bench.run(bench.PrefixConfig(tools=1, groups=1, group_size=4, reps=1, threads=1))
    finally:
        torch.set_num_threads(threads)
    assert r.rows == 4 and r.prefix_tokens > 300
    assert r.token_ratio > 1.5 and r.tokens_on < r.tokens_off
    assert r.max_rel_loss_diff <= TOL and r.max_rel_grad_diff <= TOL
