"""Past one machine: a training run whose runners and trainer ranks Ray places.

`tracerl train cfg.toml --cluster.address <ray address>` (or `[cluster]` in the file) runs
the same pipeline with its rollouts run by Ray actors spread over the cluster's nodes
(runners.py) and its trainer as data-parallel ranks (ranks.py); session.py joins (or
starts) Ray for the run and tears down what the run placed. config.py is the only module
here that does not import Ray: TrainConfig holds a ClusterConfig, and a run without
`cluster.address` never imports Ray.
"""
