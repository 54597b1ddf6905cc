"""Data-parallel trainer ranks for a cluster run: the driver is rank 0, Ray actors the rest.

Rank 0 lives in the driver and leads (tracerl.trainer.lead.Leader): the pipeline calls it
like a Trainer, and it broadcasts each call to ranks 1..N-1, Ray actors running `follow`.
Rank 0 is the driver because the engines are there too: `engine_state_dict` gathers the
full weights on rank 0, in the process whose engine serves them, so no step's weights
travel through Ray; checkpoints and outputs are written by the same process as on one
machine.

The follower actors are pinned to the driver's node: the rendezvous store (served from the
driver) and gloo's listeners are on loopback only. Ranks on other nodes would need both
on an address the nodes share; not in this version.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import ray
import torch
import torch.distributed as dist
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tracerl.cluster.config import ClusterConfig
from tracerl.trainer.config import TrainerConfig
from tracerl.trainer.distributed import DistributedTrainer
from tracerl.trainer.launch import Rendezvous, init_rank, loopback_store
from tracerl.trainer.lead import Leader, follow

__all__ = ["TrainerRanks"]


@ray.remote(max_restarts=0)
class RankActor:
    """One follower rank: join the group, build the sharded trainer, run rank 0's calls."""

    def run(
        self, rank: int, world: int, port: int, model_dir: str, cfg: TrainerConfig, device: str
    ) -> int:
        """Follow rank 0 until it closes; returns how many calls were run."""
        torch.set_num_threads(1)
        init_rank(rank, world, port, _backend(device))
        try:
            return follow(DistributedTrainer(model_dir, cfg, device))
        finally:
            dist.destroy_process_group()


def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


class TrainerRanks:
    """Ranks 1..N-1 as Ray actors beside the driver; `lead` makes the driver rank 0."""

    def __init__(self, cfg: ClusterConfig) -> None:
        self.cfg = cfg
        self.leader: Leader | None = None
        self.actors: list[Any] = []
        self.following: list[Any] = []
        self._rdzv: Rendezvous | None = None

    def lead(self, model_dir: str | Path, cfg: TrainerConfig, device: str) -> Leader:
        """Start the follower actors, join the group as rank 0, and return its Leader."""
        if self.leader is not None:
            raise ValueError("cluster.trainer_ranks > 1 trains one policy per run")
        if cfg.lora is not None:
            raise ValueError("cluster.trainer_ranks > 1 does not train LoRA adapters")
        world = self.cfg.trainer_ranks
        self._rdzv = loopback_store(world)
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        for rank in range(1, world):
            actor = RankActor.options(  # type: ignore[attr-defined]
                num_cpus=self.cfg.rank_cpus, num_gpus=self.cfg.rank_gpus, scheduling_strategy=here
            ).remote()
            self.actors.append(actor)
            args = (rank, world, self._rdzv.port, str(model_dir), cfg, device)
            self.following.append(actor.run.remote(*args))
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        init_rank(0, world, self._rdzv.port, _backend(device))
        self.leader = Leader(DistributedTrainer(model_dir, cfg, device))
        return self.leader

    def close(self) -> None:
        """Release the followers, leave the group, and end the actors."""
        if self.leader is not None:
            self.leader.close()
            ray.wait(self.following, num_returns=len(self.following), timeout=60.0)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        if dist.is_initialized():
            dist.destroy_process_group()
        if self._rdzv is not None:
            self._rdzv.sock.close()
