"""A real S3-API server on 127.0.0.1 for the tests (moto's standalone server), and a
proxy in front of it that counts the bytes it serves and can inject faults: 500/503
responses, connections dropped without an answer, and stalls (every request held until
the stall ends)."""

from __future__ import annotations

import http.client
import random
import socket
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from moto.server import ThreadedMotoServer  # a dev dependency: missing, the tests fail


def start_moto() -> tuple[object, str]:
    import logging

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:  # noqa: ANN001
        """A client killed mid-request (a fault a test injected) resets its connection:
        not worth a traceback; anything else is still printed."""
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            super().handle_error(request, client_address)


class FaultProxy:
    """HTTP proxy to ``upstream``. ``fault_rate`` of requests fail: half answered with
    500/503, half with the connection closed before any answer.

    ``injected`` counts the faults by kind (``"dropped"``, ``"500"``, ``"503"``). Every
    random draw happens under one lock, in request order, so a seed decides how many of
    the first N requests fail whatever the order concurrent requests arrive in."""

    def __init__(self, upstream: str, fault_rate: float = 0.0, seed: int = 0) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.fault_rate = fault_rate
        self.random = random.Random(seed)
        self.lock = threading.Lock()
        self.bytes_served = 0  # response bodies of GETs
        self.injected: Counter[str] = Counter()
        self.requests = 0
        self.open = threading.Event()  # cleared while the store stalls
        self.open.set()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _handle(self) -> None:
                proxy.open.wait()
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                with proxy.lock:
                    proxy.requests += 1
                    fault = proxy._draw_fault()
                    if fault:
                        proxy.injected[fault] += 1
                if fault == "dropped":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)  # no answer
                    return
                if fault:
                    payload = b"<Error><Code>SlowDown</Code></Error>"
                    self.send_response(int(fault))
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                headers["Host"] = f"{proxy.upstream[0]}:{proxy.upstream[1]}"
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                if self.command == "GET":
                    with proxy.lock:
                        proxy.bytes_served += len(data)
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                size = resp.getheader("Content-Length") if self.command == "HEAD" else len(data)
                self.send_header("Content-Length", str(size))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = _QuietServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def faults(self) -> int:
        """Faults injected so far, of every kind."""
        return sum(self.injected.values())

    def stall(self, seconds: float) -> None:
        """Hold every request for ``seconds`` from now (an object store that hangs),
        without blocking the caller."""
        self.open.clear()
        threading.Timer(seconds, self.open.set).start()

    def _draw_fault(self) -> str | None:
        """The fault for the next request (called under ``lock``), or None."""
        roll = self.random.random()
        if roll >= self.fault_rate:
            return None
        if roll < self.fault_rate / 2:
            return "dropped"
        return self.random.choice(["500", "503"])

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
