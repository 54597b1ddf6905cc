"""The gateway applies assets to an unchanged agent's calls: appended to or replacing the
system message before templating, per role, at the version the config or the rollout names
(0: withheld), one version per rollout attempt; token-in/token-out still reuses the exact
ids; every span records the versions it saw; a rollout's seed seeds its calls."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from transformers import AutoTokenizer

from tests.scripted import ScriptedEngine, closed_turns
from tracerl.assets.apply import with_assets
from tracerl.assets.config import AssetUse
from tracerl.gateway import Gateway, ServedModel, create_app
from tracerl.gateway.remote import RemoteModel
from tracerl.server import BackgroundServer, serve_in_thread, serving
from tracerl.store.sqlite import SqliteStore
from tracerl.types import UNASSISTED, SamplingParams, Task

TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}}}}]  # fmt: skip
AGENT_SYSTEM = "Use the calculator, then answer with the number."
QUESTION = {"role": "user", "content": "What is 37+48?"}


class SeenEngine(ScriptedEngine):
    """The scripted calculator model, remembering each call's sampling params."""

    def __init__(self, tokenizer) -> None:  # type: ignore[no-untyped-def]
        super().__init__(tokenizer)
        self.params: list[SamplingParams] = []

    async def generate(self, prompt_ids, params):  # type: ignore[no-untyped-def]
        self.params.append(params)
        return await super().generate(prompt_ids, params)


Served = tuple[BackgroundServer, SqliteStore, SeenEngine]


def _serve(
    tiny_model_dir: Path,
    store: SqliteStore,
    uses: dict[str, AssetUse],
    unassisted: tuple[str, ...] = (),
) -> Served:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = SeenEngine(tokenizer)
    models = {
        "policy": ServedModel("policy", engine, tokenizer),
        "critic": ServedModel("critic", engine, tokenizer),
    }
    gateway = Gateway(store, models, assets=uses, unassisted=unassisted)
    return serve_in_thread(create_app(gateway)), store, engine


@pytest.fixture
def store() -> Iterator[SqliteStore]:
    s = SqliteStore(":memory:")
    s.add_tasks([Task(id="t1", input={"question": "What is 37+48?"}, answer=85)])
    yield s
    s.close()


def _rollout(
    store: SqliteStore, assets: dict[str, int] | None = None, seed: int | None = None
) -> str:
    store.enqueue(["t1"], assets=assets, seeds=None if seed is None else [seed])
    return store.claim("test-runner", 1, 60.0)[0].id


def _client(url: str, rollout_id: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/rollouts/{rollout_id}/v1", api_key="x", max_retries=0)


def _system(engine: SeenEngine, call: int) -> str | None:
    turns = closed_turns(engine.tokenizer.decode(engine.prompts[call], skip_special_tokens=False))
    return next((text for role, text in turns if role == "system"), None)


def test_with_assets_appends_replaces_and_adds_a_system_message() -> None:
    system = {"role": "system", "content": "Be exact."}
    user = {"role": "user", "content": "hi"}
    assert with_assets([system, user], [("Answer in digits.", "append")]) == [
        {"role": "system", "content": "Be exact.\n\nAnswer in digits."}, user,
    ]  # fmt: skip
    assert with_assets([system, user], [("New.", "replace"), ("More.", "append")])[0] == {
        "role": "system", "content": "New.\n\nMore.",
    }  # fmt: skip
    assert with_assets([user], [("Alone.", "append")]) == [
        {"role": "system", "content": "Alone."}, user,
    ]  # fmt: skip
    parts = {"role": "developer", "content": [{"type": "text", "text": "A."}]}
    assert with_assets([parts], [("B.", "append")])[0]["content"][-1] == {
        "type": "text", "text": "\n\nB.",
    }  # fmt: skip
    assert with_assets([system, user], []) == [system, user]
    assert system == {"role": "system", "content": "Be exact."}  # the input is not changed


def test_the_current_asset_is_in_the_prompt_spans_record_it_and_ids_are_reused(
    tiny_model_dir: Path, store: SqliteStore
) -> None:
    store.put_asset("format", "Reply with digits only.")
    v2 = store.put_asset("format", "Reply with the number and nothing else.")
    server, _, engine = _serve(tiny_model_dir, store, {"format": AssetUse()})
    try:
        rid = _rollout(store)
        client = _client(server.url, rid)
        messages = [{"role": "system", "content": AGENT_SYSTEM}, QUESTION]
        first = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        msg = first.choices[0].message
        assert msg.tool_calls  # the scripted model calls the calculator first
        history = [*messages, msg.model_dump(exclude_none=True)]
        history.append({"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "85"})
        client.chat.completions.create(model="policy", messages=history, tools=TOOLS)
    finally:
        server.stop()
    # (This template lists the tools after the system message's text.)
    assert str(_system(engine, 0)).startswith(f"{AGENT_SYSTEM}\n\n{v2.text}\n")
    s0, s1 = store.spans(rid)
    assert s0.assets == s1.assets == {"format": 2}
    assert s0.messages[0]["content"] == f"{AGENT_SYSTEM}\n\n{v2.text}"  # what the model saw
    # Token-in/token-out: the second prompt extends the first prompt and completion exactly.
    assert s1.prefix_break is None
    assert s1.prefix_reused == len(s0.prompt_ids) + len(s0.completion_ids)
    assert engine.prompts[1] == s1.prompt_ids


def test_a_rollout_overrides_the_version_or_withholds_it_and_roles_are_respected(
    tiny_model_dir: Path, store: SqliteStore
) -> None:
    v1 = store.put_asset("format", "Version one.")
    store.put_asset("format", "Version two.")
    store.put_asset("skill", "Check the sum twice.")
    uses = {"format": AssetUse(mode="replace", roles=["policy"])}
    server, _, engine = _serve(tiny_model_dir, store, uses)
    try:
        calls = [({"format": 1, "skill": 1}, "policy"), ({"format": 0}, "policy"), (None, "critic")]
        rids = []
        for assets, model in calls:
            rids.append(_rollout(store, assets))
            _client(server.url, rids[-1]).chat.completions.create(
                model=model, messages=[{"role": "system", "content": AGENT_SYSTEM}, QUESTION]
            )
    finally:
        server.stop()
    # Replace mode puts the asset in place of the agent's system message; an asset named
    # only by the rollout is appended (the defaults).
    assert _system(engine, 0) == f"{v1.text}\n\nCheck the sum twice."
    assert _system(engine, 1) == AGENT_SYSTEM  # withheld
    assert _system(engine, 2) == AGENT_SYSTEM  # the critic role is not in the asset's roles
    spans = [store.spans(r)[0] for r in rids]
    assert [s.assets for s in spans] == [{"format": 1, "skill": 1}, {}, {}]


def test_an_attempt_keeps_its_version_while_a_new_one_is_put(
    tiny_model_dir: Path, store: SqliteStore
) -> None:
    store.put_asset("format", "Old.")
    server, _, engine = _serve(tiny_model_dir, store, {"format": AssetUse()})
    try:
        early = _client(server.url, _rollout(store))
        early.chat.completions.create(model="policy", messages=[QUESTION])
        store.put_asset("format", "New.")
        early.chat.completions.create(model="policy", messages=[QUESTION])
        _client(server.url, _rollout(store)).chat.completions.create(
            model="policy", messages=[QUESTION]
        )
    finally:
        server.stop()
    assert [_system(engine, i) for i in range(3)] == ["Old.", "Old.", "New."]


def test_a_rollouts_seed_seeds_each_call_unless_the_request_brings_one(
    tiny_model_dir: Path, store: SqliteStore
) -> None:
    server, _, engine = _serve(tiny_model_dir, store, {})
    try:
        client = _client(server.url, _rollout(store, seed=1000))
        for seed in (None, None, 7):
            client.chat.completions.create(model="policy", messages=[QUESTION], seed=seed)
        client.completions.create(model="policy", prompt="37+48=", max_tokens=4)
        _client(server.url, _rollout(store)).chat.completions.create(
            model="policy", messages=[QUESTION]
        )
    finally:
        server.stop()
    assert [p.seed for p in engine.params] == [1000, 1001, 7, 1003, None]


def test_a_missing_asset_is_refused_at_start_and_a_missing_version_per_call(
    tiny_model_dir: Path, store: SqliteStore
) -> None:
    with pytest.raises(ValueError, match="no asset 'format'"):
        _serve(tiny_model_dir, store, {"format": AssetUse()})
    store.put_asset("format", "One.")
    with pytest.raises(ValueError, match="no version 4"):
        _serve(tiny_model_dir, store, {"format": AssetUse(version=4)})
    server, _, _ = _serve(tiny_model_dir, store, {})
    try:
        rid = _rollout(store, {"format": 9})
        resp = httpx.post(
            f"{server.url}/rollouts/{rid}/v1/chat/completions",
            json={"model": "policy", "messages": [QUESTION]},
        )
    finally:
        server.stop()
    assert resp.status_code == 409
    assert resp.json()["error"]["code"] == "asset_not_found"
    assert "no version 9" in resp.json()["error"]["message"]


def test_a_remote_roles_forwarded_request_carries_the_asset(
    tiny_model_dir: Path, store: SqliteStore
) -> None:
    seen: list[dict] = []
    remote_app = FastAPI()

    @remote_app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict:
        seen.append(await request.json())
        message = {"role": "assistant", "content": "85"}
        return {"id": "x", "object": "chat.completion", "created": 0, "model": "teacher",
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}  # fmt: skip

    store.put_asset("format", "Digits only.")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with serving(remote_app) as remote_url:
        remote = {"teacher": RemoteModel("teacher", f"{remote_url}/v1", "teacher")}
        models = {"policy": ServedModel("policy", ScriptedEngine(tokenizer), tokenizer)}
        gateway = Gateway(store, models, remote=remote, assets={"format": AssetUse()})
        with serving(create_app(gateway)) as url:
            rid = _rollout(store, seed=5)
            _client(url, rid).chat.completions.create(model="teacher", messages=[QUESTION])
    assert seen[0]["messages"][0] == {"role": "system", "content": "Digits only."}
    assert seen[0]["seed"] == 5
    (span,) = store.spans(rid)
    assert span.assets == {"format": 1} and json.dumps(span.messages).count("Digits only.") == 1


def test_a_distilled_assets_calls_record_the_prompt_without_it(
    tiny_model_dir: Path, store: SqliteStore
) -> None:
    """GatewayConfig.unassisted: a call carrying the asset also records the ids of the
    agent's own request (what a distilling curriculum trains on); one without it does not."""
    store.put_asset("format", "Answer with the number alone.")
    server, _, engine = _serve(tiny_model_dir, store, {}, unassisted=("format",))
    messages = [{"role": "system", "content": AGENT_SYSTEM}, QUESTION]
    try:
        carried, withheld = _rollout(store, {"format": 1}), _rollout(store, {"format": 0})
        for rid in (carried, withheld):
            _client(server.url, rid).chat.completions.create(model="policy", messages=messages)
    finally:
        server.stop()
    with_asset, without = store.spans(carried)[0], store.spans(withheld)[0]
    assert with_asset.assets == {"format": 1} and _system(engine, 0) != AGENT_SYSTEM
    assert with_asset.response[UNASSISTED] == without.prompt_ids != with_asset.prompt_ids
    assert UNASSISTED not in without.response
