"""Reasoning in a reply: the text between a model's thinking markers (`<think>...</think>`).

It is split off the reply before tool calls are parsed and handed to the agent apart (chat
`reasoning_content`, a Responses `reasoning` item, a Messages `thinking` block). The tokens
stay where the model sampled them: only the reply's shape changes, never the span's ids.
Some templates open the reasoning in the prompt (the generation prompt ends with the start
marker); the completion then begins inside it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Reasoning", "split_reasoning"]


@dataclass(frozen=True)
class Reasoning:
    """A model's thinking markers."""

    start: str = "<think>"
    """Opens the reasoning."""
    end: str = "</think>"
    """Closes it; the reply proper follows."""
    open_in_prompt: bool = False
    """The chat template's generation prompt already holds `start`."""


def split_reasoning(text: str, markers: Reasoning | None) -> tuple[str, str]:
    """(reasoning, the rest of the text); ('', text) when the text holds none. Reasoning cut
    off by max_tokens (no end marker) is all reasoning."""
    if markers is None:
        return "", text
    head = text.lstrip()
    if head.startswith(markers.start):
        body = head[len(markers.start) :]
    elif markers.open_in_prompt:
        body = text
    else:
        return "", text
    at = body.find(markers.end)
    if at < 0:
        return body.strip(), ""
    return body[:at].strip(), body[at + len(markers.end) :]
