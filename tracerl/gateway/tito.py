"""Token-in/token-out: build each prompt from the exact ids the policy already saw.

Re-tokenizing a whole conversation on every turn silently changes what the policy is
trained on (BPE merges across turn boundaries, JSON re-serialised by the template,
special tokens the model sampled but the template spells differently). So when a request
extends the previous request of its thread (the conversation it carries on, threads.py) —
earlier messages unchanged, then the assistant message we returned, then new messages — the
prompt is the previous prompt ids + the sampled completion ids + the tokens of the new
suffix alone. When that does not hold, the whole prompt is tokenized afresh and the reason
is recorded on the span.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import orjson
from transformers import PreTrainedTokenizerBase

from tracerl.gateway.chat import Message, same_turn
from tracerl.gateway.tool_rendering import (
    ToolRendering,
    hermes_messages,
    probe_rendering,
    uses_tools,
)

OPENINGS = 256
"""First calls whose prompt ids PromptBuilder keeps (a few groups' worth of tasks)."""
OPENING_BYTES = 64 * 1024
"""The largest first call (messages and tools as JSON) whose ids are kept."""


@dataclass
class Turn:
    """What the gateway remembers of one returned choice, to extend it next time."""

    ids: list[int]
    """Prompt ids + sampled completion ids of that choice."""
    reply: Message
    """The assistant message returned for it, in canonical form."""
    end: str
    """How the completion ended: 'eos' (an end token), 'length' or 'stop_string'."""


@dataclass
class History:
    """The previous request of one thread (a conversation of one agent of an attempt)."""

    messages: list[Message]
    """Canonical messages of the previous request."""
    tools: list[dict] | None
    """Tools of the previous request (a change of tools changes the rendered prompt)."""
    turns: list[Turn] = field(default_factory=list)
    """One entry per returned choice (n > 1 returns several)."""


@dataclass
class Prompt:
    """The prompt ids for one request and how they were obtained."""

    ids: list[int]
    """Token ids to send to the engine."""
    reused: int = 0
    """Leading ids taken verbatim from the previous call."""
    prefix_break: str | None = None
    """Why reuse failed, when there was a previous call to reuse."""
    tool_rendering: ToolRendering | None = None
    """How the request's tools, calls and results were rendered; None when it had none."""


class PromptTooLong(ValueError):
    """A prompt found, before it was tokenized, to hold at least `tokens` tokens: no room
    is left in a context of `max_context`."""

    def __init__(self, tokens: int, max_context: int) -> None:
        super().__init__(f"the prompt holds at least {tokens} tokens; the context is {max_context}")
        self.tokens, self.max_context = tokens, max_context


def longest_token_bytes(tokenizer: PreTrainedTokenizerBase) -> int:
    """UTF-8 bytes of the tokenizer's longest token, added (special) tokens included.

    No token stands for more bytes of text than its own spelling holds (a byte-level
    token spells each byte with one character, a SentencePiece token spells a space as the
    3-byte "▁", a byte-fallback token spells one byte as "<0x0A>"), so a text of B bytes
    holds at least B / this many tokens."""
    vocab = tokenizer.get_vocab()
    return max((len(token.encode()) for token in vocab), default=1) or 1


def _compile(tokenizer: PreTrainedTokenizerBase) -> Any:
    """The tokenizer's chat template compiled by transformers' own (cached) compiler."""
    template = tokenizer.chat_template
    if not isinstance(template, str):
        return None
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # a transformers without it: fall back to apply_chat_template
        return None
    return _compile_jinja_template(template)


class PromptBuilder:
    """Renders chat requests to ids with one tokenizer, reusing earlier ids when it can.

    With a `max_context`, a text is measured before it is tokenized: one whose bytes alone
    show it cannot fit (bytes / longest_token_bytes >= max_context) raises PromptTooLong at
    once. Tokenizing is what costs (a 10 MB word takes BPE tens of seconds, on the one
    tokenizer thread every call shares); counting bytes takes milliseconds."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_context: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_context = max_context
        """Refuse texts that cannot fit in this many tokens; None: no bound."""
        self.longest = longest_token_bytes(tokenizer) if max_context is not None else 1
        """The longest token's bytes: no token covers more of a text (read once, and only
        when there is a bound to check)."""
        eos = tokenizer.eos_token
        if not isinstance(eos, str):
            raise ValueError("the tokenizer needs an eos token to close assistant turns")
        self.eos_text: str = eos
        eos_id = tokenizer.convert_tokens_to_ids(eos)
        assert isinstance(eos_id, int)
        self.eos_id: int = eos_id
        self._compiled = _compile(tokenizer)
        self._fast = getattr(tokenizer, "backend_tokenizer", None)
        # A normalizer may shorten text before the tokens are cut (NFKC turns 4-byte letters
        # into 1-byte ones): the bound measures what the tokens are cut from.
        self._normalizer = getattr(self._fast, "normalizer", None)
        self._specials = {
            k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)
        }
        self.tool_rendering: ToolRendering = probe_rendering(self._render)
        """How tools reach this template's prompts (tool_rendering.py)."""
        template = tokenizer.chat_template
        # A template that reads the clock (Llama 3's "Today Date") renders a request anew.
        self._openings: OrderedDict[bytes, list[int]] | None = (
            OrderedDict() if isinstance(template, str) and "strftime_now" not in template else None
        )
        """The ids of the latest first calls, by request (`opening`)."""

    def render(self, messages: list[Message], tools: list[dict] | None, gen: bool) -> str:
        """The chat template's text for messages (with the assistant header when gen); for a
        template that ignores tools, of the messages with their tools rewritten the Hermes
        way."""
        if self.tool_rendering == "hermes-fallback" and uses_tools(messages, tools):
            return self._render(hermes_messages(messages, tools), None, gen)
        return self._render(messages, tools, gen)

    def _render(self, messages: list[Message], tools: list[dict] | None, gen: bool) -> str:
        if self._compiled is not None:
            # Canonical messages are plain JSON already, so the template is rendered
            # directly: apply_chat_template's defensive copies cost as much as the render.
            return self._compiled.render(
                messages=messages, tools=tools, add_generation_prompt=gen, **self._specials
            )
        text = self.tokenizer.apply_chat_template(
            messages,  # type: ignore[arg-type]
            tools=tools,  # type: ignore[arg-type]
            add_generation_prompt=gen,
            tokenize=False,
        )
        assert isinstance(text, str)
        return text

    def opening(self, messages: list[Message], tools: list[dict] | None) -> list[int]:
        """Prompt ids of a call that extends nothing. The rollouts of a group open with the
        same request (one task, group_size times; a paired comparison's arms too), so the
        last OPENINGS requests' ids are kept: a repeat costs a JSON dump, not a render and
        a tokenization (together most of a short call's work in the gateway)."""
        key = _opening_key(messages, tools) if self._openings is not None else None
        if key is None or self._openings is None:
            return self.encode(self.render(messages, tools, gen=True))
        ids = self._openings.pop(key, None)
        if ids is None:
            ids = self.encode(self.render(messages, tools, gen=True))
        self._openings[key] = ids
        if len(self._openings) > OPENINGS:
            self._openings.popitem(last=False)
        return list(ids)  # the caller's own: a prompt's ids are extended in place later

    def encode(self, text: str, special: bool = False, before: int = 0) -> list[int]:
        """Ids of text. A rendered template already holds every special token it needs;
        `special` adds the tokenizer's own (BOS...) for raw text completions. `before`
        ids precede these in the prompt (PromptTooLong counts them)."""
        self.check_length(text, before)
        if self._fast is not None:  # the Rust tokenizer directly: no Python-side wrapping
            # encode_batch, not encode: it releases the GIL while it tokenizes, so a huge
            # prompt on the gateway's tokenizer thread never stalls the event loop (encode
            # holds the GIL throughout: seconds for a few MB).
            (encoding,) = self._fast.encode_batch([text], add_special_tokens=special)
            return list(encoding.ids)
        return list(self.tokenizer.encode(text, add_special_tokens=special))

    def check_length(self, text: str, before: int = 0) -> None:
        """Raise PromptTooLong if `before` ids and the tokens of `text` cannot leave room
        for a completion, judged by the text's bytes alone."""
        if self.max_context is None:
            return
        if self._normalizer is not None:
            text = self._normalizer.normalize_str(text)
        at_least = before + -(-len(text.encode()) // self.longest)
        if at_least >= self.max_context:
            raise PromptTooLong(at_least, self.max_context)

    def build(
        self, messages: list[Message], tools: list[dict] | None, prev: History | None
    ) -> Prompt:
        """Prompt ids for a request, extending `prev` when the request extends it."""
        rendering = self.tool_rendering if uses_tools(messages, tools) else None
        if prev is None:
            return Prompt(ids=self.opening(messages, tools), tool_rendering=rendering)
        full = self.render(messages, tools, gen=True)
        turn, reason = match_turn(messages, tools, prev)
        if turn is None:
            return Prompt(ids=self.encode(full), prefix_break=reason, tool_rendering=rendering)
        k = len(prev.messages) + 1
        before = self.render(messages[:k], tools, gen=False)
        cut = before.rfind(self.eos_text)
        if cut < 0 or not full.startswith(before):
            drift = "template drift"
            return Prompt(ids=self.encode(full), prefix_break=drift, tool_rendering=rendering)
        # The suffix starts right after the end token that closed our assistant turn, so
        # whatever the template writes after it (a newline, the next role header) is
        # tokenized with the new messages; a boundary after a special token is clean.
        suffix = full[cut + len(self.eos_text) :]
        # A completion cut by max_tokens never sampled its end token: the template's end
        # token is appended as context (the loss mask comes from the span, not from here).
        head = turn.ids if turn.end == "eos" else [*turn.ids, self.eos_id]
        ids = head + self.encode(suffix, before=len(head))
        return Prompt(ids=ids, reused=len(turn.ids), tool_rendering=rendering)


def _opening_key(messages: list[Message], tools: list[dict] | None) -> bytes | None:
    """A first call's request as bytes, or None when it is not worth keeping (too large:
    a repeat of it is rare and its key would hold memory; not JSON)."""
    try:
        key = orjson.dumps([messages, tools])
    except TypeError:
        return None
    return key if len(key) <= OPENING_BYTES else None


def match_turn(
    messages: list[Message], tools: list[dict] | None, prev: History
) -> tuple[Turn | None, str]:
    """The returned choice a request carries on from, with its ids reusable; else None and
    why not (the reason a span records as its prefix break)."""
    k = len(prev.messages)
    if tools != prev.tools:
        return None, "tools changed"
    if len(messages) <= k + 1 or messages[:k] != prev.messages:
        return None, "edited history"
    for turn in prev.turns:
        if same_turn(turn.reply, messages[k]):
            # The agent never saw the stop string the model sampled; reusing those ids
            # would put text in the context that the conversation does not hold.
            if turn.end == "stop_string":
                return None, "stop string"
            return turn, ""
    return None, "assistant message changed"
