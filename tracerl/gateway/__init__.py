"""The OpenAI-compatible gateway: serves agents' model calls and records them as spans."""

from tracerl.gateway.app import PARENT_HEADER, ROLLOUT_HEADER, create_app
from tracerl.gateway.core import Gateway, GatewayError, ServedModel

__all__ = [
    "PARENT_HEADER",
    "ROLLOUT_HEADER",
    "Gateway",
    "GatewayError",
    "ServedModel",
    "create_app",
]
