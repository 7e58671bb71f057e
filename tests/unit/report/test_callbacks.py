"""Which worker errors a restart may cure, as the controller forwards them to the driver."""

from __future__ import annotations


def test_a_worker_error_that_would_repeat_is_told_apart_from_one_a_restart_may_cure() -> None:
    from queue import Queue

    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback

    from orchestrator.errors import ConfigError
    from orchestrator.report.callbacks import ForwardFailures

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


def _forward(x):  # a user's forward with the commonest model bug
    return x @ x


def _build(path: str):  # a user's builder reading a file it cannot find
    return open(path).read()


def test_a_bug_in_the_models_own_code_is_not_retried_and_names_its_file_and_line() -> None:
    """RuntimeError, FileNotFoundError and the like repeat when the model's code (the user's, as here) raised them,
    and the failure names that line. Where the product's loop raised them (a collective inside the backward), or
    the device ran out of memory, a restart may cure them."""
    import inspect
    import pickle
    from pathlib import Path
    from queue import Queue

    import torch
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback
    from ray.train.v2._internal.util import construct_user_exception_with_traceback

    import orchestrator
    from orchestrator.errors import mark_where_raised
    from orchestrator.report.callbacks import ForwardFailures

    def as_ray_hands_it_over(call, *args):  # noqa: ANN001, ANN202 - the worker's exception, as the controller gets it
        try:
            call(*args)
        except BaseException as exc:  # noqa: BLE001
            mark_where_raised(exc)  # what the worker does before it lets the exception go
            wrapped = construct_user_exception_with_traceback(exc)
            # Ray Train 2.60 hands callbacks the inner exception, pickled across processes: no traceback left.
            return pickle.loads(pickle.dumps(wrapped._base_exc)), wrapped
        raise AssertionError("did not raise")

    def oom(x):  # noqa: ANN001, ANN202
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    here = Path(__file__).resolve()
    line = {name: inspect.getsourcelines(fn)[1] + 1 for name, fn in (("forward", _forward), ("build", _build))}
    step = Path(orchestrator.__file__).resolve().parent / "training" / "step.py"
    collective = UserExceptionWithTraceback(RuntimeError("Connection closed by peer"), (
        'Traceback (most recent call last):\n'
        f'  File "{step}", line 231, in _piece\n    parts.precision.backward(loss * norm.scale)\n'
        '  File "/venv/lib/python3.11/site-packages/torch/_tensor.py", line 625, in backward\n'
        '    torch.autograd.backward(\n'
        'RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:41235\n'))
    forwarded: Queue = Queue()
    failures = ForwardFailures(forwarded)  # type: ignore[arg-type]
    for (inner, wrapped), repeats, at in (
            (as_ray_hands_it_over(_forward, torch.ones(2, 3)), True, f"{here}:{line['forward']}"),
            (as_ray_hands_it_over(_build, "/nonexistent/weights.pt"), True, f"{here}:{line['build']}"),
            (as_ray_hands_it_over(oom, None), False, f"{here}:{inspect.getsourcelines(oom)[1] + 1}"),
            ((collective, collective), False, None)):
        for exc in (inner, wrapped):  # as Ray 2.60 hands it over, and as the wrapper with the traceback's text
            failures.after_exception(None, {0: exc})
            event = forwarded.get_nowait()
            assert (event["repeats"], event["at"]) == (repeats, at), event
