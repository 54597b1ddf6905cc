"""Where a run's numbers go: metrics.jsonl, TensorBoard event files, and plots.

One `MetricsLog` per run; every `log(step, values)` appends a JSON line (so nothing is lost
if the process dies) and writes the scalars to TensorBoard. `plot_rewards` draws the train
reward and held-out success curves from metrics.jsonl.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tracerl.pipeline.step import StepReport

Values = dict[str, float | int | str | None]
"""One step's metrics by name."""


def _pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend, imported when a plot is drawn."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers
    import matplotlib.pyplot as plt

    return plt


class MetricsLog:
    """Appends metrics to <run>/metrics.jsonl and to TensorBoard under <run>/tb."""

    def __init__(self, run_dir: Path, tensorboard: bool = True) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(run_dir / "tb"))

    def log(self, step: int, values: Values) -> None:
        """Record one step's values (non-numbers go to the JSON line only)."""
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")
        if self.writer is None:
            return
        for key, value in values.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the TensorBoard writer."""
        if self.writer is not None:
            self.writer.close()


def read_metrics(path: Path) -> list[dict]:
    """The JSON lines of a metrics file (a torn last line from a crash is skipped)."""
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def plot_rewards(metrics_path: Path, out: Path, title: str = "") -> Path:
    """reward.png: train reward and held-out success against training step (each held-out
    point labelled with its number of tasks: the evaluations before and after training use
    every held-out task, the periodic ones `eval_size`, by default all), and model calls per rollout on a
    second axis (how much the agent uses its tools)."""
    plt = _pyplot()
    rows = read_metrics(metrics_path)
    train = [(r["step"], r["train/reward"]) for r in rows if "train/reward" in r]
    evals = [
        (r["step"], r["eval/success"], r.get("eval/size")) for r in rows if "eval/success" in r
    ]
    calls = [(r["step"], r["guard/calls"]) for r in rows if r.get("guard/calls") is not None]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train, strict=True), label="train reward (mean)", color="tab:blue")
    if evals:
        steps, success, sizes = zip(*evals, strict=True)
        ax.plot(steps, success, "o-", label="held-out success (n = tasks)", color="tab:orange")
        for x, y, n in evals:
            if n is not None:
                ax.annotate(f"n={n}", (x, y), textcoords="offset points", xytext=(0, 6),
                            ha="center", fontsize=7, color="tab:orange")  # fmt: skip
    ax.set_xlabel("training step")
    ax.set_ylabel("reward / success")
    ax.set_ylim(-0.02, 1.08)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if calls:
        right = ax.twinx()
        line = right.plot(
            *zip(*calls, strict=True), ":", color="tab:green", label="calls / rollout"
        )
        right.set_ylabel("model calls per rollout")
        right.set_ylim(0, max(c for _, c in calls) * 1.3 + 0.1)
        handles, labels = handles + line, labels + ["calls / rollout"]
    ax.legend(handles, labels, loc="lower right", fontsize=8)
    ax.set_title(title or metrics_path.parent.name)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


PIPELINE_PANELS = (
    ("staleness (versions)", ("pipeline/staleness_mean", "pipeline/staleness_max")),
    ("trainer idle (s / step)", ("time/trainer_idle_s",)),
    ("runner utilisation", ("runner/utilisation",)),
    ("rollouts / s", ("pipeline/rollouts_per_s",)),
)
"""pipeline.png's panels: a title and the metrics drawn in it."""


def plot_pipeline(metrics_path: Path, out: Path, title: str = "") -> Path:
    """pipeline.png: staleness, trainer idle time, runner utilisation, rollouts/s by step."""
    plt = _pyplot()
    rows = read_metrics(metrics_path)
    fig, axes = plt.subplots(2, 2, figsize=(9, 6), sharex=True)
    for ax, (name, keys) in zip(axes.flat, PIPELINE_PANELS, strict=True):
        for key in keys:
            points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points, strict=True), label=key.split("/")[-1])
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("training step")
    fig.suptitle(title or metrics_path.parent.name)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def step_values(report: StepReport) -> Values:
    """One pipeline step's report as flat metric names (what metrics.jsonl and TensorBoard
    show); curation's counters come under curation/, each under one name."""
    t, src = report.train, report.source
    values: Values = {"train/frozen_rows": report.frozen_rows}
    if len(report.role_rows) > 1:
        values |= {f"train/rows/{role}": n for role, n in report.role_rows.items()}
    if len(report.policies) > 1:
        for name, m in report.policies.items():
            values[f"train/{name}/loss"] = m.loss if m else None
            values[f"train/{name}/tokens"] = m.tokens if m else 0
            values[f"train/{name}/kl_behaviour"] = m.kl_behaviour if m else None
    trained = {f"train/{k}": v for k, v in t.model_dump().items() if k != "wall_s"}
    return (
        values
        | trained
        | report.curation
        | {
            "train/reward": report.reward,
            "train/success": report.success,
            "train/rollouts": report.rollouts,
            "train/rows": report.rows,
            "time/generate_s": report.generate_s,
            "time/train_s": t.wall_s,
            "time/trainer_idle_s": src.wait_s,
            "pipeline/staleness_mean": src.staleness_mean,
            "pipeline/staleness_max": src.staleness_max,
            "pipeline/stale_dropped": src.stale_dropped,
            "pipeline/stale_requeued": src.stale_requeued,
            "pipeline/pending_groups": src.pending_groups,
            "pipeline/reward_errors": src.reward_errors,
            "pipeline/rollouts_per_s": report.rollouts / max(report.generate_s + t.wall_s, 1e-9),
        }
        | ({"runner/utilisation": src.utilisation} if src.utilisation is not None else {})
    )
