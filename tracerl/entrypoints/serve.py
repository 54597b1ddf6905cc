"""`tracerl serve`: the gateway + store service as its own process, for runners elsewhere."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console

from tracerl.auth import Keys, is_loopback
from tracerl.entrypoints import quiet_model_loading
from tracerl.entrypoints.config import ServeCommand
from tracerl.roles import remote_roles
from tracerl.stack import LocalStack, start_multi_stack


def main(cfg: ServeCommand, console: Console) -> None:
    """Serve every policy and the store API until interrupted."""
    keys = _keys(cfg)
    quiet_model_loading()
    try:
        specs = cfg.policies("serve")
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if "://" not in cfg.store:
        Path(cfg.store).parent.mkdir(parents=True, exist_ok=True)
    models: dict[str, str | Path] = {p.name: p.model for p in specs}
    roles = {role: p.name for p in specs for role in p.roles}
    formats = {role: fmt for p in specs for role, fmt in p.formats.items()}
    remote = remote_roles(cfg.roles, cfg.reply_format())
    stack = start_multi_stack(
        models,
        roles,
        cfg.store,
        cfg.engine,
        cfg.host,
        cfg.port,
        remote,
        keys,
        cfg.limits,
        gateway_cfg=cfg.gateway,
        formats=formats,
    )
    console.print(f"gateway: {stack.url}/v1 · per rollout: {stack.url}/rollouts/<id>/v1")
    names = ", ".join(stack.gateway.names)
    console.print(f"models: {names} · store API: {stack.url}/store · file {cfg.store}")
    for line in _model_lines(stack, models):
        console.print(line, highlight=False)
    console.print(_keys_line(keys))
    try:
        while stack.server.thread.is_alive():
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        stack.close()


def _model_lines(stack: LocalStack, models: dict[str, str | Path]) -> list[str]:
    """Each local role's context limit and how its tools are rendered, and what a converted
    model's weights are (its card's note: e.g. a quantized GGUF's, dequantized)."""
    from tracerl.models.gguf import read_card

    lines = []
    for name, served in stack.gateway.models.items():
        rendering = served.prompts.tool_rendering
        why = " (its chat template has no tool support)" if rendering != "template" else ""
        lines.append(f"{name}: {served.engine.max_context:,} positions · tools: {rendering}{why}")
    for path in dict.fromkeys(str(p) for p in models.values()):
        card = read_card(Path(path))
        if card is not None:
            lines.append(f"{path}: {card.note}")
    return lines


def _keys(cfg: ServeCommand) -> Keys:
    """The service's keys; refuses to listen beyond loopback without them."""
    try:
        keys = Keys.load(cfg.keys_file)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if not keys.enabled and not is_loopback(cfg.host):
        raise SystemExit(
            f"refusing to serve on {cfg.host} without keys: anyone who reaches it could read "
            "every trace and steer training. Set TRACERL_ADMIN_KEY (and TRACERL_RUNNER_KEYS="
            "'runner-id=key,...') in the environment or pass --keys_file FILE, or serve on "
            "127.0.0.1."
        )
    return keys


def _keys_line(keys: Keys) -> str:
    """What the console says of the keys (never a key itself)."""
    if not keys.enabled:
        return "keys: none (loopback only; every route open)"
    admin = "an admin key" if keys.admin else "no admin key"
    return f"keys: {admin}, runner keys for {', '.join(sorted(keys.runners)) or 'no runner'}"
