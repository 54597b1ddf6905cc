"""Live control of a training run, the training loop's side: pause, resume, checkpoint,
stop, and `set` of a few settings, applied between steps.

`tracerl ctl` and the dashboard append commands to the run dir's control.jsonl
(tracerl.pipeline.control_files, the channel); `Control.poll` reads the new ones between
steps, `between_steps` applies each (blocking while paused) and answers it in
control_applied.jsonl with the step it took effect, and the loop's state goes to
control_state.json. Nothing listens on a port. A step still waiting for its batch (an async
source, nothing trained yet) calls `between_steps` too, every quarter second: a pause holds
it there, and a stop gives the step up.

A checkpoint asked for is the next step's own: the pipeline records each version's
checkpoint when the step ends (a version recorded without one never gets one later), so
the step in progress, or the next one, ends with a checkpoint. A stop needs none of its
own: the run ends with the final evaluation and export, and a later resume continues from
the last checkpoint, exactly as after a crash (with checkpoint_every = 1, the stop's step).

A command the run cannot carry out is refused when it is read, answered with the reason
(what `tracerl ctl` prints and the dashboard shows), and the run goes on: e.g. a new
learning rate in a data-parallel run, whose ranks take no optimizer change mid-run.

Settings changed with `set` are replayed from control_applied.jsonl when the run resumes,
so a resumed run keeps them. A run at step 0 starts afresh: an earlier run's files in the
same dir are moved aside, and nothing from it is applied or replayed.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import JsonValue
from tqdm import tqdm

from tracerl.algorithms.curation import Curation, CurationState
from tracerl.pipeline.config import TrainConfig
from tracerl.pipeline.control_files import (
    APPLIED,
    COMMANDS,
    STATE,
    Applied,
    Command,
    ControlState,
    append,
    read_applied,
    read_commands,
    with_setting,
)

if TYPE_CHECKING:
    from tracerl.pipeline.step import Pipeline

__all__ = ["Control"]

_POLL_S = 0.25
"""How often a paused loop looks for new commands."""


class Control:
    """The training loop's end of the channel (see the module docstring).

    `between_steps` applies what was sent since the last step and blocks while paused;
    `metrics` hands the loop the `control/...` values to log with the step they took effect.
    """

    def __init__(self, run_dir: Path, cfg: TrainConfig, pipeline: Pipeline) -> None:
        self.run_dir, self.cfg, self.pipeline = run_dir, cfg, pipeline
        self.paused_since: float | None = None
        self.stopping = False
        self.checkpoint_asked = False
        self._values: dict[str, float | int | str | None] = {}
        self._seen: set[str] = set()
        if pipeline.step == 0:
            self._fresh_start()
        else:
            self._replay()
        self._write_state()

    # -- starting ---------------------------------------------------------------------

    def _fresh_start(self) -> None:
        """A run at step 0 starts afresh: an earlier run's files in this dir are moved aside,
        keeping only the commands sent since this run wrote its config (while it loaded)."""
        commands, applied = self.run_dir / COMMANDS, self.run_dir / APPLIED
        if applied.exists():
            os.replace(applied, self.run_dir / "control_applied.prev.jsonl")
        if not commands.exists():
            return
        since = (self.run_dir / "config.json").stat().st_mtime
        os.replace(commands, self.run_dir / "control.prev.jsonl")
        for cmd in read_commands(self.run_dir, "control.prev.jsonl"):
            if cmd.at >= since:
                append(commands, cmd)

    def _replay(self) -> None:
        """A resumed run: settings applied before keep their values."""
        applied = read_applied(self.run_dir)
        self._seen = {a.id for a in applied}
        for a in applied:
            if a.op == "set" and a.ok and a.key is not None:
                try:
                    self._set(a.key, a.value)
                except ValueError as e:  # e.g. the resumed run's flags conflict with it
                    tqdm.write(f"control: {a.key}={a.value!r} not replayed: {e}")
        if any(a.op == "set" and a.ok and a.key != "trainer.lr" for a in applied):
            self._reload_curation_memory()

    def _reload_curation_memory(self) -> None:
        """Curation steps turned on by a replayed set get their checkpointed memory back
        (the restore ran before the replay, when they were still off)."""
        latest = self.pipeline.checkpoints.latest()
        if latest is None:
            return
        saved = json.loads((latest / "pipeline.json").read_text()).get("curation", {})
        self.pipeline.curation.load_state(CurationState.model_validate(saved))

    # -- reading -----------------------------------------------------------------------

    def poll(self) -> list[Command]:
        """Commands sent and not yet applied, in order (the same ones until applied)."""
        return [c for c in read_commands(self.run_dir) if c.id not in self._seen]

    # -- applying ----------------------------------------------------------------------

    def between_steps(self, bar: tqdm | None = None) -> bool:
        """Apply every command sent; block while paused. False once the run should stop."""
        self._apply(self.poll())
        _describe(bar, "paused" if self.paused_since is not None else "train")
        while self.paused_since is not None and not self.stopping:
            time.sleep(_POLL_S)
            self._apply(self.poll())
            self._write_state()  # a heartbeat: the reader sees the pause is live
        _describe(bar, "stopping" if self.stopping else "train")
        return not self.stopping

    def metrics(self) -> dict[str, float | int | str | None]:
        """control/... values that took effect at the step just done (then reset)."""
        if self.checkpoint_asked:  # that step wrote it: back to the run's own schedule
            self.checkpoint_asked = False
            self.pipeline.cfg = self.cfg.pipeline
            self._values["control/checkpoint"] = self.pipeline.step
        out, self._values = self._values, {}
        return out

    def _apply(self, commands: list[Command]) -> None:
        for cmd in commands:
            self._seen.add(cmd.id)
            try:
                value = self._do(cmd)
                self._answer(cmd, value=value)
            except ValueError as e:
                self._answer(cmd, error=str(e))
        self._write_state()

    def _do(self, cmd: Command) -> JsonValue:
        """Carry out one command; returns the value now in force (for set)."""
        if cmd.op == "pause" and self.paused_since is None:
            self.paused_since = time.time()
            self.pipeline.source.pause(True)  # async runners stop taking new work too
        elif cmd.op == "resume" and self.paused_since is not None:
            self._values["control/paused_s"] = time.time() - self.paused_since
            self.paused_since = None
            self.pipeline.source.pause(False)
        elif cmd.op == "checkpoint":
            self._ask_checkpoint()
        elif cmd.op == "stop":
            self.stopping = True
        elif cmd.op == "set":
            if cmd.key is None:
                raise ValueError("set needs a key")
            value = self._set(cmd.key, cmd.value)
            self._values[f"control/{cmd.key}"] = value
            return value
        return None

    def _set(self, key: str, value: JsonValue) -> Any:
        """Put one setting in force in the live run's parts; returns its validated value."""
        new = with_setting(self.cfg, key, value)
        if key == "trainer.lr":
            from tracerl.pipeline.step import local_trainer  # step's imports reach this module

            # Every trainer first: a run that cannot take the change refuses it whole.
            trainers = [local_trainer(p, "a learning-rate change") for p in self.pipeline.policies]
            for trainer in trainers:
                trainer.set_lr(new.trainer.lr)
        else:
            self._rebuild_curation(new)
        self.cfg = new
        section, name = key.split(".", 1)
        return getattr(getattr(new, section), name)

    def _rebuild_curation(self, cfg: TrainConfig) -> None:
        """Curation (and the group size it hands the source) rebuilt from `cfg` in place:
        the source and the pipeline hold the same object, and it keeps its memory."""
        curation = self.pipeline.curation
        fresh = Curation.build(cfg.curation, cfg.pipeline.group_size, cfg.success_threshold)
        fresh.load_state(curation.state())
        curation.steps, curation.base_group_size = fresh.steps, fresh.base_group_size
        self.pipeline.cfg = cfg.pipeline.model_copy(
            update={"checkpoint_every": self.pipeline.cfg.checkpoint_every}
        )  # a checkpoint asked for stays asked for

    def _ask_checkpoint(self) -> None:
        """Have the next step end with a checkpoint (see the module docstring), unless the
        steps done are checkpointed already."""
        p = self.pipeline
        latest = p.checkpoints.latest()
        if latest is not None and latest.name == f"step-{p.step}":
            return
        self.checkpoint_asked = True
        p.cfg = p.cfg.model_copy(update={"checkpoint_every": 1})  # for this one step

    def _answer(self, cmd: Command, value: JsonValue = None, error: str | None = None) -> None:
        applied = Applied(
            id=cmd.id, op=cmd.op, key=cmd.key, value=value if error is None else cmd.value,
            ok=error is None, error=error, step=self.pipeline.step + 1, at=time.time(),
        )  # fmt: skip
        append(self.run_dir / APPLIED, applied)

    def _write_state(self) -> None:
        """control_state.json, replaced atomically so a reader never sees half of it."""
        state = ControlState(
            state="stopping" if self.stopping else "paused" if self.paused_since else "running",
            step=self.pipeline.step, pid=os.getpid(), host=socket.gethostname(),
            updated_at=time.time(), paused_since=self.paused_since,
        )  # fmt: skip
        tmp = self.run_dir / f".{STATE}.tmp"
        tmp.write_text(state.model_dump_json())
        os.replace(tmp, self.run_dir / STATE)


def _describe(bar: tqdm | None, what: str) -> None:
    """Show the loop's state in the progress bar (redrawn only when it changes)."""
    if bar is not None and bar.desc != what:
        bar.set_description_str(what)
