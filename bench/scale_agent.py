"""bench/scale.py's agent: the calculator example, unchanged, with a 0.5 s tool (a log-normal
with a tiny spread): its rollouts wait on the tool, as agents calling real tools do."""

from __future__ import annotations

import os

from tracerl.examples import example_file
from tracerl.runner import load_file

os.environ["CALCULATOR_TOOL_LATENCY"] = "0.5,0.01"
run = load_file(example_file("calculator", "agent")).run
