"""What every HTTP stand-in shares: its control client's call, serving in a thread of a test's process, and
serving as a process of its own that says where it listens through a ready file."""
from __future__ import annotations

import json
import os
import sys
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Control:
    """A stand-in's control API (`/_fake/...`), as tests and local mode drive it."""

    def __init__(self, url: str, timeout: float = 10.0):
        self.url, self.timeout = url.rstrip("/"), timeout

    def call(self, method: str, what: str, payload: dict | None = None) -> dict:
        data = json.dumps(payload).encode() if payload is not None else None
        req = urllib.request.Request(f"{self.url}/_fake/{what}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"/_fake/{what}: {e.code} {e.read().decode(errors='replace')}") from None


class JsonHandler(BaseHTTPRequestHandler):
    """A stand-in's request handler: HTTP/1.1 with JSON answers, and no request log of http.server's own (each
    stand-in logs what it chooses, never a body)."""
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def _send(self, code: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@dataclass
class Running:
    """A stand-in served by a daemon thread of this process; `.control` drives it, `.stop()` when done."""
    server: ThreadingHTTPServer
    thread: threading.Thread
    url: str
    control_class: type = Control

    @property
    def control(self):
        return self.control_class(self.url)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def in_thread(server: ThreadingHTTPServer, name: str, control_class: type = Control) -> Running:
    server.daemon_threads = True
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True, name=name)
    t.start()
    host, port = server.server_address[:2]
    return Running(server, t, f"http://{host}:{port}", control_class)


def serve(server: ThreadingHTTPServer, host: str, ready_file: str | None, what: str) -> int:
    """Serve until interrupted; first write {pid, host, port, url} to ready_file (whole or not at all)."""
    server.daemon_threads = True
    port = server.server_address[1]
    info = {"pid": os.getpid(), "host": host, "port": port, "url": f"http://{host}:{port}"}
    if ready_file:
        tmp = f"{ready_file}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            json.dump(info, fh)
        os.replace(tmp, ready_file)
    print(f"{what} listening on {info['url']}", flush=True)
    sys.stdout.flush()
    try:
        server.serve_forever(poll_interval=0.1)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
