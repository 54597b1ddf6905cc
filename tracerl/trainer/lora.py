"""LoRA adapters (peft): wrapping a model, and its weights with the adapter merged in.

The trainer (`trainer.lora`) and SFT (`SftConfig.lora`) share these, so an adapter trained
by either is the same kind of peft adapter, and the engines are handed the same merged
weights.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from tracerl.trainer.config import LoraSettings

__all__ = ["merged_lora_state", "with_lora"]


def with_lora(model: PreTrainedModel, lora: LoraSettings | None) -> PreTrainedModel:
    """`model` with a fresh LoRA adapter (only the adapter trains); unchanged for None."""
    if lora is None:
        return model
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)  # type: ignore[return-value]


@torch.no_grad()
def merged_lora_state(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """Base weights with the adapter merged in, under the base model's key names."""
    model.merge_adapter()  # type: ignore[operator]
    try:
        base = model.get_base_model()  # type: ignore[operator]
        out = {}
        for key, value in base.state_dict().items():
            if "lora_" in key:
                continue
            out[key.replace(".base_layer", "")] = value.detach().clone()
        return out
    finally:
        model.unmerge_adapter()  # type: ignore[operator]
