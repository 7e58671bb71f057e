"""Putting an autopilot candidate's settings on a running rank (training/knobs.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

# In a fresh process: torch's intra-op threads are process-wide, and those of the pytest process already exist.
SWITCH_CHECK = """
import sys, threading, torch
from dataclasses import replace
from orchestrator.training.knobs import Knobs
from orchestrator.training.parts import Parts
from orchestrator.training.precision import Precision

CPU = torch.device("cpu")
torch.set_num_threads(2)
first, second = sys.argv[1] == "on", sys.argv[2] == "on"
# ~1e-39, a subnormal float32, from its bits (a literal would be flushed on the way in when flushing is on).
subnormals = torch.full((1 << 20,), 0x000AE398, dtype=torch.int32).view(torch.float32)
out = {}

def train_thread():  # Ray Train runs the training function in a thread of its own, as here
    out["supported"] = torch.set_flush_denormal(first)
    before = subnormals * 3.0  # large enough to run on both intra-op threads, started here with `first`
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    parts = Parts(model, optimizer, scheduler, Precision("fp32", CPU), CPU)
    knobs = Knobs(parts, 8, first, (8, 0.5, None))
    knobs.apply(parts, replace(knobs.read(parts, 8), flush_denormal=second))  # the autopilot's switch mid-run
    after = subnormals * 3.0
    # Counted on the bits: a float comparison would itself treat subnormals as zero where flushing is on.
    out["zeros"] = [float((t.view(torch.int32) == 0).double().mean()) for t in (before, after)]

t = threading.Thread(target=train_thread)
t.start(); t.join()
print(out["supported"], *out["zeros"])
"""


@pytest.mark.parametrize(("first", "second"), [("off", "on"), ("on", "off")])
def test_a_flush_denormal_switch_mid_run_reaches_every_intra_op_thread(first: str, second: str) -> None:
    done = subprocess.run([sys.executable, "-c", SWITCH_CHECK, first, second], capture_output=True, text=True,
                          check=True)
    supported, before, after = done.stdout.split()
    if supported != "True":
        pytest.skip("this CPU cannot flush subnormal floats")
    # The share of outputs flushed to zero: all of them where flushing is on, none where it is off, on every thread
    # that computed a part (3e-39 stays a subnormal float32 unless flushed).
    assert float(before) == (1.0 if first == "on" else 0.0)
    assert float(after) == (1.0 if second == "on" else 0.0)
