"""The run's end, made short: what only the end needs is loaded while the run trains, and the
private cluster's processes are stopped without Ray's slow path once nothing of the run needs them.

Measured on a loaded 2-core machine (digits, 30 steps): the end's final MLflow Model took 11.8 s
cold, nearly all of it first-time costs (torch.export's machinery, `torch._dynamo`: 9 s of imports
there; its first export 2.2 s against
0.75 s for the next; MLflow's pt2 save 4.6 s against 0.6 s) and the learning-curve plot's pyplot (2
s). None of them depends on the final weights: a driver thread pays them after the first step, while
the driver only waits."""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from orchestrator.config import Config


class EndWarmUp:
    """A driver thread that loads what the end uses: pyplot for the learning curves, and with MLflow
    tracking the final model's export path, by saving a one-layer model as the end saves the run's.
    Started once, at the run's first progress line, or as the worker group starts on a machine with
    a core to spare (`early`). `wait()` before the end's own work, so that the two never export at
    once; a run that ends before the throwaway export began (a few steps) skips it, the end's own
    export then paying that cost once. Best-effort: a failure leaves the end to pay it itself."""

    def __init__(self, config: Config, cores: int | None = None) -> None:
        self.model = config.tracking.enabled
        # With a core to spare beyond the workers' and the driver's, loaded while the worker group
        # starts, so a short run's end waits for none of it; else from the first step, leaving the
        # start-up's processes the cores.
        workers = config.scaling.max_workers * config.scaling.cpus_per_worker
        self.early = (cores or os.cpu_count() or 1) - workers >= 2
        self.thread: threading.Thread | None = None
        self.ending = threading.Event()

    def start(self, after: Callable[[], object] = lambda: None) -> None:
        """Start loading, once: in its thread, `after()` first (what must be imported before it: see
        launch)."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, args=(after,), name="end-warm-up",
                                           daemon=True)
            self.thread.start()

    def wait(self) -> None:
        self.ending.set()
        if self.thread is not None:
            self.thread.join()

    def _run(self, after: Callable[[], object]) -> None:
        try:
            after()
            import matplotlib

            matplotlib.use("Agg")  # as report/plots.py: no display on clusters and CI
            import matplotlib.pyplot  # noqa: F401
            if self.model and not self.ending.is_set():
                _export_once()
        except Exception:  # noqa: BLE001, S110 - the end then loads it itself
            pass


def _export_once() -> None:
    """tracking/flavour.py's save of the final model, on a throwaway one-layer model into a
    temporary directory (no working-directory change: other driver threads run meanwhile)."""
    import torch

    from orchestrator.tracking.flavour import _save

    model = torch.nn.Linear(2, 2).eval()
    x = torch.zeros(2, 2)
    with torch.no_grad():
        output = model(x).numpy()
    with tempfile.TemporaryDirectory() as tmp:
        _save(model, x.numpy(), output, Path(tmp) / "model")
