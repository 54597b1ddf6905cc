"""`tracerl train`: the orchestrator process. Resolves the run's config (a TOML file or a
resumed run's saved config, then flags) and runs the pipeline."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from rich.console import Console

from tracerl.entrypoints import quiet_model_loading
from tracerl.entrypoints.config import TrainCommand, config_errors
from tracerl.pipeline.config import TrainConfig


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`base` with `over` written on it, section by section."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


PATH_KEYS = ("model", "tasks", "eval_tasks", "agent", "reward")
"""Top-level keys of a config file that name files ('agent'/'reward' as 'file.py:fn')."""


def _beside(folder: Path, value: str) -> str:
    """`value` read relative to `folder` when it names something there ('file.py:fn' by its
    file part); unchanged when absolute, a 'cmd:' or 'module:fn' spec, or not there."""
    path, sep, fn = value.partition(":") if value.split(":")[0].endswith(".py") else (value, "", "")
    if value.startswith("cmd:") or Path(path).is_absolute() or not (folder / path).exists():
        return value
    return str(folder / path) + sep + fn


def file_relative(data: dict[str, Any], folder: Path) -> dict[str, Any]:
    """A config file's paths made relative to the file's folder (a path that exists only
    relative to the working directory keeps working as before)."""
    out = dict(data)
    for key in PATH_KEYS:
        if isinstance(out.get(key), str):
            out[key] = _beside(folder, out[key])
    roles = dict(out.get("roles") or {})
    for name, role in roles.items():
        if isinstance(role, dict) and isinstance(role.get("model"), str):
            roles[name] = {**role, "model": _beside(folder, role["model"])}
    if roles:
        out["roles"] = roles
    return out


def _no_config(given: str) -> str:
    """What a CONFIG that is not a file means: often a value after an on/off flag."""
    said = f"no config file {given!r}"
    if given.lower() in {"true", "false", "yes", "no", "on", "off", "1", "0"}:
        said += (
            " (on/off flags take no value: --trainer.prefix_sharing turns one on,"
            " --no-trainer.prefix_sharing off)"
        )
    return said


def resolve(cmd: TrainCommand) -> TrainConfig:
    """The run's config: the resumed run's or the file's, with the flags given on top
    (SystemExit naming each bad or unknown key, or a missing essential)."""
    flags = cmd.model_dump(exclude_unset=True, exclude={"config", "resume"})
    if cmd.resume:
        base = _saved_config(cmd.resume)
    elif cmd.config:
        path = Path(cmd.config)
        if not path.is_file():
            raise SystemExit(_no_config(cmd.config))
        base = file_relative(tomllib.loads(path.read_text()), path.resolve().parent)
    else:
        base = {}
    try:
        cfg = TrainConfig.model_validate(merge(base, flags))
        cfg.check()
    except ValidationError as e:
        raise SystemExit(f"{cmd.config or cmd.resume or 'flags'}: {config_errors(e)}") from None
    except ValueError as e:
        raise SystemExit(str(e)) from None
    return cfg


def _saved_config(run_dir: str) -> dict[str, Any]:
    """A run's saved config.json (SystemExit when `run_dir` holds none)."""
    path = Path(run_dir) / "config.json"
    if not path.exists():
        raise SystemExit(f"{run_dir} is not a run directory (no config.json)")
    return TrainConfig.model_validate_json(path.read_text()).model_dump()


def main(cmd: TrainCommand, console: Console) -> None:
    """Train (or resume), then print the run's summary. The config is checked before torch
    and the servers load, so a mistake is told in a moment."""
    cfg = resolve(cmd)
    quiet_model_loading()
    from tracerl.pipeline.guards import RewardFunctionFailed
    from tracerl.pipeline.run import train

    try:
        summary = train(cfg, resume=cmd.resume is not None)
    except RewardFunctionFailed as e:  # the user's reward code: its traceback, not ours
        raise SystemExit(f"tracerl train: {e}") from None
    console.print(summary.model_dump_json(indent=2))
