"""Past one machine: a training run whose runners and trainer ranks Ray places.

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
- the engines stay in the driver process, beside the gateway and the store;
- metrics add `cluster/runners/<node>` (live runner actors), `cluster/rollouts/<node>`
  (rollouts they finished) and `cluster/nodes`.

session.py joins (or starts) Ray for the run and tears down what the run placed. config.py
is the only module here that does not import Ray: TrainConfig holds a ClusterConfig, and a
run without `cluster.address` never imports Ray.
"""
