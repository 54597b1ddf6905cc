"""Reading user-written JSONL files (tasks, demonstrations, training files): each line an
object, and a line that is not one is a ValueError naming the file and line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def read_objects(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Each non-blank line of the file as (its 1-based line number, its object)."""
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path}:{n}: each line must be a JSON object")
        yield n, raw
