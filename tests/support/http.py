"""A stand-in HTTP server's pieces."""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator


@contextmanager
def serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """A stand-in server with `handler` on a free port for the block: its URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


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


class EmptyStreamTriton(JsonHandler):
    """Triton 2.51 answering generate_stream when no model answered (docs/upstream-facts.md §C): HTTP 200,
    text/event-stream and a chunked body without any event. Every model's config declares the ensemble's and the
    llmapi model's inputs (text_input, max_tokens) and text_output."""

    protocol_version = "HTTP/1.1"

    def do_GET(self):
        self.reply(200, {"input": [{"name": "text_input", "data_type": "TYPE_STRING", "dims": [1]},
                                   {"name": "max_tokens", "data_type": "TYPE_INT32", "dims": [1]}],
                         "output": [{"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]}]})

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.write(b"0\r\n\r\n")
