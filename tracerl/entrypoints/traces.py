"""`tracerl traces list|show`: read the recorded rollouts and model calls of a store."""

from __future__ import annotations

from rich.console import Console

from tracerl.entrypoints.config import TracesCommand
from tracerl.store import NotFound
from tracerl.traces import list_rollouts, open_store, show_rollout


def main(cfg: TracesCommand, console: Console) -> None:
    """Print the list, or one rollout (SystemExit for an unknown id)."""
    if cfg.list is not None:
        list_rollouts(open_store(cfg.list.store), cfg.list.limit, console)
        return
    assert cfg.show is not None  # the parser requires one of the two
    try:
        show_rollout(open_store(cfg.show.store), cfg.show.rollout_id, console)
    except NotFound as e:
        raise SystemExit(str(e)) from None
