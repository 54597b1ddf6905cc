"""Past one machine: a training run whose runners, engine servers and trainer ranks Ray places.

    tracerl train my_run.toml --cluster.address 10.0.0.1:6379 --cluster.trainer_ranks 2

or, in the run's file,

    [cluster]
    address = "10.0.0.1:6379"     # "local": a Ray of the run's own on this machine
    runners_per_node = 1          # each runs runner.concurrency rollouts at once
    trainer_ranks = 2
    gateway_host = "10.0.0.1"     # an address the nodes reach (private network)

runs the same pipeline, with the same progress, metrics and outputs, except that:

- runners are Ray actors spread over the cluster's nodes (runners.py): each runs a tracerl
  Runner against the gateway URL and the store's HTTP API (or Postgres, with a
  `postgresql://` store), the agent unchanged. Every node loads the agent from the run's
  `agent` spec, so its file must be at the same path there (and tracerl installed);
- the trainer is N data-parallel ranks (ranks.py): the driver is rank 0 and leads, ranks
  1..N-1 are actors on the driver's node;
- a server engine's replicas (`engine.kind = "hf_server"` or "vllm", `engine.replicas`) are
  servers started by Ray actors spread over the nodes (engines.py), reserving
  `engine_cpus` / `engine_gpus` each; the engine in the driver routes to them and syncs
  their weights as to local ones (a multi-machine cluster needs `engine.weights_dir` on a
  shared filesystem). An in-process engine (`engine.kind = "hf"`) stays in the driver,
  beside the gateway and the store;
- metrics add `cluster/runners/<node>` (live runner actors), `cluster/rollouts/<node>`
  (rollouts they finished), `cluster/nodes` and `cluster/engines/<node>` (engine servers).

session.py joins (or starts) Ray for the run and tears down what the run placed. config.py
is the only module here that does not import Ray: TrainConfig holds a ClusterConfig, and a
run without `cluster.address` never imports Ray.
"""
