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
from tracerl.pipeline.run import load_run_config, train


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`base` with `over` written on it, section by section."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def resolve(cmd: TrainCommand) -> TrainConfig:
    """The run's config: the resumed run's or the file's, with the flags given on top
    (SystemExit naming each bad or unknown key, or a missing essential)."""
    flags = cmd.model_dump(exclude_unset=True, exclude={"config", "resume"})
    if cmd.resume:
        base = load_run_config(cmd.resume).model_dump()
    elif cmd.config:
        base = tomllib.loads(Path(cmd.config).read_text())
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


def main(cmd: TrainCommand, console: Console) -> None:
    """Train (or resume), then print the run's summary."""
    quiet_model_loading()
    summary = train(resolve(cmd), resume=cmd.resume is not None)
    console.print(summary.model_dump_json(indent=2))
