"""Coding-agent CLIs, unchanged, against the gateway serving the long-context model:
Codex (`codex exec`, the Responses API) and Claude Code (`claude -p`, the Messages API).
The task need not succeed (the model is tiny); every call must be answered without a
client error, recorded with its token ids under the CLI's session, and re-scored within
1e-4. Neither CLI may reach beyond loopback: each gets only the gateway's URL, a proxy
that leads nowhere for anything else, and its telemetry and updates turned off.

Needs `make clis` (the pinned CLIs in .npm-tools/); skipped without them."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.needs import missing
from tracerl.stack import LocalStack

from .longctx import (  # noqa: F401
    ROOT,
    all_spans,
    check_recorded,
    long_model_dir,
    long_stack,
    summary,
    worst_rescore,
)

pytestmark = [pytest.mark.slow, pytest.mark.clis]

BIN = ROOT / ".npm-tools" / "node_modules" / ".bin"
TASK = "Create hello.txt containing the word hello."


def _cli(name: str) -> Path:
    path = BIN / name
    if not path.exists():
        missing("clis", f"{name} is not installed: run `make clis`")
    return path


def _env(home: Path, **extra: str) -> dict[str, str]:
    """A closed environment: its own HOME, no proxy but a dead one for anything not local."""
    home.mkdir(parents=True, exist_ok=True)
    dead = "http://127.0.0.1:9"  # nothing listens on the discard port: off-box calls fail
    keep = {k: os.environ[k] for k in ("PATH", "LANG", "TERM") if k in os.environ}
    return {
        **keep,
        "HOME": str(home),
        "HTTPS_PROXY": dead,
        "HTTP_PROXY": dead,
        "ALL_PROXY": dead,
        "NO_PROXY": "127.0.0.1,localhost",
        **extra,
    }


def _run(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    cwd.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        argv,
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=420,
        stdin=subprocess.DEVNULL,
    )
    print(done.stdout[-3000:], done.stderr[-3000:])
    return done


def _check(name: str, stack: LocalStack, model_dir: Path, output: str) -> None:
    for refusal in ("API Error: 4", 'ERROR: {"error"', "unexpected status 4"):
        assert refusal not in output, f"{name} got a client error"
    spans = all_spans(stack)
    print(summary(name, spans))
    check_recorded(spans)
    assert len(stack.store.rollouts()) >= 1
    assert worst_rescore(model_dir, spans) <= 1e-4


def test_codex_exec(long_stack: LocalStack, long_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    codex = _cli("codex")
    codex_home = tmp_path / "codex-home"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(
        'model = "policy"\n'
        'model_provider = "tracerl"\n'
        "[model_providers.tracerl]\n"
        'name = "tracerl"\n'
        f'base_url = "{long_stack.url}/v1"\n'
        'wire_api = "responses"\n'
        'env_key = "TRACERL_CLI_KEY"\n'
        "request_max_retries = 0\n"
        "stream_max_retries = 0\n"
        "[analytics]\n"
        "enabled = false\n"
    )
    env = _env(tmp_path / "home", CODEX_HOME=str(codex_home), TRACERL_CLI_KEY="codex")
    argv = [str(codex), "exec", "--skip-git-repo-check", TASK]
    done = _run(argv, env, tmp_path / "work")
    _check("codex", long_stack, long_model_dir, done.stdout + done.stderr)


def test_claude_code(long_stack: LocalStack, long_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    claude = _cli("claude")
    env = _env(
        tmp_path / "home",
        ANTHROPIC_BASE_URL=long_stack.url,
        ANTHROPIC_API_KEY="claude",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        DISABLE_TELEMETRY="1",
        DISABLE_AUTOUPDATER="1",
        DISABLE_ERROR_REPORTING="1",
        DISABLE_BUG_COMMAND="1",
    )
    done = _run([str(claude), "-p", TASK, "--max-turns", "3"], env, tmp_path / "work")
    _check("claude", long_stack, long_model_dir, done.stdout + done.stderr)
