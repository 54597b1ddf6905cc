"""The trace filter language: which rollouts, and which of their calls, to train on or export.

A filter is clauses joined by `and` (or `,`), each `FIELD OP VALUE`:

    reward >= 1 and status == answered and task ^= calc- and role == executor

| field | of | ops | value |
|---|---|---|---|
| `reward` | the rollout's final reward (a missing one fails every comparison) | `== != < <= > >=` | number |
| `noise` | tool perturbations recorded for the rollout (`tracerl.noise`; none: 0) | `== != < <= > >=` | number |
| `status` | the rollout's status, as shown (answered, error, timed out) or stored (succeeded, failed, timed_out) | `== !=` | word |
| `split` | the task's split | `== != ^=` | word |
| `task` | the task id (`^=`: starts with) | `== != ^=` | word |
| `role` | a call's role: other roles' calls are left out | `== != ^=` | word |
| `version` | a call's policy version: other calls stay as context, untrained | `== != < <= > >=` | integer |

It is parsed by a small tokenizer into typed clauses, never evaluated as code, and a
mistake is a ValueError naming the clause and what is allowed. The readers that make
training data (`tracerl sft --from-traces`, `tracerl export`) read `successes(threshold)`
when given no filter; `status != queued` keeps every finished rollout.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tracerl.types import STATUS_SHOWN

__all__ = ["Clause", "TraceFilter", "parse_filter", "successes"]

_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "==": operator.eq,
    "!=": operator.ne,
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
    "^=": lambda a, b: str(a).startswith(str(b)),
}
_NUMERIC = {"reward": float, "noise": float, "version": int}
_TEXT = {"status", "split", "task", "role"}
_SPAN_FIELDS = {"role", "version"}
_STATUS_WORDS = {shown: str(status) for status, shown in STATUS_SHOWN.items()}
_CLAUSE = re.compile(r"""\s*([a-z_]+)\s*(==|!=|>=|<=|\^=|>|<)\s*("[^"]*"|'[^']*'|\S+)\s*$""")


@dataclass(frozen=True)
class Clause:
    """One `FIELD OP VALUE` comparison."""

    field: str
    """What is compared (see the module's table)."""
    op: str
    """The operator's text: ==, !=, <, <=, >, >=, or ^= (starts with)."""
    value: str | float | int
    """The right-hand side, already converted to the field's type."""

    def holds(self, actual: str | float | int | None) -> bool:
        """Whether the comparison holds for `actual` (None, a missing value, never does)."""
        return actual is not None and _OPS[self.op](actual, self.value)


@dataclass(frozen=True)
class TraceFilter:
    """A parsed filter: rollout-level clauses and call-level clauses, all of which must hold."""

    rollout: tuple[Clause, ...] = ()
    """Clauses on the rollout and its task (reward, noise, status, split, task)."""
    call: tuple[Clause, ...] = ()
    """Clauses on each call (role, version)."""

    def keeps_rollout(self, values: dict[str, str | float | int | None]) -> bool:
        """Whether a rollout with these field values passes every rollout-level clause."""
        return all(c.holds(values.get(c.field)) for c in self.rollout)

    def keeps_role(self, role: str) -> bool:
        """Whether calls of this role are kept at all."""
        return all(c.holds(role) for c in self.call if c.field == "role")

    def keeps_version(self, version: int) -> bool:
        """Whether calls sampled by this policy version are trained on."""
        return all(c.holds(version) for c in self.call if c.field == "version")


def _clause(text: str) -> Clause:
    m = _CLAUSE.match(text)
    if m is None:
        raise ValueError(f"filter clause {text.strip()!r}: expected FIELD OP VALUE")
    field, op, raw = m.groups()
    raw = raw[1:-1] if raw[:1] in "\"'" else raw
    if field in _NUMERIC:
        if op == "^=":
            raise ValueError(f"filter clause {text.strip()!r}: ^= compares text only")
        try:
            return Clause(field, op, _NUMERIC[field](raw))
        except ValueError:
            raise ValueError(f"filter clause {text.strip()!r}: {field} takes a number") from None
    if field in _TEXT:
        if op not in ("==", "!=", "^="):
            raise ValueError(f"filter clause {text.strip()!r}: {field} takes ==, != or ^=")
        if field == "status":  # the words statuses are shown in mean their stored names
            raw = _STATUS_WORDS.get(raw.replace("_", " "), raw)
        return Clause(field, op, raw)
    known = ", ".join(sorted([*_NUMERIC, *_TEXT]))
    raise ValueError(f"filter clause {text.strip()!r}: unknown field {field!r} ({known})")


def parse_filter(text: str) -> TraceFilter:
    """Parse a filter ('' keeps everything); ValueError for anything else."""
    parts = [p for p in re.split(r"\s+and\s+|,", text.strip()) if p.strip()]
    clauses = [_clause(p) for p in parts]
    return TraceFilter(
        rollout=tuple(c for c in clauses if c.field not in _SPAN_FIELDS),
        call=tuple(c for c in clauses if c.field in _SPAN_FIELDS),
    )


def successes(threshold: float) -> str:
    """The filter of the successful rollouts: finished as succeeded (not failed, not timed
    out, whatever reward a runner reported with those) with a reward of at least
    `threshold`, the run's success threshold."""
    return f"status == succeeded and reward >= {threshold:g}"
