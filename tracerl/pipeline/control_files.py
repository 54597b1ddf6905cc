"""The control channel of a training run: the commands, the files they travel in, and the
settings `set` may change. Torch-free, so `tracerl ctl` and the dashboard stay light.

Three files in the run dir, so a controller needs no connection to the training process
and nothing new listens on a port: control.jsonl (append-only `Command`s with ids, written
by `send`), control_applied.jsonl (the loop's `Applied` answer to each: the step it took
effect, or why it was refused) and control_state.json (`ControlState`: running, paused or
stopping). The loop's side is tracerl.pipeline.control.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, JsonValue, ValidationError

from tracerl.algorithms.config import CurationConfig
from tracerl.pipeline.config import TrainConfig

__all__ = [
    "APPLIED",
    "COMMANDS",
    "STATE",
    "Applied",
    "Command",
    "ControlState",
    "Op",
    "parse_setting",
    "read_applied",
    "read_commands",
    "read_state",
    "send",
    "settable",
    "append",
    "is_live",
    "json_lines",
    "wait_applied",
    "with_setting",
]

Op = Literal["pause", "resume", "checkpoint", "stop", "set"]
"""What a command asks of the training loop."""

COMMANDS, APPLIED, STATE = "control.jsonl", "control_applied.jsonl", "control_state.json"
"""The control files in a run dir: commands sent, what the loop did, the loop's state."""


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class Command(_Record):
    """One line of control.jsonl: what a controller asked."""

    id: str
    """Unique id; control_applied.jsonl answers it under the same id."""
    op: Op
    """pause (block between steps until resume), resume, checkpoint (the next step ends
    with one), stop (cleanly:
    final evaluation and export as on a normal end), or set (key = value)."""
    key: str | None = None
    """For set: the setting, e.g. 'trainer.lr' (see `settable`)."""
    value: JsonValue = None
    """For set: the new value."""
    at: float
    """Unix time it was sent."""
    origin: str = "ctl"
    """Who sent it ('ctl', 'dashboard')."""


class Applied(_Record):
    """One line of control_applied.jsonl: what the training loop did with a command."""

    id: str
    """The command's id."""
    op: Op
    """The command's op."""
    key: str | None = None
    """For set: the setting."""
    value: JsonValue = None
    """For set: the value now in force."""
    ok: bool = True
    """Whether it was applied; False with `error` when it was refused."""
    error: str | None = None
    """Why it was refused."""
    step: int
    """The first step it affects: the number metrics.jsonl logs that step under."""
    at: float
    """Unix time it was applied."""


class ControlState(_Record):
    """control_state.json: where the training loop is, for readers of the run dir."""

    state: Literal["running", "paused", "stopping"]
    """running (training or evaluating), paused (blocked between steps), stopping (a stop
    was applied: final evaluation and export follow)."""
    step: int
    """Steps done."""
    pid: int
    """The training process."""
    host: str
    """The machine it runs on (a pid means something only there)."""
    updated_at: float
    """Unix time of this write (renewed about every second while paused)."""
    paused_since: float | None = None
    """When the current pause began."""


# -------------------------------------------------------------------- settings (both sides)


def settable(key: str) -> bool:
    """Whether `set` may change `key` mid-run: the learning rate, the group size and the
    curation switches (the parts read afresh at every step). A new group size applies to
    groups issued from then on; an async run has issued some groups ahead already."""
    if key in ("trainer.lr", "pipeline.group_size"):
        return True
    section, _, name = key.partition(".")
    return section == "curation" and name in CurationConfig.model_fields


def parse_setting(text: str) -> tuple[str, JsonValue]:
    """'key=value' -> (key, value); the value is read as JSON when it is JSON (numbers,
    true/false), else kept as text. ValueError for a malformed or unknown key."""
    key, sep, raw = text.partition("=")
    key, raw = key.strip(), raw.strip()
    if not sep or not key or not raw:
        raise ValueError(f"{text!r}: expected key=value")
    if not settable(key):
        raise ValueError(f"{key} cannot be set mid-run (settable: {_settable_names()})")
    try:
        value: JsonValue = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key, value


def _settable_names() -> str:
    return (
        "trainer.lr, pipeline.group_size, curation.<" + "|".join(CurationConfig.model_fields) + ">"
    )


def with_setting(cfg: TrainConfig, key: str, value: JsonValue) -> TrainConfig:
    """`cfg` with one settable setting changed, validated (ValueError saying what is wrong)."""
    if not settable(key):
        raise ValueError(f"{key} cannot be set mid-run (settable: {_settable_names()})")
    section, name = key.split(".", 1)
    data = cfg.model_dump()
    data[section] = {**data[section], name: value}
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        raise ValueError(f"{key}={value!r}: {err['msg']}") from None


# ---------------------------------------------------------------- the files (both sides)


def json_lines(path: Path) -> list[dict[str, Any]]:
    """The complete JSON lines of an append-only file (a torn last line is skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def append(path: Path, record: BaseModel) -> None:
    # One write of one short line with O_APPEND: concurrent writers never interleave.
    with path.open("a") as f:
        f.write(record.model_dump_json() + "\n")


_R = TypeVar("_R", bound=BaseModel)


def _records(path: Path, record: type[_R]) -> list[_R]:
    """The file's lines that are valid records; a hand-edited bad line is skipped rather
    than stopping a training loop (`send` only writes valid ones)."""
    out = []
    for line in json_lines(path):
        try:
            out.append(record.model_validate(line))
        except ValidationError:
            continue
    return out


def read_commands(run_dir: str | Path, file: str = COMMANDS) -> list[Command]:
    """Every command sent to the run, in order (from `file` in the run dir)."""
    return _records(Path(run_dir) / file, Command)


def read_applied(run_dir: str | Path) -> list[Applied]:
    """What the training loop did with each command it read, in order."""
    return _records(Path(run_dir) / APPLIED, Applied)


def read_state(run_dir: str | Path) -> ControlState | None:
    """The training loop's last written state (None before a loop ever ran there)."""
    path = Path(run_dir) / STATE
    try:
        return ControlState.model_validate_json(path.read_text())
    except (OSError, ValidationError):
        return None


def is_live(state: ControlState | None) -> bool:
    """Whether the training loop that wrote `state` is still running (its pid is checked on
    this machine; another machine's state is taken at its word)."""
    if state is None or state.host != socket.gethostname():
        return state is not None
    try:
        os.kill(state.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, someone else's
    return True


def send(
    run_dir: str | Path,
    op: Op,
    key: str | None = None,
    value: JsonValue = None,
    origin: str = "ctl",
) -> Command:
    """Append a command for the run's training loop; a `set` is validated against the run's
    config first (ValueError), so a bad one is refused here rather than in the loop."""
    run = Path(run_dir)
    if not (run / "config.json").exists():
        raise ValueError(f"{run_dir} is not a run directory (no config.json)")
    if op == "set":
        if key is None:
            raise ValueError("set needs a key and a value")
        with_setting(TrainConfig.model_validate_json((run / "config.json").read_text()), key, value)
    elif key is not None:
        raise ValueError(f"{op} takes no setting")
    cmd = Command(id=uuid.uuid4().hex[:12], op=op, key=key, value=value, at=time.time(),
                  origin=origin)  # fmt: skip
    append(run / COMMANDS, cmd)
    return cmd


def wait_applied(run_dir: str | Path, command_id: str, timeout_s: float) -> Applied | None:
    """The loop's answer to a command, waiting up to `timeout_s` for it (None: not yet)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = [a for a in read_applied(run_dir) if a.id == command_id]
        if found or time.monotonic() >= deadline:
            return found[0] if found else None
        time.sleep(0.1)
