"""The cockpit's commands: `tracerl dashboard` (the live web page) and `tracerl ctl` (live
control of a training run). Torch-free: `tracerl --help` reads them."""

from __future__ import annotations

import ipaddress
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_settings import CliPositionalArg

__all__ = ["CtlCommand", "DashboardCommand", "is_loopback"]


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Command(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")


class DashboardCommand(_Command):
    """Serve a live web page of the runs in a folder: curves, rollouts, traces token by token,
    engine and runner health, and buttons that pause, resume, checkpoint, stop or retune a
    running training run. Control needs $TRACERL_ADMIN_KEY when it is set."""

    runs: str = "runs"
    """Folder holding runs (each a runs/<name>/ written by `tracerl train` or `demo`)."""
    host: str = "127.0.0.1"
    """Interface to listen on; loopback only (the page can stop a training run)."""
    port: int = Field(default=8765, ge=0, lt=65536)
    """Port to listen on (0: any free one)."""

    @field_validator("host")
    @classmethod
    def _loopback(cls, host: str) -> str:
        if not is_loopback(host):
            raise ValueError("the dashboard listens on loopback only (e.g. 127.0.0.1)")
        return host


class CtlCommand(_Command):
    """Control a training run while it trains: pause, resume, checkpoint (the next step ends
    with one), stop (final evaluation and export as on a normal end; resumable from the last
    checkpoint), set key=value (trainer.lr, pipeline.group_size, curation.*), or status.
    Applied between steps; sets are kept on resume."""

    run_dir: CliPositionalArg[str]
    """The run's directory (runs/<name>)."""
    action: CliPositionalArg[Literal["pause", "resume", "checkpoint", "stop", "set", "status"]]
    """pause | resume | checkpoint | stop | set | status."""
    settings: CliPositionalArg[list[str]] = []
    """For set: one or more key=value (values read as JSON: 3e-4, 8, true)."""
    wait: float = Field(default=30.0, ge=0)
    """Seconds to wait for a live run to apply each command (0: return once it is sent)."""
