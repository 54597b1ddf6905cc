"""Several roles, several policies: the role -> policy mapping in each sharing mode, frozen
roles recorded but never trained, LoRA adapters per role saved as standard peft adapters."""

from __future__ import annotations

import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from openai import OpenAI
from peft import PeftModel
from transformers import AutoModelForCausalLM

from tracerl.agents import python_agent
from tracerl.algorithms.config import AlgorithmConfig
from tracerl.pipeline.config import GuardConfig, PipelineConfig, TrainConfig
from tracerl.pipeline.run import train
from tracerl.roles import RoleConfig, remote_roles
from tracerl.runner import RunnerConfig
from tracerl.stack import start_stack
from tracerl.store.sqlite import SqliteStore
from tracerl.trainer.config import LoraSettings, TrainerConfig
from tracerl.trainer.trainer import Trainer
from tracerl.types import Task, Transition

CLIENT = httpx.Client()


def two_roles(task: dict, *, base_url: str, api_key: str, model: str) -> str:
    """A planner call, then one or two executor calls (varying per task), then an answer."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=CLIENT)
    plan = client.chat.completions.create(
        model="planner", messages=[{"role": "user", "content": task["question"]}], max_tokens=6
    )
    answers = []
    for _ in range(task["subtasks"]):
        reply = client.chat.completions.create(
            model="executor",
            messages=[{"role": "user", "content": plan.choices[0].message.content or "?"}],
            max_tokens=6,
        )
        answers.append(reply.choices[0].message.content or "")
    return " ".join(answers)


def reward(task: dict, answer: str) -> float:
    return float(len(answer) % 2)  # arbitrary but varied: groups get a signal


def _tasks(n: int, split: str) -> list[Task]:
    return [
        Task(id=f"{split}{i}", input={"question": f"q{i}", "subtasks": 1 + i % 2}, answer=0)
        for i in range(n)
    ]


def _cfg(tmp: Path, model: Path, roles: dict[str, RoleConfig], **trainer: object) -> TrainConfig:
    return TrainConfig(
        name="roles",
        runs=str(tmp),
        model=str(model),
        roles=roles,
        eval_before=False,
        pipeline=PipelineConfig(steps=1, tasks_per_step=2, group_size=2, eval_every=0),
        trainer=TrainerConfig(lr=1e-3, **trainer),  # type: ignore[arg-type]
        runner=RunnerConfig(concurrency=4),
        # These runs are about which rows reach which trainer, not about learning: the
        # untrained model's answers get an arbitrary reward (`reward` above) that can be 0 on
        # all 8 pre-flight rollouts, and the check that refuses such a start would stop them.
        guard=GuardConfig(preflight=False),
    )


def _run(cfg: TrainConfig, seen: list[tuple[str, set[str]]], monkeypatch) -> SqliteStore:  # type: ignore[no-untyped-def]
    """Train, recording which roles' rows each policy's trainer was handed."""
    original = Trainer.train

    def spy(self: Trainer, rows: list[Transition]):  # type: ignore[no-untyped-def]
        seen.append((self.model_dir, {r.role for r in rows}))
        return original(self, rows)

    monkeypatch.setattr(Trainer, "train", spy)
    with ThreadPoolExecutor(4) as threads:
        train(cfg, python_agent(two_roles, threads), reward, (_tasks(4, "t"), _tasks(2, "e")))
    return SqliteStore(Path(cfg.runs) / cfg.name / "traces.db")


def test_role_mapping_resolves_each_sharing_mode() -> None:
    def specs(roles: dict) -> list:  # type: ignore[type-arg]
        return TrainConfig(model="/m", roles=roles).policies()

    own = specs({"a": RoleConfig(model="/a"), "b": {}})
    assert [(p.name, p.model, p.roles) for p in own] == [("a", "/a", ["a"]), ("b", "/m", ["b"])]
    shared = specs({"a": RoleConfig(), "b": RoleConfig(share="a")})
    assert [(p.name, p.roles) for p in shared] == [("a", ["a", "b"])]
    frozen = specs({"a": RoleConfig(), "b": RoleConfig(frozen=True)})
    assert [(p.name, p.frozen) for p in frozen] == [("a", False), ("b", True)]
    lora = LoraSettings(r=4)
    adapters = specs({"a": RoleConfig(lora=lora), "b": RoleConfig()})
    assert adapters[0].lora == lora and adapters[1].lora is None
    assert [p.roles for p in specs({})] == [["policy"]]  # no roles: one policy
    remote = specs({"a": RoleConfig(), "b": RoleConfig(url="http://h:8000/v1")})
    assert [p.name for p in remote] == ["a"]  # a remote role is no policy of ours
    bad = [
        ({"b": RoleConfig(share="a")}, "not a role with local weights"),
        ({"a": RoleConfig(), "b": RoleConfig(share="a", model="/x")}, "set model"),
        ({"a": RoleConfig(frozen=True)}, "nothing to train"),
        ({"a": RoleConfig(url="http://h/v1")}, "nothing to train"),
        ({"a": RoleConfig(), "b": {"url": "http://h/v1", "model": "/x"}}, "no local model"),
        ({"a": RoleConfig(), "b": {"url": "h:8000"}}, "expected http"),
        ({"a": RoleConfig(), "b": {"remote_model": "gpt"}}, "need a url"),
        ({"a": RoleConfig(url="http://h/v1"), "b": RoleConfig(share="a")}, "local weights"),
    ]
    for roles, message in bad:
        with pytest.raises(ValueError, match=message):
            specs(roles)


def test_frozen_role_is_recorded_but_never_trained(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    roles = {"planner": RoleConfig(), "executor": RoleConfig(frozen=True)}
    seen: list[tuple[str, set[str]]] = []
    store = _run(_cfg(tmp_path, tiny_model_dir, roles), seen, monkeypatch)
    spans = [s for r in store.rollouts() for s in store.spans(r.id)]
    store.close()
    assert {s.role for s in spans} == {"planner", "executor"}  # both recorded
    assert seen and all(trained == {"planner"} for _, trained in seen)
    # The frozen role's engine never got new weights: its spans are all version 0.
    assert {s.policy_version for s in spans if s.role == "executor"} == {0}
    lines = (tmp_path / "roles" / "metrics.jsonl").read_text().splitlines()
    assert any(json.loads(x).get("train/frozen_rows", 0) > 0 for x in lines)
    assert (tmp_path / "roles" / "model" / "config.json").exists()


def test_shared_backbone_trains_on_both_roles(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    roles = {"planner": RoleConfig(), "executor": RoleConfig(share="planner")}
    seen: list[tuple[str, set[str]]] = []
    _run(_cfg(tmp_path, tiny_model_dir, roles), seen, monkeypatch).close()
    assert [trained for _, trained in seen] == [{"planner", "executor"}]


def test_aligned_role_gets_the_same_rows_from_every_rollout(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    # The agent calls the executor once or twice per task; aligned to 2, every rollout hands
    # the trainer exactly two executor rows (M-GRPO's fixed-size batch), one planner row.
    roles = {"planner": RoleConfig(), "executor": RoleConfig(share="planner")}
    cfg = _cfg(tmp_path, tiny_model_dir, roles)
    cfg.algorithm = AlgorithmConfig(align={"executor": 2})
    cfg.pipeline = PipelineConfig(steps=1, tasks_per_step=4, group_size=2, eval_every=0)
    handed: list[list[Transition]] = []
    original = Trainer.train

    def spy(self: Trainer, rows: list[Transition]):  # type: ignore[no-untyped-def]
        handed.append(rows)
        return original(self, rows)

    monkeypatch.setattr(Trainer, "train", spy)
    with ThreadPoolExecutor(4) as threads:
        train(cfg, python_agent(two_roles, threads), reward, (_tasks(4, "t"), _tasks(2, "e")))
    (rows,) = handed
    per_rollout = Counter((r.rollout_id, r.role) for r in rows)
    rollouts = {r.rollout_id for r in rows}
    assert len(rollouts) == 8  # 4 tasks x 2
    assert per_rollout == {(x, "planner"): 1 for x in rollouts} | {
        (x, "executor"): 2 for x in rollouts
    }
    store = SqliteStore(tmp_path / "roles" / "traces.db")
    calls = Counter(s.rollout_id for x in rollouts for s in store.spans(x) if s.role == "executor")
    store.close()
    assert sorted(calls.values()) == [1] * 4 + [2] * 4  # the calls varied; the batch did not
    lines = (tmp_path / "roles" / "metrics.jsonl").read_text().splitlines()
    (metrics,) = [m for m in map(json.loads, lines) if "train/rows" in m]
    assert (metrics["train/rows/planner"], metrics["train/rows/executor"]) == (8, 16)


def test_lora_per_role_saves_standard_peft_adapters(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    roles = {"planner": RoleConfig(lora=LoraSettings(r=4)), "executor": RoleConfig()}
    cfg = _cfg(tmp_path, tiny_model_dir, roles, lora=LoraSettings(r=2))
    seen: list[tuple[str, set[str]]] = []
    _run(cfg, seen, monkeypatch).close()
    assert sorted(tuple(trained) for _, trained in seen) == [("executor",), ("planner",)]
    run = tmp_path / "roles"
    step = run / "checkpoints" / "step-1"
    assert (step / "planner" / "trainer.pt").exists() and (step / "executor" / "model").is_dir()
    for role, rank in (("planner", 4), ("executor", 2)):
        adapter = run / "models" / role
        config = json.loads((adapter / "adapter_config.json").read_text())
        assert config["r"] == rank
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        loaded = PeftModel.from_pretrained(base, str(adapter))  # a standard peft adapter
        merged = AutoModelForCausalLM.from_pretrained(run / "models" / f"{role}-merged")
        ids = torch.tensor([[1, 2, 3, 4]])
        with torch.no_grad():
            want = loaded.merge_and_unload()(ids).logits
            got = merged(ids).logits
        assert torch.allclose(want, got, atol=1e-5)


def test_two_policies_train_under_the_async_pipeline(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    roles = {"planner": RoleConfig(), "executor": RoleConfig(model=str(tiny_model_dir))}
    cfg = _cfg(tmp_path, tiny_model_dir, roles)
    cfg = cfg.model_copy(
        update={"pipeline": cfg.pipeline.model_copy(update={"mode": "async", "steps": 2})}
    )
    seen: list[tuple[str, set[str]]] = []
    store = _run(cfg, seen, monkeypatch)
    spans = [s for r in store.rollouts() for s in store.spans(r.id)]
    store.close()
    assert sorted(tuple(trained) for _, trained in seen) == [("executor",)] * 2 + [("planner",)] * 2
    # Both engines published each step's weights: spans come from versions 0..2 only.
    assert {s.policy_version for s in spans} <= {0, 1, 2}
    step = tmp_path / "roles" / "checkpoints" / "step-2"
    assert (step / "planner" / "model").is_dir() and (step / "executor" / "model").is_dir()


def _async(cfg: TrainConfig, steps: int) -> TrainConfig:
    """The same run under the async pipeline with no staleness allowed at all."""
    pipeline = cfg.pipeline.model_copy(update={"mode": "async", "steps": steps, "max_staleness": 0})
    return cfg.model_copy(update={"pipeline": pipeline})


def _metrics(run: Path) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_frozen_role_never_ages_in_the_async_pipeline(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    # The frozen executor's spans stay at version 0 while the planner moves on; with
    # max_staleness 0 they would be stale from step 1 if frozen spans counted.
    # (A planner rollout sampled while a step trains may still be re-run: that is timing.)
    roles = {"planner": RoleConfig(), "executor": RoleConfig(frozen=True)}
    seen: list[tuple[str, set[str]]] = []
    store = _run(_async(_cfg(tmp_path, tiny_model_dir, roles), 3), seen, monkeypatch)
    assert [trained for _, trained in seen] == [{"planner"}] * 3
    steps = [m for m in _metrics(tmp_path / "roles") if "pipeline/staleness_max" in m]
    assert [m["pipeline/staleness_max"] for m in steps] == [0, 0, 0]
    # Step 3 (version 2, no staleness allowed) trained on rollouts whose planner calls
    # were sampled at version 2 and whose executor calls at version 0.
    calls = [store.spans(r.id, r.attempt) for r in store.rollouts()]
    late = [c for c in calls if {s.policy_version for s in c if s.role == "planner"} == {2}]
    assert late and all({s.policy_version for s in c if s.role == "executor"} == {0} for c in late)
    store.close()


def judged_executor(task: dict, *, base_url: str, api_key: str, model: str) -> str:
    """two_roles, and the agent judges its executor itself: a per-role reward over HTTP."""
    answer = two_roles(task, base_url=base_url, api_key=api_key, model=model)
    reward_url = base_url.removesuffix("/v1") + "/reward"
    value = 0.25 * task["subtasks"]
    CLIENT.post(reward_url, json={"value": value, "role": "executor"}).raise_for_status()
    return answer


def test_role_reward_credits_its_role_and_the_outcome_the_others(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    rows: list[Transition] = []
    original = Trainer.train

    def keep(self: Trainer, batch: list[Transition]):  # type: ignore[no-untyped-def]
        rows.extend(batch)
        return original(self, batch)

    monkeypatch.setattr(Trainer, "train", keep)
    roles = {"planner": RoleConfig(), "executor": RoleConfig(model=str(tiny_model_dir))}
    cfg = _cfg(tmp_path, tiny_model_dir, roles)
    with ThreadPoolExecutor(4) as threads:
        agent = python_agent(judged_executor, threads)
        train(cfg, agent, reward, (_tasks(4, "t"), _tasks(2, "e")))
    store = SqliteStore(tmp_path / "roles" / "traces.db")
    outcome = {r.id: r.reward for r in store.rollouts()}
    store.close()
    subtasks = {f"t{i}": 1 + i % 2 for i in range(4)}
    executor = [r for r in rows if r.role == "executor"]
    planner = [r for r in rows if r.role == "planner"]
    assert executor and planner
    assert all(r.reward == 0.25 * subtasks[r.task_id] for r in executor)
    assert all(r.reward == outcome[r.rollout_id] for r in planner)


def test_remote_role_is_recorded_as_text_and_never_trained(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    # The executor is another OpenAI-compatible server (here: a second tracerl stack).
    upstream = start_stack(tiny_model_dir, tmp_path / "upstream.db", model_name="tiny")
    try:
        remote = RoleConfig(url=f"{upstream.url}/v1", remote_model="tiny")
        roles = {"planner": RoleConfig(), "executor": remote}
        seen: list[tuple[str, set[str]]] = []
        cfg = _async(_cfg(tmp_path, tiny_model_dir, roles), 2)
        store = _run(cfg, seen, monkeypatch)
    finally:
        upstream.close()
    spans = [s for r in store.rollouts() for s in store.spans(r.id)]
    store.close()
    executor = [s for s in spans if s.role == "executor"]
    assert executor and all(s.completion_ids == [] and s.policy_version == -1 for s in executor)
    assert all(isinstance(s.response["message"]["content"], str) for s in executor)
    assert [trained for _, trained in seen] == [{"planner"}] * 2  # never stale, never trained
    assert (tmp_path / "roles" / "model" / "config.json").exists()  # the one trained policy


def test_reply_formats_come_from_each_role_else_the_run(tiny_model_dir: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    import typing

    import tracerl.cli
    from tracerl.gateway import Gateway
    from tracerl.gateway.toolcalls import FORMATS
    from tracerl.roles import ReplyFormat, ToolParser

    assert typing.get_args(ToolParser) == tuple(FORMATS)  # the config knows every parser
    roles = {
        "a": {"tool_parser": "llama3", "thinking": ["<plan>", "</plan>"]},
        "b": {"share": "a"},
        "c": {"share": "a", "tool_parser": "mistral"},
    }
    cfg = TrainConfig(model="/m", roles=roles, tool_parser="qwen3_coder")
    (spec,) = cfg.policies()
    plan = ("<plan>", "</plan>")
    assert spec.formats == {  # a role playing another's policy reads replies its own way
        "a": ReplyFormat("llama3", plan),
        "b": ReplyFormat("qwen3_coder", None),
        "c": ReplyFormat("mistral", None),
    }
    (alone,) = TrainConfig(model="/m", thinking=plan).policies()
    assert alone.formats == {"policy": ReplyFormat(None, plan)}  # no roles: the run's policy
    # A remote role with a tokenizer reads its encoded replies back in its format too.
    teacher = {"url": "http://h/v1", "tokenizer": str(tiny_model_dir), "tool_parser": "llama3"}
    remote = remote_roles({"t": RoleConfig.model_validate(teacher)}, cfg.reply_format())
    assert remote["t"].reply == ReplyFormat("llama3", None)
    gateway = Gateway(SqliteStore(":memory:"), {}, remote=remote)
    assert gateway._students["t"].format.name == "llama3"
    bad = [
        ({"tool_parser": "llama4"}, "Input should be 'hermes', 'qwen3_coder', 'llama3' or"),
        ({"thinking": ["<t>", "<t>"]}, "two different non-empty markers"),
        ({"thinking": ["<t>"]}, "thinking.1\n  Field required"),
        ({"url": "http://h/v1", "tool_parser": "hermes"}, "need a tokenizer"),
    ]
    for role, message in bad:
        with pytest.raises(ValueError, match=message):
            RoleConfig.model_validate(role)
    with pytest.raises(SystemExit, match="roles.a.tool_parser: Input should be 'hermes'"):
        tracerl.cli.main(["serve", "--roles", json.dumps({"a": {"tool_parser": "nope"}})])
    with pytest.raises(SystemExit, match="train.tool_parser: Input should be"):
        tracerl.cli.main(["train", "--tool_parser", "nope"])
    with pytest.raises(SystemExit):
        tracerl.cli.main(["serve", "--help"])
    shown = capsys.readouterr().out
    assert "--tool_parser {{hermes,qwen3_coder,llama3,mistral},null}" in shown
    assert "--thinking" in shown


def test_top_agent_is_told_a_served_role_and_check_reads_role_models(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    m = str(tiny_model_dir)
    two = {"planner": {"model": m}, "executor": {"model": m}}
    run = {"agent": "a.py:f", "tasks": "t.jsonl"}
    cfg = TrainConfig.model_validate({**run, "roles": two})
    assert cfg.model_name == "planner"  # no model_name: the first role, not "policy"
    cfg.check()  # every role has its model: no top-level --model needed
    resumed = TrainConfig.model_validate(cfg.model_dump())  # what a resumed run reads back
    assert resumed.model_name == "planner"
    assert TrainConfig(model=m, **run).model_name == "policy"  # one role: unchanged
    bad = [
        ({"roles": two, "model_name": "policy"}, "not one of the roles"),
        ({"roles": {"planner": {"model": str(tmp_path / "none")}}}, "role 'planner'.*not a local"),
        ({"roles": {"planner": {}}}, "not a local model directory"),
        ({}, "train needs --model"),
        ({"roles": two, "algorithm": {"align": {"critic": 2}}}, "align names \\['critic'\\]"),
        ({"roles": two, "algorithm": {"align": {"executor": 0}}}, "greater than 0"),
    ]
    for extra, message in bad:
        with pytest.raises(ValueError, match=message):
            TrainConfig.model_validate({**run, **extra}).check()


def test_the_readme_roles_example_parses() -> None:
    import re
    import tomllib

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    block = next(b for b in re.findall(r"```toml\n(.*?)```", readme, re.S) if "[roles." in b)
    cfg = TrainConfig.model_validate(tomllib.loads(block))
    assert [(p.name, p.model) for p in cfg.policies()] == [
        ("planner", "/models/planner"),
        ("executor", "/models/executor"),
    ]
    (critic,) = remote_roles(cfg.roles).values()
    assert (critic.name, critic.model, critic.api_key_env) == (
        "critic",
        "Qwen/Qwen3-8B",
        "CRITIC_API_KEY",
    )


def test_tracerl_eval_serves_every_role(tiny_model_dir: Path, tmp_path: Path) -> None:
    import tracerl.cli

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(t.model_dump()) + "\n" for t in _tasks(3, "e")))
    roles = {"planner": {"model": str(tiny_model_dir)}, "executor": {"share": "planner"}}
    here = Path(__file__)
    args = [
        *("eval", f"{here}:two_roles", "--tasks", str(tasks), "--roles", json.dumps(roles)),
        *("--reward", f"{here}:reward", "--runs", str(tmp_path), "--name", "ev"),
    ]
    tracerl.cli.main(args)
    report = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert report["rollouts"] == 3
    stats = report["roles"]
    assert list(stats) == ["planner", "executor"]
    assert stats["executor"]["calls_per_rollout"] == pytest.approx((1 + 2 + 1) / 3)
    bad = [*args[:4], "--roles", json.dumps({"a": {"share": "b"}}), *args[6:]]
    with pytest.raises(SystemExit, match="not a role with local weights"):
        tracerl.cli.main(bad)


@pytest.mark.slow
def test_tracerl_serve_answers_to_every_role(tiny_model_dir: Path, tmp_path: Path) -> None:
    import subprocess
    import sys
    import time

    from tracerl.server import free_port

    port = free_port()
    roles = {"planner": {"model": str(tiny_model_dir)}, "executor": {"share": "planner"}}
    code = "import sys, tracerl.cli; tracerl.cli.main(sys.argv[1:])"
    args = ["serve", "--roles", json.dumps(roles), "--port", str(port)]
    cmd = [sys.executable, "-c", code, *args, "--store", str(tmp_path / "s.db")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                listed = httpx.get(f"{url}/v1/models").json()
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "tracerl serve did not come up"
                time.sleep(0.3)
        assert sorted(m["id"] for m in listed["data"]) == ["executor", "planner"]
        client = OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        hi = [{"role": "user", "content": "hi"}]
        reply = client.chat.completions.create(model="executor", messages=hi, max_tokens=3)
        assert reply.model == "executor"
    finally:
        proc.terminate()
        proc.wait(30)
    bad = subprocess.run(
        [*cmd[:3], "serve", "--roles", json.dumps({"a": {"share": "b"}})],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and "not a role with local weights" in bad.stderr
