"""Prompts and weights from the same traces: optimize a system prompt (an asset), then move
it into the weights with a curriculum, against RL without it.

The task is a convention a small instruct model cannot guess: "Classify this review: The
food was great.", rewarded 1 only for a reply that names the right tag, POS or NEG, and not
the other. The agent, unchanged throughout, sends the review with no system message of its
own; the gateway adds the asset's text, and only the asset can say what the tags are.
SmolLM2-135M-Instruct (temperature 0.7, 80 reviews, measured): no prompt 0%; the seed below
7.5%; the seed with two worked examples of the kind the bootstrap proposer writes 42%. It
does not follow "answer with one word" (0% whatever the prompt), nor add reliably (an
earlier version of this bench asked for a + b alone: 0% in every arm).

1. Held-out success without the asset (success_none) and with the hand-written seed
   (success_seed), paired.
2. `Optimizer` on the train tasks (proposer: the served policy itself by default, or the
   bootstrap proposer): candidates compared with the best, a Pareto archive; the best is
   tested against the seed on the held-out tasks (repairs, regressions, p_value) and
   accepted only with p < alpha. success_optimized: the best's held-out success (the seed's
   when no candidate beat it on the train tasks).
3. Two training runs from the same start, the same steps and tasks: one with the asset
   that won (`assets.curriculum`, carried with probability 1 -> 0 over the first 3/4 of
   the steps; it distills: a carried rollout's success is also taught on the prompt without
   the asset), one plain RL without any asset. Both are evaluated on the held-out tasks
   without the asset: success_internalized_zero_shot, success_rl_no_curriculum (the last
   weights').

Prints a line per stage, then one JSON line: success_none, success_seed, success_optimized,
repairs, regressions, p_value, rounds, proposer, success_internalized_zero_shot,
success_rl_no_curriculum (and accepted, the texts, timings).

Usage: python bench/assets.py [--model DIR] [--device cuda] [--steps 10] [--proposer llm]
       python bench/assets.py --reuse_prompt runs/bench-assets/prompt.json  # stage 3 only
The default proposer is `bootstrap` (worked examples from successful traces): the served 135M
policy, asked to revise a prompt, writes incoherent text. Stages 1-2 write their report to
RUNS/prompt.json; `--reuse_prompt` trains from one without repeating them. Training uses a
LoRA adapter (r 16, lr 3e-4) and vLLM when `make vllm` has built it. On a 2-core AVX2 CPU the
prompt stages take about 4 min with vLLM (15 with the transformers engine); a curriculum step
about 3 min while rollouts carry the asset (its rows are trained twice, as sampled and
distilled, and the asset's worked examples make the prompt long), 40 s without it: the
whole bench about 40 min.
Default model: SmolLM2-135M-Instruct (`tracerl models get smollm2-135m-instruct` builds it
into $TRACERL_HOME/models/). Any local HF model dir works, the tests' tiny ones included
(`--model DIR --lr 3e-4 --steps 2 --train_tasks 16 --eval_tasks 16 --rounds 1`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import time
from pathlib import Path

from tracerl import ensure_passive_omp

ensure_passive_omp()

import httpx  # noqa: E402

from tracerl.agents import AgentResult  # noqa: E402
from tracerl.assets.compare import Arena, compare  # noqa: E402
from tracerl.assets.config import OptimizeSettings  # noqa: E402
from tracerl.assets.optimize import Optimizer  # noqa: E402
from tracerl.assets.proposers import BootstrapProposer, LlmProposer, Proposer  # noqa: E402
from tracerl.assets.records import AssetRef, Comparison  # noqa: E402
from tracerl.cache import cache_dir  # noqa: E402
from tracerl.engines.config import EngineConfig  # noqa: E402
from tracerl.pipeline.config import TrainConfig  # noqa: E402
from tracerl.pipeline.run import TrainSummary, train  # noqa: E402
from tracerl.runner import RunnerConfig  # noqa: E402
from tracerl.stack import start_stack  # noqa: E402
from tracerl.store import Store  # noqa: E402
from tracerl.store.open import open_store  # noqa: E402
from tracerl.types import Task  # noqa: E402

NAME = "format"
"""The asset's name."""
SEED_TEXT = "You classify reviews. Answer with POS or NEG."
"""The hand-written seed: it names the tags, and shows nothing."""
MODEL = "smollm2-135m-instruct"
"""The default model's catalogue name."""
ROOT = Path(__file__).resolve().parent.parent


POSITIVE = ["great", "wonderful", "delicious", "amazing", "excellent", "lovely", "fantastic",
            "superb", "charming", "perfect"]  # fmt: skip
NEGATIVE = ["terrible", "awful", "disgusting", "horrible", "bad", "dreadful", "boring", "dirty",
            "rude", "broken"]  # fmt: skip
THINGS = ["food", "movie", "hotel room", "service", "book", "concert", "coffee", "game", "staff",
          "view", "music", "pizza"]  # fmt: skip


def make_tasks(n: int, split: str, offset: int, seed: int = 0) -> list[Task]:
    """n one-line reviews ("The food was great."), distinct across splits (by `offset` into
    one seeded order of every thing and word), each answered by its tag, POS or NEG."""
    words = [(w, "POS") for w in POSITIVE] + [(w, "NEG") for w in NEGATIVE]
    reviews = [(f"The {thing} was {w}.", tag) for thing in THINGS for w, tag in words]
    random.Random(seed).shuffle(reviews)
    chosen = reviews[offset : offset + n]
    if len(chosen) < n:
        raise SystemExit(f"only {len(reviews)} reviews: ask for fewer tasks")
    return [
        Task(id=f"{split}-{i}", input={"review": review}, answer=tag, split=split)
        for i, (review, tag) in enumerate(chosen)
    ]


async def agent(task: Task, base_url: str, api_key: str, model: str) -> AgentResult:
    """The unchanged agent: the review alone, no system message, one call."""
    async with httpx.AsyncClient(timeout=300) as http:
        resp = await http.post(
            f"{base_url}/chat/completions",
            headers={"authorization": f"Bearer {api_key}"},
            json={
                "model": model,
                "max_tokens": 16,
                "temperature": 0.7,
                "messages": [
                    {"role": "user", "content": f"Classify this review: {task.input['review']}"}
                ],
            },  # fmt: skip
        )
    resp.raise_for_status()
    return AgentResult(resp.json()["choices"][0]["message"]["content"] or "")


def reward(task: dict, answer: str) -> float:
    """1 for a reply naming the right tag and not the other (as words), else 0."""
    right = str(task["answer"])
    wrong = "NEG" if right == "POS" else "POS"
    return float(_names(answer, right) and not _names(answer, wrong))


def _names(text: str, tag: str) -> bool:
    return re.search(rf"\b{tag}\b", text) is not None


def default_model() -> Path:
    path = cache_dir() / "models" / MODEL
    if not path.is_dir():
        raise SystemExit(
            f"no {MODEL} at {path}: run `tracerl models get {MODEL}` or pass --model DIR"
        )
    return path


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """How every stage serves the policy (vLLM: its own venv, a small KV cache)."""
    if args.engine == "vllm":
        return EngineConfig(kind="vllm", python=args.vllm_python, kv_cache_gib=1.0)
    return EngineConfig(device=args.device, kind=args.engine)


def prompt_stage(args: argparse.Namespace, store_path: Path, train_tasks: list[Task],
                 held_out: list[Task]) -> dict[str, object]:  # fmt: skip
    """Stages 1 and 2 on one served model: none vs seed, then the optimization."""
    stack = start_stack(args.model, store_path, engine_config(args))
    try:
        store: Store = stack.store
        store.put_asset(NAME, SEED_TEXT, note="the hand-written seed")
        runner = RunnerConfig(concurrency=args.concurrency, timeout_s=600)
        arena = Arena(store, stack.url, agent, reward, runner)
        baseline = compare(
            arena, AssetRef(name=NAME, version=0), AssetRef(name=NAME, version=1), held_out
        )
        print(
            f"held-out: none {baseline.success_a:.3f}, seed {baseline.success_b:.3f} (p {baseline.p_value:.3g})"
        )
        settings = OptimizeSettings(
            rounds=args.rounds, candidates=args.candidates, cases=args.cases
        )
        proposer: Proposer = (
            BootstrapProposer() if args.proposer == "bootstrap"
            else LlmProposer(store, stack.url, "policy", served=True, withhold={NAME: 0}, max_tokens=256)
        )  # fmt: skip
        opt = Optimizer(arena, NAME, proposer, settings).run(
            AssetRef(name=NAME), train_tasks, held_out
        )
        final: Comparison | None = next(
            (c for c in store.comparisons(NAME) if c.id == opt.final), None
        )
        winner = store.asset(NAME)  # the accepted version, or still the seed
        best = store.asset(NAME, opt.best) if opt.best else winner
    finally:
        stack.close()
    print(f"optimization {opt.status}: {len(opt.rounds)} rounds, best v{opt.best}")
    return {
        "success_none": baseline.success_a,
        "success_seed": baseline.success_b,
        "success_optimized": final.success_b if final else baseline.success_b,
        "repairs": final.repairs if final else 0,
        "regressions": final.regressions if final else 0,
        "p_value": final.p_value if final else None,
        "rounds": len(opt.rounds),
        "proposer": proposer.name,
        "accepted": opt.status == "accepted",
        "optimized_text": best.text,
        "internalized_text": winner.text,
    }


def train_stage(args: argparse.Namespace, name: str, store_path: Path, curriculum: bool,
                train_tasks: list[Task], held_out: list[Task]) -> float:  # fmt: skip
    """One training run; the held-out success of its last weights (without the asset)."""
    assets = {}
    if curriculum:
        steps = max(1, (3 * args.steps) // 4)
        assets = {"curriculum": {"name": NAME, "start": 1.0, "end": 0.0, "steps": steps}}
    trainer: dict[str, object] = {"lr": args.lr, "warmup_steps": 0, "schedule": "constant",
                                  "prefix_sharing": True}  # fmt: skip
    if args.lora_r:
        trainer["lora"] = {"r": args.lora_r}
    cfg = TrainConfig.model_validate({
        "name": name, "runs": str(args.runs), "model": str(args.model), "store": str(store_path),
        "device": args.device, "engine": engine_config(args).model_dump(),
        "pipeline": {"steps": args.steps, "tasks_per_step": args.tasks_per_step,
                     "group_size": args.group_size, "eval_every": 0},
        "trainer": trainer,
        "runner": {"concurrency": args.concurrency, "timeout_s": 600},
        "guard": {"preflight": False, "keep_best": False},
        "assets": assets,
    })  # fmt: skip
    summary: TrainSummary = train(cfg, agent=agent, reward_fn=reward, tasks=(train_tasks, held_out))
    last = summary.model.last_success if summary.model else summary.success_after
    print(f"{name}: held-out zero-shot {summary.success_before} -> {last}")
    return last


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="local HF model dir (default: SmolLM2-135M-Instruct)",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--engine", default=None, choices=["hf", "hf_server", "vllm"],
        help="default: vllm when --vllm_python exists (`make vllm`), else hf",
    )  # fmt: skip
    p.add_argument(
        "--vllm_python",
        default=os.environ.get("TRACERL_VLLM_PYTHON", str(ROOT / ".venv-vllm/bin/python")),
    )
    p.add_argument("--runs", type=Path, default=Path("runs/bench-assets"))
    p.add_argument("--train_tasks", type=int, default=64)
    p.add_argument("--eval_tasks", type=int, default=64)
    p.add_argument("--proposer", default="bootstrap", choices=["llm", "bootstrap"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--candidates", type=int, default=3)
    p.add_argument("--cases", type=int, default=3, help="failures shown to the proposer")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--tasks_per_step", type=int, default=8)
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument(
        "--lora_r", type=int, default=16, help="the trainer's LoRA rank; 0: full fine-tuning"
    )
    p.add_argument(
        "--lr", type=float, default=None,
        help="default: 3e-4 with LoRA (at 1e-4 nothing carried over in 10 steps), 1e-5 in full",
    )  # fmt: skip
    p.add_argument(
        "--reuse_prompt",
        type=Path,
        default=None,
        help="a prompt.json of an earlier run: skip stages 1-2, train on its texts",
    )
    p.add_argument("--concurrency", type=int, default=16)
    args = p.parse_args()
    args.model = args.model or default_model()
    if args.engine is None:
        args.engine = "vllm" if Path(args.vllm_python).exists() else "hf"
    if args.lr is None:
        args.lr = 3e-4 if args.lora_r else 1e-5
    started = time.perf_counter()
    train_tasks = make_tasks(args.train_tasks, "train", 0)
    held_out = make_tasks(args.eval_tasks, "eval", args.train_tasks)
    shutil.rmtree(args.runs, ignore_errors=True)  # a bench run starts from nothing
    args.runs.mkdir(parents=True)
    store_path = args.runs / "assets" / "traces.db"
    store_path.parent.mkdir(parents=True)
    if args.reuse_prompt:
        report = json.loads(args.reuse_prompt.read_text())
        store = open_store(store_path)
        store.put_asset(NAME, str(report["internalized_text"]), note="from --reuse_prompt")
        store.close()
    else:
        report = prompt_stage(args, store_path, train_tasks, held_out)
    (args.runs / "prompt.json").write_text(json.dumps(report, indent=1))
    prompt_s = time.perf_counter() - started
    report["success_internalized_zero_shot"] = train_stage(
        args, "internalized", store_path, True, train_tasks, held_out
    )
    report["success_rl_no_curriculum"] = train_stage(
        args, "rl", store_path, False, train_tasks, held_out
    )
    report |= {"model": str(args.model), "steps": args.steps, "prompt_s": round(prompt_s, 1),
               "wall_s": round(time.perf_counter() - started, 1)}  # fmt: skip
    print(json.dumps(report))


if __name__ == "__main__":
    main()
