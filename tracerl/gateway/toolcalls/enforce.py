"""What a request forces the reply to be, as a grammar the engine decodes under.

`tool_choice: "required"` (or a named function) becomes the served model's tool-call format
with the tools' argument schemas: one or more calls, nothing else. `response_format`
json_object / json_schema becomes a JSON grammar. Both are llguidance Lark text, the form
every engine takes (vLLM's as `structured_outputs.grammar`). The grammar travels to the
engine in `ConstrainedParams`; engines that cannot constrain decoding sample as usual, and
the gateway still parses what comes back.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from llguidance import LLMatcher
from transformers import PreTrainedTokenizerBase

from tracerl.engines.constrained import ConstrainedParams, grammar_error
from tracerl.gateway.chat import ChatRequest, NamedToolChoice
from tracerl.gateway.errors import GatewayError
from tracerl.gateway.toolcalls.base import COMPACT_JSON, ToolFormat
from tracerl.types import SamplingParams

if TYPE_CHECKING:
    from tracerl.gateway.served import ServedModel

__all__ = ["constrained", "forces_format", "literal_for", "request_grammar"]

log = logging.getLogger(__name__)
_warned: set[str] = set()


def constrained(
    served: ServedModel,
    req: ChatRequest,
    tools: list[dict[str, Any]] | None,
    params: SamplingParams,
) -> SamplingParams:
    """`params` with the grammar `req` forces (on the gateway's tokenizer thread), or as they
    are when it forces nothing or the model's engine cannot constrain decoding (warned once:
    the reply is then only parsed, and the span records no grammar)."""
    try:
        grammar = request_grammar(req, tools, served.tool_format, served.tokenizer)
    except ValueError as e:
        raise GatewayError(400, str(e), param="response_format") from None
    if grammar is None:
        return params
    if not getattr(served.engine, "constrains_decoding", False):
        if served.name not in _warned:
            _warned.add(served.name)
            log.warning("%s's engine cannot constrain decoding: output formats not enforced",
                        served.name)  # fmt: skip
        return params
    return ConstrainedParams(**params.model_dump(), grammar=grammar)


def forces_format(req: ChatRequest) -> bool:
    """Whether `req` asks for a grammar at all (tool_choice required or named, a JSON
    response_format): only then has `constrained` anything to build, so only then does the
    gateway send it to the tokenizer thread."""
    choice = req.tool_choice
    fmt = req.response_format
    forced_tool = choice == "required" or isinstance(choice, NamedToolChoice)
    return forced_tool or (fmt is not None and fmt.type != "text")


def request_grammar(
    req: ChatRequest,
    tools: list[dict[str, Any]] | None,
    fmt: ToolFormat,
    tokenizer: PreTrainedTokenizerBase,
) -> str | None:
    """The llguidance grammar `req` decodes under; None when it forces nothing. A grammar
    that cannot be built (a malformed schema) raises ValueError."""
    grammar = _tool_grammar(req, tools or [], fmt, tokenizer) or _json_grammar(req)
    if grammar is not None and (error := grammar_error(grammar)):
        raise ValueError(f"cannot enforce this request's output format: {error}")
    return grammar


def _tool_grammar(
    req: ChatRequest, tools: list[dict[str, Any]], fmt: ToolFormat, tokenizer: Any
) -> str | None:
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t["function"]["name"] == choice.function.name]
    elif choice != "required":
        return None
    parallel = req.parallel_tool_calls is not False
    return LLMatcher.grammar_from_lark(fmt.grammar(tools, literal_for(tokenizer), parallel))


def _json_grammar(req: ChatRequest) -> str | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    schema: dict[str, Any] = {"type": "object"}
    if fmt.type == "json_schema" and fmt.json_schema is not None:
        schema = fmt.json_schema.schema_ or schema
    # Defaults, so a schema's own "x-guidance" options still win.
    compact: Any = COMPACT_JSON
    built = json.loads(LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=compact))
    # As Lark, like the tool grammars: the one form every engine takes (vLLM's
    # `structured_outputs.grammar` reads Lark, not llguidance's JSON form).
    return "start: %json " + json.dumps(built["grammars"][0]["json_schema"])


def literal_for(tokenizer: PreTrainedTokenizerBase) -> Any:
    """Renders a marker for a Lark grammar: the token itself (`<[id]>`) when the tokenizer
    holds it as one added token, which is how the model writes it, else the quoted text."""
    added = tokenizer.get_added_vocab()

    def literal(marker: str) -> str:
        return f"<[{added[marker]}]>" if marker in added else json.dumps(marker)

    return literal
