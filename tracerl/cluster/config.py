"""ClusterConfig: where a run's runners, engine servers and trainer ranks go when Ray places
them.

Torch-free and Ray-free: TrainConfig holds it, and reading a config imports neither.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ClusterConfig"]


class ClusterConfig(BaseModel):
    """A run spread over a Ray cluster (off unless `address` is given)."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    address: str = ""
    """The Ray cluster: "" runs everything in this process tree (Ray is not imported);
    "local" starts a Ray of its own on this machine for the run and stops it after; anything
    else is joined as given ("127.0.0.1:6379", "auto", "ray://head:10001") and left running."""
    runners_per_node: int = Field(default=1, ge=1)
    """Runner actors on each node; each runs `runner.concurrency` rollouts at once, so a node
    runs runners_per_node x runner.concurrency."""
    nodes: int = Field(default=0, ge=0)
    """Nodes to spread the runners over, one placement-group bundle each (STRICT_SPREAD: never
    two on one node); 0: every node alive when the run starts."""
    runner_cpus: float = Field(default=0.25, ge=0)
    """CPUs each runner actor reserves (agents mostly wait on the model and their tools)."""
    trainer_ranks: int = Field(default=1, ge=1)
    """Data-parallel trainer ranks (FSDP2). The driver is rank 0 and leads; ranks 1..N-1 are
    Ray actors on the driver's node (the rendezvous and gloo listen on loopback only)."""
    rank_cpus: float = Field(default=1.0, ge=0)
    """CPUs each trainer rank actor reserves."""
    rank_gpus: float = Field(default=0.0, ge=0)
    """GPUs each trainer rank actor reserves: 1 with `device = "cuda"` (ranks then use NCCL)."""
    engine_cpus: float = Field(default=1.0, gt=0)
    """CPUs each engine replica's actor reserves (engine.kind "hf_server" or "vllm": Ray
    starts each of the engine.replicas servers on a node, spread over the nodes)."""
    engine_gpus: float = Field(default=0.0, ge=0)
    """GPUs each engine replica's actor reserves: on a GPU cluster 1 (or the GPUs of one
    server); its server sees the GPUs Ray gave the actor (CUDA_VISIBLE_DEVICES)."""
    gateway_host: str = "127.0.0.1"
    """Where the gateway and its store API listen; runners on other machines must reach it.
    127.0.0.1 serves only nodes sharing this machine's loopback (a one-machine cluster, the
    tests); a real cluster needs an address the nodes can reach, on a private network."""
    num_cpus: int | None = Field(default=None, ge=1)
    """address "local": CPUs the started Ray offers (default: all of this machine's)."""
    object_store_memory: int | None = Field(default=None, ge=78_643_200)
    """address "local": bytes of Ray's object store (default: Ray's, 30% of memory). Little
    passes through it: actor calls carry rollout counts and configs, never weights."""
    namespace: str = "tracerl"
    """Ray namespace of the run's actors."""
    place_timeout_s: float = Field(default=120.0, gt=0)
    """How long to wait for Ray to place the runners, engine servers and trainer ranks."""
