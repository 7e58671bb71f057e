"""The worker side on a machine with torch and none of Ray, MLflow, boto3 or pyarrow (the GPU check's torch tier on a
bare GPU machine, issue 57): its modules import, and steps run through the loop, in a process where those packages
cannot be imported (`sys.modules[name] = None`: an import of one raises ImportError)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
# What a bare GPU machine lacks: Ray, MLflow, the AWS SDK, Arrow (the torch tier carries only a few small wheels).
BLOCKED = ("ray", "mlflow", "boto3", "botocore", "moto", "pyarrow", "pandas", "sklearn", "matplotlib")
# The step, the loop's pieces, precision and optimizer, the autopilot's search, FSDP2 and DCP checkpointing, the
# data's host-to-device path.
WORKER = ("orchestrator.training.step", "orchestrator.training.loop", "orchestrator.training.parts",
          "orchestrator.training.precision", "orchestrator.training.optim", "orchestrator.training.autopilot",
          "orchestrator.training.knobs", "orchestrator.training.micro_batch", "orchestrator.training.memory",
          "orchestrator.training.timing", "orchestrator.training.fsdp", "orchestrator.training.checkpoint",
          "orchestrator.models.zoo", "orchestrator.models.tasks", "pipelines.tensors", "pipelines.batches",
          "pipelines.feed")

BARE_RUN = """
import importlib, json, os, sys
for name in {blocked!r}:
    sys.modules[name] = None
for module in {worker!r}:
    importlib.import_module(module)

import torch
from orchestrator.config import load_config
from orchestrator.training.loop import Data, run
from orchestrator.training.parts import build_parts

cfg = load_config(None, ["scaling.num_workers=1", "model.hidden=[32]", "model.num_classes=4",
                         "train.global_batch_size=16", "train.micro_batch_size=8", "train.max_steps=6",
                         "train.log_every=3", "data.val=null", "train.eval_every=null", "checkpoint.every=100",
                         "optim.warmup_steps=1"])
parts = build_parts(cfg, 16, torch.device("cpu"))
x = torch.randn(96, 16)
y = x[:, :4].argmax(dim=1)
published, saved = [], []

class Reporter:
    def publish(self, metrics):
        published.append(metrics)

    def checkpoint(self, metrics, checkpoint_dir):  # the last step's: a state.pt written without Arrow or Ray
        saved.append(sorted(os.listdir(checkpoint_dir)))

run(cfg, parts, Data(lambda epoch: [{{"x": x[i:i + 8], "labels": y[i:i + 8]}} for i in range(0, 96, 8)]), Reporter())
loaded = sorted(name for name in {blocked!r} if sys.modules.get(name) is not None)
print(json.dumps({{"steps": [m["step"] for m in published], "losses": [m["train_loss"] for m in published],
                  "saved": saved, "loaded": loaded}}))
"""


def test_the_worker_side_imports_and_trains_without_ray_mlflow_boto3_or_arrow() -> None:
    done = subprocess.run([sys.executable, "-c", BARE_RUN.format(blocked=BLOCKED, worker=WORKER)], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["steps"] == [3, 6] and result["loaded"] == []
    assert len(result["saved"]) == 1 and "state.pt" in result["saved"][0]
    assert all(loss == loss and loss < 10 for loss in result["losses"])  # finite: real steps ran
