"""tracerl: reinforcement learning for LLM agents from their traces."""
