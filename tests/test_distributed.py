"""Data-parallel training gives the single trainer's update, and its checkpoints move
between rank counts.

Two ranks (spawned by tracerl.trainer.launch, gloo, one thread each) train on the same
realistic rows as a plain `Trainer` in this process: multi-turn rows merged from 3-call
rollouts plus single-call rows, varied lengths, GRPO advantages, varied weights, several
micro-batches per rank (fp32). The loss, the pre-clip gradient norm (which a mean instead of
a sum over ranks would halve, while Adam would hide it in the weights) and every parameter
must match after one and two optimizer steps. A checkpoint written by 2 ranks resumes in a
plain trainer and one written by a plain trainer resumes on 2 ranks; each next update equals
the uninterrupted run's. While the ranks run, nothing they or the launcher own listens
beyond loopback.
"""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM, PreTrainedModel

from tests.rollouts import growing_rollout
from tracerl.algorithms import GRPO, compute_advantages
from tracerl.algorithms.transitions import spans_to_transitions
from tracerl.trainer.distributed import DistributedTrainer, split_by_tokens
from tracerl.trainer.launch import spawn
from tracerl.trainer.lead import Leader, follow
from tracerl.trainer.loss import LossConfig
from tracerl.trainer.trainer import Trainer, TrainerConfig, TrainMetrics
from tracerl.types import Transition

TOL = 1e-5
# Small micro-batches: each rank accumulates over several, and the ranks hold different
# numbers of them (the idle passes are exercised).
ONE_STEP = TrainerConfig(
    lr=1e-3, bf16=False, micro_batch_tokens=96, weight_decay=0.01, grad_clip=0.5
)
TWO_STEPS = TrainerConfig(
    lr=1e-3, bf16=False, micro_batch_tokens=96, minibatches=2,
    loss=LossConfig(aggregation="sequence"),
)  # fmt: skip

Params = dict[str, torch.Tensor]


def test_split_by_tokens_is_balanced_deterministic_and_complete() -> None:
    lengths = [90, 10, 50, 50, 40, 30, 30, 20, 5, 5]
    groups = split_by_tokens(lengths, 2)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in g) for g in groups]
    assert abs(loads[0] - loads[1]) <= 10 and sum(loads) == 330
    assert groups == split_by_tokens(lengths, 2)
    assert split_by_tokens([7, 3], 3) == [[0], [1], []]  # more ranks than rows: one idles


def _rows(model: PreTrainedModel, seed: int) -> list[Transition]:
    """8 merged 3-call rollouts in 2 groups, plus 4 rollouts cut into one row per call."""
    rng = random.Random(seed)
    rows: list[Transition] = []
    for k in range(12):
        spans = growing_rollout(
            model, rng, f"s{seed}-r{k}", prompt_len=(5, 14), completion_len=(2, 9), turn_len=(2, 6)
        )
        parts = [spans] if k < 8 else [[s] for s in spans]
        group, reward = f"g{k // 4}", float(rng.random() < 0.5)
        for part in parts:
            rows += spans_to_transitions(part, reward, group_id=group, task_id=group)
    rows = compute_advantages(GRPO(), rows)
    return [r.model_copy(update={"weight": r.weight * rng.uniform(0.5, 1.5)}) for r in rows]


class Job(NamedTuple):
    """What the ranks are given."""

    model_dir: str
    """The tiny model."""
    rows_a: list[Transition]
    """The first batch."""
    rows_b: list[Transition]
    """The second batch."""
    single_ckpt: str
    """A plain trainer's checkpoint after rows_a (TWO_STEPS): resumed on 2 ranks."""
    dp_ckpt: str
    """Where the ranks write their checkpoint after rows_a (TWO_STEPS)."""


def _full(trainer: DistributedTrainer) -> Params:
    """Every parameter, gathered on every rank."""
    return get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))


def _listeners(pids: set[int]) -> list[str]:
    """Listening TCP sockets of `pids`: `ss` lines of the form 'ADDR:PORT ... pid=N'."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return [
        line for line in out.splitlines() if any(f"pid={p}," in line for p in pids)
    ]  # fmt: skip


def _on_each_rank(job: Job, launcher_pid: int) -> dict[str, Any]:
    """Everything the 2-rank side of the tests does; rank 0 returns its results."""
    rank, got = dist.get_rank(), {}
    one = DistributedTrainer(job.model_dir, ONE_STEP)
    got["one_metrics"] = [one.train(job.rows_a)]
    got["one_params"] = [_full(one)]
    got["one_metrics"].append(one.train(job.rows_b))
    got["one_params"].append(_full(one))
    # While both ranks are joined (store, gloo pairs), list what the run listens on.
    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    got["listen"] = _listeners({launcher_pid, *pids}) if rank == 0 else []
    dist.barrier()

    two = DistributedTrainer(job.model_dir, TWO_STEPS)
    got["two_metrics"], got["two_params"] = two.train(job.rows_a), _full(two)
    _write_checkpoint_as_pipeline(DistributedTrainer(job.model_dir, TWO_STEPS), job)

    resumed = DistributedTrainer(job.model_dir, TWO_STEPS)
    resumed.load_weights(Path(job.single_ckpt) / "model")
    saved = torch.load(Path(job.single_ckpt) / "trainer.pt", weights_only=False)
    resumed.load_state(saved if rank == 0 else {})  # only rank 0 needs the files
    got["resumed_metrics"], got["resumed_params"] = resumed.train(job.rows_b), _full(resumed)
    return got


def _write_checkpoint_as_pipeline(trainer: DistributedTrainer, job: Job) -> None:
    """Rank 0 drives (as the pipeline will, through a Leader), rank 1 follows: train on
    rows_a, then write what `Checkpoints.save` writes."""
    if dist.get_rank() != 0:
        assert follow(trainer) == 3
        return
    lead = Leader(trainer)
    lead.train(job.rows_a)
    lead.save_model(Path(job.dp_ckpt) / "model")
    torch.save(lead.state(), Path(job.dp_ckpt) / "trainer.pt")
    lead.close()


def _max_rel(ref: Params, other: Params) -> float:
    assert set(ref) == set(other)
    return max(float((other[k] - ref[k]).norm() / ref[k].norm()) for k in ref)


def _rel(ref: float, other: float) -> float:
    return abs(other - ref) / abs(ref)


def _state(trainer: Trainer) -> Params:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


class Reference(NamedTuple):
    """The single-process runs the ranks must reproduce."""

    one_metrics: list[TrainMetrics]
    one_params: list[Params]
    two_metrics: list[TrainMetrics]
    """TWO_STEPS on rows_a, then on rows_b (uninterrupted)."""
    two_params: list[Params]


def _reference(job: Job, start: Params) -> Reference:
    one = Trainer(job.model_dir, ONE_STEP)
    m1, p1 = one.train(job.rows_a), _state(one)
    m2, p2 = one.train(job.rows_b), _state(one)
    two = Trainer(job.model_dir, TWO_STEPS)
    n1, q1 = two.train(job.rows_a), _state(two)
    two.save_model(Path(job.single_ckpt) / "model")
    torch.save(two.state(), Path(job.single_ckpt) / "trainer.pt")
    n2, q2 = two.train(job.rows_b), _state(two)
    assert _max_rel(start, p1) > 1e-4 and _max_rel(p1, p2) > 1e-4  # the weights do move
    return Reference([m1, m2], [p1, p2], [n1, n2], [q1, q2])


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tmp = tmp_path_factory.mktemp("dp")
    job = Job(
        str(tiny_model_dir), _rows(model, 1), _rows(model, 2), str(tmp / "single"),
        str(tmp / "dp"),
    )  # fmt: skip
    ref = _reference(job, _state_of(model))
    ranks = spawn(_on_each_rank, 2, job, os.getpid(), timeout_s=500)
    return job, ref, ranks


def _state_of(model: PreTrainedModel) -> Params:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_two_ranks_make_the_single_trainers_update(runs: tuple) -> None:
    job, ref, (r0, r1) = runs
    assert len(job.rows_a) == 20 and len({len(r.input_ids) for r in job.rows_a}) > 10
    for step in range(2):
        got, want = r0["one_metrics"][step], ref.one_metrics[step]
        assert _rel(want.loss, got.loss) <= TOL
        assert _rel(want.grad_norm, got.grad_norm) <= TOL
        assert want.grad_norm > ONE_STEP.grad_clip  # the clip is active
        assert got.tokens_per_s > 0 and got.optimizer_steps == 1
        assert _max_rel(ref.one_params[step], r0["one_params"][step]) <= TOL
        # Every rank ends with the same full weights.
        for k, v in r0["one_params"][step].items():
            assert torch.equal(v, r1["one_params"][step][k]), k
    got, want = r0["two_metrics"], ref.two_metrics[0]
    assert got.optimizer_steps == 2 and want.optimizer_steps == 2  # with a proximal pass
    assert _rel(want.loss, got.loss) <= TOL and _rel(want.grad_norm, got.grad_norm) <= TOL
    assert _max_rel(ref.two_params[0], r0["two_params"]) <= TOL


@pytest.mark.slow
def test_checkpoints_resume_on_a_different_number_of_ranks(runs: tuple) -> None:
    job, ref, (r0, _) = runs
    want_m, want_p = ref.two_metrics[1], ref.two_params[1]  # uninterrupted: rows_a, rows_b
    # Written by one process, resumed on two ranks.
    assert _rel(want_m.loss, r0["resumed_metrics"].loss) <= TOL
    assert _max_rel(want_p, r0["resumed_params"]) <= TOL
    # Written by two ranks (an HF dir and Trainer.state()'s format), resumed by one process.
    config = (Path(job.dp_ckpt) / "model" / "config.json").read_text()
    assert '"LlamaForCausalLM"' in config  # the architecture, not the sharded class
    plain = Trainer(job.model_dir, TWO_STEPS)
    plain.load_weights(Path(job.dp_ckpt) / "model")
    plain.load_state(torch.load(Path(job.dp_ckpt) / "trainer.pt", weights_only=False))
    assert _max_rel(ref.two_params[0], _state(plain)) <= TOL
    assert plain.version == 1
    got = plain.train(job.rows_b)
    assert _rel(want_m.loss, got.loss) <= TOL
    assert _max_rel(want_p, _state(plain)) <= TOL


@pytest.mark.slow
def test_nothing_listens_beyond_loopback(runs: tuple) -> None:
    _, _, (r0, _) = runs
    listening = r0["listen"]
    # The launcher's store and gloo's rank-to-rank listeners: there must be some to check.
    assert len(listening) >= 2, listening
    for line in listening:
        local = line.split()[3]
        assert local.startswith(("127.", "[::1]", "[::ffff:127.")), line
