"""`tracerl serve`: the gateway + store service as its own process, for runners elsewhere."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console

from tracerl.entrypoints import quiet_model_loading
from tracerl.entrypoints.config import ServeCommand
from tracerl.pipeline.run import start_roles_stack
from tracerl.roles import remote_roles


def main(cfg: ServeCommand, console: Console) -> None:
    """Serve every policy and the store API until interrupted."""
    quiet_model_loading()
    try:
        specs = cfg.policies("serve")
    except ValueError as e:
        raise SystemExit(str(e)) from None
    Path(cfg.store).parent.mkdir(parents=True, exist_ok=True)
    remote = remote_roles(cfg.roles)
    stack = start_roles_stack(
        specs, remote, cfg.store, cfg.engine, cfg.host, cfg.port, gateway=cfg.gateway
    )
    console.print(f"gateway: {stack.url}/v1 · per rollout: {stack.url}/rollouts/<id>/v1")
    names = ", ".join(stack.gateway.names)
    console.print(f"models: {names} · store API: {stack.url}/store · file {cfg.store}")
    try:
        while stack.server.thread.is_alive():
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        stack.close()
