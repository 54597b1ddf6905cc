"""Data-parallel training: the same update as one `Trainer`, computed by N ranks with FSDP2.

`DistributedTrainer` is a `Trainer` whose model is sharded with `fully_shard` over the
default process group (gloo on CPU, NCCL on GPU). Every rank calls the same methods in the
same order with the same arguments (SPMD); `Trainer.train` runs unchanged on each rank —
the same shuffle (same seed), the same mini-batches, the same schedule — and only the
optimizer step is split:

1. the step's rows are split over ranks balanced by tokens (`split_by_tokens`);
2. each rank packs its rows; the ranks add up their loss denominators sum(W) first, so each
   rank's loss is its own numerator over the WHOLE step's denominator;
3. each rank runs forward+backward (`backward_micro_batches`, the function `loss_and_grads`
   runs); ranks with fewer micro-batches run zero-weight ones, since every FSDP forward and
   backward is a collective that all ranks must join;
4. FSDP2 reduce-scatters the gradients as a SUM (by default it divides by the number of
   ranks, which suits a per-rank mean loss, not a share of one global sum), so each shard
   holds exactly the whole batch's gradient; clipping uses the global norm (DTensor);
5. AdamW steps each rank's shard.
Full weights exist once gathered: `engine_state_dict` and `save_model` gather them on
rank 0 (`get_model_state_dict(full_state_dict=True, cpu_offload=True)`).

Checkpoints are full state dicts in `Trainer`'s own format (an HF model dir for the weights;
`state()` with an index-keyed optimizer state, as `torch.optim.AdamW.state_dict()` writes
it), written by rank 0. So a checkpoint of N ranks resumes on M ranks or in a plain
`Trainer`, and the other way round, with the checkpoint code unchanged. Loading broadcasts
from rank 0 (`broadcast_from_rank0`): only rank 0 needs to read the files. Full state dicts
cost one gathered copy on rank 0's CPU; sharded DCP checkpoints would avoid that for
models too big for one host, and would need a reshard step to change the rank count.

Not covered: LoRA (the adapter merge for the engine assumes unsharded weights), and the
entropy top-q selection is decided per micro-batch, which differs with the rows a rank holds.
`lead`/`follow` (tracerl.trainer.lead) let rank 0's pipeline drive the others.
"""

from __future__ import annotations

import heapq
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from tracerl.precision import Precision, use_bf16
from tracerl.trainer.config import TrainerConfig
from tracerl.trainer.gradients import backward_micro_batches, forward_logprobs, loss_denominator
from tracerl.trainer.loss import LossMetrics
from tracerl.trainer.packing import MicroBatch, pack
from tracerl.trainer.trainer import Trainer
from tracerl.types import Transition

__all__ = ["DistributedTrainer", "split_by_tokens"]

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
"""Gather full tensors onto rank 0's CPU; the other ranks get empty dicts."""
FROM_RANK0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
"""Load a full state dict that only rank 0 holds; the tied output head may be absent."""


def split_by_tokens(lengths: list[int], parts: int) -> list[list[int]]:
    """Indices of `lengths` in `parts` groups of near-equal token sums, each ascending.

    Greedy longest-first: each item goes to the group with the fewest tokens so far (the
    lowest-numbered on ties), so the split is deterministic and every rank computes it.
    """
    heap = [(0, p) for p in range(parts)]
    groups: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, p = heapq.heappop(heap)
        groups[p].append(i)
        heapq.heappush(heap, (load + lengths[i], p))
    return [sorted(g) for g in groups]


class DistributedTrainer(Trainer):
    """A `Trainer` sharded over the default process group; every rank calls every method.

    Build it on each rank after `dist.init_process_group` (tracerl.trainer.launch.init_rank
    or a Ray actor's own). `train`, `engine_state_dict`, `save_model`, `load_weights`,
    `state` and `load_state` are collectives: all ranks call them, in the same order, with
    the same rows; what they return is meaningful on rank 0 (full weights, full optimizer
    state), while the others get empty dicts.
    """

    def __init__(self, model_dir: str | Path, cfg: TrainerConfig, device: str = "cpu") -> None:
        if not dist.is_initialized():
            raise RuntimeError("DistributedTrainer needs an initialised default process group")
        if cfg.lora is not None:
            raise NotImplementedError("LoRA is not supported by the data-parallel trainer yet")
        if device == "cuda":  # each rank its own GPU, chosen by whoever started the rank
            device = f"cuda:{torch.cuda.current_device()}"
        super().__init__(model_dir, cfg, device)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        _shard(self.model, self.device.type, self.world_size)
        # The optimizer must hold the sharded parameters, which replaced the full ones.
        self.optimizer, self.scheduler = self._build_optimizer()

    def _choose_precision(self, cfg: TrainerConfig, device: str) -> Precision:
        """Rank 0's choice on every rank: a timed `auto` could differ between ranks, and the
        ranks of one model must compute alike."""
        mine = super()._choose_precision(cfg, device)
        chosen: list[object] = [mine]
        dist.broadcast_object_list(chosen, src=0)
        theirs = chosen[0]
        assert isinstance(theirs, Precision)
        return theirs.model_copy(update={"device": mine.device})

    def _optimizer_step(
        self, rows: list[Transition], idx: list[int], proximal: list[Tensor] | None
    ) -> tuple[float, float | None, list[LossMetrics], int]:
        """This rank's share of one optimizer step, then the step itself on its shard."""
        share = split_by_tokens([len(rows[i].input_ids) for i in idx], self.world_size)
        mine = [idx[k] for k in share[self.rank]]
        picked = [rows[i] for i in mine]
        prox = None if proximal is None else [proximal[i] for i in mine]
        batches = pack(picked, self.cfg.micro_batch_tokens)
        denom, most = self._denominator_and_most(batches)
        out = backward_micro_batches(
            self.model, picked, _padded(batches, most), self.cfg, denom, prox,
            self._reference_logprobs,
        )  # fmt: skip
        local = [out.loss, float(sum(int(mb.attention_mask_BT.sum()) for mb in batches))]
        loss, tokens = self._sum_over_ranks(local)
        metrics = _gather_lists(out.metrics[: len(batches)])  # the idle passes are not data
        return loss, self.apply_gradients(loss), metrics, int(tokens)

    def _sum_over_ranks(self, values: list[float]) -> list[float]:
        """Each value summed over the ranks (float64, on the trainer's device)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def _denominator_and_most(self, batches: list[MicroBatch]) -> tuple[float, int]:
        """The whole step's loss denominator and the most micro-batches any rank holds."""
        # On the trainer's device: NCCL reduces GPU tensors only.
        local_R2 = torch.tensor(
            [[loss_denominator(batches, self.cfg), float(len(batches))]],
            dtype=torch.float64,
            device=self.device,
        )
        every_R2 = [torch.zeros_like(local_R2) for _ in range(self.world_size)]
        dist.all_gather(every_R2, local_R2)
        all_R2 = torch.cat(every_R2).cpu()
        # Summed in rank order, like the single trainer's sum over micro-batches.
        return float(sum(all_R2[:, 0].tolist())), int(all_R2[:, 1].max())

    def _clip_gradients(self) -> float:
        """Clip by the global norm of the sharded gradients; returns the pre-clip norm, the
        same on every rank (as the summed loss is), so every rank steps or skips alike."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm)

    @torch.no_grad()
    def _proximal(self, rows: list[Transition]) -> list[Tensor]:
        """Every row's log-probs before the update: each rank scores its share, all gather."""
        mine = split_by_tokens([len(r.input_ids) for r in rows], self.world_size)[self.rank]
        picked = [rows[i] for i in mine]
        batches = pack(picked, self.cfg.micro_batch_tokens)
        _, most = self._denominator_and_most(batches)
        scored: dict[int, Tensor] = {}
        for mb in _padded(batches, most):
            logp_BT = forward_logprobs(self.model, mb, use_bf16(self.cfg.bf16, self.device))
            for b, i in enumerate(mb.row_indices):
                scored[mine[i]] = logp_BT[b, : len(picked[i].input_ids)].cpu()
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, scored)
        out = {i: t for part in every for i, t in part.items()}
        return [out[i].to(self.device) for i in range(len(rows))]

    def engine_state_dict(self) -> dict[str, Tensor]:
        """Full weights on rank 0's CPU ({} on the others); the same keys as `Trainer`'s."""
        return _tensors(get_model_state_dict(self.model, options=FULL))

    def save_model(self, out_dir: str | Path) -> None:
        """Rank 0 writes a standard HF model dir (what `Trainer.save_model` writes)."""
        full = _tensors(get_model_state_dict(self.model, options=FULL))
        if self.rank == 0:
            _save_hf(self.model.config, full, Path(out_dir))
        dist.barrier()  # the dir is complete when any rank returns

    def load_weights(self, model_dir: str | Path) -> None:
        """Load `save_model`'s weights: rank 0 reads the files and broadcasts them."""
        state: dict[str, Any] = {}
        error = None
        if self.rank == 0:
            try:
                state = _read_checked(model_dir, set(self.model.state_dict()), self.model)
            except (FileNotFoundError, ValueError) as e:
                error = e
        sent: list[Any] = [error]
        dist.broadcast_object_list(sent, src=0)  # every rank raises, or none does
        if sent[0] is not None:
            raise sent[0]
        set_model_state_dict(self.model, state, options=FROM_RANK0)

    def state(self) -> dict:
        """`Trainer.state()` on rank 0 (its optimizer state gathered and index-keyed, as a
        single trainer's); the others get the same keys with an empty optimizer state."""
        full = get_optimizer_state_dict(self.model, self.optimizer, options=FULL)
        out = _small_state(self)
        out["optimizer"] = _by_index(full, self._names()) if self.rank == 0 else {}
        return out

    def load_state(self, state: dict) -> None:
        """Restore a `state()` of any number of ranks (or a `Trainer`'s); rank 0's counts."""
        small: list[Any] = [{k: v for k, v in state.items() if k != "optimizer"}]
        dist.broadcast_object_list(small, src=0)
        optim = _by_name(state["optimizer"], self._names()) if self.rank == 0 else {}
        set_optimizer_state_dict(self.model, self.optimizer, optim, options=FROM_RANK0)
        self.scheduler.load_state_dict(small[0]["scheduler"])
        self.version = int(small[0]["version"])
        self._rng.setstate(small[0]["rng"])
        torch.set_rng_state(small[0]["torch_rng"])

    def _names(self) -> list[str]:
        """Names of the optimizer's parameters, in its order (`Trainer`'s index order)."""
        return [n for n, p in self.model.named_parameters() if p.requires_grad]


def _small_state(trainer: Trainer) -> dict:
    """`Trainer.state()` without its optimizer state (a sharded one is gathered apart)."""
    return {
        "scheduler": trainer.scheduler.state_dict(),
        "version": trainer.version,
        "rng": trainer._rng.getstate(),
        "torch_rng": torch.get_rng_state(),
    }


def _shard(model: torch.nn.Module, device_type: str, world_size: int) -> None:
    """FSDP2 over all ranks: one group per decoder layer, the rest (embeddings, tied head,
    final norm) in the root's; gradients reduced as a plain sum."""
    mesh = init_device_mesh(device_type, (world_size,))
    for layer in model.model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # Each rank's loss already carries 1/(global denominator): its gradients are summands.
    # The setting is per FSDP group (the root's covers only its own parameters), and gloo
    # has no pre-multiplied sum, so the reduction must be a plain SUM op.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def _padded(batches: list[MicroBatch], most: int) -> list[MicroBatch]:
    """`batches` followed by idle micro-batches up to `most`: forward and backward run on
    them (FSDP's collectives need every rank) but their loss weight, hence gradient, is 0."""
    return batches + [_idle_batch() for _ in range(most - len(batches))]


def _idle_batch() -> MicroBatch:
    """Two real tokens, nothing sampled: attention on (fully masked rows give NaN softmax),
    loss mask 0, no rows of the step."""
    zeros_BT = torch.zeros(1, 2)
    return MicroBatch(
        input_ids_BT=torch.zeros(1, 2, dtype=torch.long),
        attention_mask_BT=torch.ones(1, 2, dtype=torch.long),
        loss_mask_BT=zeros_BT,
        behaviour_logp_BT=zeros_BT,
        adv_BT=zeros_BT,
        weight_BT=zeros_BT,
        temperature_B=torch.ones(1),
        row_indices=[],
    )


def _tensors(state: dict[str, Any]) -> dict[str, Tensor]:
    """A full model state dict, typed as what it holds (plain tensors, no DTensors)."""
    return {k: v for k, v in state.items() if isinstance(v, Tensor)}


def _gather_lists(local: list[Any]) -> list[Any]:
    """Every rank's list, concatenated in rank order, on every rank."""
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, local)
    return [x for part in every for x in part]


def _by_index(full: dict, names: list[str]) -> dict:
    """A name-keyed full optimizer state as `torch.optim` keys it: by parameter index."""
    index = {n: i for i, n in enumerate(names)}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in full["param_groups"]]
    return {"state": {index[n]: s for n, s in full["state"].items()}, "param_groups": groups}


def _by_name(indexed: dict, names: list[str]) -> dict:
    """The inverse of `_by_index`: what `set_optimizer_state_dict` takes."""
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in indexed["param_groups"]]
    return {"state": {names[i]: s for i, s in indexed["state"].items()}, "param_groups": groups}


def _read_checked(
    model_dir: str | Path, keys: set[str], model: torch.nn.Module
) -> dict[str, Tensor]:
    """The safetensors of an HF model dir, checked against the model's keys (a tied head
    may be absent), as `Trainer.load_weights` checks them."""
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {model_dir}")
    state: dict[str, Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    tied = set(getattr(model, "_tied_weights_keys", None) or ["lm_head.weight"])
    missing, unexpected = keys - set(state), set(state) - keys
    if unexpected or missing - tied:
        raise ValueError(f"weights in {model_dir} do not fit: {missing=} {unexpected=}")
    return state


def _save_hf(config: Any, state: dict[str, Tensor], out_dir: Path) -> None:
    """An HF model dir from full weights. A plain model is built on the meta device and
    given the tensors, since the sharded model's class (FSDP<Model>) would be written as
    the architecture."""
    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    shell.load_state_dict(state, assign=True)
    shell.tie_weights()
    shell.save_pretrained(str(out_dir))
