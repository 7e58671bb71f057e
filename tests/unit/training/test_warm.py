"""training/warm.py: the workers' imports started while Ray Train sets the group up. In a fresh interpreter, as a
worker process is: start_imports loads what DDP's constructor and the loop import, in a thread, once; the
training function waits for it; Ray Train's TorchConfig settings are kept."""

from __future__ import annotations

import subprocess
import sys

from ray.train.torch import TorchConfig
from ray.train.torch.config import _TorchBackend

from orchestrator.training.warm import WarmTorchConfig, _WarmBackend

PROBE = """
import sys, threading
from orchestrator.training import warm
assert "torch._dynamo" not in sys.modules and "orchestrator.training.worker" not in sys.modules
warm.start_imports()
first = warm._imports
warm.start_imports()  # once per process: a second call starts no second thread
assert warm._imports is first and first.name == "orchestrator-imports" and first.daemon
first.join()
print(sorted(m for m in ("torch._dynamo", "orchestrator.training.worker") if m in sys.modules))
"""


def test_a_worker_process_imports_the_training_side_in_one_background_thread() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "['orchestrator.training.worker', 'torch._dynamo']"


def test_the_warm_config_keeps_ray_trains_torch_config() -> None:
    config = WarmTorchConfig()
    default = TorchConfig()
    assert (config.backend, config.init_method, config.timeout_s) == (default.backend, default.init_method,
                                                                      default.timeout_s)
    assert config.backend_cls is _WarmBackend and issubclass(_WarmBackend, _TorchBackend)

