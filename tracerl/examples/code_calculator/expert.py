"""A scripted, slightly fallible expert that writes code-calculator demonstrations as JSONL.

Each demonstration is the conversation agent.py would have with a good model: the system
prompt, the question, a `python` tool call whose program prints the answer, the program's
output, and that output as the final answer. Sometimes (`retry`) the first program has a
typo, the sandbox's traceback comes back, and a fixed program follows. With probability
`noise` the expert makes a realistic mistake instead, so demonstrations are imperfect, as
human ones are. Outputs other than the answer (tracebacks, a mistyped program's result) are
what the sandbox really printed. The demos feed `tracerl sft` (one {"messages", "tools"} a
line). Usage: python examples/code_calculator/expert.py N out.jsonl [seed]
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
import string
import sys
from pathlib import Path
from types import ModuleType

from tracerl.tools import format_result, run_python


def _sibling(name: str) -> ModuleType:
    """Another module of this folder, loaded by path under a name of its own: every example
    has an agent.py and a tasks.py, so a bare `import agent` may find another example's."""
    key = f"code_calculator_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, Path(__file__).parent / f"{name}.py")
        assert spec is not None and spec.loader is not None
        sys.modules[key] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[key]


agent, tasks = _sibling("agent"), _sibling("tasks")

EVAL_SEED = 1  # tasks.py draws the eval split with seed 1; demos must not see those tasks
DEFAULT_SEED = 1234
LIST = r"(?P<xs>\[[-\d, ]*\])"

PROGRAMS = [
    (rf"What is the sum of the squares of {LIST}\?", "print(sum(x * x for x in {xs}))"),
    (r"Reverse the string '(?P<s>\w+)'\.", "print('{s}'[::-1])"),
    (r"How many times does '(?P<c>\w)' occur in '(?P<s>\w+)'\?", "print('{s}'.count('{c}'))"),
    (rf"Sort {LIST} in ascending order\.", "print(sorted({xs}))"),
    (r"What is (?P<e>\d+\*\d+[-+]\d+)\?", "print({e})"),
    (
        rf"What is the largest number in {LIST} minus the smallest\?",
        "xs = {xs}\nprint(max(xs) - min(xs))",
    ),
    (r"How many vowels are in '(?P<s>\w+)'\?", "print(sum(ch in 'aeiou' for ch in '{s}'))"),
]
"""(question pattern, program template) for each kind of task in tasks.py."""

MISTAKES = ("typo", "no_tool", "copy")
"""The kinds of mistake: mistype the program's data and trust its output, guess without the
tool, miscopy the output into the answer."""


def program(question: str) -> str | None:
    """The program that prints the answer to `question`, or None for an unknown question."""
    for pattern, template in PROGRAMS:
        match = re.fullmatch(pattern, question.strip())
        if match:
            return template.format(**match.groupdict())
    return None


def _wrong_char(rng: random.Random, text: str) -> str:
    """`text` with one digit or letter replaced by a different one of its kind."""
    positions = [i for i, ch in enumerate(text) if ch.isalnum()]
    if not positions:
        return text + "1"
    i = rng.choice(positions)
    pool = string.digits if text[i].isdigit() else string.ascii_lowercase
    return text[:i] + rng.choice([c for c in pool if c != text[i]]) + text[i + 1 :]


def _call(code: str, call_id: str) -> dict:
    """The assistant turn that calls the python tool (OpenAI format, arguments as JSON)."""
    function = {"name": "python", "arguments": json.dumps({"code": code})}
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": call_id, "type": "function", "function": function}],
    }


def _turn(code: str, call_id: str, output: str) -> list[dict]:
    """A tool call and its result."""
    return [_call(code, call_id), {"role": "tool", "tool_call_id": call_id, "content": output}]


def _ran(code: str) -> str:
    """What the agent's sandbox gives back for `code`."""
    return format_result(run_python(code, agent.SANDBOX))


def demonstration(
    rng: random.Random, task: dict, index: int, noise: float, retry: float = 0.1
) -> list[dict]:
    """One conversation; with probability `noise` it holds one of MISTAKES, and with
    probability `retry` it first runs a program with a typo and then fixes it."""
    question, answer = task["input"]["question"], str(task["answer"])
    code = program(question)
    assert code is not None, question
    messages = [
        {"role": "system", "content": agent.SYSTEM_PROMPT},
        {"role": "user", "content": question},
    ]
    mistake = rng.choice(MISTAKES) if rng.random() < noise else None
    if mistake == "no_tool":  # guesses without running anything, and guesses wrong
        return [*messages, {"role": "assistant", "content": _wrong_char(rng, answer)}]
    if rng.random() < retry:
        broken = code.replace("print(", "pritn(", 1)
        messages += _turn(broken, f"call_{index}_0", _ran(broken))
    output = answer
    if mistake == "typo":  # mistypes the data, then trusts what the program printed
        code = _wrong_char(rng, code)
        output = _ran(code)
    messages += _turn(code, f"call_{index}_1", output)
    final = _wrong_char(rng, output) if mistake == "copy" else output
    return [*messages, {"role": "assistant", "content": final}]


def demonstrations(
    n: int, seed: int = DEFAULT_SEED, noise: float = 0.1, retry: float = 0.1
) -> list[dict]:
    """n demos ({"messages", "tools"}) on train-split tasks drawn with `seed` (not the eval seed)."""
    if seed == EVAL_SEED:
        raise ValueError(f"seed {EVAL_SEED} draws the eval tasks; pick another")
    rng = random.Random(seed + 1)  # the mistakes' own stream, apart from the tasks'
    return [
        {"messages": demonstration(rng, task, i, noise, retry), "tools": agent.TOOLS}
        for i, task in enumerate(tasks.make_tasks(n, "train", seed))
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
