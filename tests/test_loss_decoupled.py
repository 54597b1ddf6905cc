"""The decoupled off-policy correction (truncate / mask / filter) and entropy top-q token
selection, against references written here in plain Python or plain torch."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tracerl.algorithms import GRPO, compute_advantages, spans_to_transitions
from tracerl.engines.scoring import score_completion
from tracerl.trainer.loss import (
    LossConfig,
    entropy_selection,
    policy_loss,
    token_entropy,
)
from tracerl.trainer.trainer import Trainer, TrainerConfig
from tracerl.types import Span

MODES = ["truncate", "mask", "filter"]


def ppo_clip(logp, old, adv, mask, clip_low=0.2, clip_high=0.28):
    """Textbook PPO-clip, token mean over the mask: no importance weight at all."""
    ratio = torch.exp(logp - old)
    surr = torch.minimum(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)
    return -(surr * mask).sum() / mask.sum()


def random_batch(seed: int, B: int = 3, T: int = 8):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.3).double()
    mask[:, 0] = 0
    mask[:, 1] = 1
    return logp, adv, mask


@pytest.mark.parametrize("mode", MODES)
def test_on_policy_equals_plain_ppo_clip_loss_and_gradient(mode) -> None:
    logp, adv, mask = random_batch(0)
    cfg = LossConfig(is_mode=mode)
    # behaviour = proximal = current: every weight is 1, nothing clipped, nothing masked.
    cur = logp.clone().requires_grad_(True)
    loss, m = policy_loss(cur, logp, logp, adv, mask, cfg)
    loss.backward()
    ref_cur = logp.clone().requires_grad_(True)
    want = ppo_clip(ref_cur, logp, adv, mask)
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    assert torch.allclose(cur.grad, ref_cur.grad, rtol=1e-12, atol=1e-15)
    assert m.is_masked_fraction == 0.0 and m.tis_capped_fraction == 0.0
    assert m.clip_fraction == 0.0 and m.entropy_kept_fraction == 1.0

    # Current moved away from proximal (clipping bites), behaviour still = proximal.
    moved = logp + 0.5 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(1))
    cur = moved.clone().requires_grad_(True)
    loss, m = policy_loss(cur, logp, logp, adv, mask, cfg)
    loss.backward()
    ref_cur = moved.clone().requires_grad_(True)
    want = ppo_clip(ref_cur, logp, adv, mask)
    want.backward()
    assert m.clip_fraction > 0
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    assert torch.allclose(cur.grad, ref_cur.grad, rtol=1e-12, atol=1e-15)


# ---------------------------------------------------------------- stale spans, by hand

# Each row: per-token (current logp, proximal logp, log w = proximal - behaviour, advantage),
# all tokens sampled. Weights w: 4.5 and 3.0 are above the cap 2; 0.3 and 0.4 below 0.5.
STALE = [
    [(-0.3, -0.35, math.log(4.5), 0.6), (-0.8, -0.8, math.log(0.3), -0.6),
     (-1.5, -1.2, math.log(1.5), 0.6), (-0.1, -0.1, math.log(1.0), 0.6)],
    [(-1.3, -1.0, math.log(3.0), -0.8), (-0.9, -0.9, math.log(3.0), -0.8)],
    [(-0.5, -0.6, math.log(0.3), 1.0), (-1.0, -0.7, math.log(0.4), 1.0),
     (-0.2, -0.2, math.log(0.9), 1.0)],
    [(-0.4, -0.5, math.log(4.0), 0.5), (-0.7, -0.7, math.log(0.6), 0.5),
     (-1.1, -1.0, math.log(1.0), -0.5)],
]  # fmt: skip


def stale_tensors():
    T = max(len(r) for r in STALE)

    def col(k: int, pad: float) -> torch.Tensor:
        return torch.tensor(
            [[t[k] for t in r] + [pad] * (T - len(r)) for r in STALE], dtype=torch.float64
        )

    logp, prox, log_w, adv = col(0, -60.0), col(1, 9.0), col(2, 40.0), col(3, 5.0)
    mask = torch.tensor([[1.0] * len(r) + [0.0] * (T - len(r)) for r in STALE], dtype=torch.float64)
    return logp, prox, prox - log_w, adv, mask


def reference(weight_of, clip=(0.2, 0.28)):
    """Token-mean loss sum_t w_t * surr_t / N and its gradient per token, in plain Python.
    weight_of(row, t) gives the importance weight the mode should apply."""
    n = sum(len(r) for r in STALE)
    loss, grads = 0.0, []
    for b, row in enumerate(STALE):
        g_row = []
        for t, (lp, px, _, a) in enumerate(row):
            r = math.exp(lp - px)
            c = min(max(r, 1 - clip[0]), 1 + clip[1])
            w = weight_of(b, t)
            loss += -w * min(r * a, c * a) / n
            g_row.append(-w * a * r / n if r * a <= c * a else 0.0)
        grads.append(g_row)
    return loss, grads


def run(cfg: LossConfig):
    logp, prox, beh, adv, mask = stale_tensors()
    cur = logp.clone().requires_grad_(True)
    loss, m = policy_loss(cur, prox, beh, adv, mask, cfg)
    loss.backward()
    return loss.item(), cur.grad, m


def w(b: int, t: int) -> float:
    return math.exp(STALE[b][t][2])


def check(got_loss, grad, want) -> None:
    want_loss, want_grads = want
    assert got_loss == pytest.approx(want_loss, rel=1e-9)
    for b, g in enumerate(want_grads):
        assert grad[b, : len(g)].tolist() == pytest.approx(g, rel=1e-9, abs=1e-12)
        assert grad[b, len(g) :].abs().sum() == 0.0


def test_truncate_applies_the_capped_weight_exactly() -> None:
    loss, grad, m = run(LossConfig(is_mode="truncate", tis_cap=2.0))
    check(loss, grad, reference(lambda b, t: min(w(b, t), 2.0)))
    assert m.num_tokens == 12
    assert m.tis_capped_fraction == pytest.approx(4 / 12)  # 4.5, 3.0, 3.0, 4.0
    assert m.tis_ratio_max == pytest.approx(4.5)
    assert m.tis_ratio_mean == pytest.approx(
        sum(w(b, t) for b, r in enumerate(STALE) for t in range(len(r))) / 12
    )
    assert m.is_masked_fraction == 0.0
    # With the cap off the weights are 1: the stale gap is not corrected at all.
    loss, grad, m = run(LossConfig(tis_cap=None))
    check(loss, grad, reference(lambda b, t: 1.0))
    assert m.tis_capped_fraction == 0.0


def test_mask_zeroes_exactly_the_out_of_bounds_tokens() -> None:
    loss, grad, m = run(LossConfig(is_mode="mask", is_low=0.5, is_high=2.0))
    out = {(b, t) for b, r in enumerate(STALE) for t in range(len(r)) if not 0.5 <= w(b, t) <= 2.0}
    assert out == {(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0)}
    check(loss, grad, reference(lambda b, t: 0.0 if (b, t) in out else w(b, t)))
    for b, t in out:
        assert grad[b, t] == 0.0
    assert m.is_masked_fraction == pytest.approx(len(out) / 12)
    assert m.tis_capped_fraction == 0.0
    assert grad[3, 1] != 0.0  # w = 0.6: inside, kept with its weight


def test_filter_drops_exactly_the_out_of_bounds_rows() -> None:
    # Geometric means: row 0 (4.5*0.3*1.5*1)^(1/4) = 1.16 kept; row 1: 3.0 dropped;
    # row 2 (0.3*0.4*0.9)^(1/3) = 0.48 dropped; row 3 (4*0.6*1)^(1/3) = 1.34 kept.
    gm = [math.exp(sum(t[2] for t in r) / len(r)) for r in STALE]
    dropped = {b for b, g in enumerate(gm) if not 0.5 <= g <= 2.0}
    assert dropped == {1, 2}
    loss, grad, m = run(LossConfig(is_mode="filter", is_low=0.5, is_high=2.0, tis_cap=2.0))
    check(loss, grad, reference(lambda b, t: 0.0 if b in dropped else min(w(b, t), 2.0)))
    assert grad[1].abs().sum() == 0.0 and grad[2].abs().sum() == 0.0
    assert m.is_masked_fraction == pytest.approx(5 / 12)
    assert m.tis_capped_fraction == pytest.approx(2 / 12)  # 4.5 and 4.0, in kept rows


def test_bounds_must_accept_weight_one() -> None:
    with pytest.raises(ValueError):
        LossConfig(is_low=1.2)
    with pytest.raises(ValueError):
        LossConfig(is_high=0.9)
    with pytest.raises(ValueError):
        LossConfig(entropy_top_q=0.0)


# ------------------------------------------------------------------ entropy selection


def entropy_of(row: list[float], temp: float) -> float:
    z = [x / temp for x in row]
    top = max(z)
    e = [math.exp(x - top) for x in z]
    s = sum(e)
    return -sum((x / s) * math.log(x / s) for x in e)


def test_token_entropy_matches_plain_python() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    temps = [0.8, 1.5]
    got = token_entropy(logits, torch.tensor(temps), chunk_size=2)
    assert got.shape == (2, 5) and not got.requires_grad
    for b in range(2):
        assert got[b, 0].item() == 0.0
        for t in range(1, 5):
            want = entropy_of(logits[b, t - 1].tolist(), temps[b])
            assert got[b, t].item() == pytest.approx(want, rel=1e-5)


def test_entropy_top_q_keeps_exactly_the_highest_entropy_tokens() -> None:
    # Position t-1's logits are s * onehot: the entropy of token t falls as s grows, so the
    # scale table fixes which tokens are the high-entropy ones.
    V = 6
    scales = torch.tensor([[0.0, 0.1, 5.0, 0.5, 9.0, 2.0], [1.0, 7.0, 0.2, 3.0, 1.0, 0.0]])
    logits = scales[..., None] * torch.nn.functional.one_hot(torch.zeros(2, 6).long(), V)
    ent = token_entropy(logits.double())
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0]], dtype=torch.float64)
    # token t's entropy comes from scale[t-1]; sampled tokens and their scales:
    sampled = {(b, t): scales[b, t - 1].item() for b in range(2) for t in range(6) if mask[b, t]}
    assert len(sampled) == 9
    # q = 0.3 of 9 -> ceil(2.7) = 3 tokens: the three smallest scales (highest entropy).
    want = {k for k, _ in sorted(sampled.items(), key=lambda kv: kv[1])[:3]}
    assert want == {(0, 1), (0, 2), (1, 3)}  # scales 0.0, 0.1, 0.2
    kept = entropy_selection(ent, mask, 0.3)
    assert {(b, t) for b, t in kept.nonzero().tolist()} == want

    logp = torch.full((2, 6), -1.0, dtype=torch.float64)
    adv = torch.ones(2, 6, dtype=torch.float64)
    cur = logp.clone().requires_grad_(True)
    loss, m = policy_loss(cur, logp, logp, adv, mask, LossConfig(entropy_top_q=0.3), entropy_BT=ent)
    loss.backward()
    assert {(b, t) for b, t in cur.grad.nonzero().tolist()} == want
    # The dropped tokens stay in the denominator: loss = -(3 kept x A=1) / 9 sampled.
    assert loss.item() == pytest.approx(-3 / 9)
    assert m.entropy_kept_fraction == pytest.approx(3 / 9)
    assert m.entropy == pytest.approx(sum(ent[b, t].item() for b, t in sampled) / 9)
    # q = 1 keeps everything; no q with an entropy given only reports it.
    for cfg in (LossConfig(entropy_top_q=1.0), LossConfig()):
        _, m = policy_loss(logp, logp, logp, adv, mask, cfg, entropy_BT=ent)
        assert m.entropy_kept_fraction == 1.0
    with pytest.raises(ValueError):
        policy_loss(logp, logp, logp, adv, mask, LossConfig(entropy_top_q=0.5))


# -------------------------------------------------------------------- trainer plumbing


def test_trainer_reports_masking_and_entropy_selection(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    vocab = model.config.vocab_size
    rng = random.Random(0)
    rows = []
    for k in range(4):
        prompt = [rng.randrange(vocab) for _ in range(6)]
        completion = [rng.randrange(vocab) for _ in range(4)]
        true = score_completion(model, prompt, completion)
        # Every other token's behaviour log-prob is 1.5 above the trainer's: w = 0.22 < 0.5.
        beh = [x + (1.5 if i % 2 else 0.0) for i, x in enumerate(true)]
        span = Span(
            id=f"s{k}", rollout_id=f"r{k}", attempt=1, seq=0, role="policy", policy_version=0,
            prompt_ids=prompt, completion_ids=completion, logprobs=beh,
        )  # fmt: skip
        rows += spans_to_transitions([span], float(k % 2), group_id="g", task_id="t")
    rows = compute_advantages(GRPO(), rows)
    loss = LossConfig(is_mode="mask", entropy_top_q=0.25)
    trainer = Trainer(tiny_model_dir, TrainerConfig(bf16=False, loss=loss))
    m = trainer.train(rows)
    assert m.is_masked_fraction == pytest.approx(0.5)
    assert m.entropy_kept_fraction == pytest.approx(4 / 16)  # one micro-batch of 16 tokens
    with torch.no_grad():
        ids = torch.tensor([r.input_ids for r in rows])
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)
        ent = -(logp.exp() * logp).sum(-1)[:, :-1]  # position t-1 predicts token t
        sampled = torch.tensor([r.loss_mask for r in rows])[:, 1:].bool()
    assert m.entropy == pytest.approx(ent[sampled].mean().item(), rel=1e-4)
    plain = Trainer(tiny_model_dir, TrainerConfig(bf16=False)).train(rows)
    assert plain.entropy is None and plain.entropy_kept_fraction == 1.0
    assert plain.is_masked_fraction == 0.0


@pytest.mark.parametrize("mode", MODES)
def test_an_unknown_behaviour_log_prob_is_weighted_as_the_proximal_policys(mode) -> None:
    """NaN behaviour (a token distilled from another prompt): the loss, its gradient and
    metrics are those of behaviour = proximal, on those tokens only, and all finite."""
    logp, adv, mask = random_batch(2)
    old = logp - 0.3 * torch.rand(logp.shape, generator=torch.Generator().manual_seed(3))
    beh = old - 0.2  # a stale behaviour policy elsewhere
    beh_nan = beh.clone()
    beh_nan[1] = math.nan  # row 1: sampled under another prompt
    want_beh = beh.clone()
    want_beh[1] = old[1]
    cfg = LossConfig(is_mode=mode)
    cur = logp.clone().requires_grad_(True)
    loss, m = policy_loss(cur, old, beh_nan, adv, mask, cfg)
    loss.backward()
    ref = logp.clone().requires_grad_(True)
    want, want_m = policy_loss(ref, old, want_beh, adv, mask, cfg)
    want.backward()
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx(want.item(), rel=1e-12)
    assert torch.allclose(cur.grad, ref.grad, rtol=1e-12, atol=1e-15)
    assert m.tis_ratio_mean == pytest.approx(want_m.tis_ratio_mean)
    assert math.isfinite(m.approx_kl) and m.approx_kl == pytest.approx(want_m.approx_kl)
