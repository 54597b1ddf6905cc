"""Calibrates the calculator warm start: success at temperature 1 after N steps of SFT.

Builds the tiny model from rendered expert demonstrations, fine-tunes it for several fixed
step counts and with the default config (early stop at a loss) over three data orders, and
after each replays the calculator agent's loop in-process (render, sample at
T=1, parse the tool call, run the calculator, render again, sample the answer) on 200
held-out eval tasks, scored with the example's reward. Also measures SFT tokens/s in fp32
and in the precision `auto` chooses on this machine, side by side (bf16 autocast only where
the CPU computes bf16 natively: tracerl.precision). Prints a table, then one JSON line.
Usage: python bench/sft_curve.py [steps,steps,...]   (about 4 minutes on one thread)
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


def _row(base: Path, demos: list[Demo], out: Path, cfg: SftConfig) -> dict:
    """Fine-tune with `cfg`, evaluate, and time both."""
    start = time.perf_counter()
    r = sft(base, demos, out, cfg)
    sft_s = time.perf_counter() - start
    start = time.perf_counter()
    rate = success_rate(r.out_dir)
    row = {
        "seed": cfg.seed,
        "stop_loss": cfg.stop_loss,
        "steps": r.steps,
        "loss": round(r.final_loss, 4),
        "success_t1": rate,
        "sft_s": round(sft_s, 1),
        "eval_s": round(time.perf_counter() - start, 1),
    }
    print(
        f"{str(cfg.stop_loss):>9}  {cfg.seed:4d}  {r.steps:5d}  {r.final_loss:.4f}  {rate:10.3f}"
        f"  {sft_s:5.1f}  {row['eval_s']:5.1f}",
        flush=True,
    )
    return row


def main() -> None:
    torch.set_num_threads(1)  # the CPU is shared
    arg = sys.argv[1] if len(sys.argv) > 1 else "100,200,300"
    step_counts = [int(s) for s in arg.split(",")]
    demos = [Demo.model_validate(d) for d in demonstrations(N_DEMOS)]
    work = Path(tempfile.mkdtemp(prefix="sft_curve_"))
    base = build_tiny_model(work / "base", [render_chat(d.messages, d.tools) for d in demos])
    speed = {}
    for bf16 in (False, "auto"):
        cfg = SftConfig(steps=30, stop_loss=None, bf16=bf16, progress=False)
        result = sft(base, demos, work / "speed", cfg)
        name = "fp32" if bf16 is False else f"chosen ({result.precision})"
        speed[name] = round(result.tokens_per_s)
    print(result.precision_reason)  # what `auto` chose, and why
    print(f"SFT tokens/s, 1 thread, batch 16: {speed}")
    print("stop_loss  seed  steps  loss    success@T1  sft_s  eval_s")
    # Fixed step counts (no early stop): shows how abrupt the digit-copying transition is.
    curve = [
        _row(base, demos, work / f"s{n}", SftConfig(steps=n, stop_loss=None, progress=False))
        for n in step_counts
    ]
    # The defaults, over data orders: what a user of `tracerl sft` gets.
    defaults = [
        _row(base, demos, work / f"d{seed}", SftConfig(seed=seed, progress=False))
        for seed in (0, 1, 2)
    ]
    result = {"sft_tokens_per_s": speed, "curve": curve, "defaults": defaults}
    print(json.dumps({**result, "demos": N_DEMOS, "eval_tasks": N_EVAL}))


if __name__ == "__main__":
    main()
