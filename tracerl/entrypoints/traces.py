"""`tracerl traces list|show|prune`: read the recorded rollouts and model calls of a store,
or shrink it."""

from __future__ import annotations

import math
import time

from rich.console import Console

from tracerl.entrypoints.config import TracesCommand, TracesPrune
from tracerl.store import NotFound
from tracerl.traces import list_rollouts, open_store, show_rollout


def main(cfg: TracesCommand, console: Console) -> None:
    """Print the list, or one rollout (SystemExit for an unknown id), or prune."""
    if cfg.list is not None:
        list_rollouts(open_store(cfg.list.store), cfg.list.limit, console)
        return
    if cfg.prune is not None:
        prune(cfg.prune, console)
        return
    assert cfg.show is not None  # the parser requires one of the three
    try:
        show_rollout(open_store(cfg.show.store), cfg.show.rollout_id, console)
    except NotFound as e:
        raise SystemExit(str(e)) from None


def prune(cfg: TracesPrune, console: Console) -> None:
    """Work out what to keep from the flags, prune, and print what went."""
    from tracerl.store.retention import needed_by_run, newest_finished
    from tracerl.store.retention import prune as prune_store

    if cfg.keep is None and cfg.keep_days is None and not cfg.keep_run:
        raise SystemExit("say what to keep: --keep N, --keep_days D and/or --keep_run DIR")
    store = open_store(cfg.store)
    try:
        keep: set[str] = set()
        for run in cfg.keep_run:
            keep |= needed_by_run(store, run)
        if cfg.keep is not None:
            keep |= newest_finished(store, cfg.keep)
        # --keep alone bounds by count, --keep_days alone by age; neither: only the runs'.
        before = math.inf if cfg.keep_days is None else time.time() - cfg.keep_days * 86400
        counts = prune_store(store, keep, before)
    except (FileNotFoundError, TypeError) as e:
        raise SystemExit(str(e)) from None
    finally:
        store.close()
    mb = (counts.bytes_before - counts.bytes_after) / 1e6
    console.print(
        f"pruned {counts.rollouts} rollouts, {counts.spans} spans, {counts.rewards} rewards; "
        f"kept {len(keep)} named; file {counts.bytes_before / 1e6:.1f} MB -> "
        f"{counts.bytes_after / 1e6:.1f} MB ({mb:.1f} MB freed)"
    )
