"""The `tracerl` command: help without heavy imports, unknown keys refused by name, the
demo's flags, the model name handed to agents, example loading, the packaged examples."""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

import tracerl.cli
from tracerl.agents import AgentResult, load_callable
from tracerl.demo import DemoConfig, demo_run_config
from tracerl.evaluate import run_rollouts
from tracerl.pipeline.config import TrainConfig
from tracerl.runner import RunnerConfig
from tracerl.store.sqlite import SqliteStore
from tracerl.types import Task

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "fastapi", "uvicorn", "matplotlib", "tensorboard", "openai")


@pytest.mark.parametrize("args", [["--help"], ["train", "--help"], ["demo", "--help"]])
def test_help_imports_nothing_heavy(args: list[str]) -> None:
    code = (
        "import sys, tracerl.cli\n"
        "try:\n    tracerl.cli.main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "print(' '.join(sorted(sys.modules)), file=sys.stderr)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, check=True
    )
    assert "usage: tracerl" in out.stdout
    loaded = set(out.stderr.split())
    assert "tracerl.cli" in loaded
    assert not [m for m in loaded if m.split(".")[0] in HEAVY]


def _train_toml(tmp_path: Path, body: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(f'name = "x"\nruns = "{tmp_path}"\n{body}')
    return str(path)


@pytest.mark.parametrize(
    ("body", "key"),
    [
        ("[runner]\nconcurency = 4\n", "runner.concurency"),
        ("[engine]\nmax_batch = 4\n", "engine.max_batch"),
        ("[pipeline]\nstep = 4\n", "pipeline.step"),
        ("modle = 'm'\n", "modle"),
    ],
)
def test_train_refuses_an_unknown_key_of_the_file_by_name(
    tmp_path: Path, body: str, key: str
) -> None:
    with pytest.raises(SystemExit, match=rf"{key}: Extra inputs are not permitted"):
        tracerl.cli.main(["train", _train_toml(tmp_path, body)])


def test_train_refuses_an_unknown_flag_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        tracerl.cli.main(["train", _train_toml(tmp_path, ""), "--runner.concurency", "4"])
    assert exit_.value.code != 0
    assert "--runner.concurency" in capsys.readouterr().err


def test_an_unknown_key_inside_a_json_flag_is_named() -> None:
    with pytest.raises(SystemExit, match=r"serve\.roles\.p\.modle: Extra inputs"):
        tracerl.cli.main(["serve", "--roles", json.dumps({"p": {"modle": "m"}})])


def _configs() -> list[type[BaseModel]]:
    """Every config class the package defines (settings a person writes, by name)."""
    names = ["algorithms", "engines", "entrypoints", "pipeline", "trainer"]
    for module in [f"tracerl.{n}.config" for n in names] + ["tracerl.models.sft", "tracerl.demo"]:
        importlib.import_module(module)
    modules = [v for k, v in sys.modules.items() if k.startswith("tracerl.")]
    found = {
        obj
        for mod in modules
        for obj in vars(mod).values()
        if isinstance(obj, type)
        and issubclass(obj, BaseModel)
        and obj.__module__ == mod.__name__
        and obj.__name__.endswith(("Config", "Command", "Settings", "Recipe", "Show", "List"))
    }
    return sorted(found, key=lambda c: c.__name__)


def test_every_config_refuses_unknown_keys_by_name() -> None:
    configs = _configs()
    names = {c.__name__ for c in configs}
    assert {"RunnerConfig", "EngineConfig", "TrainConfig", "DemoConfig", "EvalCommand"} <= names
    for config in configs:
        with pytest.raises(ValidationError, match="not_a_field"):
            config.model_validate({"not_a_field": 1})


def test_runner_config_has_no_model_name_to_overwrite() -> None:
    # The model name is the run's (TrainConfig.model_name, eval's, runner's --model_name),
    # handed to Runner(model=...): a runner section cannot carry a second one.
    with pytest.raises(ValidationError, match="model"):
        TrainConfig.model_validate({"runner": {"model": "planner"}})
    assert "model" not in RunnerConfig.model_fields


def test_the_model_name_given_reaches_the_agent() -> None:
    told: list[str] = []

    async def agent(task: Task, base_url: str, api_key: str, model: str) -> AgentResult:
        told.append(model)
        return AgentResult("1")

    store = SqliteStore(":memory:")
    tasks = [Task(id=f"t{i}", input={}, answer=1) for i in range(3)]
    reward = load_callable(f"{ROOT}/examples/calculator/reward.py:reward")
    cfg = RunnerConfig(poll_s=0.01)
    done = run_rollouts(store, "http://127.0.0.1:9", agent, reward, tasks, 2, cfg, model="planner")
    assert told == ["planner"] * 6
    assert [r.reward for r in done] == [1.0] * 6


def test_demo_flags_override_one_field_and_keep_the_demo_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[DemoConfig] = []
    fake = types.ModuleType("tracerl.entrypoints.demo")
    fake.main = lambda cfg, console: seen.append(cfg)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tracerl.entrypoints.demo", fake)
    tracerl.cli.main(
        [
            *("demo", "--async", "--pipeline.steps", "80", "--trainer.lr", "5e-4"),
            *("--no-curation.dynamic_sampling", "--device", "cuda", "--runner.timeout_s", "9"),
            *("--eval_tasks", "16", "--train_tasks", "32", "--runs", str(tmp_path)),
            *("--model", str(tmp_path)),  # given: the demo builds no model
        ]
    )
    (cfg,) = seen
    assert (cfg.pipeline.steps, cfg.pipeline.eval_every) == (80, 10)
    assert (cfg.trainer.lr, cfg.trainer.schedule, cfg.trainer.warmup_steps) == (5e-4, "cosine", 5)
    assert not cfg.curation.dynamic_sampling
    assert (cfg.runner.timeout_s, cfg.runner.concurrency) == (9.0, 64)
    assert (cfg.device, cfg.engine.device, cfg.engine.max_batch_size) == ("cuda", "cuda", 64)
    run = demo_run_config(cfg)
    assert type(run) is TrainConfig and run.pipeline.mode == "async"
    assert run.eval_tasks is None and run.engine.device == "cuda"
    rows = [json.loads(line) for line in Path(run.tasks).read_text().splitlines()]
    assert [r["split"] for r in rows] == ["train"] * 32 + ["eval"] * 16
    assert load_callable(run.agent).__name__ == "run"
    assert load_callable(str(run.reward))({"answer": 3}, "it is 3") == 1.0


def test_demo_defaults_are_the_demos() -> None:
    cfg = DemoConfig()
    assert (cfg.name, cfg.pipeline.eval_every, cfg.runner.concurrency) == ("demo", 10, 64)
    # One set of run defaults: the demo trains with `tracerl train`'s own.
    assert cfg.trainer == TrainConfig().trainer and cfg.curation == TrainConfig().curation
    assert cfg.trainer.lr == 3e-4 and not cfg.run_async
    assert Path(cfg.agent.rpartition(":")[0]).is_file()


def _two_examples(root: Path) -> list[Path]:
    """Two folders, each an agent.py that imports its sibling tasks.py (different values)."""
    agents = []
    for name in ("a", "b"):
        folder = root / name
        folder.mkdir()
        (folder / "tasks.py").write_text(f"VALUE = {name!r}\n")
        (folder / "agent.py").write_text(
            "from . import tasks\n\n\ndef run(task, **kw):\n    return tasks.VALUE\n"
        )
        agents.append(folder / "agent.py")
    return agents


def test_two_folders_with_the_same_file_names_load_side_by_side(tmp_path: Path) -> None:
    path_before = list(sys.path)
    a, b = (load_callable(f"{agent}:run") for agent in _two_examples(tmp_path))
    assert (a({}), b({})) == ("a", "b")
    assert sys.path == path_before
    # Each under a name of its own, never the bare `agent` / `tasks` another test may hold.
    assert len({a.__module__, b.__module__, "agent"}) == 3
    assert getattr(sys.modules.get("tasks"), "VALUE", None) not in ("a", "b")
    assert load_callable(f"{tmp_path / 'a' / 'agent.py'}:run") is a  # loaded once


def test_the_two_shipped_examples_keep_their_own_siblings() -> None:
    from tracerl.examples import example_module

    calc = example_module("calculator", "expert")
    planner = example_module("planner_executor", "expert")
    assert calc.make_tasks(1, "train", 0)[0]["input"]["question"].startswith("What is")
    assert planner.__name__ != calc.__name__
    assert example_module("calculator", "tasks") is example_module("calculator", "tasks")


def test_examples_run_as_plain_scripts(tmp_path: Path) -> None:
    tasks = subprocess.run(
        [sys.executable, "examples/calculator/tasks.py", "3", "eval"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert [json.loads(line)["split"] for line in tasks.stdout.splitlines()] == ["eval"] * 3
    out = tmp_path / "demos.jsonl"
    subprocess.run(
        [sys.executable, "examples/calculator/expert.py", "2", str(out)], cwd=ROOT, check=True
    )
    assert len(out.read_text().splitlines()) == 2


@pytest.mark.slow
def test_the_wheel_ships_the_demo_example(tmp_path: Path) -> None:
    # Built from a copy: an in-tree build would write build/ and *.egg-info into the checkout.
    src = tmp_path / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(ROOT / "tracerl", src / "tracerl", ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", str(tmp_path), str(src)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("tracerl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("agent", "tasks", "reward", "expert"):
        assert f"tracerl/examples/calculator/{module}.py" in names
    # Unpacked away from any checkout, the demo finds its example inside the package.
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = (
        "from tracerl.demo import DemoConfig, example_module\n"
        "print(DemoConfig().agent)\n"
        "print(example_module('calculator', 'tasks').make_tasks(1, 'eval', 1)[0]['split'])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    agent, split = out.stdout.split()
    assert agent == f"{site / 'tracerl' / 'examples' / 'calculator' / 'agent.py'}:run"
    assert split == "eval"


SIGNAL_IN_A_FINALIZER = """
class Client:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        sum(range(10000))
client = Client()
del client
"""
SIGNAL_IN_AN_IMPORT = """
sys.path.insert(0, sys.argv[1])
atexit.register(lambda: print("initialized" if "plotting" in sys.modules else "half"))
import plotting  # sends the signal from its top level, then goes on initializing
"""


@pytest.mark.parametrize(
    ("where", "printed"), [(SIGNAL_IN_A_FINALIZER, ""), (SIGNAL_IN_AN_IMPORT, "initialized\n")]
)
def test_sigterm_where_no_exception_can_unwind_still_stops_the_command(
    where: str, printed: str, tmp_path: Path
) -> None:
    """A SIGTERM landing while a `__del__` runs (e.g. an SDK client collected mid-step) is
    not dropped with the finalizer's "Exception ignored", and one landing inside an import
    does not leave the module half-initialized: the command exits 143 once past them."""
    (tmp_path / "plotting.py").write_text(
        "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n"
        "sum(range(100000))\nINITIALIZED = True\n"
    )
    code = (
        "import atexit, os, signal, sys, time, tracerl.cli\n"
        "signal.signal(signal.SIGTERM, tracerl.cli._terminated)\n"
        f"{where}\n"
        "time.sleep(5)\n"
        "print('ran on')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True
    )
    assert (out.returncode, out.stdout, out.stderr) == (143, printed, "")


def test_a_missing_file_or_a_bad_task_is_one_line_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tracerl.cli import main

    monkeypatch.delenv("TRACERL_DEBUG", raising=False)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "a", "input": {"question": "1+1"}, "answer": "2"}\n')
    model = str(tmp_path)
    with pytest.raises(SystemExit, match=r"^tracerl eval: no such agent file: .*nope\.py"):
        main(["eval", "x.py:run", "--tasks", str(tasks), "--model", model,
              "--reward", f"{tmp_path}/nope.py:reward"])  # fmt: skip
    tasks.write_text('{"id": "a", "input": "1+1", "answer": "2"}\n')
    with pytest.raises(SystemExit, match=rf"^tracerl eval: {tasks}:1: Input should be"):
        main(["eval", f"{tmp_path}/nope.py:run", "--tasks", str(tasks), "--model", model])
    monkeypatch.setenv("TRACERL_DEBUG", "1")  # the traceback, for whoever debugs tracerl
    with pytest.raises(ValueError, match=":1: Input should be"):
        main(["eval", f"{tmp_path}/nope.py:run", "--tasks", str(tasks), "--model", model])


def test_a_value_after_an_on_off_flag_is_explained() -> None:
    from tracerl.cli import main

    with pytest.raises(SystemExit, match=r"no config file 'true' \(on/off flags take no value"):
        main(["train", "--model", "m", "--agent", "a.py:run", "--tasks", "t.jsonl",
              "--trainer.prefix_sharing", "true"])  # fmt: skip
