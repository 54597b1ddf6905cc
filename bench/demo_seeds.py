"""`tracerl demo` at several recipe seeds: its promise must not depend on luck or the CPU.

Runs the demo (as a user would: `tracerl demo`, a fresh process each) at recipe seeds 0, 1
and 2 with the default precision (`auto`: bf16 only where the hardware computes it natively
and it is faster on the model, which the demo's tiny model is not even on a CPU with AMX;
`-- --recipe.bf16 true --trainer.bf16 true` forces bf16 everywhere), each into
its own run directory, and reads back each run's summary.json: held-out success before and
after training, the wall time (building the start included when it is not cached) and the
precision the run chose. The demo's promise: every `before` <= 0.40 and every `after` >= 0.90.

Last line: JSON {"before": [...], "after": [...], "wall_s": [...], "precision": "...",
"seeds": [...], "promise_kept": bool}.
Usage: python bench/demo_seeds.py [--seeds 0,1,2] [-- extra demo flags, e.g. --trainer.bf16 true]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_demo(seed: int, runs: Path, extra: list[str]) -> dict:
    """One `tracerl demo` at recipe seed `seed`; its summary and wall time."""
    name = f"demo-seed{seed}"
    cmd = [sys.executable, "-m", "tracerl.cli", "demo", "--recipe.seed", str(seed)]
    cmd += ["--name", name, "--runs", str(runs), *extra]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    wall = time.perf_counter() - t0
    summary = json.loads((runs / name / "summary.json").read_text())
    return {"summary": summary, "wall_s": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0,1,2", help="recipe seeds, comma-separated")
    p.add_argument("--runs", default="", help="where the runs go (default: a temporary dir)")
    args, extra = p.parse_known_args()
    extra = [a for a in extra if a != "--"]
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = Path(args.runs or tempfile.mkdtemp(prefix="demo_seeds_"))
    results = [run_demo(seed, runs, extra) for seed in seeds]
    before = [r["summary"]["success_before"] for r in results]
    after = [r["summary"]["success_after"] for r in results]
    for seed, b, a, r in zip(seeds, before, after, results, strict=True):
        print(f"seed {seed}: {b:.1%} -> {a:.1%} in {r['wall_s'] / 60:.1f} min")
    row = {
        "seeds": seeds,
        "before": before,
        "after": after,
        "wall_s": [round(r["wall_s"], 1) for r in results],
        "precision": results[0]["summary"].get("precision", "?"),
        "promise_kept": all(b <= 0.40 for b in before) and all(a >= 0.90 for a in after),
        "extra_flags": extra,
    }
    print(json.dumps(row))


if __name__ == "__main__":
    main()
