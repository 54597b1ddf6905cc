"""The sandbox as an OpenAI tool: the `python(code)` schema, and running a model's call.

An agent passes `tools=[PYTHON_TOOL]`, and for each tool call the model makes appends
`execute_tool_call(call)` (a `{"role": "tool", ...}` message) to the conversation.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from tracerl.tools.sandbox import SandboxConfig, SandboxResult, run_python

__all__ = ["PYTHON_TOOL", "execute_tool_call", "format_result"]

PYTHON_TOOL: dict = {
    "type": "function",
    "function": {
        "name": "python",
        "description": (
            "Run a Python 3 program in a sandbox (no network, no files outside its working "
            "directory, a few seconds of CPU) and return what it prints."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "The program; print the result."}
            },
            "required": ["code"],
        },
    },
}
"""The OpenAI tool schema of `run_python` (pass it in `tools=[PYTHON_TOOL]`)."""


def format_result(result: SandboxResult) -> str:
    """The tool message text: stdout alone when the code succeeded quietly (so a model can
    copy it), else stdout, stderr and a note on how it ended."""
    if result.ok and not result.stderr and not result.stdout_truncated:
        return result.stdout.rstrip("\n")
    parts = [result.stdout.rstrip("\n"), result.stderr.rstrip("\n")]
    if result.stdout_truncated or result.stderr_truncated:
        parts.append("[output truncated]")
    if result.limit is not None:
        parts.append(f"[stopped: {result.limit} limit]")
    elif result.signal is not None:
        parts.append(f"[killed by signal {result.signal}]")
    elif result.exit_code:
        parts.append(f"[exit code {result.exit_code}]")
    return "\n".join(p for p in parts if p)


def _call_fields(call: object) -> tuple[str, str, str]:
    """(id, function name, arguments JSON) of an OpenAI tool call, as an object or a dict."""
    data = call.model_dump() if hasattr(call, "model_dump") else call
    if not isinstance(data, Mapping):
        raise TypeError(f"not a tool call: {call!r}")
    function = data.get("function") or {}
    return str(data.get("id", "")), str(function.get("name", "")), function.get("arguments") or ""


def execute_tool_call(call: object, cfg: SandboxConfig | None = None) -> dict[str, str]:
    """Run one `python` tool call from a model and return the tool message to append.

    Bad calls (another tool's name, arguments that are not JSON with a `code` string) come
    back as an error message for the model, never as an exception.
    """
    call_id, name, arguments = _call_fields(call)
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        code = parsed.get("code") if isinstance(parsed, dict) else None
    except json.JSONDecodeError:
        code = None
    if name != "python":
        content = f"error: unknown tool {name!r}; the only tool is python(code)"
    elif not isinstance(code, str):
        content = 'error: arguments must be JSON like {"code": "print(1 + 1)"}'
    else:
        content = format_result(run_python(code, cfg))
    return {"role": "tool", "tool_call_id": call_id, "content": content}
