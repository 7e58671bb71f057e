"""Which worker errors a restart may cure, as the controller forwards them to the driver."""

from __future__ import annotations


def test_a_worker_error_that_would_repeat_is_told_apart_from_one_a_restart_may_cure() -> None:
    from queue import Queue

    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback

    from orchestrator.errors import ConfigError
    from orchestrator.report.progress import ForwardFailures

    forwarded: Queue = Queue()
    failures = ForwardFailures(forwarded)  # type: ignore[arg-type]
    for raised, repeats in ((ValueError("shapes (4, 3) and (5, 3)"), True), (ConfigError("bad option"), True),
                            (ConnectionError("S3 unreachable"), False), (RuntimeError("gloo: peer gone"), False)):
        failures.after_exception(None, {1: UserExceptionWithTraceback(raised, f"Traceback ...\n{raised!r}"),
                                        0: UserExceptionWithTraceback(raised, f"Traceback ...\n{raised!r}")})
        event = forwarded.get_nowait()
        assert (event["rank"], event["repeats"]) == (0, repeats) and repr(raised) in event["error"]
    failures.after_exception(None, {0: ValueError("a bug")})
    assert forwarded.get_nowait()["error"] == "ValueError: a bug"  # named, as a traceback's last line names it
    failures.after_exception(None, {0: RuntimeError("the worker process died")})  # a crash: Ray's error, retried
    assert forwarded.get_nowait()["repeats"] is False
