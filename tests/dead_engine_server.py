"""A stand-in for a vLLM API server whose engine core dies while the HTTP server lives on.

Run as `python dead_engine_server.py HOST PORT`. It answers the few routes tracerl's engine
client uses (/health, /v1/completions with one end token, /update_weight_version) until
POST /die; from then on it answers as vLLM's API server over a dead engine core does:
completions 500 (EngineDeadError), /health 503, and the process stays up. Used by
tests/test_engine_server.py, where the real thing takes a minute to start.
"""

from __future__ import annotations

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

DEAD = {"engine": False}
"""Whether POST /die was called (the engine core is dead)."""


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/health":
            self._answer(503 if DEAD["engine"] else 200, {})
        else:
            self._answer(404, {"error": "not found"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        if self.path == "/die":
            DEAD["engine"] = True
            self._answer(200, {})
        elif DEAD["engine"]:
            error = {"message": "EngineCore encountered an issue.", "code": 500}
            self._answer(500, {"error": error})
        elif self.path == "/v1/completions":
            end = int(body["stop_token_ids"][0])
            choice = {
                "token_ids": [end],
                "logprobs": {"token_logprobs": [0.0]},
                "finish_reason": "stop",
            }
            self._answer(200, {"choices": [choice]})
        else:  # /update_weight_version and the other control routes
            self._answer(200, {})

    def _answer(self, status: int, data: dict[str, object]) -> None:
        payload = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: the test reads no access log."""


if __name__ == "__main__":
    ThreadingHTTPServer((sys.argv[1], int(sys.argv[2])), Handler).serve_forever()
