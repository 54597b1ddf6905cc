"""The tiny embedded model: a chat template, a locally trained tokenizer, a small Llama, and
a supervised warm start from demonstrations. Nothing here downloads anything; any local HF
model directory works the same way downstream."""

from tracerl.models.sft import (
    Demo,
    EncodedDemo,
    SftConfig,
    SftResult,
    encode_demo,
    load_demos,
    sft,
)
from tracerl.models.template import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    format_tool_call,
    render_chat,
)
from tracerl.models.tiny import TinyModelConfig, build_tiny_model
from tracerl.models.tokenizer import train_tokenizer

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "Demo",
    "EncodedDemo",
    "SftConfig",
    "SftResult",
    "TinyModelConfig",
    "build_tiny_model",
    "encode_demo",
    "format_tool_call",
    "load_demos",
    "render_chat",
    "sft",
    "train_tokenizer",
]
