"""From recorded traces to training data: select, filter, export, and train on them.

`select` turns a store's rollouts into rows exactly as the RL step does (same ids, same
mask); `filter` is the small language that picks them (`reward >= 1 and role == executor`);
`formats` writes and reads Agent Data Protocol trajectories and OpenAI fine-tuning lines.
`tracerl sft --from-traces` trains on the rows' own ids; `tracerl export` writes them out.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import JsonValue

from tracerl.export.filter import TraceFilter, parse_filter, successes
from tracerl.export.select import TraceRow, select_rows, store_path
from tracerl.store import SqliteStore

__all__ = [
    "Format",
    "TraceFilter",
    "TraceRow",
    "export_rows",
    "load_tools",
    "parse_filter",
    "read_rows",
    "rows_as_examples",
    "select_rows",
    "successes",
]

Format = Literal["adp", "openai"]


def read_rows(target: str | Path, filter_text: str) -> list[TraceRow]:
    """The rows of a store file (or run dir) that pass the filter (ValueError for a bad
    filter, FileNotFoundError for a missing store)."""
    flt = parse_filter(filter_text)
    store = SqliteStore(store_path(target))
    try:
        return select_rows(store, flt)
    finally:
        store.close()


def rows_as_examples(rows: list[TraceRow]) -> list:
    """The rows as SFT examples of ids (EncodedDemo): loss on the sampled tokens only."""
    from tracerl.models.sft import EncodedDemo  # torch only when training

    return [
        EncodedDemo(input_ids=r.row.input_ids, loss_mask=[bool(m) for m in r.row.loss_mask])
        for r in rows
    ]


def load_tools(spec: str | None) -> list[dict[str, JsonValue]]:
    """Tool schemas from a JSON file, or from 'file.py:NAME' (a list in an agent's file)."""
    if not spec:
        return []
    if spec.endswith(".json"):
        tools = json.loads(Path(spec).read_text())
    else:
        from tracerl.agents import load_file

        target, _, name = spec.rpartition(":")
        tools = getattr(load_file(target), name)
    if not isinstance(tools, list):
        raise ValueError(f"{spec}: expected a list of tool schemas")
    return tools


def export_rows(
    rows: list[TraceRow], fmt: Format, out: str | Path, tools: list[dict[str, JsonValue]]
) -> int:
    """Write one line per row to `out`; returns the number written."""
    from tracerl.export.formats import adp_line, openai_line

    line = adp_line if fmt == "adp" else openai_line
    index: dict[str, int] = {}
    lines = []
    for row in rows:
        k = index[row.rollout.id] = index.get(row.rollout.id, -1) + 1
        lines.append(line(row, k, tools))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text("".join(f"{text}\n" for text in lines))
    return len(lines)
