"""A stand-in HTTP server's pieces."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler

class JsonHandler(BaseHTTPRequestHandler):
    """A stand-in HTTP server's handler: JSON replies, no request log."""

    def reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass
