"""Token histories of the rollout attempts in flight: what each agent's conversation with
each model was sent and sampled, so its next call reuses those exact ids (tito.py).

Kept per attempt, dropped when the attempt finishes here and bounded for those finished
elsewhere (another gateway's store API, an expired lease): the least recently used go
first. A forgotten history only costs a re-tokenization (recorded as a prefix break).
record.py keeps the same attempts' call memory beside it.
"""

from __future__ import annotations

from collections import OrderedDict

from tracerl.gateway.chat import Message, canonical_reply
from tracerl.gateway.served import Choice, HistoryKey
from tracerl.gateway.tito import History, Prompt, Turn
from tracerl.types import Generation

__all__ = ["Histories"]


class Histories:
    """Each attempt's conversations' token histories, for at most `memory` attempts."""

    def __init__(self, memory: int) -> None:
        self.memory = memory
        """Rollout attempts whose histories are kept."""
        self._attempts: OrderedDict[tuple[str, int], dict[HistoryKey, History]] = OrderedDict()

    def __len__(self) -> int:
        """Attempts remembered."""
        return len(self._attempts)

    def get(self, key: HistoryKey) -> History | None:
        """The conversation's history, or None (a first call, or one forgotten)."""
        return self._attempts.get(key[:2], {}).get(key)

    def remember(
        self,
        key: HistoryKey,
        messages: list[Message],
        tools: list[dict] | None,
        prompt: Prompt,
        choices: list[Choice],
    ) -> None:
        """Keep a call's prompt and each choice's reply as the conversation's history; the
        least recently used attempt goes once more than `memory` are kept."""
        turns = [
            Turn(
                ids=prompt.ids + c.gen.completion_ids,
                reply=canonical_reply(c.reply, c.call_ids),
                end=_end(c.gen),
            )
            for c in choices
        ]
        attempt = self._attempts.setdefault(key[:2], {})
        attempt[key] = History(messages=messages, tools=tools, turns=turns)
        self._attempts.move_to_end(key[:2])
        while len(self._attempts) > self.memory:
            self._attempts.popitem(last=False)

    def forget(self, rollout_id: str, attempt: int) -> None:
        """Drop a finished attempt's histories: no call of it follows."""
        self._attempts.pop((rollout_id, attempt), None)


def _end(gen: Generation) -> str:
    """How a sampled turn ended, as tito.Turn records it."""
    if gen.stop_string:
        return "stop_string"
    return "eos" if gen.finish_reason == "stop" else "length"
