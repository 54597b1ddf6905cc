"""The Responses API's reply side: a finished choice as output items (its reasoning, its
message, its function calls), the response object, and the same as an event stream.

The request side and the routes are responses.py.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from tracerl.gateway.chat import wire_message
from tracerl.gateway.core import Gateway
from tracerl.gateway.served import Choice, Pending, Served
from tracerl.gateway.streaming import Thought, sse, stream_call

if TYPE_CHECKING:
    from tracerl.gateway.responses import ResponsesRequest

__all__ = ["Keep", "body", "events", "output", "reasoning_item"]

Keep = Callable[[Served, dict[str, Any]], None]
"""What to do with a finished response (remember it when the request asks to store it)."""


def output(c: Choice) -> list[dict[str, Any]]:
    """The output items of a finished choice: its reasoning and its message (each if it
    wrote any), its calls."""
    status = "incomplete" if c.finish_reason == "length" else "completed"
    items = [reasoning_item(c.reply.reasoning)] if c.reply.reasoning else []
    items += [_message(c.reply.content, status)] if c.reply.content else []
    return items + [_call(call_id, call, "completed") for call_id, call in _calls(c)]


def reasoning_item(text: str) -> dict[str, Any]:
    """A `reasoning` output item holding the model's own reasoning text (no summary)."""
    return {
        "id": f"rs_{uuid.uuid4().hex}",
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed",
    }


def _calls(c: Choice) -> list[tuple[str, dict[str, Any]]]:
    return list(
        zip(c.call_ids, wire_message(c.reply, c.call_ids).get("tool_calls", []), strict=True)
    )


def _message(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "id": item_id or f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [_part(text)] if status != "in_progress" else [],
    }


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call(call_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    return {
        "id": f"fc_{call_id.removeprefix('call_')}",
        "type": "function_call",
        "call_id": call_id,
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"] if status != "in_progress" else "",
        "status": status,
    }


def body(
    served: Served | None, req: ResponsesRequest, output: list[dict[str, Any]], status: str,
    p: Pending | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The response object (in progress while streaming: no usage yet)."""
    span_id = served.span_id if served else p.span_id if p else ""
    usage = None
    if served is not None:
        usage = {
            "input_tokens": served.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": served.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": served.prompt_tokens + served.completion_tokens,
        }
        if served.choices[0].finish_reason == "length":
            status = "incomplete"
    return {
        "id": f"resp_{span_id}",
        "object": "response",
        "created_at": served.created if served else int(time.time()),
        "status": status,
        "model": req.model,
        "output": output,
        "usage": usage,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "metadata": req.metadata or {},
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "tool_choice": req.tool_choice or "auto",
        "tools": [t for t in req.tools or [] if t.get("type") == "function"],
        "max_output_tokens": req.max_output_tokens,
        "previous_response_id": req.previous_response_id,
        "store": req.store is not False,
        "text": req.text or {"format": {"type": "text"}},
        "truncation": "disabled",
    }


# -- streaming --------------------------------------------------------------------------------


class _Events:
    """Numbers a response's events (sequence_number) and writes them as SSE."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(data, kind)


async def events(
    gateway: Gateway, p: Pending, req: ResponsesRequest, keep: Keep
) -> AsyncIterator[bytes]:
    """created, in_progress, the message's text as it is sampled, each call, completed."""
    event = _Events()
    yield event("response.created", response=body(None, req, [], "in_progress", p))
    yield event("response.in_progress", response=body(None, req, [], "in_progress", p))
    msg_id, text, served = f"msg_{uuid.uuid4().hex}", "", None
    output: list[dict[str, Any]] = []
    where = {"item_id": msg_id, "output_index": 0, "content_index": 0}
    async for piece in stream_call(gateway, p):
        if isinstance(piece, Served):
            served = piece
            break
        if isinstance(piece, Thought):  # it closes before any text: the first item
            output.append(reasoning_item(piece.text))
            for kind in ("response.output_item.added", "response.output_item.done"):
                yield event(kind, output_index=0, item=output[-1])
            continue
        if not text:  # the message item opens with its first piece of text
            where["output_index"] = len(output)
            item = _message("", "in_progress", msg_id)
            yield event("response.output_item.added", output_index=len(output), item=item)
            yield event("response.content_part.added", part=_part(""), **where)
        text += piece
        yield event("response.output_text.delta", delta=piece, logprobs=[], **where)
    assert served is not None, "stream_call ends with the Served"
    c = served.choices[0]
    if text:
        status = "incomplete" if c.finish_reason == "length" else "completed"
        yield event("response.output_text.done", text=text, logprobs=[], **where)
        yield event("response.content_part.done", part=_part(text), **where)
        output.append(_message(text, status, msg_id))
        yield event("response.output_item.done", output_index=len(output) - 1, item=output[-1])
    for call_id, call in _calls(c):
        index, done = len(output), _call(call_id, call, "completed")
        yield event(
            "response.output_item.added",
            output_index=index,
            item=_call(call_id, call, "in_progress"),
        )
        at = {"item_id": done["id"], "output_index": index}
        yield event("response.function_call_arguments.delta", delta=done["arguments"], **at)
        yield event(
            "response.function_call_arguments.done",
            arguments=done["arguments"],
            name=done["name"],
            **at,
        )
        output.append(done)
        yield event("response.output_item.done", output_index=index, item=done)
    reply = body(served, req, output, "completed")
    keep(served, reply)
    kind = "response.incomplete" if reply["status"] == "incomplete" else "response.completed"
    yield event(kind, response=reply)
