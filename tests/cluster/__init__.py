"""Scripts the cluster tests run inside namespaces of their own (see tests/test_cluster.py)."""
