"""What a training worker imports before its training function runs, started while Ray Train still
sets the worker group up. DDP's constructor imports torch._dynamo (about 3 s of CPU on a 2-core
node) and the loop's modules take more: in every fresh worker process, so at each start and each
restart of the group. `WarmTorchConfig` (Ray Train's TorchConfig, same settings) starts those
imports in a thread of each worker as the group's process group is set up; `train_entry`, the
function Ray Train runs, waits for them before it imports anything itself (two threads importing the
same modules at once can deadlock in Python's import locks)."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from ray.train.torch import TorchConfig
from ray.train.torch.config import _TorchBackend

if TYPE_CHECKING:
    from orchestrator.training.handoff import WorkerSpec

_imports: threading.Thread | None = None


def start_imports() -> None:
    """In a worker process: import the training side in a background thread, once."""
    global _imports
    if _imports is None:
        _imports = threading.Thread(target=_import_training, name="orchestrator-imports",
                                    daemon=True)
        _imports.start()


def _import_training() -> None:
    import torch._dynamo  # noqa: F401 - what DistributedDataParallel's constructor imports

    import orchestrator.training.worker  # noqa: F401


def loop_config(spec: WorkerSpec) -> dict[str, Any]:
    """TorchTrainer's `train_loop_config` for `spec`: Ray Train keeps its run settings as a dict, so
    the spec crosses inside one, under one key that `train_entry` reads."""
    return {"spec": spec}


def train_entry(config: dict[str, Any]) -> dict[str, Any]:
    """The function Ray Train runs on every worker (see orchestrator.training.worker.train_worker),
    given `loop_config`'s dict. The wait for the imports is worker set-up in the start-up breakdown:
    what of them Ray's own start did not hide."""
    entered = time.time()
    if _imports is not None:
        _imports.join()
    from orchestrator.training.worker import train_worker

    return train_worker(config["spec"], entered)


class _WarmBackend(_TorchBackend):
    def on_start(self, worker_group: Any, backend_config: TorchConfig) -> None:
        # not awaited: it runs while the process group is set up
        worker_group.execute_async(start_imports)
        super().on_start(worker_group, backend_config)


class WarmTorchConfig(TorchConfig):
    """Ray Train's TorchConfig whose workers start importing the training side as the group
    starts."""

    @property
    def backend_cls(self) -> type[_TorchBackend]:
        return _WarmBackend
