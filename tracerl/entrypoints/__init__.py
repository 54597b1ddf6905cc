"""One thin entry point per command and process kind: `serve` (gateway + store service),
`runner`, `train` (the orchestrator), `eval`, `demo`, `sft`, `traces`.

Each module `tracerl.entrypoints.<command>` holds `main(cfg)`: it wires the parts that own
the work (stack, runner, evaluate, pipeline, traces, models) and prints what a person needs.
The commands' typed configs live apart, in `config` (and with their owners: TrainConfig,
DemoConfig), and import nothing heavy, so `tracerl --help` reads them all in a fraction of
a second; `tracerl.cli` imports an entry point, with torch and the servers, only to run it.
"""

from __future__ import annotations


def quiet_model_loading() -> None:
    """Our own progress bars say what is happening; transformers' loading bars are noise."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
