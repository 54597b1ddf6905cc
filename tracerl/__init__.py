"""tracerl: reinforcement learning for LLM agents from their traces."""

import os

# torch's OpenMP threads spin while waiting for work by default. tracerl runs an engine, a
# trainer, an HTTP server and many agent threads in one process on few cores: spinning
# threads starve the others (2-thread steps measured 5-17x slower beside another busy
# process). Passive waiting must be chosen before torch is first imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
