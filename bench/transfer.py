"""Learning that transfers: a weak start on each task family, `tracerl train` with the
default config (the same for every family), held-out success before -> after.

For each family (tracerl/examples/{lookup,textgame,extract,shop}) and seed: the family's
scripted expert writes demonstrations; `tracerl sft --recipe skill-then-habit
--skill_target 0.9` builds a weak tiny model from them (the skill to 0.9 held-out exact
match, the README's one cap of 3,000 steps being only a safety limit; then a habit of
skipping the tools, its strength per family in HABIT_RATES; cached under
$TRACERL_HOME/models/); then
`train(TrainConfig(...))` with only the run's name, model, agent, reward and tasks given.
Prints a line per run, then one JSON line:
{"families": {name: {"before": [...], "after": [...], "last": [...], "best_eval": [...],
 "best_rescored": [...], "gain": mean, "gain_range": [min, max], "drop": ..., "below_start": ...}},
 "min_gain", "mean_gain" (points, over families' mean gains), "worst_final_drop" (points:
the largest fall from a run's best periodic held-out evaluation to its exported model),
"worst_below_start" (points: the largest fall of the exported model below its start, 0 when
none)}.
A run whose <runs>/<family>-seed<k>/summary.json exists is read back instead of run again.
Usage: python bench/transfer.py [--families a,b] [--seeds 0,1,2] [--steps N] [--runs DIR]
(--steps changes every family's run alike; default: TrainConfig's own.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from tracerl import ensure_passive_omp

ensure_passive_omp()

from tracerl.demo import cache_dir  # noqa: E402
from tracerl.examples import example_file, example_module  # noqa: E402
from tracerl.models.recipe import HabitStage, skill_then_habit  # noqa: E402
from tracerl.models.sft import Demo, SftConfig  # noqa: E402
from tracerl.pipeline.config import TrainConfig  # noqa: E402
from tracerl.pipeline.run import TrainSummary, train  # noqa: E402

FAMILIES = ("lookup", "textgame", "extract", "shop")
DEMOS = 4000
TRAIN_TASKS, HELD_OUT = 2000, 200
SKILL_CAP = 3000
"""The skill stage's cap (the README's one recommendation): the learning rate is constant
after warm-up under a target, so the cap changes nothing before it is reached."""
HABIT_RATES = {"extract": 0.4, "lookup": 0.5}
"""Degraded share of the habit stage where the default (0.65) left a start below the
issue's 20-50% band. extract answers nothing right without its tool (a record's name and
age cannot be guessed), so every skipped call is a failure: its default-rate starts read
7.5-14.5%, and 0.4 read 31% on seed 0. lookup's seed 2 read 17-18% at 0.65, and 34.5% at
0.5. Each rate was chosen from the start's held-out success alone, before any RL. Only the
start is set per family; the training config is the same for all."""


def weak_model(family: str, seed: int) -> Path:
    """The family's weak start for `seed`, built once (skill SFT, then the habit)."""
    rate = HABIT_RATES.get(family)
    tag = "" if rate is None else f"-habit{rate}"
    out = cache_dir() / "models" / f"transfer-{family}{tag}-s0.9cap{SKILL_CAP}-seed{seed}"
    habit_stage = HabitStage() if rate is None else HabitStage(rate=rate)
    if (out / "config.json").exists():
        return out
    raw = example_module(family, "expert").demonstrations(DEMOS, seed=1000 + seed)
    demos = [Demo.model_validate(d) for d in raw]
    # The README's recipe: the skill to 0.9 held-out exact match, 3,000 steps at most.
    skill_cfg = SftConfig(seed=seed, holdout=0.1, target=0.9, steps=SKILL_CAP)
    skill, habit = skill_then_habit(demos, out, None, skill_cfg, habit_stage)
    reached = "" if skill.target_reached else " (the cap came first)"
    print(
        f"{family} seed {seed}: skill {skill.steps} steps (held-out exact match "
        f"{skill.held_out[-1].exact_match:.3f}){reached}, loss {skill.final_loss:.3f}; "
        f"habit loss {habit.final_loss:.3f}"
    )
    return out


def task_file(family: str, runs: Path) -> Path:
    """Train split (seed 0) then held-out split (seed 1) of the family's tasks."""
    make = example_module(family, "tasks").make_tasks
    path = runs / f"{family}-tasks.jsonl"
    rows = make(TRAIN_TASKS, "train", 0) + make(HELD_OUT, "eval", 1)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_one(family: str, seed: int, runs: Path, steps: int | None) -> dict:
    """One default-config run; its before, exported and last held-out success."""
    data: dict[str, object] = {
        "name": f"{family}-seed{seed}", "runs": str(runs), "model": str(weak_model(family, seed)),
        "agent": f"{example_file(family, 'agent')}:run",
        "reward": f"{example_file(family, 'reward')}:reward",
        "tasks": str(task_file(family, runs)),
    }  # fmt: skip
    if steps:
        data["pipeline"] = {"steps": steps}
    done = runs / f"{family}-seed{seed}" / "summary.json"
    if done.exists():  # a finished run is read back, not run again
        summary = TrainSummary.model_validate_json(done.read_text())
    else:
        summary = train(TrainConfig.model_validate(data))
    assert summary.model is not None
    out = {"before": summary.success_before or 0.0, "after": summary.success_after,
           "last": summary.model.last_success, "best_eval": max(summary.evals.values()),
           "best_rescored": summary.model.best_rescored, "warnings": len(summary.warnings)}  # fmt: skip
    print(f"{family} seed {seed}: {out}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--runs", default="runs/transfer")
    args = p.parse_args()
    runs = Path(args.runs)
    runs.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    families: dict[str, dict] = {}
    for family in args.families.split(","):
        results = [run_one(family, int(s), runs, args.steps) for s in args.seeds.split(",")]
        keys = ("before", "after", "last", "best_eval", "best_rescored")
        families[family] = {k: [r[k] for r in results] for k in keys}
        gains = [100 * (r["after"] - r["before"]) for r in results]
        families[family]["gain"] = statistics.fmean(gains)
        families[family]["gain_range"] = [min(gains), max(gains)]
        # From the best held-out evaluation to the exported model, both on all held-out
        # tasks. The best of several evaluations at temperature 1 reads high (the largest
        # of noisy scores); the run scores that checkpoint again before choosing what to
        # export ("best_rescored", None when the last weights were the best evaluated).
        families[family]["drop"] = max(100 * (r["best_eval"] - r["after"]) for r in results)
        families[family]["below_start"] = max(
            0.0, *(100 * (r["before"] - r["after"]) for r in results)
        )
    gains = [f["gain"] for f in families.values()]
    print(json.dumps({
        "families": families, "min_gain": min(gains), "mean_gain": statistics.fmean(gains),
        "worst_final_drop": max(f["drop"] for f in families.values()),
        "worst_below_start": max(f["below_start"] for f in families.values()),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
