"""The examples shipped with tracerl: runnable agents, tasks and rewards, one folder each.

Each folder is plain user code written against the public OpenAI client (it knows nothing
of tracerl) and its files run as scripts; in a checkout `examples/` points here, so
`python examples/calculator/tasks.py 50 eval` works as documented. The folders ship inside
the package, so `tracerl demo` finds them from an installed wheel too; a file of one is
loaded by path (`tracerl.agents.load_file`), never through sys.path.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from types import ModuleType

from tracerl.agents import load_file

__all__ = ["example_dir", "example_file", "example_module"]


def example_dir(name: str = "calculator") -> Path:
    """The folder of the example `name` (FileNotFoundError naming the ones there are)."""
    # A wheel is installed unzipped, so the package's resources are real files on disk.
    root = Path(str(files(__name__)))
    path = root / name
    if not path.is_dir():
        there = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name[0].isalpha())
        raise FileNotFoundError(f"no example {name!r} in {root} (examples: {there})")
    return path


def example_file(name: str, module: str) -> Path:
    """The path of <example>/<module>.py."""
    return example_dir(name) / f"{module}.py"


def example_module(name: str, module: str) -> ModuleType:
    """<example>/<module>.py imported by path, under a name of its own (see load_file)."""
    return load_file(example_file(name, module))
