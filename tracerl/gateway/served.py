"""What the gateway serves and what one call is: ServedModel, Pending (checked, not yet
sampled), Choice and Served (what it produced).

Records only, no I/O: core.py fills them, record.py turns choices into spans, app.py writes
them in each wire format.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from tracerl.engines.base import Engine
from tracerl.gateway.chat import Message, ParsedReply
from tracerl.gateway.threads import HistoryKey, Placement
from tracerl.gateway.tito import Prompt, PromptBuilder
from tracerl.gateway.toolcalls import Reasoning, ToolFormat, detect_reasoning, tool_format
from tracerl.gateway.toolcalls.hermes import HERMES
from tracerl.types import Generation, Rollout, SamplingParams

__all__ = ["Choice", "Pending", "Served", "ServedModel", "decode"]

log = logging.getLogger(__name__)


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
    tool_parser: str | None = None
    """Its tool-call format (hermes, qwen3_coder, llama3, mistral); None: read off the chat
    template (toolcalls.detect)."""
    thinking: tuple[str, str] | None = None
    """Its reasoning markers (start, end); None: `<think>`/`</think>` when the chat template
    knows them, else no reasoning is split off."""
    vocab_size: int = field(init=False)
    """Token ids below this are the tokenizer's (added tokens included)."""
    prompts: PromptBuilder = field(init=False)
    """Renders and tokenizes this model's prompts (on the gateway's tokenizer thread, or its
    loop for a short chat while that thread is idle: core.Gateway._tokenize)."""
    tool_format: ToolFormat = field(init=False)
    """How its replies' tool calls are parsed and forced."""
    reasoning: Reasoning | None = field(init=False)
    """How its replies' reasoning is split off; None: it writes none."""
    _special: re.Pattern[str] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.vocab_size = len(self.tokenizer)
        # Bounded by the engine's context: a prompt that cannot fit is refused before it is
        # tokenized (tito.PromptTooLong).
        self.prompts = PromptBuilder(self.tokenizer, self.engine.max_context)
        template = self.tokenizer.chat_template
        self.tool_format = self._tool_format(template)
        self.reasoning = self._reasoning(template)
        # Special tokens other than the format's markers never reach the agent's text.
        keep = set(self.tool_format.markers)
        if self.reasoning is not None:
            keep |= {self.reasoning.start, self.reasoning.end}
        hidden = [t for t in self.tokenizer.all_special_tokens if t not in keep]
        if hidden:
            self._special = re.compile("|".join(re.escape(t) for t in hidden))

    def _tool_format(self, template: object) -> ToolFormat:
        """The configured format, else the template's; Hermes for a template that ignores
        tools, since the gateway then renders them the Hermes way (tool_rendering.py)."""
        if self.prompts.tool_rendering == "template":
            return tool_format(self.tool_parser, template)
        if self.tool_parser not in (None, HERMES.name):
            raise ValueError(
                f"{self.name}: its chat template ignores tools, so the gateway renders them "
                f"the Hermes way and parses Hermes calls; tool_parser {self.tool_parser!r} "
                "cannot read those (leave it unset, or set hermes)"
            )
        log.info("%s: its chat template ignores tools; rendering them the Hermes way", self.name)
        return HERMES

    def _reasoning(self, template: object) -> Reasoning | None:
        if self.thinking is not None:
            return Reasoning(*self.thinking)
        try:
            opening = self.prompts.render([{"role": "user", "content": "x"}], None, True)
        except Exception:  # a template that cannot render a bare user turn opens nothing
            opening = ""
        return detect_reasoning(template, opening)

    def text(self, gen: Generation) -> str:
        """The completion's text as the agent sees it (no end token, no stop string)."""
        text = decode(self.tokenizer, gen.completion_ids, skip_special=False)
        if gen.stop_string:
            at = text.find(gen.stop_string)
            text = text[:at] if at >= 0 else text
        return self.hide(text)

    def hide(self, text: str) -> str:
        """Text without the special tokens agents never see (tool-call markers stay)."""
        return self._special.sub("", text) if self._special else text


@dataclass
class Pending:
    """A call that passed every check and has its prompt ids, not yet sampled: what a
    stream is opened from (a refusal must come before the first byte is sent)."""

    served: ServedModel
    """The model answering it."""
    model: str
    """The model name the client asked for (an alias, or the role itself)."""
    rollout: Rollout | None
    """The rollout attempt it is recorded under; None when not recorded."""
    parent_id: str | None
    """The span of the agent that spawned the caller, if any."""
    key: HistoryKey | None
    """Its agent's token-history key (chat calls under a rollout), else None."""
    thread: Placement | None
    """Its thread (chat calls under a rollout), else None."""
    messages: list[Message]
    """Canonical messages ([] for raw completions)."""
    tools: list[dict] | None
    """Tools as the chat template sees them."""
    prompt: Prompt
    """Prompt ids and how they were built."""
    params: SamplingParams
    """How to sample (max_tokens already capped by the context)."""
    n: int
    """Number of choices."""
    kind: str
    """Response id prefix: 'chatcmpl' or 'cmpl'."""
    span_id: str
    """Id of its first choice's span, chosen up front so a stream's first chunk carries it."""
    assets: dict[str, int] = field(default_factory=dict)
    """The assets in its prompt, name -> version (gateway/assets.py)."""
    unassisted: list[int] | None = None
    """The prompt's ids without its assets, when the gateway records them for an asset
    (GatewayConfig.unassisted): what a curriculum's distillation trains on."""


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
    span_id: str
    """The first choice's span id (other wire formats prefix it their own way)."""
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
    fast = getattr(tokenizer, "backend_tokenizer", None)
    if fast is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        # The Rust tokenizer directly: what decode does when there is nothing to clean up,
        # without its Python-side wrapping (once per call and choice).
        return str(fast.decode(ids, skip_special_tokens=skip_special))
    text = tokenizer.decode(ids, skip_special_tokens=skip_special)
    assert isinstance(text, str)
    return text
