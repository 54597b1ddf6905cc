"""The policy loss and token log-probs against plain-Python loop references, and the key
property: a merged multi-turn row trains exactly like one row per call."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tracerl.algorithms import GRPO, compute_advantages, spans_to_transitions
from tracerl.trainer.config import LossConfig
from tracerl.trainer.loss import loss_weights, policy_loss, token_logprobs
from tracerl.trainer.packing import pack
from tracerl.types import Span, Transition

# ---------------------------------------------------------------- plain-Python reference


def ref_token_terms(logp, prox, beh, adv, cfg, ref=None):
    """Per-token loss and d(loss_t)/d(logp_t) for one token, by the textbook formulas."""
    r = math.exp(logp - prox)
    clipped = min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high)
    tis = 1.0 if cfg.tis_cap is None else min(math.exp(prox - beh), cfg.tis_cap)
    unclipped_active = r * adv <= clipped * adv
    loss = -tis * min(r * adv, clipped * adv)
    grad = -tis * adv * r if unclipped_active else 0.0
    if ref is not None and cfg.kl_coef:
        d = ref - logp
        loss += cfg.kl_coef * (math.exp(d) - 1 - d)
        grad += cfg.kl_coef * (1 - math.exp(d))
    return loss, grad


def ref_loss(rows, cfg):
    """rows: dicts of per-token lists (logp, prox, beh, adv, mask, [ref]) and a row weight.
    Returns (loss, grads per row) computed with loops."""
    terms = [
        [
            ref_token_terms(
                r["logp"][t],
                r["prox"][t],
                r["beh"][t],
                r["adv"][t],
                cfg,
                r.get("ref", [None] * 99)[t],
            )
            for t in range(len(r["mask"]))
        ]
        for r in rows
    ]
    if cfg.aggregation == "token":
        # each sampled token weighs its row's weight
        w = [[r["weight"] * m for m in r["mask"]] for r in rows]
    else:
        # each row weighs its weight, spread evenly over its sampled tokens
        w = [[r["weight"] * m / sum(r["mask"]) for m in r["mask"]] for r in rows]
    denom = sum(sum(x) for x in w)
    loss = sum(w[b][t] * terms[b][t][0] for b in range(len(rows)) for t in range(len(w[b]))) / denom
    grads = [[w[b][t] * terms[b][t][1] / denom for t in range(len(w[b]))] for b in range(len(rows))]
    return loss, grads


def to_BT(rows, key, pad):
    T = max(len(r["mask"]) for r in rows)
    return torch.tensor([r[key] + [pad] * (T - len(r[key])) for r in rows], dtype=torch.float64)


def run_loss(rows, cfg, with_ref=False):
    logp = to_BT(rows, "logp", -100.0).requires_grad_(True)
    weight = torch.tensor([[r["weight"]] for r in rows], dtype=torch.float64)
    loss, metrics = policy_loss(
        logp,
        to_BT(rows, "prox", 7.0),  # garbage on padding: must not leak in
        to_BT(rows, "beh", 50.0),
        to_BT(rows, "adv", 3.0),
        to_BT(rows, "mask", 0.0),
        cfg,
        weight_BT=weight.expand_as(logp),
        ref_logp_BT=to_BT(rows, "ref", 0.0) if with_ref else None,
    )
    loss.backward()
    return loss, logp.grad, metrics


def hand_batch():
    """A multi-turn row, a truncated completion (ends in a sampled token, no end token)
    and a row with stale behaviour log-probs (importance weight above the cap)."""
    multi = {
        "mask": [0, 0, 1, 1, 0, 0, 1, 1, 1],
        "logp": [0, 0, -0.5, -1.0, 0, 0, -0.2, -2.0, -0.05],
        "prox": [0, 0, -0.6, -0.7, 0, 0, -0.2, -2.5, -0.05],
        "beh": [0, 0, -0.62, -0.7, 0, 0, -0.25, -2.4, -0.05],
        "adv": [0, 0, 1.0, 1.0, 0, 0, 1.0, 1.0, 1.0],
        "ref": [0, 0, -0.4, -1.2, 0, 0, -0.3, -1.8, -0.1],
        "weight": 1.0,
    }
    truncated = {
        "mask": [0, 0, 0, 1, 1, 1],
        "logp": [0, 0, 0, -1.3, -0.9, -0.4],
        "prox": [0, 0, 0, -1.0, -0.9, -0.3],
        "beh": [0, 0, 0, -1.0, -0.95, -0.3],
        "adv": [0, 0, 0, -0.8, -0.8, -0.8],
        "ref": [0, 0, 0, -1.1, -1.0, -0.2],
        "weight": 0.5,
    }
    stale = {
        "mask": [0, 1, 1, 1, 1],
        "logp": [0, -0.3, -0.8, -1.5, -0.1],
        "prox": [0, -0.35, -0.8, -1.2, -0.1],
        "beh": [0, -1.85, -2.0, -1.3, -0.1],  # exp(prox - beh) = 4.5, 3.3, 1.1, 1.0
        "adv": [0, 0.6, -0.6, 0.6, 0.6],
        "ref": [0, -0.3, -0.7, -1.4, -0.2],
        "weight": 2.0,
    }
    return [multi, truncated, stale]


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
@pytest.mark.parametrize("tis_cap", [2.0, None])
@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_policy_loss_matches_loop_reference(aggregation, tis_cap, kl_coef) -> None:
    rows = hand_batch()
    cfg = LossConfig(aggregation=aggregation, tis_cap=tis_cap, kl_coef=kl_coef)
    loss, grad, _ = run_loss(rows, cfg, with_ref=kl_coef > 0)
    want_loss, want_grads = ref_loss(rows, cfg)
    assert loss.item() == pytest.approx(want_loss, rel=1e-6)
    for b, g in enumerate(want_grads):
        assert grad[b, : len(g)].tolist() == pytest.approx(g, rel=1e-6, abs=1e-9)
        assert grad[b, len(g) :].abs().sum() == 0.0


def test_token_and_sequence_aggregation_differ_as_expected() -> None:
    rows = hand_batch()
    tok, _, _ = run_loss(rows, LossConfig(aggregation="token"))
    seq, _, _ = run_loss(rows, LossConfig(aggregation="sequence"))
    assert tok.item() == pytest.approx(ref_loss(rows, LossConfig(aggregation="token"))[0], rel=1e-6)
    assert seq.item() == pytest.approx(
        ref_loss(rows, LossConfig(aggregation="sequence"))[0], rel=1e-6
    )
    assert abs(tok.item() - seq.item()) > 1e-3


def test_metrics_match_reference() -> None:
    rows = hand_batch()
    cfg = LossConfig()
    _, _, m = run_loss(rows, cfg, with_ref=True)
    toks = [(r, t) for r in rows for t in range(len(r["mask"])) if r["mask"][t]]
    n = len(toks)
    ratios = [math.exp(r["logp"][t] - r["prox"][t]) for r, t in toks]
    advs = [r["adv"][t] for r, t in toks]
    clipped = sum(
        1 for x, a in zip(ratios, advs, strict=True) if (x > 1.28 and a > 0) or (x < 0.8 and a < 0)
    )
    iw = [math.exp(r["prox"][t] - r["beh"][t]) for r, t in toks]
    k3 = [math.exp(r["logp"][t] - r["beh"][t]) - 1 - (r["logp"][t] - r["beh"][t]) for r, t in toks]
    assert m.num_tokens == n == 12
    assert m.clip_fraction == pytest.approx(clipped / n) and clipped > 0
    assert m.tis_ratio_mean == pytest.approx(sum(iw) / n, rel=1e-6)
    assert m.tis_ratio_max == pytest.approx(max(iw), rel=1e-6)
    assert m.tis_capped_fraction == pytest.approx(sum(x > 2.0 for x in iw) / n) and max(iw) > 2.0
    assert m.approx_kl == pytest.approx(sum(k3) / n, rel=1e-6)
    assert m.ref_kl is not None and m.ref_kl > 0 and m.entropy is None


def test_on_policy_is_plain_ppo_minus_mean_advantage() -> None:
    torch.manual_seed(0)
    logp = -torch.rand(3, 7, dtype=torch.float64)
    adv = torch.randn(3, 7, dtype=torch.float64)
    mask = (torch.rand(3, 7) > 0.3).double()
    mask[:, 0] = 0
    for aggregation in ("token", "sequence"):
        cur = logp.clone().requires_grad_(True)
        loss, m = policy_loss(cur, logp, logp, adv, mask, LossConfig(aggregation=aggregation))
        loss.backward()
        W = loss_weights(mask, None, aggregation).double()
        W = W / W.sum()
        assert loss.item() == pytest.approx(-(W * adv).sum().item(), rel=1e-9)
        assert cur.grad is not None
        assert torch.allclose(cur.grad, -W * adv, rtol=1e-9, atol=1e-12)
        assert m.clip_fraction == 0.0 and m.tis_capped_fraction == 0.0
        assert m.approx_kl == pytest.approx(0.0, abs=1e-12)
    plain = policy_loss(logp, logp, logp, adv, mask, LossConfig())[0]
    assert plain.item() == pytest.approx(-(adv * mask).sum().item() / mask.sum().item())


def test_empty_mask_gives_zero_loss_not_nan() -> None:
    x = torch.zeros(2, 3, requires_grad=True)
    loss, m = policy_loss(x, x, x, x, torch.zeros(2, 3), LossConfig())
    assert loss.item() == 0.0 and m.num_tokens == 0


def test_token_logprobs_matches_loop_reference() -> None:
    torch.manual_seed(0)
    B, T, V = 2, 6, 11
    logits = torch.randn(B, T, V, dtype=torch.bfloat16)
    ids = torch.randint(0, V, (B, T))
    temps = [0.7, 1.3]
    got = token_logprobs(logits, ids, torch.tensor(temps), chunk_size=2)
    assert got.dtype == torch.float32 and got.shape == (B, T)
    for b in range(B):
        assert got[b, 0].item() == 0.0
        for t in range(1, T):
            row = [float(x) / temps[b] for x in logits[b, t - 1].float()]
            lse = math.log(sum(math.exp(x) for x in row))
            assert got[b, t].item() == pytest.approx(row[int(ids[b, t])] - lse, abs=1e-5)
    whole = token_logprobs(logits, ids, torch.tensor(temps), chunk_size=1024)
    assert torch.equal(got, whole)


# ------------------------------------------- merged rows vs one row per call, tiny Llama


def tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(cfg).float()


def three_turn_spans(rollout_id: str, rng: random.Random) -> list[Span]:
    prompt = [rng.randrange(1, 64) for _ in range(5)]
    spans = []
    for seq in range(3):
        completion = [rng.randrange(1, 64) for _ in range(rng.randrange(2, 5))]
        # Behaviour log-probs: plausible and sometimes far from the trainer's (stale).
        lps = [-rng.uniform(0.5, 5.0) for _ in completion]
        spans.append(
            Span(
                id=f"{rollout_id}-{seq}",
                rollout_id=rollout_id,
                attempt=1,
                seq=seq,
                role="policy",
                policy_version=0,
                prompt_ids=list(prompt),
                completion_ids=completion,
                logprobs=lps,
                temperature=0.9,
            )
        )
        prompt = prompt + completion + [rng.randrange(1, 64) for _ in range(3)]  # tool result
    return spans


def rows_both_forms() -> tuple[list[Transition], list[Transition]]:
    rng = random.Random(0)
    merged, per_span = [], []
    for rid, reward in (("r1", 1.0), ("r2", 0.0), ("r3", 0.25)):
        spans = three_turn_spans(rid, rng)
        merged += spans_to_transitions(spans, reward, group_id="g", task_id="t")
        for s in spans:  # one row per call: each row holds the whole prompt again
            per_span += spans_to_transitions([s], reward, group_id="g", task_id="t")
    assert len(merged) == 3 and len(per_span) == 9
    return merged, per_span


def step(model, old_model, rows: list[Transition], cfg: LossConfig, max_tokens: int):
    """One accumulated loss over micro-batches with a global denominator; returns loss, grads."""
    model.zero_grad()
    batches = pack(rows, max_tokens)
    denom = sum(
        loss_weights(mb.loss_mask_BT, mb.weight_BT, cfg.aggregation).sum() for mb in batches
    )
    total = torch.zeros(())
    for mb in batches:
        logits = model(input_ids=mb.input_ids_BT, attention_mask=mb.attention_mask_BT).logits
        logp = token_logprobs(logits, mb.input_ids_BT, mb.temperature_B)
        with torch.no_grad():
            old = old_model(input_ids=mb.input_ids_BT, attention_mask=mb.attention_mask_BT).logits
            prox = token_logprobs(old, mb.input_ids_BT, mb.temperature_B)
        loss, _ = policy_loss(
            logp,
            prox,
            mb.behaviour_logp_BT,
            mb.adv_BT,
            mb.loss_mask_BT,
            cfg,
            mb.weight_BT,
            denominator=denom,
        )
        loss.backward()
        total = total + loss.detach()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return total, grads


@pytest.mark.parametrize("normalize", ["none", "token"])
def test_merged_rows_train_like_one_row_per_call(normalize) -> None:
    torch.set_num_threads(1)
    model, old_model = tiny_llama(0), tiny_llama(0)
    with torch.no_grad():  # the proximal policy: the same net one update ago
        for p in old_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    merged, per_span = rows_both_forms()
    algo = GRPO(normalize=normalize)
    merged, per_span = compute_advantages(algo, merged), compute_advantages(algo, per_span)
    cfg = LossConfig(aggregation="token")
    loss_m, grad_m = step(model, old_model, merged, cfg, max_tokens=10_000)
    loss_s, grad_s = step(model, old_model, per_span, cfg, max_tokens=60)  # several micro-batches
    assert sum(len(r.input_ids) for r in merged) < sum(len(r.input_ids) for r in per_span)
    assert loss_m.abs().item() > 1e-3
    assert loss_s.item() == pytest.approx(loss_m.item(), rel=1e-5)
    assert torch.allclose(grad_s, grad_m, rtol=1e-5, atol=1e-5 * grad_m.abs().max().item())
    # Sequence aggregation counts rows, so the two forms then (rightly) differ.
    seq = LossConfig(aggregation="sequence")
    assert (
        abs(
            step(model, old_model, merged, seq, 10_000)[0]
            - step(model, old_model, per_span, seq, 60)[0]
        )
        > 1e-4
    )
