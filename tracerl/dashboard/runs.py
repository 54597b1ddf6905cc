"""The runs folder as the dashboard sees it: which runs there are, their metrics (read
incrementally, so a live page fetches only new lines), the training ledger, each run's
state from its control files, and the tokenizer that decodes its token ids.

Everything is read from the files runs write (config.json, metrics.jsonl, trained.jsonl,
summary.json, control_*); nothing here imports torch.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from tracerl.pipeline.config import TrainConfig
from tracerl.pipeline.control_files import (
    STATE,
    Applied,
    Command,
    ControlState,
    is_live,
    read_applied,
    read_commands,
    read_state,
)

__all__ = ["MetricsChunk", "RunStatus", "RunSummary", "Runs"]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
"""A run's folder name as the API accepts it: no path separators, no leading dot."""

State = Literal["training", "paused", "stopping", "finished", "stopped", "idle"]


class RunSummary(BaseModel):
    """One entry of the runs list."""

    name: str
    """The run's folder name."""
    state: State
    """training / paused / stopping (a live loop), finished (summary.json written), stopped
    (its process is gone before the end: resumable), idle (nothing ran yet)."""
    step: int | None
    """The last step logged."""
    steps: int | None
    """Steps the run is configured for."""
    reward: float | None
    """The last logged train reward."""
    success: float | None
    """The last held-out success."""
    updated_at: float | None
    """When metrics.jsonl was last written."""


class RunStatus(BaseModel):
    """A run's live state and its control history."""

    state: State
    """See RunSummary.state."""
    live: bool
    """Whether its training loop is running now."""
    control: ControlState | None
    """The loop's last written state."""
    applied: list[Applied]
    """The newest answers to control commands (at most 20), oldest first."""
    pending: list[Command]
    """Commands sent and not applied yet (the loop applies them between steps)."""


class MetricsChunk(BaseModel):
    """Metrics lines appended since a byte offset."""

    rows: list[dict[str, Any]]
    """The new lines, parsed, in order."""
    next: int
    """Byte offset to ask from next time."""
    reset: bool
    """True when the file shrank (a new run in the same folder): rows start from the top."""


class Runs:
    """The runs under one folder; unknown or malformed names raise KeyError."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._ledgers: dict[str, tuple[tuple[float, int], dict[str, int]]] = {}
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        """Run folders (those with a config, metrics or a store: `tracerl assets` keeps its
        store in one), newest first."""
        if not self.root.is_dir():
            return []
        marks = ("config.json", "metrics.jsonl", "traces.db")
        found = [
            p for p in self.root.iterdir()
            if _NAME.match(p.name) and any((p / m).exists() for m in marks)
        ]  # fmt: skip
        return [p.name for p in sorted(found, key=_mtime, reverse=True)]

    def dir(self, name: str) -> Path:
        """The run's folder (KeyError for a name that is not a run here)."""
        path = self.root / name
        if not _NAME.match(name) or not path.is_dir():
            raise KeyError(name)
        return path

    def config(self, name: str) -> TrainConfig | None:
        """The run's resolved config (None when missing or unreadable)."""
        try:
            return TrainConfig.model_validate_json((self.dir(name) / "config.json").read_text())
        except (OSError, ValidationError):
            return None

    def metrics(self, name: str, since: int = 0) -> MetricsChunk:
        """The complete lines of metrics.jsonl after byte `since`."""
        path = self.dir(name) / "metrics.jsonl"
        if not path.exists():
            return MetricsChunk(rows=[], next=0, reset=since > 0)
        with path.open("rb") as f:
            size = f.seek(0, 2)
            reset = since > size
            start = 0 if reset else since
            f.seek(start)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next poll
        rows = []
        for line in data[:end].splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return MetricsChunk(rows=rows, next=start + end, reset=reset)

    def steps(self, name: str) -> dict[str, int]:
        """Rollout id -> the step that trained on it (trained.jsonl, re-read when it
        changes)."""
        path = self.dir(name) / "trained.jsonl"
        if not path.exists():
            return {}
        stat = path.stat()
        key = (stat.st_mtime, stat.st_size)
        with self._lock:
            cached = self._ledgers.get(name)
            if cached and cached[0] == key:
                return cached[1]
        out: dict[str, int] = {}
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            out.update(dict.fromkeys(entry["rollouts"], int(entry["step"])))
        with self._lock:
            self._ledgers[name] = (key, out)
        return out

    def status(self, name: str) -> RunStatus:
        """Live state and control history."""
        run = self.dir(name)
        state = read_state(run)
        applied = read_applied(run)
        done = {a.id for a in applied}
        pending = [c for c in read_commands(run) if c.id not in done]
        return RunStatus(
            state=self._state(run, state), live=is_live(state), control=state,
            applied=applied[-20:], pending=pending,
        )  # fmt: skip

    def _state(self, run: Path, control: ControlState | None) -> State:
        # summary.json is written last; a resumed run rewrites config.json first.
        started = max(_mtime(run / STATE), _mtime(run / "config.json"))
        if (run / "summary.json").exists() and _mtime(run / "summary.json") >= started:
            return "finished"
        if is_live(control):
            assert control is not None
            return "training" if control.state == "running" else control.state
        if control is not None:
            return "stopped"
        # A run without control files (written before them, or not started yet).
        metrics = run / "metrics.jsonl"
        if metrics.exists() and time.time() - _mtime(metrics) < 120:
            return "training"
        return "stopped" if metrics.exists() else "idle"

    def summary(self, name: str) -> RunSummary:
        """The runs list's entry (reads the metrics file's tail only)."""
        run = self.dir(name)
        cfg = self.config(name)
        last = _tail_values(run / "metrics.jsonl", ("train/reward", "eval/success"))
        return RunSummary(
            name=name, state=self._state(run, read_state(run)), step=last.get("step"),
            steps=cfg.pipeline.steps if cfg else None, reward=last.get("train/reward"),
            success=last.get("eval/success"),
            updated_at=_mtime(run / "metrics.jsonl") or None,
        )  # fmt: skip

    def tokenizer_file(self, name: str, role: str) -> Path | None:
        """tokenizer.json of the model that serves `role` in the run (its policy's model
        dir from config.json, else the exported model), None if none is found."""
        run = self.dir(name)
        cfg = self.config(name)
        candidates = [run / "model", run / "models" / role]
        if cfg is not None:
            try:
                specs = cfg.policies()
            except ValueError:
                specs = []
            mine = [s.model for s in specs if role in s.roles] + [cfg.model]
            candidates = [Path(m) for m in mine if m] + candidates
        return next(
            (c / "tokenizer.json" for c in candidates if (c / "tokenizer.json").exists()), None
        )


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _tail_values(path: Path, keys: tuple[str, ...], tail_bytes: int = 65536) -> dict[str, Any]:
    """The newest value of each key (and the last step) among the file's last lines."""
    if not path.exists():
        return {}
    with path.open("rb") as f:
        size = f.seek(0, 2)
        f.seek(max(0, size - tail_bytes))
        lines = f.read().splitlines()
    out: dict[str, Any] = {}
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn line, or the first one cut by the seek
        out.setdefault("step", row.get("step"))
        for key in keys:
            if row.get(key) is not None:
                out.setdefault(key, row[key])
        if len(out) == len(keys) + 1:
            break
    return out
