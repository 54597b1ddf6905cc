"""A first call's prompt ids are kept by request: a group's rollouts open with the same
request, and a repeat is not rendered or tokenized again. The ids are the same as a fresh
build's, each caller gets its own list, the store is bounded, and a template that reads
the clock is rendered every time."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

from transformers import AutoTokenizer

from tracerl.gateway import tito
from tracerl.gateway.tito import OPENINGS, PromptBuilder

TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]


def _ask(i: int) -> list[dict]:
    return [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": f"{i}+1?"}]


def test_a_repeated_first_call_is_not_rendered_again(tiny_model_dir: Path) -> None:
    builder = PromptBuilder(AutoTokenizer.from_pretrained(tiny_model_dir))
    fresh = PromptBuilder(AutoTokenizer.from_pretrained(tiny_model_dir))
    first = builder.build(_ask(1), TOOLS, None)
    with mock.patch.object(builder, "_render", side_effect=AssertionError("rendered")):
        again = builder.build(_ask(1), TOOLS, None)
    assert again.ids == first.ids == fresh.build(_ask(1), TOOLS, None).ids
    assert again.tool_rendering == first.tool_rendering
    again.ids.append(0)  # the caller's own list
    assert builder.build(_ask(1), TOOLS, None).ids == first.ids
    assert builder.build(_ask(1), None, None).ids != first.ids  # the tools are the request's


def test_the_kept_openings_are_bounded(tiny_model_dir: Path) -> None:
    builder = PromptBuilder(AutoTokenizer.from_pretrained(tiny_model_dir))
    for i in range(OPENINGS + 10):
        builder.build(_ask(i), TOOLS, None)
    assert builder._openings is not None and len(builder._openings) == OPENINGS
    with mock.patch.object(tito, "OPENING_BYTES", 10):  # too large to keep: built each time
        builder.build(_ask(-1), TOOLS, None)
    assert len(builder._openings) == OPENINGS


def test_a_template_that_reads_the_clock_is_rendered_each_time(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = (
        "{{ strftime_now('%d %b %Y') }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    builder = PromptBuilder(tokenizer)
    builder.build(_ask(1), None, None)
    calls = []
    with mock.patch.object(builder, "_render", side_effect=lambda *a: calls.append(a) or "x"):
        builder.build(_ask(1), None, None)
    assert calls
