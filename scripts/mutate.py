"""Plant known bugs in the code behind the README's guarantees and check that the tests notice each one.

Each mutant is one edit to a copy of the package (in a temporary directory, never the checkout) and the tests that
claim to cover it; a mutant "survives" when those tests still pass. Run: `make mutate` (about 3 minutes here).
Exits 1 when any mutant survives.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPIED = ("orchestrator", "pipelines", "tests", "cluster", "examples", "pyproject.toml")


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]


LOOP = "orchestrator/training/loop.py"
CHECKPOINT = "orchestrator/training/checkpoint.py"
UNIT = "tests/unit/training"
MUTANTS = (
    Mutant("loss normalised per micro-batch", LOOP,
           "precision.backward(loss * scale)", "precision.backward(loss * scale * len(pieces))",
           (f"{UNIT}/test_loop.py",)),
    Mutant("world-size factor dropped from the normaliser", LOOP,
           "scale = world / targets.clamp(min=1)", "scale = 1 / targets.clamp(min=1)",
           (f"{UNIT}/test_rank_agreement.py",)),
    Mutant("gradient clipping disabled", LOOP,
           "max_norm = parts.max_grad_norm if parts.max_grad_norm is not None else math.inf",
           "max_norm = math.inf", (f"{UNIT}/test_loop.py",)),
    Mutant("gradients not zeroed before an OOM retry", LOOP,
           "        parts.optimizer.zero_grad(set_to_none=True)\n        release_cached_memory(parts.device)",
           "        release_cached_memory(parts.device)", (f"{UNIT}/test_rank_agreement.py",)),
    Mutant("OOM retry decided per rank", LOOP,
           "together = ddp and ranks.world()[1] > 1 and len(pieces) > 1", "together = False",
           (f"{UNIT}/test_rank_agreement.py",)),
    Mutant("data position counted in micro-batches", LOOP,
           "if skip >= rows(batch):\n                skip -= rows(batch)", "if skip >= 1:\n                skip -= 1",
           (f"{UNIT}/test_loop.py",)),
    Mutant("local SGD resumes every rank from rank 0's optimizer", CHECKPOINT,
           "optimizer[rank if same_world else 0], precision[rank if same_world else 0]",
           "optimizer[0], precision[0]", (f"{UNIT}/test_rank_agreement.py",)),
    Mutant("every rank resumes rank 0's RNG streams", CHECKPOINT,
           "restore_rng(state[\"rng\"][rank])", "restore_rng(state[\"rng\"][0])",
           (f"{UNIT}/test_rank_agreement.py",)),
    Mutant("LR schedule restarts after a resume", CHECKPOINT,
           "    parts.scheduler.load_state_dict(state[\"scheduler\"])\n", "",
           (f"{UNIT}/test_fault_handling.py",)),
    Mutant("checkpoint fallback may pick a newer checkpoint", "orchestrator/training/resume.py",
           "if step is not None and (limit is None or step < limit):", "if step is not None:",
           (f"{UNIT}/test_fault_handling.py",)),
    Mutant("checkpoint manifest ignores sizes", CHECKPOINT,
           "        if info.size != size:", "        if False:", (f"{UNIT}/test_fault_handling.py",)),
    Mutant("shard order ignores the epoch", "pipelines/order.py",
           "np.random.default_rng([seed, epoch]).permutation", "np.random.default_rng([seed]).permutation",
           ("tests/unit/pipelines/test_data_options.py",)),
    Mutant("shuffle-buffer seed ignores the epoch", "pipelines/order.py",
           "default_rng([seed, epoch, rank, 7])", "default_rng([seed, rank, 7])",
           ("tests/unit/pipelines/test_data_options.py",)),
)


def run_mutant(mutant: Mutant, python: str) -> tuple[bool, float]:
    """(survived, seconds): apply the edit to a fresh copy, run its tests there."""
    with tempfile.TemporaryDirectory(prefix="mutant-") as tmp:
        for name in COPIED:
            source = ROOT / name
            if source.is_dir():
                shutil.copytree(source, Path(tmp) / name, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(source, Path(tmp) / name)
        target = Path(tmp) / mutant.file
        text = target.read_text()
        if text.count(mutant.old) != 1:
            raise SystemExit(f"mutant '{mutant.name}': the code to change is not (exactly once) in {mutant.file}; "
                             "update scripts/mutate.py")
        target.write_text(text.replace(mutant.old, mutant.new))
        started = time.monotonic()
        # `python -m pytest` in the copy: its directory comes first on sys.path, so the mutated package is imported.
        done = subprocess.run([python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *mutant.tests],
                              cwd=tmp, capture_output=True, text=True)
        return done.returncode == 0, time.monotonic() - started


def main() -> int:
    python = sys.executable
    survivors = []
    for mutant in MUTANTS:
        survived, seconds = run_mutant(mutant, python)
        print(f"{'SURVIVED' if survived else 'killed  '}  {mutant.name}  ({seconds:.0f} s)", flush=True)
        if survived:
            survivors.append(mutant.name)
    print(f"{len(MUTANTS) - len(survivors)} of {len(MUTANTS)} mutants killed"
          + (f"; survived: {', '.join(survivors)}" if survivors else ""))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
