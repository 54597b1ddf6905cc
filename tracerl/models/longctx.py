"""A long-context test model: the tiny Llama with 32k RoPE positions and an 8k BPE vocabulary.

Coding-agent CLIs and agent frameworks send prompts of tens of thousands of characters
(instructions, tool schemas, code); the demo model's 512 positions and ~400-token vocabulary
cannot hold one. This model can: its tokenizer is trained on text of the same kinds (the
package's own source and docs, which are English and code, plus tool JSON schemas written
here), so such a prompt takes a few thousand tokens, and RoPE positions go to 32,768. It is
trained only to answer briefly (sometimes after one tool call): it answers in protocol, not
sensibly, which is what gateway tests need.

Built locally (nothing is downloaded) and cached under $TRACERL_HOME/models/.
`python -m tracerl.models.longctx [--rebuild]` builds it and prints its directory.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tracerl.models.sft import Demo, SftConfig, sft
from tracerl.models.template import render_chat
from tracerl.models.tiny import TinyModelConfig, build_tiny_model

__all__ = [
    "LONG_CONTEXT",
    "brief_demos",
    "build_long_context_model",
    "corpus",
    "ensure_long_context_model",
]

LONG_CONTEXT = TinyModelConfig(
    vocab_size=8192,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    intermediate_size=128,
    max_position=32768,
)
"""Small enough that a 5k-token prompt is prefilled in well under a second on a CPU core."""

_PACKAGE = Path(__file__).resolve().parents[1]
_WORDS = [
    "read",
    "write",
    "edit",
    "file",
    "path",
    "command",
    "shell",
    "run",
    "test",
    "search",
    "list",
    "directory",
    "pattern",
    "query",
    "url",
    "content",
    "limit",
    "offset",
    "timeout",
    "description",
    "replace",
    "string",
    "line",
    "number",
    "output",
    "error",
]


def _tool_schema(rng: random.Random) -> dict[str, Any]:
    """A function tool of the shape agent frameworks send (name, description, JSON schema)."""
    names = rng.sample(_WORDS, 3)
    props = {
        n: {"type": rng.choice(["string", "integer", "boolean"]), "description": f"The {n} to use."}
        for n in names[1:]
    }
    return {
        "type": "function",
        "function": {
            "name": "_".join(names[:2]),
            "description": f"{names[0].title()} the {names[1]}; returns the {names[2]}.",
            "parameters": {"type": "object", "properties": props, "required": names[1:2]},
        },
    }


def corpus(seed: int = 0) -> Iterator[str]:
    """The tokenizer's training texts: the package's source and docs (English and code), tool
    schemas as JSON, and chat-template renders of conversations with tools and tool calls."""
    for path in sorted(_PACKAGE.rglob("*")):
        if path.suffix in (".py", ".md") and path.is_file():
            yield path.read_text(errors="replace")
    rng = random.Random(seed)
    for _ in range(2000):
        tools = [_tool_schema(rng) for _ in range(3)]
        yield json.dumps(tools, indent=rng.choice([None, 2]))
        call = {"name": tools[0]["function"]["name"], "arguments": {"path": "src/app.py"}}
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a coding agent. Use the tools."},
            {"role": "user", "content": "Fix the failing test in src/app.py."},
            {"role": "assistant", "content": "", "tool_calls": [{"function": call}]},
            {"role": "tool", "content": "def main():\n    return 0\n"},
        ]
        yield render_chat(messages, tools)


def brief_demos(n: int, seed: int = 0) -> list[Demo]:
    """Conversations whose assistant answers in a few tokens, half of them after one tool
    call: a random-init model would sample thousands of tokens before ending a reply."""
    rng = random.Random(seed)
    demos = []
    for _ in range(n):
        tools = [_tool_schema(rng) for _ in range(rng.randint(1, 3))]
        fn = tools[0]["function"]
        user = (
            f"Please {rng.choice(_WORDS)} the {rng.choice(_WORDS)} in src/{rng.choice(_WORDS)}.py."
        )
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a coding agent. Use the tools."},
            {"role": "user", "content": user},
        ]
        if rng.random() < 0.5:
            args = {k: "src/app.py" for k in list(fn["parameters"]["properties"])[:1]}
            call = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
            messages += [
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": rng.choice(["ok", "0", "def main(): pass"])},
            ]
        messages.append({"role": "assistant", "content": rng.choice(["Done.", "OK.", "Fixed."])})
        demos.append(Demo(messages=messages, tools=tools))
    return demos


def build_long_context_model(out: str | Path, cfg: TinyModelConfig = LONG_CONTEXT) -> Path:
    """Build the long-context model into `out`: the tokenizer, the model, and a short SFT on
    brief_demos (about two minutes on a CPU)."""
    out = Path(out)
    base = out.with_name(out.name + "-base")
    build_tiny_model(base, corpus(cfg.seed), cfg)
    steps = SftConfig(steps=300, batch_size=16, max_len=256, seed=cfg.seed, progress=False)
    sft(base, brief_demos(2000, cfg.seed), out, steps)
    shutil.rmtree(base, ignore_errors=True)
    return out


def ensure_long_context_model(rebuild: bool = False) -> Path:
    """The long-context model, built on first use and cached under $TRACERL_HOME/models/."""
    from tracerl.cache import build_lock, cache_dir

    cfg = LONG_CONTEXT
    name = f"long-context-v{cfg.vocab_size}-p{cfg.max_position}-h{cfg.hidden_size}-seed{cfg.seed}"
    out = cache_dir() / "models" / name
    if not rebuild and (out / "config.json").exists():
        return out
    # One process builds; another that needs it meanwhile (a test worker, a demo) waits for
    # it rather than building it a second time beside it.
    with build_lock(name):
        if rebuild or not (out / "config.json").exists():
            # Built beside and renamed into place: a half-built model is never found as cached.
            tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
            build_long_context_model(tmp, cfg)
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rebuild", action="store_true", help="build again even if cached")
    print(ensure_long_context_model(parser.parse_args().rebuild))


if __name__ == "__main__":
    main()
