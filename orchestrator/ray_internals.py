"""Every use of Ray's internal modules (`ray._private`, `ray.*._internal`), in one place: each with
why the product needs it and what happens on a Ray whose internals moved (the fallback). Ray changes
these between releases without notice; the rest of the product imports only Ray's public API. A
leaf: the driver's console and cluster code and the workers' reporting call it;
`tests/unit/test_ray_internals.py` checks that nothing else imports Ray's internals and that each
fallback holds where the internal is missing."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any


def ray_data_logging_config() -> dict[str, Any] | None:
    """Ray Data's logging config (its DEFAULT_CONFIG), for the product to swap its console handler:
    Ray Data prints a line per dataset execution otherwise. None where it moved: Ray Data logs as it
    would."""
    try:
        from ray.data._internal.logging import DEFAULT_CONFIG
    except ImportError:
        return None
    return DEFAULT_CONFIG


def worker_output() -> tuple[ModuleType, Any] | None:
    """Ray's driver-side printer of what workers and raylets send (the `ray._private.worker` module,
    whose `print_to_stdstream` prints raylet lines, and the dispatcher of worker lines), for the
    product to route them to the run's log. None where they moved: Ray prints those lines itself."""
    try:
        from ray._private import worker as ray_worker
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return None
    return ray_worker, dispatcher


def autoscaler_events(lines: Sequence[str]) -> list[str]:
    """The events of the autoscaler's periodic status output (what Ray's own printer keeps); all
    lines where the filter moved."""
    try:
        from ray._private.worker import filter_autoscaler_events
    except ImportError:
        return list(lines)
    return list(filter_autoscaler_events(lines))


@contextlib.contextmanager
def local_only() -> Iterator[None]:
    """Ray's local-only mode (its default on macOS and Windows) in this process while it starts or
    joins a cluster on loopback: on Linux Ray otherwise replaces the loopback address it is given
    with the machine's own. Where the flag moved nothing is changed (the cluster may then listen on
    the machine's address, as Ray's default does)."""
    try:
        from ray._private import ray_constants
    except ImportError:
        yield
        return
    saved, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def token_auth_by_default() -> None:
    """What Ray's own `ray.init()` does for a local cluster: token auth on unless RAY_AUTH_MODE says
    otherwise. Where it moved: nothing (the Ray of that version decides, as for its own local
    clusters)."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            enable_token_auth_by_default,
        )
    except ImportError:
        return
    enable_token_auth_by_default()


def ensure_token() -> Path | None:
    """With token auth on, the token file that joins this user's clusters (made when missing, as
    Ray's local cluster makes it), in the process's current umask; None where Ray's token setup
    moved (nothing made: Ray makes it)."""
    try:
        from ray._private.authentication import authentication_token_setup as tokens
    except ImportError:
        return None
    tokens.ensure_token_if_auth_enabled(create_token_if_missing=True)
    return Path(tokens._get_default_token_path())


def system_temp_dir() -> str:
    """The temp directory Ray picks for its sessions (RAY_TMPDIR, TMPDIR on Linux, else /tmp: short
    enough for its Unix sockets); Python's where Ray's helper moved."""
    try:
        from ray._common.utils import get_default_system_temp_dir
    except ImportError:
        import tempfile

        return tempfile.gettempdir()
    return get_default_system_temp_dir()


def quiet_train_report_log() -> None:
    """Ray 2.60 logs every `ray.train.report` at INFO under a logger named by its file's path, which
    RunConfig's logging_config does not reach (it filters 'ray.train*' names): that logger to
    WARNING. Where it moved: nothing to work around."""
    try:
        from ray.train.v2._internal.execution import context
    except ImportError:
        return
    logging.getLogger(context.__file__).setLevel(logging.WARNING)



def started_process_ids() -> list[int]:
    """The process ids of the Ray processes `ray.init` started in this process (its node's raylet,
    GCS, dashboard, log monitor...; Ray's node object keeps them), for the product to see every one
    of them ended. Empty for a process that joined a cluster, or where the node object moved."""
    try:
        from ray._private import worker
    except ImportError:
        return []
    node = getattr(worker, "_global_node", None)
    processes = getattr(node, "all_processes", None) or {}
    try:
        return [info.process.pid for infos in processes.values() for info in infos]
    except AttributeError:
        return []


def shutdown_leaving_processes() -> bool:
    """`ray.shutdown()` of this process's Ray (its driver disconnected, the head's spilled objects
    removed) without Ray's stop of the processes its `ray.init` started, which terminates them one
    after another and waits up to a second for each (1.3-1.6 s measured on 2 cores, after which the
    workers were still exiting for 1.4 s more): the caller stops them together (cluster/local.py).
    True when that was done; False where there are no such processes or Ray's node object moved,
    after a plain `ray.shutdown()` (Ray then stops them itself)."""
    import ray

    try:
        from ray._private import worker
    except ImportError:
        ray.shutdown()
        return False
    node = getattr(worker, "_global_node", None)
    if (node is None or not getattr(node, "all_processes", None)
            or not hasattr(node, "destroy_external_storage")):
        ray.shutdown()
        return False
    worker._global_node = None  # ray.shutdown() stops only the processes of the node it finds here
    try:
        ray.shutdown()
    finally:
        if node.is_head():
            node.destroy_external_storage()
    return True
