"""Calibrates the calculator warm start: success at temperature 1 after N steps of SFT.

Builds the tiny model from rendered expert demonstrations, fine-tunes it for several step
counts, and after each replays the calculator agent's loop in-process (render, sample at
T=1, parse the tool call, run the calculator, render again, sample the answer) on 200
held-out eval tasks, scored with the example's reward. Also measures SFT tokens/s with and
without bf16 autocast. Prints a table, then one JSON line.
Usage: python bench/sft_curve.py [steps,steps,...]
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tracerl.models import Demo, SftConfig, build_tiny_model, render_chat, sft

CALC = Path(__file__).resolve().parent.parent / "examples" / "calculator"
sys.path.insert(0, str(CALC))
from agent import MAX_TURNS, SYSTEM_PROMPT, TOOLS, calculate  # noqa: E402
from expert import demonstrations  # noqa: E402
from reward import reward  # noqa: E402
from tasks import make_tasks  # noqa: E402

N_DEMOS = 2000
N_EVAL = 200
MAX_NEW_TOKENS = 48
CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _reply(text: str) -> tuple[dict, str | None]:
    """The assistant message for a sampled text, and its calculator expression if it called."""
    text = text.split("<|end|>")[0]
    match = CALL_RE.search(text)
    try:
        call = json.loads(match.group(1)) if match else None
        expression = str(call["arguments"]["expression"]) if call else None
    except (json.JSONDecodeError, KeyError, TypeError):
        call, expression = None, None
    if call is None or expression is None:
        return {"role": "assistant", "content": text}, None
    function = {"name": str(call.get("name")), "arguments": json.dumps(call["arguments"])}
    tool_call = {"id": "call_0", "type": "function", "function": function}
    content = text[: match.start()] if match else ""
    return {"role": "assistant", "content": content or None, "tool_calls": [tool_call]}, expression


@torch.no_grad()
def _sample(model, tokenizer, conversations: list[list[dict]]) -> list[str]:
    """One T=1 completion per conversation, batched with left padding."""
    prompts = [render_chat(c, TOOLS, add_generation_prompt=True) for c in conversations]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    out_BT = model.generate(
        **batch,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_new_tokens=MAX_NEW_TOKENS,
    )
    new_BT = out_BT[:, batch["input_ids"].shape[1] :]
    return tokenizer.batch_decode(new_BT, skip_special_tokens=False)


def success_rate(model_dir: str, seed: int = 0) -> float:
    """Fraction of the eval tasks the agent loop solves with this model at T=1."""
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tasks = make_tasks(N_EVAL, "eval", 1)
    convs = [
        [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": t["input"]["question"]},
        ]
        for t in tasks
    ]
    answers = [""] * len(tasks)
    active = list(range(len(tasks)))
    for _ in range(MAX_TURNS):
        if not active:
            break
        texts = _sample(model, tokenizer, [convs[i] for i in active])
        still = []
        for i, text in zip(active, texts, strict=True):
            message, expression = _reply(text)
            convs[i].append(message)
            if expression is None:
                answers[i] = (message["content"] or "").strip()
                continue
            convs[i].append(
                {"role": "tool", "tool_call_id": "call_0", "content": calculate(expression)}
            )
            still.append(i)
        active = still
    return sum(reward(t, a) for t, a in zip(tasks, answers, strict=True)) / len(tasks)


def main() -> None:
    torch.set_num_threads(1)  # the CPU is shared
    step_counts = (
        [int(s) for s in sys.argv[1].split(",")] if len(sys.argv) > 1 else [50, 100, 150, 200, 300]
    )
    demos = [Demo.model_validate(d) for d in demonstrations(N_DEMOS)]
    work = Path(tempfile.mkdtemp(prefix="sft_curve_"))
    texts = [render_chat(d.messages, d.tools) for d in demos]
    base = build_tiny_model(work / "base", texts)
    speed = {}
    for bf16 in (False, True):
        r = sft(base, demos, work / "speed", SftConfig(steps=30, bf16=bf16, progress=False))
        speed["bf16" if bf16 else "fp32"] = round(r.tokens_per_s)
    rows = []
    for steps in step_counts:
        start = time.perf_counter()
        r = sft(base, demos, work / f"sft{steps}", SftConfig(steps=steps, progress=False))
        sft_s = time.perf_counter() - start
        start = time.perf_counter()
        rate = success_rate(r.out_dir)
        rows.append(
            {
                "steps": steps,
                "loss": round(r.final_loss, 4),
                "success_t1": rate,
                "sft_s": round(sft_s, 1),
                "eval_s": round(time.perf_counter() - start, 1),
            }
        )
        print(
            f"steps {steps:5d}  loss {r.final_loss:.4f}  success@T1 {rate:.3f}  "
            f"sft {sft_s:.1f}s  eval {rows[-1]['eval_s']}s",
            flush=True,
        )
    print(
        json.dumps(
            {"sft_tokens_per_s": speed, "curve": rows, "demos": N_DEMOS, "eval_tasks": N_EVAL}
        )
    )


if __name__ == "__main__":
    main()
