"""Stand-in engines for tests above the engine: `ScriptedEngine` answers like a perfect
calculator model; `TurnEngine` is the base of the ones that read their reply off the
prompt's turns."""

from __future__ import annotations

from tracerl.store import Store
from tracerl.types import Generation, SamplingParams, Task

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "37+48"}}</tool_call>'


class ScriptedEngine:
    """A tool call first, the number after a tool result; exact ids, fixed log-probs."""

    def __init__(self, tokenizer, max_context: int = 512) -> None:  # type: ignore[no-untyped-def]
        self.tokenizer = tokenizer
        self.eos = tokenizer.convert_tokens_to_ids("<|end|>")
        self.eos_token_ids = [self.eos]
        self.max_context = max_context
        self.policy_version = 3
        self.prompts: list[list[int]] = []

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        self.prompts.append(prompt_ids)
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        turns = text.split("<|end|>")
        last_turn = turns[-2] if len(turns) > 1 else ""
        reply = "85" if "<|tool|>" in last_turn else CALL
        ids = [*self.tokenizer.encode(reply, add_special_tokens=False), self.eos]
        finish = "stop"
        if len(ids) > params.max_tokens:
            ids, finish = ids[: params.max_tokens], "length"
        return Generation(
            completion_ids=ids,
            logprobs=[-0.1] * len(ids),
            finish_reason=finish,
            policy_version=self.policy_version,
        )

    def load_state_dict(self, state: dict, version: int) -> None:
        self.policy_version = version

    def close(self) -> None:
        pass


def running_rollout(store: Store) -> str:
    """One task, queued and claimed: the id of a running rollout to call the gateway under."""
    store.add_tasks([Task(id="t1", input={"question": "What is 37+48?"}, answer=85)])
    store.enqueue(["t1"])
    return store.claim("test-runner", 1, 60.0)[0].id


def closed_turns(text: str) -> list[tuple[str, str]]:
    """(role, content) of each closed turn of a rendered prompt."""
    out = []
    for part in text.split("<|end|>")[:-1]:  # the last piece is the open generation prompt
        for role in ("system", "user", "assistant", "tool"):
            marker = f"<|{role}|>"
            if marker in part:
                out.append((role, part.split(marker, 1)[1]))
    return out


class TurnEngine:
    """A model that answers `reply(closed turns of the prompt)`, then <|end|>: exact ids,
    every token at log-prob `logprob`. Subclasses write `reply`."""

    def __init__(  # type: ignore[no-untyped-def]
        self, tokenizer, max_context: int, policy_version: int, logprob: float
    ) -> None:
        self.tokenizer = tokenizer
        self.eos = tokenizer.convert_tokens_to_ids("<|end|>")
        self.eos_token_ids = [self.eos]
        self.max_context = max_context
        self.policy_version = policy_version
        self.logprob = logprob

    def reply(self, turns: list[tuple[str, str]]) -> str:
        raise NotImplementedError

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        reply = self.reply(closed_turns(text))
        ids = [*self.tokenizer.encode(reply, add_special_tokens=False), self.eos]
        return Generation(
            completion_ids=ids,
            logprobs=[self.logprob] * len(ids),
            finish_reason="stop",
            policy_version=self.policy_version,
        )

    def load_state_dict(self, state: dict, version: int) -> None:
        self.policy_version = version

    def close(self) -> None:
        pass
