"""A remote role's calls recorded as a local tokenizer's ids: a teacher's replies become a
student's training rows.

A teacher served elsewhere (any OpenAI-compatible server) answers in text. When its role
names a local tokenizer (RoleConfig.tokenizer, the student's), each call is also encoded as
the student would have seen and written it: the prompt is built token-in/token-out with the
student's chat template, exactly as for a local call, and the teacher's reply is rendered
as that template writes an assistant turn, its text tokenized as the completion. The span
then holds ids `tracerl sft --from-traces` trains on (loss on the reply's ids only). The
student sampled none of them: their log-probs are 0 and their policy version -1.
"""

from __future__ import annotations

import uuid
from typing import Any

from transformers import AutoTokenizer

from tracerl.gateway.chat import Message, normalize_message
from tracerl.gateway.served import Choice, decode
from tracerl.gateway.tito import PromptBuilder
from tracerl.gateway.toolcalls import Reasoning, parse_reply, tool_format
from tracerl.gateway.toolcalls.hermes import HERMES
from tracerl.roles import ReplyFormat
from tracerl.types import Generation

__all__ = ["TEACHER_VERSION", "StudentEncoder"]

TEACHER_VERSION = -1
"""Policy version of a teacher's tokens: no version of a trained policy sampled them."""


class StudentEncoder:
    """Encodes a remote role's calls with a local model's tokenizer and chat template."""

    def __init__(self, model_dir: str, reply: ReplyFormat) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.prompts = PromptBuilder(self.tokenizer)
        """Builds the prompt ids, reusing the previous call's ids as a local model's are."""
        template = self.tokenizer.chat_template
        # A template that ignores tools gets them the Hermes way (tool_rendering.py).
        fallback = self.prompts.tool_rendering == "hermes-fallback" and not reply.tool_parser
        self.format = HERMES if fallback else tool_format(reply.tool_parser, template)
        """How the student writes tool calls (to read the encoded reply back)."""
        self.reasoning = Reasoning(*reply.thinking) if reply.thinking else None
        """The student's reasoning markers, when set (split off the encoded reply)."""

    def completion_ids(
        self, messages: list[Message], tools: list[dict] | None, reply: Message
    ) -> list[int]:
        """The reply as the student would write it: the template's assistant turn after the
        generation prompt, up to and including its end token (what the template puts
        after it belongs to the next prompt, as for a sampled completion)."""
        before = self.prompts.render(messages, tools, gen=True)
        after = self.prompts.render([*messages, reply], tools, gen=False)
        if not after.startswith(before):
            raise ValueError("the student's chat template is not prefix-stable")
        text = after[len(before) :]
        end = text.rfind(self.prompts.eos_text)
        if end >= 0:
            text = text[: end + len(self.prompts.eos_text)]
        return self.prompts.encode(text)

    def choices(
        self, messages: list[Message], tools: list[dict] | None, body: dict[str, Any]
    ) -> list[Choice]:
        """The remote reply's choices as the student's ids, read back in its tool format."""
        out = []
        for index, raw in enumerate(body["choices"]):
            reply = normalize_message({**raw["message"], "role": "assistant"})
            ids = self.completion_ids(messages, tools, reply)
            gen = Generation(
                completion_ids=ids,
                logprobs=[0.0] * len(ids),
                finish_reason="stop" if ids[-1:] == [self.prompts.eos_id] else "length",
                policy_version=TEACHER_VERSION,
            )
            text = decode(self.tokenizer, [t for t in ids if t != self.prompts.eos_id], False)
            parsed = parse_reply(text, tools, self.format, self.reasoning)
            call_ids = [f"call_{uuid.uuid4().hex[:16]}" for _ in parsed.tool_calls]
            finish = "tool_calls" if parsed.tool_calls else gen.finish_reason
            out.append(Choice(index, gen, text, parsed, call_ids, finish))
        return out
