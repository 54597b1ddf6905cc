"""SFT with the batch's shared prefix forwarded once: the same loss and gradients as each
conversation forwarded whole, for fewer tokens."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tracerl.examples import example_module
from tracerl.models.demos import collate, encode_all
from tracerl.models.heads import shared_prefix, shared_prefix_logprobs, target_logprobs
from tracerl.models.sft import Demo


def test_shared_prefix_sft_equals_the_plain_loss_and_gradients(tiny_model_dir: Path) -> None:
    demos = [
        Demo.model_validate(d)
        for d in example_module("calculator", "expert").demonstrations(6, seed=3)
    ]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids_BT, attn_BT, labels_BT = collate(encode_all(tokenizer, demos), tokenizer.pad_token_id, 256)
    # The calculator's system prompt and tool schema: a third of each conversation.
    assert shared_prefix(ids_BT, attn_BT) > 0.3 * float(attn_BT.sum(1).float().mean())
    plain_N = target_logprobs(model, ids_BT, attn_BT, labels_BT).logp_N
    (-plain_N.mean()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    shared_N = shared_prefix_logprobs(model, ids_BT, attn_BT, labels_BT, bf16=False)
    assert shared_N is not None
    torch.testing.assert_close(shared_N, plain_N, rtol=0, atol=2e-5)
    (-shared_N.mean()).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-6)


def test_rows_without_a_common_prefix_take_the_plain_path(tiny_model_dir: Path) -> None:
    ids_BT = torch.tensor([[5, 6, 7, 8], [9, 6, 7, 0]])
    attn_BT = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    assert shared_prefix(ids_BT, attn_BT) == 0
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert shared_prefix_logprobs(model, ids_BT, attn_BT, ids_BT, bf16=False) is None
    assert shared_prefix(torch.tensor([[1, 2, 3], [1, 2, 4]]), torch.ones(2, 3)) == 2
    assert (
        shared_prefix(torch.tensor([[1, 2, 3], [1, 2, 0]]), torch.tensor([[1, 1, 1], [1, 1, 0]]))
        == 2
    )
