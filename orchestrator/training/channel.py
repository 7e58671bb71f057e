"""The run's report channel: rank 0's metrics and the controller's events go straight to the process
that drives the run (the command's driver, or a Tune trial's actor), over one TCP connection per
sender.

Why not a Ray queue actor: one more Ray process for every run (started while the worker group
starts, ~1% of a core at rest even when nothing is sent, more when polled). The driver is reachable
from every node already (Ray's workers call back their owner there), so the channel listens on the
driver's node address and costs nothing while nothing is sent. Senders authenticate with the run's
key (HMAC, multiprocessing's handshake) before anything is read. Each item is acknowledged once it
is in the driver's queue: a sender's `put` returning means the driver has it, so everything sent
before `fit()` returns is there when it does.
"""

from __future__ import annotations

import queue
import secrets
import socket
import threading
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

CONNECT_TIMEOUT_S = 10.0  # a driver that is gone: the sender's warning, not a hung worker
ACK = b"1"


class ChannelSender:
    """A sender's end: the driver's address and the run's key. Picklable (crosses to the workers in
    the spec and to Ray Train's controller in its callbacks) without its connection, which the first
    `put` opens."""

    def __init__(self, address: tuple[str, int], key: bytes) -> None:
        self.address, self.key = address, key
        self._conn: Connection | None = None
        # one item at a time on the connection (the controller's two callbacks share it)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ChannelSender({self.address[0]}:{self.address[1]})"  # never the key

    def __getstate__(self) -> dict[str, Any]:
        return {"address": self.address, "key": self.key}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["address"], state["key"])  # type: ignore[misc]

    def put(self, item: dict[str, Any]) -> None:
        """Send `item` and wait until the driver has it. Raises OSError or EOFError when the driver
        is gone."""
        with self._lock:
            try:
                if self._conn is None:
                    self._conn = self._connect()
                self._conn.send(item)
                if self._conn.recv_bytes() != ACK:
                    raise EOFError("the report channel answered out of turn")
            except BaseException:
                self._close()  # the next put connects again, or fails again
                raise

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _connect(self) -> Connection:
        sock = socket.create_connection(self.address, timeout=CONNECT_TIMEOUT_S)
        sock.settimeout(None)  # blocking again: Connection reads and writes the descriptor directly
        conn = Connection(sock.detach())
        try:
            answer_challenge(conn, self.key)
            deliver_challenge(conn, self.key)
        except BaseException:
            conn.close()
            raise
        return conn


class ReportChannel:
    """The driver's end: a listener on `host` and one reader thread per sender, feeding one
    in-process queue. `get` blocks on that queue (no polling); `close` ends the listener and gives
    `get` an end mark."""

    END = None

    def __init__(self, host: str) -> None:
        self.key = secrets.token_bytes(32)
        self.items: queue.Queue[dict[str, Any] | None] = queue.Queue()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, 0), family=family)
        self._closed = threading.Event()
        self._closing = threading.Lock()  # an item is in the queue before the end mark, or refused
        self._readers: set[int] = set()  # the senders' connections (descriptors), shut at close
        self.sender = ChannelSender(self._listener.getsockname()[:2], self.key)
        threading.Thread(target=self._accept, name="orchestrator-reports-listener",
                         daemon=True).start()

    def get(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The next item, or `END` once the channel is closed and emptied. Raises queue.Empty after
        `timeout`."""
        return self.items.get(timeout=timeout)

    def close(self) -> None:
        """No more senders: what was sent is in the queue already (each item was acknowledged), then
        the end."""
        with self._closing:
            if self._closed.is_set():
                return
            self._closed.set()
            self.items.put(self.END)
            for fd in self._readers:  # wakes the threads blocked on them (closing alone does not)
                _shutdown(fd)
        _shutdown(self._listener.fileno())
        self._listener.close()

    def __enter__(self) -> ReportChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._read, args=(sock,), name="orchestrator-reports-reader",
                             daemon=True).start()

    def _read(self, sock: socket.socket) -> None:
        """One sender's items, in order. The handshake comes first, here, so a silent peer holds
        only its thread."""
        conn = Connection(sock.detach())
        with self._closing:
            self._readers.add(conn.fileno())
        try:
            deliver_challenge(conn, self.key)
            answer_challenge(conn, self.key)
            while True:
                item = conn.recv()
                with self._closing:
                    # a late sender is told so by the connection's end, not acknowledged
                    if self._closed.is_set():
                        return
                    self.items.put(item)
                conn.send_bytes(ACK)
        # the sender ended, or failed the handshake
        except (EOFError, OSError, AuthenticationError):
            pass
        finally:
            with self._closing:
                self._readers.discard(conn.fileno())
                conn.close()


def _shutdown(fd: int) -> None:
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.detach()  # the descriptor stays its owner's to close
