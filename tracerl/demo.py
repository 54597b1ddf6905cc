"""The calculator demo's pieces: where the example lives and its warm-started tiny model.

The model is built once and cached: expert demonstrations from the example's own code,
a tokenizer and a random-init tiny Llama trained on their text, then a short supervised
warm start that leaves the agent weak (roughly 20-40% success) so RL has room to work.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from tracerl.models.sft import Demo, SftConfig, sft
from tracerl.models.template import render_chat
from tracerl.models.tiny import TinyModelConfig, build_tiny_model


def cache_dir() -> Path:
    """Where built models are kept: $TRACERL_HOME, else ~/.cache/tracerl."""
    return Path(os.environ.get("TRACERL_HOME", Path.home() / ".cache" / "tracerl"))


def example_dir(name: str = "calculator") -> Path:
    """The example folder, next to the package in a checkout, else under the cwd."""
    for root in (Path(__file__).resolve().parents[1], Path.cwd()):
        path = root / "examples" / name
        if path.is_dir():
            return path
    raise FileNotFoundError(f"examples/{name} not found next to tracerl or in {Path.cwd()}")


def example_module(name: str, module: str) -> ModuleType:
    """Import examples/<name>/<module>.py by path (examples are not a package)."""
    path = example_dir(name) / f"{module}.py"
    key = f"tracerl_example_{name}_{module}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    sys.modules[key] = mod
    spec.loader.exec_module(mod)
    return mod


def calculator_demos(n: int, seed: int) -> list[Demo]:
    """Expert demonstrations written by the example's scripted expert."""
    expert = example_module("calculator", "expert")
    return [Demo.model_validate(d) for d in expert.demonstrations(n, seed=seed)]


def ensure_calculator_model(
    steps: int | None = None, seed: int = 0, rebuild: bool = False, n_demos: int = 4000
) -> Path:
    """The warm-started calculator model, built and cached on first use."""
    # By default SFT stops at a calibrated loss (weak but not hopeless, ~25-35% success at
    # T=1); an explicit step count trains exactly that many steps.
    cfg = (
        SftConfig(seed=seed) if steps is None else SftConfig(steps=steps, seed=seed, stop_loss=None)
    )
    stop = "none" if cfg.stop_loss is None else f"{cfg.stop_loss:g}"
    out = cache_dir() / "models" / f"calculator-tiny-sft{cfg.steps}-stop{stop}-seed{seed}"
    if (out / "config.json").exists() and not rebuild:
        return out
    demos = calculator_demos(n_demos, seed=seed + 1000)
    texts = [render_chat(d.messages, d.tools) for d in demos]
    base = cache_dir() / "models" / f"calculator-tiny-base-seed{seed}"
    build_tiny_model(base, texts, TinyModelConfig(seed=seed))
    sft(base, demos, out, cfg)
    return out
