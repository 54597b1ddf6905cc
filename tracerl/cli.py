"""The `tracerl` command: a dispatcher over the entry points in tracerl.entrypoints.

Every field of every command is documented and settable as --field (nested ones as
--section.field); `tracerl <command> --help` lists them, from configs that import nothing
heavy. The chosen command's entry point, and with it torch and the servers, is imported only
once the command runs. Each run saves its resolved config next to its outputs.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
from types import FrameType

from pydantic import ValidationError
from pydantic_settings import BaseSettings, CliApp, CliSubCommand
from rich.console import Console

from tracerl.dashboard.config import CtlCommand, DashboardCommand
from tracerl.demo import DemoConfig
from tracerl.entrypoints.assets import AssetsCommand
from tracerl.entrypoints.config import (
    EvalCommand,
    RunnerCommand,
    ServeCommand,
    SftCommand,
    TracesCommand,
    TrainCommand,
    config_errors,
)
from tracerl.entrypoints.export import ExportCommand
from tracerl.entrypoints.models import ModelsCommand
from tracerl.entrypoints.store import StoreCommand

console = Console()
"""Where every command prints (tests swap it for one that records)."""


class Tracerl(
    BaseSettings,
    cli_prog_name="tracerl",
    cli_kebab_case=False,
    cli_implicit_flags=True,
    cli_use_class_docs_for_groups=True,
    use_attribute_docstrings=True,
):
    """tracerl: reinforcement learning for LLM agents from the traces of the agents as they
    already are. Point your agent's base_url at the gateway; tracerl records, trains, serves."""

    # Each field's name is its entry point's module: tracerl.entrypoints.<name>.main(cfg).
    demo: CliSubCommand[DemoConfig]
    train: CliSubCommand[TrainCommand]
    eval: CliSubCommand[EvalCommand]
    traces: CliSubCommand[TracesCommand]
    sft: CliSubCommand[SftCommand]
    serve: CliSubCommand[ServeCommand]
    runner: CliSubCommand[RunnerCommand]
    store: CliSubCommand[StoreCommand]
    dashboard: CliSubCommand[DashboardCommand]
    ctl: CliSubCommand[CtlCommand]
    export: CliSubCommand[ExportCommand]
    models: CliSubCommand[ModelsCommand]
    assets: CliSubCommand[AssetsCommand]


_terminated_by: int | None = None
"""The signal that asked this process to stop, once one has."""


def _terminated(signum: int, frame: FrameType | None) -> None:
    """SIGTERM: unwind with SystemExit(128 + signum), from a frame where it can unwind.

    Python runs a signal handler in whatever frame the main thread is in, and two of those
    cannot take an exception: inside a finalizer (`__del__`, e.g. an SDK client collected
    mid-step) a raised SystemExit is printed as "Exception ignored" and dropped, and the run
    goes on to its end; inside an import it leaves the module half-initialized (a C
    extension's failed init, matplotlib's, aborted the interpreter at exit). There the
    signal is sent again a moment later, until it lands outside them."""
    global _terminated_by
    _terminated_by = signum
    if _cannot_unwind(frame):
        main = threading.main_thread().ident
        assert main is not None
        threading.Timer(0.05, signal.pthread_kill, args=(main, signum)).start()
        return
    raise SystemExit(128 + signum)


def _cannot_unwind(frame: FrameType | None) -> bool:
    """Whether `frame` or a caller is a `__del__` method, a `weakref.finalize` callback or
    the import machinery."""
    while frame is not None:
        code = frame.f_code
        if (
            code.co_name == "__del__"
            or (code.co_name == "__call__" and code.co_filename.endswith("weakref.py"))
            or code.co_filename.startswith("<frozen importlib")
        ):
            return True
        frame = frame.f_back
    return False


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `tracerl` command: parse, then run the chosen entry point."""
    # SIGTERM (kill, a scheduler, docker stop) unwinds like an error: the run's cleanup
    # stops the engine servers it started, instead of leaving them running with no parent.
    # (`tracerl serve`'s HTTP server installs its own graceful handler while it runs.)
    if threading.current_thread() is threading.main_thread():  # the only thread allowed to
        signal.signal(signal.SIGTERM, _terminated)
    args = sys.argv[1:] if argv is None else argv
    try:
        parsed = CliApp.run(Tracerl, cli_args=args or ["--help"])
    except ValidationError as e:  # e.g. an unknown key inside a JSON value
        raise SystemExit(f"tracerl: {config_errors(e)}") from None
    name = next(name for name in Tracerl.model_fields if getattr(parsed, name) is not None)
    entry = importlib.import_module(f"tracerl.entrypoints.{name}")
    try:
        entry.main(getattr(parsed, name), console)
    except (FileNotFoundError, ValueError) as e:  # a path or a value the user gave: one line
        if _terminated_by is None and not os.environ.get("TRACERL_DEBUG"):
            raise SystemExit(f"tracerl {name}: {e} (TRACERL_DEBUG=1 shows where)") from None
        raise
    except Exception:
        if _terminated_by is None:
            raise
        # The signal's SystemExit, turned into another error on its way out (e.g. raised
        # inside a callback from C): still a stop by that signal.
        raise SystemExit(128 + _terminated_by) from None
    if _terminated_by is not None:  # stopped by a signal whose SystemExit something swallowed
        raise SystemExit(128 + _terminated_by)


if __name__ == "__main__":
    main()
