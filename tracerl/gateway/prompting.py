"""A request's prompt: canonical messages and tools, and its token ids. These run on the
gateway's tokenizer thread, never on its event loop."""

from __future__ import annotations

from tracerl.gateway.chat import ChatRequest, Message, ToolSpec, normalize_message
from tracerl.gateway.errors import GatewayError
from tracerl.gateway.served import ServedModel
from tracerl.gateway.tito import History, Prompt

__all__ = ["chat_prompt", "completion_ids", "request_messages", "tool_dicts"]


def chat_prompt(
    served: ServedModel, req: ChatRequest, prev: History | None
) -> tuple[list[Message], list[dict] | None, Prompt]:
    """The request's canonical messages and tools, and its prompt ids (extending `prev`)."""
    messages = request_messages(req)
    tools = tool_dicts(req.tools)
    try:
        return messages, tools, served.prompts.build(messages, tools, prev)
    except GatewayError:
        raise
    except Exception as e:  # a template that cannot render this conversation
        raise GatewayError(400, f"cannot render messages: {e}", param="messages") from None


def completion_ids(served: ServedModel, prompt: str | list[int]) -> list[int]:
    """A raw completion's prompt ids: text tokenized as the tokenizer does, or ids checked."""
    if isinstance(prompt, str):
        ids = served.prompts.encode(prompt, special=True)
    else:
        ids = list(prompt)
        vocab = len(served.tokenizer)
        if any(not 0 <= t < vocab for t in ids):
            raise GatewayError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
    if not ids:
        raise GatewayError(400, "prompt is empty", param="prompt")
    return ids


def request_messages(req: ChatRequest) -> list[Message]:
    """The request's messages in one form, or a 400 naming what is wrong with them."""
    try:
        return [normalize_message(m) for m in req.messages]
    except (ValueError, TypeError, AttributeError) as e:
        raise GatewayError(400, str(e), param="messages") from None


def tool_dicts(tools: list[ToolSpec] | None) -> list[dict] | None:
    """Tools as plain dicts for the chat template (None when absent or empty)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None
