"""What a test needs from the machine, and what happens when it is missing.

A test that needs a part of the machine (PostgreSQL, Ray in namespaces, vLLM's environment,
the system chromium, bubblewrap, the coding-agent CLIs, the converted SmolLM2) skips where
the part is missing, saying how to get it. Where the run says the part must be there —
`TRACERL_REQUIRE=all` (what `make test` and CI set), or a comma list such as
`TRACERL_REQUIRE=postgres,ray`, or the older `TRACERL_REQUIRE_VLLM=1` — the same absence is
a failure, so a suite that silently tested less cannot pass.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

__all__ = ["PARTS", "missing", "required"]

PARTS = ("postgres", "ray", "vllm", "browser", "sandbox", "clis", "smollm2")
"""The parts of the machine tests may need."""


def required(part: str) -> bool:
    """Whether this run must have `part` (TRACERL_REQUIRE names it, or says all)."""
    assert part in PARTS, part
    named = {p.strip() for p in os.environ.get("TRACERL_REQUIRE", "").split(",") if p.strip()}
    legacy = os.environ.get(f"TRACERL_REQUIRE_{part.upper()}")
    return "all" in named or part in named or bool(legacy)


def missing(part: str, reason: str) -> NoReturn:
    """Skip the test, or fail it where the run requires `part`."""
    if required(part):
        pytest.fail(f"{part} is required here (TRACERL_REQUIRE) but unavailable: {reason}")
    pytest.skip(reason)
