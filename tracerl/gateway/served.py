"""What the gateway serves and what one served call produced: ServedModel, Choice, Served.

Records only, no I/O: core.py fills them, record.py turns choices into spans, app.py writes
them in each wire format.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from tracerl.engines.base import Engine
from tracerl.gateway.chat import ParsedReply
from tracerl.gateway.tito import PromptBuilder
from tracerl.types import Generation

__all__ = ["Choice", "Served", "ServedModel", "decode"]


@dataclass
class ServedModel:
    """A model name the gateway answers to, with its engine and tokenizer."""

    name: str
    """The `model` agents ask for; also the role recorded on spans."""
    engine: Engine
    """What samples completions."""
    tokenizer: PreTrainedTokenizerBase
    """Tokenizer with the chat template of the engine's model."""
    default_max_tokens: int = 512
    """max_tokens when a request gives none (still capped by the context)."""
    prompts: PromptBuilder = field(init=False)
    """Renders and tokenizes this model's prompts (used on the gateway's tokenizer thread)."""
    _special: re.Pattern[str] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.prompts = PromptBuilder(self.tokenizer)
        # Special tokens other than the tool-call markers never reach the agent's text.
        hidden = [t for t in self.tokenizer.all_special_tokens if "tool_call" not in t]
        if hidden:
            self._special = re.compile("|".join(re.escape(t) for t in hidden))

    def text(self, gen: Generation) -> str:
        """The completion's text as the agent sees it (no end token, no stop string)."""
        text = decode(self.tokenizer, gen.completion_ids, skip_special=False)
        if gen.stop_string:
            at = text.find(gen.stop_string)
            text = text[:at] if at >= 0 else text
        return self._special.sub("", text) if self._special else text


@dataclass
class Choice:
    """One sampled choice, ready to be written in any wire format."""

    index: int
    """Position among the request's n choices."""
    gen: Generation
    """What the engine sampled."""
    text: str
    """Decoded completion text (raw, before tool-call parsing)."""
    reply: ParsedReply
    """Content and tool calls parsed from the text."""
    call_ids: list[str]
    """Ids given to the parsed tool calls."""
    finish_reason: str
    """OpenAI finish reason: stop, length or tool_calls."""


@dataclass
class Served:
    """The outcome of one call: its choices and token counts."""

    id: str
    """Response id: chatcmpl-<span id> / cmpl-<span id> (the first choice's span)."""
    model: str
    """Model name that answered."""
    created: int
    """Unix time."""
    choices: list[Choice]
    """The n choices."""
    prompt_tokens: int
    """Prompt length in tokens."""
    tokenizer: PreTrainedTokenizerBase
    """For per-token text in logprobs and streaming."""

    @property
    def completion_tokens(self) -> int:
        """Sampled tokens over all choices."""
        return sum(len(c.gen.completion_ids) for c in self.choices)


def decode(tokenizer: PreTrainedTokenizerBase, ids: list[int], skip_special: bool) -> str:
    """Text of ids (the tokenizer's stubs allow a list; one sequence gives a string)."""
    text = tokenizer.decode(ids, skip_special_tokens=skip_special)
    assert isinstance(text, str)
    return text
