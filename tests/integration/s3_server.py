"""A real S3 endpoint over HTTP for tests: `moto_server` in a subprocess, plus a small proxy in front of it that
can answer 503 SlowDown (always, or the first time it sees each request) and counts what it saw."""

from __future__ import annotations

import http.client
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

MOTO = Path(sys.executable).with_name("moto_server")
FAKE_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret", "AWS_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class MotoServer:
    """`moto_server` on 127.0.0.1:<free port>; its request log is kept to count GETs per key."""

    def __init__(self, log_dir: Path, extra_env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"moto-{self.port}.log"
        env = {**os.environ, **FAKE_ENV, **(extra_env or {})}
        self._out = open(self.log, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen([str(MOTO), "-H", "127.0.0.1", "-p", str(self.port)], stdout=self._out,
                                        stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 90  # a loaded machine can take a while
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/moto-api/", timeout=1)
                break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto_server did not start: {self.log.read_text()[-2000:]}") from None
                time.sleep(0.2)

    def requests(self, method: str, path_prefix: str) -> list[str]:
        """Request lines seen so far, e.g. requests("GET", "/bucket/train/")."""
        # werkzeug colours some status lines: skip the ANSI escape codes before the method.
        pattern = re.compile(rf'"(?:\x1b\[[0-9;]*m)*{method} ({re.escape(path_prefix)}\S*) HTTP')
        return [m.group(1) for m in pattern.finditer(self.log.read_text(errors="replace"))]

    def require_auth(self) -> None:
        """From now on refuse every request not signed with the access key of one of moto's IAM users (moto's
        INITIAL_NO_AUTH_ACTION_COUNT, reset through its API so the set-up before needs no credentials)."""
        request = urllib.request.Request(f"{self.url}/moto-api/reset-auth", data=b"0", method="POST",
                                         headers={"Content-Type": "text/plain"})
        urllib.request.urlopen(request, timeout=10).read()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()  # our own child, by PID
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self._out.close()


SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message><RequestId>test</RequestId></Error>")


class FaultyProxy:
    """HTTP proxy to `target` that answers 503 SlowDown: every time (`mode="always"`), or the first time each
    distinct request arrives (`mode="first"`, so one retry succeeds), or never (`mode="never"`, counting only)."""

    def __init__(self, target: str | None, mode: str = "first") -> None:
        self.target, self.mode = target, mode
        self.seen = 0
        self.failed = 0
        self._first: set[str] = set()
        lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                key = f"{self.command} {self.path} {self.headers.get('Range', '')}"
                with lock:
                    proxy.seen += 1
                    first = key not in proxy._first
                    fail = proxy.mode == "always" or proxy.target is None or (proxy.mode == "first" and first)
                    proxy._first.add(key)
                    proxy.failed += fail
                if fail:
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOW_DOWN)))
                    self.end_headers()
                    self.wfile.write(SLOW_DOWN)
                    return
                host = proxy.target.removeprefix("http://")  # type: ignore[union-attr]
                conn = http.client.HTTPConnection(host, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                headers["Host"] = self.headers.get("Host", host)
                conn.request(self.command, self.path, body=body, headers=headers)
                response = conn.getresponse()
                data = response.read()
                self.send_response(response.status)
                for k, v in response.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                # A HEAD has no body but must report the object's length.
                length = response.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
