"""The trainer's chunked logits: the same log-probs and gradients as the whole logits, at any
chunk size, so a big vocabulary never materialises [B, T, V]."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.test_packing import make_rows
from tracerl.trainer.chunked import ChunkedLogits, chunked_logits
from tracerl.trainer.gradients import model_logits
from tracerl.trainer.loss import token_entropy, token_logprobs
from tracerl.trainer.packing import pack


@pytest.mark.parametrize("chunk", [1, 3, 7, 512])
def test_chunked_logprobs_and_gradients_equal_the_whole_logits(
    tiny_model_dir: Path, chunk: int
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    mb = pack(make_rows([9, 14, 5]), 4096)[0]
    ids_BT, temp_B = mb.input_ids_BT, mb.temperature_B
    whole_BT = token_logprobs(model_logits(model, mb, False), ids_BT, temp_B)
    (whole_BT * mb.loss_mask_BT).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    logits = chunked_logits(model, mb, False, chunk=chunk)
    assert isinstance(logits, ChunkedLogits)
    chunked_BT = logits.per_token(token_logprobs, ids_BT, temp_B)
    torch.testing.assert_close(chunked_BT, whole_BT, rtol=0, atol=1e-5)
    (chunked_BT * mb.loss_mask_BT).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        ent_chunked = chunked_logits(model, mb, False, chunk).per_token(  # type: ignore[union-attr]
            lambda x, _ids, t: token_entropy(x, t), ids_BT, temp_B
        )
        ent_whole = token_entropy(model_logits(model, mb, False), temp_B)
    torch.testing.assert_close(ent_chunked, ent_whole, rtol=0, atol=1e-5)
