"""Steps and time the calculator skill stage needs to reach a held-out exact-match target.

Trains the demo's skill stage (4,000 clean calculator demos, lr 2e-3, batch 16) from the
tiny base with `SftConfig.target`: 10% of the demos held out, scored every 50 steps, the
step count only a cap. Then times one held-out scoring alone. Reuses the demo's cached base
model when it exists (read only); otherwise builds one in a temporary directory. Prints the
checks, then one JSON line.
Usage: python bench/sft_target.py [target] [cap]   (about 4 minutes on one thread)
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tracerl.demo import cache_dir, calculator_demos
from tracerl.models import SftConfig, build_tiny_model, render_chat, sft
from tracerl.models.sft import encode_demo, exact_match, split_holdout


def main(target: float, cap: int) -> None:
    demos = calculator_demos(4000, seed=1000)
    with tempfile.TemporaryDirectory() as tmp:
        base = cache_dir() / "models" / "calculator-tiny-base-clean-seed0"
        if not (base / "config.json").exists():
            base = build_tiny_model(
                Path(tmp) / "base", [render_chat(d.messages, d.tools) for d in demos]
            )
        cfg = SftConfig(steps=cap, holdout=0.1, target=target, eval_every=50)
        start = time.perf_counter()
        result = sft(base, demos, Path(tmp) / "skill", cfg)
        total_s = time.perf_counter() - start
        tokenizer = AutoTokenizer.from_pretrained(result.out_dir)
        model = AutoModelForCausalLM.from_pretrained(result.out_dir, dtype=torch.float32)
        _, held = split_holdout(demos, cfg.holdout, cfg.seed)
        encoded = [encode_demo(tokenizer, d) for d in held]
        t0 = time.perf_counter()
        score = exact_match(model, encoded, tokenizer.pad_token_id, cfg.max_len)
        check_s = time.perf_counter() - t0
    for c in result.held_out:
        print(f"step {c.step:5d}  held-out exact match {c.exact_match:.3f}")
    row = {
        "target": target,
        "cap": cap,
        "reached": result.target_reached,
        "steps": result.steps,
        "train_loop_s": round(result.wall_s, 1),
        "sft_total_s": round(total_s, 1),
        "held_out": len(held),
        "final_exact_match": score,
        "one_check_s": round(check_s, 2),
    }
    print(json.dumps(row))


if __name__ == "__main__":
    main(
        float(sys.argv[1]) if len(sys.argv) > 1 else 0.9,
        int(sys.argv[2]) if len(sys.argv) > 2 else 1500,
    )
