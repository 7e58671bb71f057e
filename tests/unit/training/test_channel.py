"""The run's report channel (training/channel.py): what a sender's `put` returned for is in the driver's queue, in
order, before the end mark; nobody without the run's key gets anything in; a sender after the end is told so."""

from __future__ import annotations

import multiprocessing
import pickle
import queue
import threading

import pytest

from orchestrator.report.progress import ReportConsumer
from orchestrator.training.channel import ChannelSender, ReportChannel


def _send(sender: ChannelSender, first: int, count: int) -> None:
    for i in range(first, first + count):
        sender.put({"step": i, "loss": 1.0 / (i + 1)})
    sender.close()


def test_what_a_sender_put_is_in_the_queue_in_order_then_the_end() -> None:
    channel = ReportChannel("127.0.0.1")
    sender = pickle.loads(pickle.dumps(channel.sender))  # as the workers and the controller get it
    sender.put({"step": 0})
    assert channel.items.qsize() == 1  # acknowledged: already in the driver's queue when put returned
    # Another process (a worker elsewhere) and this one, at once: each sender's items stay in its order.
    other = multiprocessing.get_context("spawn").Process(target=_send, args=(channel.sender, 100, 50))
    other.start()
    _send(sender, 1, 50)
    other.join(60)
    assert other.exitcode == 0
    channel.close()
    got = []
    while (item := channel.get(timeout=5)) is not channel.END:
        got.append(item["step"])
    assert [s for s in got if s < 100] == list(range(51))
    assert [s for s in got if s >= 100] == list(range(100, 150))
    with pytest.raises((EOFError, OSError)):  # after the end: refused, not acknowledged and lost
        sender.put({"step": 999})
    assert channel.items.empty()


def _ipv6_loopback() -> bool:
    import socket

    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        return False
    return True


@pytest.mark.parametrize("host", ["127.0.0.1", pytest.param("::1", marks=pytest.mark.skipif(
    not _ipv6_loopback(), reason="no IPv6 loopback here"))])
def test_a_sender_without_the_runs_key_gets_nothing_in(host: str) -> None:
    from multiprocessing import AuthenticationError

    with ReportChannel(host) as channel:
        stranger = ChannelSender(channel.sender.address, b"x" * 32)
        with pytest.raises(AuthenticationError):
            stranger.put({"event": "checkpoint", "step": 1, "path": "/tmp/evil"})
        channel.sender.put({"step": 1})  # the run's own sender still gets through
        assert channel.get(timeout=5) == {"step": 1}
        assert channel.items.empty()
    # Its pickled form and its repr carry the address, never an open connection; the repr not the key.
    assert channel.sender.key.hex() not in repr(channel.sender)
    assert pickle.loads(pickle.dumps(channel.sender))._conn is None


def test_the_consumer_hands_over_every_item_then_ends() -> None:
    """The driver's thread hands every item over before the end, those that came in just before it left too."""
    handled: list[int] = []
    entered = threading.Event()
    channel = ReportChannel("127.0.0.1")
    with ReportConsumer(channel, lambda item: (handled.append(item["step"]), entered.set())) as consumer:
        channel.sender.put({"step": 1})
        assert entered.wait(5)
        for step in range(2, 20):
            channel.sender.put({"step": step})
    assert handled == list(range(1, 20))
    assert not consumer._thread.is_alive()
    with pytest.raises(queue.Empty):
        channel.get(timeout=0.01)  # the end mark was taken by the consumer: nothing left behind
