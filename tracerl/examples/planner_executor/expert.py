"""A scripted, slightly fallible expert that writes demonstrations for both roles as JSONL.

A planner demonstration is the conversation agent.py's planner would have with a perfect
model: the question, one `ask_executor` call per operation (each sub-question uses the
previous answer), the answers a perfect executor gives, and the number as the final answer.
An executor demonstration is a calculator conversation on one such sub-question. With
probability `noise` the expert makes a realistic mistake instead, so that warm-started
models begin weak. Knows nothing of tracerl; the demos feed `tracerl sft` (one
{"messages", "tools"} a line).
Usage: python examples/planner_executor/expert.py planner|executor N out.jsonl
           [--seed S] [--noise P] [--mistakes echo,skip]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import re
import sys
from pathlib import Path
from types import ModuleType

EVAL_SEED = 1  # tasks.py draws the eval split with seed 1; demos must not see those tasks
DEFAULT_SEED = 1234
ROLES = ("planner", "executor")


def _sibling(name: str) -> ModuleType:
    """Another module of this folder, loaded by path under a name of its own: every example
    has an agent.py and a tasks.py, so a bare `import agent` may find another example's."""
    key = f"planner_executor_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, Path(__file__).parent / f"{name}.py")
        assert spec is not None and spec.loader is not None
        sys.modules[key] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[key]


agent = _sibling("agent")
tasks = _sibling("tasks")

PLANNER_MISTAKES = ("typo", "skip", "copy")
"""Planner mistakes: mistype a number of one sub-question (then trust the answers), answer
after the first sub-question, miscopy the final answer. "echo" (answer at once with the
question's arithmetic, unevaluated, asking nobody) is available on request."""

EXECUTOR_MISTAKES = ("typo", "no_tool", "copy")
"""Executor mistakes: mistype the expression, guess without the tool, miscopy the result.
"echo" (answer with the expression itself, unevaluated) is available on request."""


def _wrong_digit(rng: random.Random, text: str) -> str:
    """`text` with one digit replaced by a different digit."""
    positions = [i for i, ch in enumerate(text) if ch.isdigit()]
    if not positions:
        return text + "1"
    i = rng.choice(positions)
    digit = rng.choice([d for d in "0123456789" if d != text[i]])
    return text[:i] + digit + text[i + 1 :]


def _call(name: str, arguments: dict, call_id: str) -> dict:
    """An assistant turn with one tool call (OpenAI format, arguments as JSON text)."""
    function = {"name": name, "arguments": json.dumps(arguments)}
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": call_id, "type": "function", "function": function}],
    }


def expression(question: str) -> str:
    """The arithmetic inside 'What is 37+48?'."""
    match = re.search(r"-?\d+\s*[-+*]\s*-?\d+", question)
    return match.group(0).replace(" ", "") if match else question


def sub_question(value: int | str, op: str, operand: int) -> str:
    """The sub-question applying one operation to the answer so far."""
    return f"What is {value}{op}{operand}?"


def planner_demonstration(
    rng: random.Random,
    question: str,
    index: int,
    noise: float,
    mistakes: tuple[str, ...] = PLANNER_MISTAKES,
) -> list[dict]:
    """One planner conversation; with probability `noise` it holds one of `mistakes`."""
    head = [
        {"role": "system", "content": agent.PLANNER_PROMPT},
        {"role": "user", "content": question},
    ]
    parsed = tasks.steps(question)
    if parsed is None:
        raise ValueError(f"not a chained question: {question!r}")
    start, chain = parsed
    mistake = rng.choice(mistakes) if rng.random() < noise else None
    if mistake == "echo":  # answers without working it out: the arithmetic, unevaluated
        arithmetic = tasks.question_text(start, chain, words=False)
        return [*head, {"role": "assistant", "content": arithmetic.removeprefix("What is ")[:-1]}]
    typo_at = rng.randrange(len(chain)) if mistake == "typo" else -1
    if mistake == "skip":  # stops after the first sub-question and answers with its result
        chain = chain[:1]
    messages, value = list(head), str(start)
    for k, (op, operand) in enumerate(chain):
        asked = sub_question(value, op, operand)
        if k == typo_at:  # mistypes a number of this sub-question, then trusts the answer
            asked = _wrong_digit(rng, asked)
        call_id = f"call_{index}_{k}"
        messages.append(_call("ask_executor", {"question": asked}, call_id))
        value = agent.calculate(expression(asked))
        messages.append({"role": "tool", "tool_call_id": call_id, "content": value})
    answer = _wrong_digit(rng, value) if mistake == "copy" else value
    return [*messages, {"role": "assistant", "content": answer}]


def executor_demonstration(
    rng: random.Random,
    question: str,
    index: int,
    noise: float,
    mistakes: tuple[str, ...] = EXECUTOR_MISTAKES,
) -> list[dict]:
    """One executor (calculator) conversation; with probability `noise` one of `mistakes`."""
    head = [
        {"role": "system", "content": agent.EXECUTOR_PROMPT},
        {"role": "user", "content": question},
    ]
    expr = expression(question)
    mistake = rng.choice(mistakes) if rng.random() < noise else None
    if mistake == "no_tool":  # guesses without the calculator, and guesses wrong
        guess = _wrong_digit(rng, agent.calculate(expr))
        return [*head, {"role": "assistant", "content": guess}]
    if mistake == "echo":  # answers without working it out: repeats the expression
        return [*head, {"role": "assistant", "content": expr}]
    if mistake == "typo":  # mistypes a digit of the expression, then trusts the result
        expr = _wrong_digit(rng, expr)
    call_id = f"call_{index}"
    result = agent.calculate(expr)
    answer = _wrong_digit(rng, result) if mistake == "copy" else result
    return [
        *head,
        _call("calculator", {"expression": expr}, call_id),
        {"role": "tool", "tool_call_id": call_id, "content": result},
        {"role": "assistant", "content": answer},
    ]


def sub_questions(question: str) -> list[str]:
    """The sub-questions a perfect planner asks for a question, in order."""
    parsed = tasks.steps(question)
    if parsed is None:
        return []
    value, chain = parsed
    out = []
    for op, operand in chain:
        out.append(sub_question(value, op, operand))
        value = tasks.apply(op, value, operand)
    return out


def demonstrations(
    n: int,
    role: str,
    seed: int = DEFAULT_SEED,
    noise: float = 0.1,
    mistakes: tuple[str, ...] | None = None,
) -> list[dict]:
    """n demos ({"messages", "tools"}) of one role, on train tasks drawn with `seed`.

    Executor demos are the sub-questions a perfect planner asks of those tasks, so the
    executor learns on the questions it will be asked. `mistakes` defaults to the role's.
    """
    if seed == EVAL_SEED:
        raise ValueError(f"seed {EVAL_SEED} draws the eval tasks; pick another")
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    known = {*(PLANNER_MISTAKES if role == "planner" else EXECUTOR_MISTAKES), "echo"}
    unknown = sorted(set(mistakes or ()) - known)
    if unknown:
        raise ValueError(f"unknown {role} mistakes {unknown}; known: {sorted(known)}")
    rng = random.Random(seed + 1)  # the mistakes' own stream, apart from the tasks'
    questions = [t["input"]["question"] for t in tasks.make_tasks(n, "train", seed)]
    if role == "planner":
        kinds = mistakes or PLANNER_MISTAKES
        tools = agent.PLANNER_TOOLS
        convs = [planner_demonstration(rng, q, i, noise, kinds) for i, q in enumerate(questions)]
    else:
        kinds = mistakes or EXECUTOR_MISTAKES
        tools = agent.EXECUTOR_TOOLS
        subs = [s for q in questions for s in sub_questions(q)][:n]
        convs = [executor_demonstration(rng, q, i, noise, kinds) for i, q in enumerate(subs)]
    return [{"messages": messages, "tools": tools} for messages in convs]


def main() -> None:
    parser = argparse.ArgumentParser(description="Write one role's demonstrations as JSONL.")
    parser.add_argument("role", choices=ROLES)
    parser.add_argument("n", type=int, help="how many demonstrations")
    parser.add_argument("out", type=Path, help="JSONL file to write")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed of the tasks")
    parser.add_argument("--noise", type=float, default=0.1, help="share with a mistake")
    parser.add_argument(
        "--mistakes", default=None, help="comma-separated kinds (default: the role's own)"
    )
    args = parser.parse_args()
    mistakes = tuple(args.mistakes.split(",")) if args.mistakes else None
    try:
        demos = demonstrations(args.n, args.role, args.seed, args.noise, mistakes)
    except ValueError as e:
        parser.error(str(e))
    with args.out.open("w") as f:
        for demo in demos:
            f.write(json.dumps(demo) + "\n")
    print(f"wrote {args.n} {args.role} demonstrations to {args.out}")


if __name__ == "__main__":
    main()
