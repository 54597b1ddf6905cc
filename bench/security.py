"""The doors, checked: every role against every sensitive call, what a web page, an
anonymous upload and a long prompt can do, then a bounded fuzz.

Starts the gateway + store (a scripted engine on a tiny tokenizer built locally) with an
admin key and two runner keys, and calls each operation of the table below as each role:
nobody (no key), a forged key, the agent key of a rollout runner w1 holds, runner w1's key,
the admin key; each call in a world of its own (rollout A held by w1, B by w2). Then the
doors (issue 28, items 10-13): a web page's simple cross-origin POSTs to a keyless gateway,
store and dashboard (csrf_blocked), reads under a rebound Host name (rebinding_blocked),
six anonymous 60 MB uploads to the keyed service (preauth_rss_growth_mb: the server runs in
this process), a 10 MB message (long_prompt_reject_s), a 1e300-second lease
(lease_bound_enforced). Then it runs schemathesis with every check on every operation of
the OpenAPI document (bodies included, positive and negative cases), with keys on (as the
admin) and off, and counts cases, server errors (5xx) and failures. Prints it all; the last
line is one JSON object.

    .venv/bin/python bench/security.py [--max-examples 8]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

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


# -- what a web page, an anonymous upload and a long prompt may do (issue 28, 10-13) ------

EVIL = "http://evil.example"
"""The origin of a web page the user happens to have open."""
UPLOADERS = 6
"""Anonymous clients uploading at once."""
UPLOAD_MB = 60
"""What each announces, and sends slowly (1 MB every 50 ms) until it is answered."""
LONG_PROMPT_BYTES = 10 * 2**20
"""A one-word user message of this many bytes (BPE's worst case)."""


@dataclass(frozen=True)
class DoorsReport:
    """What got past the doors."""

    csrf_blocked: bool
    """A page's simple cross-origin POSTs (text/plain, its Origin) to a keyless gateway,
    store and dashboard were all refused, and nothing was published or sent."""
    rebinding_blocked: bool
    """Reads under a rebound Host name (DNS rebinding) were refused while no keys are set."""
    preauth_rss_growth_mb: float
    """How much the server's memory grew while anonymous clients uploaded to it (keys on)."""
    long_prompt_reject_s: float
    """Seconds until a 10 MB message got its context_length_exceeded (inf: it did not)."""
    lease_bound_enforced: bool
    """A claim asking for a lease of 1e300 seconds got a 422."""

    @property
    def passed(self) -> bool:
        """Every door held (memory: under 50 MB for the six uploads; refusal under 1 s)."""
        return (
            self.csrf_blocked
            and self.rebinding_blocked
            and self.preauth_rss_growth_mb < 50
            and self.long_prompt_reject_s < 1.0
            and self.lease_bound_enforced
        )


def csrf_blocked(keyless: Service, dashboard_url: str, runs: Path) -> bool:
    """A page's "simple" requests (no CORS preflight: text/plain, or a body of no type)
    are refused and change nothing: no version published, no command sent to the run."""
    from tracerl.pipeline.control_files import read_commands

    version = orjson.dumps({"version": 8, "path": "/any/path", "role": "policy"})
    chat = orjson.dumps({"model": "policy", "messages": MESSAGES})
    pause = orjson.dumps({"op": "pause"})
    answers = []
    for page in ({"content-type": "text/plain", "origin": EVIL}, {"origin": EVIL}):
        answers += [
            httpx.post(f"{keyless.url}/store/versions", content=version, headers=page),
            httpx.post(f"{keyless.url}/v1/chat/completions", content=chat, headers=page),
            httpx.post(f"{dashboard_url}/api/runs/r/control", content=pause, headers=page),
        ]
    served = [r for r in answers if r.status_code < 400]
    published = keyless.store.latest_version("policy") is not None
    return not served and not published and not read_commands(runs / "r")


def rebinding_blocked(keyless: Service, dashboard_url: str) -> bool:
    """Reads under the attacker's name for 127.0.0.1 are refused (no keys set)."""
    answers = []
    for url, path in ((keyless.url, "/store/rollouts"), (dashboard_url, "/api/runs")):
        port = url.rsplit(":", 1)[1]
        answers.append(httpx.get(f"{url}{path}", headers={"host": f"evil.example:{port}"}))
    return all(r.status_code == 400 for r in answers)


def preauth_rss_growth_mb(keyed: Service) -> float:
    """Peak growth of this process's memory (the server runs in it) while UPLOADERS anonymous
    clients each announce UPLOAD_MB and send it slowly to a route that needs a key."""
    before = _rss_mb()
    peak, done = before, threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _rss_mb())
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    uploads = [threading.Thread(target=_upload, args=(keyed.url,)) for _ in range(UPLOADERS)]
    for t in uploads:
        t.start()
    for t in uploads:
        t.join()
    time.sleep(0.5)  # what the server still holds once the uploads are answered
    done.set()
    sampler.join()
    return round(peak - before, 1)


def _upload(url: str) -> None:
    """POST UPLOAD_MB to /store/spans without a key, 1 MB at a time, until answered."""
    host, port = url.removeprefix("http://").split(":")
    head = (
        f"POST /store/spans HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {UPLOAD_MB * 2**20}\r\n\r\n"
    )
    chunk = b" " * 2**20
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.setblocking(True)
        try:
            conn.sendall(head.encode())
            for _ in range(UPLOAD_MB):
                conn.sendall(chunk)
                time.sleep(0.05)
        except OSError:  # answered and closed: the rest is not read
            pass
        with contextlib.suppress(OSError):
            conn.recv(4096)


def _rss_mb() -> float:
    """This process's resident memory, in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def long_prompt_reject_s(keyless: Service) -> float:
    """Seconds from sending a 10 MB message to its context_length_exceeded (inf if another
    answer came)."""
    body = orjson.dumps(
        {"model": "policy", "messages": [{"role": "user", "content": "x" * LONG_PROMPT_BYTES}]}
    )
    started = time.perf_counter()
    resp = httpx.post(
        f"{keyless.url}/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=600,
    )
    elapsed = time.perf_counter() - started
    refused = resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded"
    return round(elapsed, 3) if refused else math.inf


def lease_bound_enforced(keyed: Service) -> bool:
    """A claim of a 1e300-second lease (a dead runner's rollout never re-queued) is a 422."""
    headers = {"authorization": f"Bearer {keyed.keys.admin}"}
    body = {"runner_id": "w1", "n": 1, "lease_s": 1e300}
    return httpx.post(f"{keyed.url}/store/claim", json=body, headers=headers).status_code == 422


def dashboard_over(runs: Path) -> BackgroundServer:
    """The dashboard over `runs` (keyless: control open to loopback) with one empty run."""
    from tracerl.dashboard.app import create_app as dashboard_app

    (runs / "r").mkdir(parents=True, exist_ok=True)
    return serve_in_thread(dashboard_app(runs, admin_key=""))


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


CROSS_FIELD = {("POST", "/store/rollouts"): "one sampling seed per task id"}
"""Operations with a rule between fields that JSON Schema cannot state (and so a 422 for a
body the document allows), and the rule: schemathesis is told to expect that 422 there
alone, as its documentation advises for a cross-field rule."""

PHASES = ("coverage", "fuzzing")
"""schemathesis's phases the fuzz runs by default: boundary cases of every parameter and
body field, wrong methods and OPTIONS (coverage), then drawn cases (fuzzing)."""


ACCEPTED = ["2xx", "3xx", "401", "403", "404", "409", "422", "429", "5xx"]
"""What a body the document allows may get on a CROSS_FIELD operation: schemathesis's
default, and the 422 of its rule."""


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
            "operations": [
                {
                    "include-method": method,
                    "include-path": path,
                    "checks": {"positive_data_acceptance": {"expected-statuses": ACCEPTED}},
                }
                for method, path in CROSS_FIELD
            ],
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
    """Run the table, the doors and the fuzz with keys on and off; print them, JSON last."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-examples", type=int, default=8)
    parser.add_argument("--budget-s", type=float, default=120.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tokenizer_dir(Path(tmp))
        service = start_service(model_dir, KEYS)
        try:
            rows = audit(service)
            growth = preauth_rss_growth_mb(service)  # first: before the fuzz's own garbage
            lease = lease_bound_enforced(service)
            locked = fuzz(service.url, headers_of("admin", new_world(service), KEYS),
                          args.max_examples, args.budget_s)  # fmt: skip
        finally:
            service.close()
        runs = Path(tmp) / "runs"
        service, board = start_service(model_dir, Keys()), dashboard_over(runs)
        try:
            csrf, rebinding = (
                csrf_blocked(service, board.url, runs),
                rebinding_blocked(service, board.url),
            )
            long_s = long_prompt_reject_s(service)
            opened = fuzz(service.url, {}, args.max_examples, args.budget_s)
        finally:
            board.stop()
            service.close()
    doors = DoorsReport(csrf, rebinding, growth, long_s, lease)
    passed = sum(r.got == r.expected for r in rows)
    print(f"{'operation':28} " + " ".join(f"{r:>8}" for r in ROLES))
    for op in EXPECTED:
        cells = [r for r in rows if r.operation == op]
        text = [f"{r.got}" if r.got == r.expected else f"{r.got}!={r.expected}" for r in cells]
        print(f"{op:28} " + " ".join(f"{t:>8}" for t in text))
    print(f"auth checks passed: {passed}/{len(rows)}")
    print(f"web page's requests refused (CSRF): {doors.csrf_blocked}; "
          f"rebound Host refused: {doors.rebinding_blocked}")  # fmt: skip
    print(f"memory growth under {UPLOADERS} anonymous {UPLOAD_MB} MB uploads: "
          f"{doors.preauth_rss_growth_mb} MB")  # fmt: skip
    print(f"10 MB prompt refused in {doors.long_prompt_reject_s} s; "
          f"1e300 s lease refused: {doors.lease_bound_enforced}")  # fmt: skip
    print(f"doors held: {doors.passed}")
    for name, rep in (("keys on", locked), ("keys off", opened)):
        print(f"fuzz ({name}, every check): {rep.cases} cases, {rep.server_errors} 5xx, "
              f"{len(rep.violations)} failures")  # fmt: skip
        for v in rep.violations[:10]:
            print("  ", v)
    reject_s = doors.long_prompt_reject_s if math.isfinite(doors.long_prompt_reject_s) else None
    print(json.dumps({
        "auth_passed": passed, "auth_total": len(rows),
        "fuzz_cases": locked.cases + opened.cases,
        "fuzz_5xx": locked.server_errors + opened.server_errors,
        "fuzz_violations": len(locked.violations) + len(opened.violations),
        "csrf_blocked": doors.csrf_blocked, "rebinding_blocked": doors.rebinding_blocked,
        "preauth_rss_growth_mb": doors.preauth_rss_growth_mb,
        "long_prompt_reject_s": reject_s, "lease_bound_enforced": doors.lease_bound_enforced,
        "doors_passed": doors.passed,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
