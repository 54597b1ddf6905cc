"""A scripted, slightly fallible expert that writes calculator demonstrations as JSONL.

Each demonstration is the conversation the agent in agent.py would have with a perfect
model: the system prompt, the question, a calculator tool call on the question's arithmetic,
the tool's result, and the number as the final answer. With probability `noise` the expert
makes a realistic mistake instead, so demonstrations are imperfect, as human ones are.
Knows nothing of tracerl; the demos feed `tracerl sft` (one {"messages", "tools"} a line).
Usage: python examples/calculator/expert.py N out.jsonl [seed]
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
import re
import sys
from pathlib import Path
from types import ModuleType


def _sibling(name: str) -> ModuleType:
    """Another file of this folder, loaded by path under a name unique to the folder: every
    example has an agent.py and a tasks.py, so a bare `import agent` may find another's."""
    path = Path(__file__).resolve().with_name(f"{name}.py")
    key = f"_example_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, path)
        assert spec is not None and spec.loader is not None
        sys.modules[key] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[key]


_agent = _sibling("agent")
SYSTEM_PROMPT, TOOLS, calculate = _agent.SYSTEM_PROMPT, _agent.TOOLS, _agent.calculate
make_tasks = _sibling("tasks").make_tasks

EVAL_SEED = 1  # tasks.py draws the eval split with seed 1; demos must not see those tasks
DEFAULT_SEED = 1234


def _expression(question: str) -> str:
    """The arithmetic inside 'What is 37+48?'."""
    match = re.search(r"-?\d+\s*[-+*]\s*-?\d+", question)
    return match.group(0).replace(" ", "") if match else question


def _wrong_digit(rng: random.Random, text: str) -> str:
    """`text` with one digit replaced by a different digit."""
    positions = [i for i, ch in enumerate(text) if ch.isdigit()]
    if not positions:
        return text + "1"
    i = rng.choice(positions)
    digit = rng.choice([d for d in "0123456789" if d != text[i]])
    return text[:i] + digit + text[i + 1 :]


def _call(expression: str, call_id: str) -> dict:
    """The assistant turn that calls the calculator (OpenAI format, arguments as JSON text)."""
    arguments = json.dumps({"expression": expression})
    function = {"name": "calculator", "arguments": arguments}
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": call_id, "type": "function", "function": function}],
    }


MISTAKES = ("typo", "no_tool", "copy")
"""The kinds of mistake: mistype the expression, guess without the tool, miscopy the result;
"echo" (answer with the expression itself, unevaluated) and "give_up" (answer without a
number) are available on request."""


def demonstration(
    rng: random.Random,
    question: str,
    index: int,
    noise: float,
    mistakes: tuple[str, ...] = MISTAKES,
) -> list[dict]:
    """One conversation; with probability `noise` it holds one of `mistakes`."""
    head = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    expression = _expression(question)
    mistake = rng.choice(mistakes) if rng.random() < noise else None
    if mistake == "no_tool":  # guesses without the calculator, and guesses wrong
        guess = _wrong_digit(rng, calculate(expression))
        return [*head, {"role": "assistant", "content": guess}]
    if mistake == "echo":  # answers without working it out: repeats the expression
        return [*head, {"role": "assistant", "content": expression}]
    if mistake == "give_up":  # does not try: no tool, no number
        return [*head, {"role": "assistant", "content": "I cannot compute that."}]
    if mistake == "typo":  # mistypes a digit of the expression, then trusts the result
        expression = _wrong_digit(rng, expression)
    call_id = f"call_{index}"
    result = calculate(expression)
    answer = _wrong_digit(rng, result) if mistake == "copy" else result
    return [
        *head,
        _call(expression, call_id),
        {"role": "tool", "tool_call_id": call_id, "content": result},
        {"role": "assistant", "content": answer},
    ]


def demonstrations(
    n: int, seed: int = DEFAULT_SEED, noise: float = 0.1, mistakes: tuple[str, ...] = MISTAKES
) -> list[dict]:
    """n demos ({"messages", "tools"}) on train-split tasks drawn with `seed` (not the eval seed)."""
    if seed == EVAL_SEED:
        raise ValueError(f"seed {EVAL_SEED} draws the eval tasks; pick another")
    rng = random.Random(seed + 1)  # the mistakes' own stream, apart from the tasks'
    tasks = make_tasks(n, "train", seed)
    return [
        {
            "messages": demonstration(rng, task["input"]["question"], i, noise, mistakes),
            "tools": TOOLS,
        }
        for i, task in enumerate(tasks)
    ]


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    count, path = int(sys.argv[1]), Path(sys.argv[2])
    seed = int(sys.argv[3]) if len(sys.argv) > 3 else DEFAULT_SEED
    with path.open("w") as f:
        for demo in demonstrations(count, seed):
            f.write(json.dumps(demo) + "\n")
    print(f"wrote {count} demonstrations to {path}")
