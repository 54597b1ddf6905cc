"""A request's prompt: canonical messages and tools, and its token ids. These run on the
gateway's tokenizer thread, never on its event loop, except what costs less than the hop to
that thread: the range check of a short token-id prompt (`INLINE_IDS`) and the rendering and
tokenizing of a short chat (`INLINE_CHARS`, `inline_chat`)."""

from __future__ import annotations

from pydantic import BaseModel

from tracerl.gateway.chat import ChatRequest, Message, ToolSpec, normalize_message
from tracerl.gateway.errors import GatewayError
from tracerl.gateway.served import ServedModel
from tracerl.gateway.threads import HistoryKey, Placement, Thread, place
from tracerl.gateway.tito import History, Prompt, PromptTooLong

__all__ = [
    "INLINE_CHARS",
    "INLINE_IDS",
    "chat_prompt",
    "completion_ids",
    "inline_chat",
    "inline_ids",
    "request_messages",
    "thread_prompt",
    "too_long",
    "tool_dicts",
]

INLINE_IDS = 2_048
"""Token-id prompts up to this long are checked on the event loop: the range check takes
tens of microseconds there, less than a round trip to the tokenizer thread, and a longer
one would hold the loop (and every other call) for longer than that round trip."""


INLINE_CHARS = 4_096
"""Chats whose messages and tools hold at most this many characters are rendered and
tokenized on the event loop. Rendering is Python (it holds the GIL on the tokenizer thread
too, so the loop waits for it either way); a short chat takes ~0.1-0.5 ms, no more than the
round trip to the thread under load, while a longer one (a 50 KB system prompt) could hold
the loop for milliseconds, and goes to the thread, where the Rust tokenizer releases the
GIL."""


def inline_chat(req: ChatRequest) -> bool:
    """Whether the request's chat is short enough to render on the event loop: its strings
    (keys and values of messages and tools) hold at most INLINE_CHARS characters. Stops
    counting once past the bound, so a 10 MB message costs no more to judge than a short one."""
    return _chars_left(INLINE_CHARS, [req.messages, req.tools]) >= 0


def _chars_left(budget: int, value: object) -> int:
    """`budget` less the characters of the strings in `value` (JSON values and pydantic
    models, walked without recursion: nesting depth is the client's to choose); negative as
    soon as it runs out."""
    stack = [value]
    while stack and budget >= 0:
        v = stack.pop()
        if isinstance(v, str):
            budget -= len(v)
        elif isinstance(v, dict | list | tuple):
            budget -= len(v)  # a separator an item at least; a huge one is judged unopened
            if budget >= 0:
                stack.extend([*v.keys(), *v.values()] if isinstance(v, dict) else v)
        elif isinstance(v, BaseModel):
            stack.extend(v.__dict__.values())
            stack.extend((v.__pydantic_extra__ or {}).values())
        else:  # numbers, booleans, None
            budget -= 1
    return budget


def chat_prompt(
    served: ServedModel, req: ChatRequest, prev: History | None
) -> tuple[list[Message], list[dict] | None, Prompt]:
    """The request's canonical messages and tools, and its prompt ids (extending `prev`)."""
    messages = request_messages(req)
    tools = tool_dicts(req.tools)
    return messages, tools, _build(served, messages, tools, prev)


def thread_prompt(
    served: ServedModel,
    req: ChatRequest,
    key: HistoryKey,
    threads: list[Thread],
    new_id: str,
    named_parent: str | None,
) -> tuple[list[Message], list[dict] | None, Prompt, Placement]:
    """A rollout's chat call: its messages and tools, its thread (threads.py) and its prompt
    ids, extending the thread's last call when it carries it on."""
    messages = request_messages(req)
    tools = tool_dicts(req.tools)
    placement = place(messages, tools, key, threads, new_id, named_parent)
    return messages, tools, _build(served, messages, tools, placement.prev), placement


def _build(
    served: ServedModel, messages: list[Message], tools: list[dict] | None, prev: History | None
) -> Prompt:
    try:
        return served.prompts.build(messages, tools, prev)
    except PromptTooLong as e:
        raise too_long(e.tokens, e.max_context, "messages", at_least=True) from None
    except GatewayError:
        raise
    except Exception as e:  # a template that cannot render this conversation
        raise GatewayError(400, f"cannot render messages: {e}", param="messages") from None


def completion_ids(served: ServedModel, prompt: str | list[int]) -> list[int]:
    """A raw completion's prompt ids: text tokenized as the tokenizer does, or ids checked."""
    if isinstance(prompt, str):
        try:
            ids = served.prompts.encode(prompt, special=True)
        except PromptTooLong as e:
            raise too_long(e.tokens, e.max_context, "prompt", at_least=True) from None
    else:
        ids = list(prompt)
        if ids and not (min(ids) >= 0 and max(ids) < served.vocab_size):
            message = f"prompt token ids must be in [0, {served.vocab_size})"
            raise GatewayError(400, message, param="prompt")
    if not ids:
        raise GatewayError(400, "prompt is empty", param="prompt")
    return ids


def too_long(tokens: int, max_context: int, param: str, at_least: bool = False) -> GatewayError:
    """OpenAI's refusal of a prompt over the context (`at_least`: counted by its bytes,
    before it was tokenized)."""
    holds = f"at least {tokens}" if at_least else str(tokens)
    return GatewayError(
        400,
        f"This model's maximum context length is {max_context} tokens; the prompt holds {holds}.",
        param=param,
        code="context_length_exceeded",
    )


def inline_ids(prompt: str | list[int]) -> bool:
    """Whether `completion_ids` of `prompt` may run on the event loop: token ids, at most
    INLINE_IDS of them (text needs the tokenizer, which runs on its own thread)."""
    return isinstance(prompt, list) and len(prompt) <= INLINE_IDS


def request_messages(req: ChatRequest) -> list[Message]:
    """The request's messages in one form, or a 400 naming what is wrong with them."""
    try:
        return [normalize_message(m) for m in req.messages]
    except (ValueError, TypeError, AttributeError) as e:
        raise GatewayError(400, str(e), param="messages") from None


def tool_dicts(tools: list[ToolSpec] | None) -> list[dict] | None:
    """Tools as plain dicts for the chat template (None when absent or empty)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None
