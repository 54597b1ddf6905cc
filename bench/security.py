"""The doors, checked: every role against every sensitive call, then a bounded fuzz.

Starts the gateway + store (a scripted engine on a tiny tokenizer built locally) with an
admin key and two runner keys, and calls each operation of the table below as each role:
nobody (no key), a forged key, the agent key of a rollout runner w1 holds, runner w1's key,
the admin key; each call in a world of its own (rollout A held by w1, B by w2). Then it
fuzzes every operation of the OpenAPI document with schemathesis (bodies included,
positive and negative cases), with keys on (as the admin) and off, and counts cases,
server errors (5xx) and responses that break the document. Prints the table and the
counts; the last line is one JSON object.

    .venv/bin/python bench/security.py [--max-examples 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tracerl.auth import Keys
from tracerl.gateway import Gateway, ServedModel, create_app
from tracerl.limits import Limits
from tracerl.server import BackgroundServer, serve_in_thread
from tracerl.store.sqlite import SqliteStore
from tracerl.types import Generation, RolloutStatus, SamplingParams, Task

KEYS = Keys(admin="admin-key-for-the-bench", runners={"w1": "runner-key-w1", "w2": "runner-key-w2"})
ROLES = ("nobody", "forged", "agent", "runner", "admin")
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


class EchoEngine:
    """Answers every prompt with the same few tokens, after `delay_s`; counts cancels."""

    def __init__(self, tokenizer: Any, delay_s: float = 0.0, max_context: int = 512) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = [tokenizer.eos_token_id or 0]
        self.max_context = max_context
        self.policy_version = 0
        self.delay_s = delay_s
        self.started = 0
        """generate calls begun."""
        self.cancelled = 0
        """generate calls cancelled before their answer (their client left)."""

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        self.started += 1
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        ids = [*self.tokenizer.encode("4", add_special_tokens=False), *self.eos_token_ids]
        ids = ids[: params.max_tokens]
        return Generation(
            completion_ids=ids, logprobs=[-0.1] * len(ids), finish_reason="stop", policy_version=0
        )

    def load_state_dict(self, state: dict, version: int) -> None:
        self.policy_version = version

    def close(self) -> None:
        pass


@dataclass
class Service:
    """The gateway + store on loopback, and what the checks need of it."""

    server: BackgroundServer
    """The HTTP server."""
    store: SqliteStore
    """The store it serves (used directly to set worlds up)."""
    engine: EchoEngine
    """The scripted engine."""
    keys: Keys
    """Its keys (disabled: every route open)."""

    @property
    def url(self) -> str:
        """Base URL."""
        return self.server.url

    def close(self) -> None:
        """Stop the server, then the store."""
        self.server.stop()
        self.store.close()


def start_service(
    model_dir: Path, keys: Keys, limits: Limits | None = None, delay_s: float = 0.0
) -> Service:
    """Serve an EchoEngine with the tokenizer of `model_dir` behind `keys` and `limits`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = EchoEngine(tokenizer, delay_s)
    store = SqliteStore(":memory:")
    store.add_tasks([Task(id="t", input={"question": "2+2"}, answer=4)])
    gateway = Gateway(store, {"policy": ServedModel("policy", engine, tokenizer)})
    server = serve_in_thread(create_app(gateway, keys=keys, limits=limits))
    return Service(server, store, engine, keys)


def build_tokenizer_dir(out: Path) -> Path:
    """A tiny model dir (its tokenizer is what the gateway needs), built locally."""
    from tracerl.examples import example_module
    from tracerl.models.template import render_chat
    from tracerl.models.tiny import TinyModelConfig, build_tiny_model

    demos = example_module("calculator", "expert").demonstrations(100, seed=7)
    texts = [render_chat(d["messages"], d["tools"]) for d in demos]
    return build_tiny_model(out, texts, TinyModelConfig(hidden_size=32, num_layers=1, seed=0))


# -- the table ----------------------------------------------------------------------------


@dataclass
class World:
    """Two running rollouts: A held by runner w1, B by runner w2."""

    a: str
    """Rollout held by w1 (the agent key is A's)."""
    b: str
    """Rollout held by w2."""
    agent_key: str
    """The agent key of A's attempt."""


def new_world(service: Service) -> World:
    """Fresh rollouts for one call, so no call depends on another's effects."""
    store = service.store
    store.enqueue(["t", "t"])
    (a,) = store.claim("w1", 1, 600.0)
    (b,) = store.claim("w2", 1, 600.0)
    return World(a.id, b.id, service.keys.agent_key(a.id, a.attempt))


def _span(rollout_id: str) -> list[dict[str, Any]]:
    return [
        {"id": f"forged-{time.time_ns()}", "rollout_id": rollout_id, "attempt": 1, "seq": 99,
         "role": "policy", "policy_version": 0, "prompt_ids": [1], "completion_ids": [2],
         "logprobs": [-0.1], "messages": [], "response": {}, "latency_s": 0.0}
    ]  # fmt: skip


def _chat(path: str) -> Callable[[httpx.Client, World], httpx.Response]:
    return lambda h, w: h.post(path.format(w=w), json={"model": "policy", "messages": MESSAGES})


def _ended(h: httpx.Client, w: World, store: SqliteStore) -> httpx.Response:
    store.finish(w.a, 1, RolloutStatus.succeeded, "4", 1.0)
    return _chat("/rollouts/{w.a}/v1/chat/completions")(h, w)


Operation = Callable[[httpx.Client, World], httpx.Response]

OPERATIONS: dict[str, Operation] = {
    "health": lambda h, w: h.get("/health"),
    "read rollouts": lambda h, w: h.get("/store/rollouts"),
    "read spans": lambda h, w: h.get(f"/store/rollouts/{w.a}/spans"),
    "model call, own rollout": _chat("/rollouts/{w.a}/v1/chat/completions"),
    "model call, other rollout": _chat("/rollouts/{w.b}/v1/chat/completions"),
    "model call, unattributed": _chat("/v1/chat/completions"),
    "reward own rollout": lambda h, w: h.post(f"/rollouts/{w.a}/reward", json={"value": 1}),
    "reward other rollout": lambda h, w: h.post(f"/rollouts/{w.b}/reward", json={"value": 1}),
    "forge a span": lambda h, w: h.post("/store/spans", json=_span(w.a)),
    "claim": lambda h, w: h.post("/store/claim", json={"runner_id": "w1"}),
    "heartbeat own lease": lambda h, w: h.post(
        f"/store/rollouts/{w.a}/heartbeat", json={"attempt": 1}
    ),
    "extend other's lease": lambda h, w: h.post(
        f"/store/rollouts/{w.b}/heartbeat", json={"attempt": 1}
    ),
    "finish own rollout": lambda h, w: h.post(
        f"/store/rollouts/{w.a}/finish", json={"attempt": 1, "status": "succeeded"}
    ),
    "finish other's rollout": lambda h, w: h.post(
        f"/store/rollouts/{w.b}/finish", json={"attempt": 1, "status": "failed"}
    ),
    "publish version": lambda h, w: h.post(
        "/store/versions", json={"role": "policy", "version": time.time_ns() % 2**30, "path": "p"}
    ),
    "requeue_expired": lambda h, w: h.post("/store/requeue_expired", json={}),
    "enqueue": lambda h, w: h.post("/store/rollouts", json={"task_ids": ["t"]}),
}
ENDED = "model call, attempt ended"

_ = 401  # nobody and forged keys: every guarded call is a 401
EXPECTED: dict[str, tuple[int, int, int, int, int]] = {
    # operation:                  nobody forged agent runner admin
    "health":                     (200, 200, 200, 200, 200),
    "read rollouts":              (_,   _,   403, 403, 200),
    "read spans":                 (_,   _,   403, 403, 200),
    "model call, own rollout":    (_,   _,   200, 403, 200),
    "model call, other rollout":  (_,   _,   403, 403, 200),
    "model call, unattributed":   (_,   _,   403, 403, 200),
    "reward own rollout":         (_,   _,   200, 403, 200),
    "reward other rollout":       (_,   _,   403, 403, 200),
    "forge a span":               (_,   _,   403, 403, 204),
    "claim":                      (_,   _,   403, 200, 200),
    "heartbeat own lease":        (_,   _,   403, 200, 200),
    "extend other's lease":       (_,   _,   403, 403, 200),
    "finish own rollout":         (_,   _,   403, 200, 200),
    "finish other's rollout":     (_,   _,   403, 403, 200),
    "publish version":            (_,   _,   403, 403, 204),
    "requeue_expired":            (_,   _,   403, 403, 200),
    "enqueue":                    (_,   _,   403, 403, 200),
    ENDED:                        (_,   _,   401, 403, 409),
}  # fmt: skip
"""Expected status of each operation called as each role (ROLES order)."""


@dataclass(frozen=True)
class Row:
    """One call of the table."""

    operation: str
    """What was attempted."""
    role: str
    """Who attempted it."""
    expected: int
    """The status it must get."""
    got: int
    """The status it got."""


def headers_of(role: str, world: World, keys: Keys) -> dict[str, str]:
    """The key each role presents (none for nobody)."""
    key = {
        "nobody": None,
        "forged": "ak.forged.1.0000",
        "agent": world.agent_key,
        "runner": keys.runners.get("w1"),
        "admin": keys.admin,
    }[role]
    return {"authorization": f"Bearer {key}"} if key else {}


def check(service: Service, operation: str, role: str) -> Row:
    """Call one operation as one role in a fresh world."""
    world = new_world(service)
    with httpx.Client(
        base_url=service.url, headers=headers_of(role, world, service.keys), timeout=30
    ) as http:
        if operation == ENDED:
            resp = _ended(http, world, service.store)
        else:
            resp = OPERATIONS[operation](http, world)
    return Row(operation, role, EXPECTED[operation][ROLES.index(role)], resp.status_code)


def audit(service: Service) -> list[Row]:
    """Every operation of the table as every role."""
    return [check(service, op, role) for op in EXPECTED for role in ROLES]


# -- the fuzz -----------------------------------------------------------------------------


@dataclass
class FuzzReport:
    """What one schemathesis run found."""

    cases: int = 0
    """Requests sent."""
    server_errors: int = 0
    """Unique failures that are a 5xx."""
    violations: list[str] = field(default_factory=list)
    """Each unique failure of any check (`--checks all`): a 5xx, a response outside the
    document, a request the document allows that is refused, one it forbids that is
    served, an `Allow` header that does not list the path's methods, ..."""


PHASES = ("coverage", "fuzzing")
"""schemathesis's phases the fuzz runs by default: boundary cases of every parameter and
body field, wrong methods and OPTIONS (coverage), then drawn cases (fuzzing)."""


def fuzz(
    url: str,
    headers: dict[str, str],
    max_examples: int,
    budget_s: float,
    phases: tuple[str, ...] = PHASES,
) -> FuzzReport:
    """Every check on every operation of `url`'s OpenAPI document, as `schemathesis run
    --checks all` does, in `phases` (examples are run too; the stateful phase is not: no
    links are declared, and the auth table above chains what it would). Seeded, so a run
    sends the same cases; stopped after `budget_s` seconds if it is not done by then."""
    import schemathesis
    from schemathesis.config import SchemathesisConfig
    from schemathesis.core.failures import ServerError
    from schemathesis.engine import events, from_schema
    from schemathesis.engine.statistic import Statistic

    switches = {name: {"enabled": name in phases} for name in PHASES}
    config = SchemathesisConfig.from_dict(
        {
            "seed": 7,
            "headers": headers,
            "request-timeout": 30,
            "continue-on-failure": True,  # every failure of an operation, not its first
            "generation": {"max-examples": max_examples},
            # No max-time: with one the fuzzing phase runs until it, not max_examples.
            "phases": {**switches, "stateful": {"enabled": False}},
            "checks": {"enabled": True},
        }
    )
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", config=config)
    stats, deadline = Statistic(), time.monotonic() + budget_s
    stream = from_schema(schema).execute()
    for event in stream:
        if isinstance(event, events.ScenarioFinished):
            stats.on_scenario_finished(event.recorder)
        if time.monotonic() > deadline:
            stream.stop()  # the next event is the last
    report = FuzzReport(cases=stats.total_cases)
    for label, groups in sorted(stats.failures.items()):
        for group in groups.values():
            answer = group.response
            said = f"{answer.status_code} {answer.text_lossy()[:160]}" if answer else "no answer"
            for failure in group.failures:
                report.server_errors += isinstance(failure, ServerError)
                report.violations.append(f"{label}: {failure.title} ({said})")
    return report


def main() -> None:
    """Run the table, then the fuzz with keys on and off; print both, JSON last."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-examples", type=int, default=8)
    parser.add_argument("--budget-s", type=float, default=50.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tokenizer_dir(Path(tmp))
        service = start_service(model_dir, KEYS)
        try:
            rows = audit(service)
            locked = fuzz(service.url, headers_of("admin", new_world(service), KEYS),
                          args.max_examples, args.budget_s)  # fmt: skip
        finally:
            service.close()
        service = start_service(model_dir, Keys())
        try:
            opened = fuzz(service.url, {}, args.max_examples, args.budget_s)
        finally:
            service.close()
    passed = sum(r.got == r.expected for r in rows)
    print(f"{'operation':28} " + " ".join(f"{r:>8}" for r in ROLES))
    for op in EXPECTED:
        cells = [r for r in rows if r.operation == op]
        text = [f"{r.got}" if r.got == r.expected else f"{r.got}!={r.expected}" for r in cells]
        print(f"{op:28} " + " ".join(f"{t:>8}" for t in text))
    print(f"auth checks passed: {passed}/{len(rows)}")
    for name, rep in (("keys on", locked), ("keys off", opened)):
        print(f"fuzz ({name}): {rep.cases} cases, {rep.server_errors} 5xx, "
              f"{len(rep.violations)} schema violations")  # fmt: skip
        for v in rep.violations[:10]:
            print("  ", v)
    print(json.dumps({
        "auth_passed": passed, "auth_total": len(rows),
        "fuzz_cases": locked.cases + opened.cases,
        "fuzz_5xx": locked.server_errors + opened.server_errors,
        "fuzz_violations": len(locked.violations) + len(opened.violations),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
