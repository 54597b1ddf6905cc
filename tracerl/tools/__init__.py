"""Tools that agents call: Python run in a bubblewrap sandbox (`sandbox`), its process
handling (`capture`), and its OpenAI tool form `python(code)` (`python_tool`)."""

from tracerl.tools.python_tool import PYTHON_TOOL, execute_tool_call, format_result
from tracerl.tools.sandbox import SandboxConfig, SandboxResult, SandboxUnavailable, run_python

__all__ = [
    "PYTHON_TOOL",
    "SandboxConfig",
    "SandboxResult",
    "SandboxUnavailable",
    "execute_tool_call",
    "format_result",
    "run_python",
]
