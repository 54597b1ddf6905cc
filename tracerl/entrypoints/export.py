"""`tracerl export --store runs/x --format adp|openai --filter 'reward >= 1' --out f.jsonl`.

The config is here, beside the entry point, and imports nothing heavy (the CLI reads it for
--help); reading the store and writing the lines (tracerl/export/) load only when it runs.
"""

from __future__ import annotations

from typing import Literal

from rich.console import Console

from tracerl.entrypoints.config import Command

__all__ = ["ExportCommand", "main"]


class ExportCommand(Command):
    """Write recorded rollouts as training data: Agent Data Protocol trajectories (with the
    exact token ids) or OpenAI fine-tuning JSONL; `tracerl sft --demos` reads both."""

    store: str
    """The store: a traces.db file or a run directory holding one."""
    out: str
    """Output JSONL file, one line per row (a rollout's conversation of one role)."""
    format: Literal["adp", "openai"] = "adp"
    """'adp': ADP trajectories, token ids in details.tracerl_tokens (exact round trip);
    'openai': {"messages", "tools"} lines (text: re-rendered when trained on)."""
    filter: str | None = None
    """Which rollouts and calls, e.g. 'reward >= 1 and status == answered and task ^= calc'
    (fields: reward, noise, status, split, task, role, version; see tracerl/export/filter.py).
    Default: the successful rollouts (status answered, reward at or above
    --success_threshold), as `tracerl sft --from-traces` reads them: these lines are
    training data, and OpenAI lines keep no status to filter on later ('status != queued'
    writes every finished rollout)."""
    success_threshold: float = 1.0
    """With no --filter: the reward at or above which a rollout counts as a success (a
    run's own threshold)."""
    tools: str | None = None
    """The agent's tool schemas, which spans do not record: a JSON file or 'file.py:NAME'
    (e.g. examples/calculator/agent.py:TOOLS); default: none."""


def main(cfg: ExportCommand, console: Console) -> None:
    """Select the rows, write them, print how many and which filter chose them."""
    from tracerl.export import export_rows, load_tools, read_rows, successes

    chosen = cfg.filter if cfg.filter is not None else successes(cfg.success_threshold)
    try:
        rows = read_rows(cfg.store, chosen)
        tools = load_tools(cfg.tools)
    except (OSError, ValueError, AttributeError) as e:
        raise SystemExit(str(e)) from None
    n = export_rows(rows, cfg.format, cfg.out, tools)
    rollouts = len({r.rollout.id for r in rows})
    default = " (the default: successful rollouts only)" if cfg.filter is None else ""
    console.print(
        f"wrote {n} {cfg.format} lines from {rollouts} rollouts passing {chosen!r}{default} "
        f"to {cfg.out}",
        highlight=False,
    )
