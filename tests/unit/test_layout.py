"""The driver's shape (docs/layout.md): orchestrator/ holds its packages and few loose modules, each package is on the
layout page, and the walks through the driver (scripts/config_walk.py: `train` to its plan and through its launch,
`tune`) go back and forth no more than they did. No Ray."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The loose modules of orchestrator/: the API (__init__), `python -m orchestrator`, the one CLI entry, the errors,
# Ray's internals (leaves both sides import).
LOOSE = {"__init__", "__main__", "cli", "errors", "ray_internals"}
MAX_LOOSE = 6
# Each walk the guard follows: where it starts, the value it follows, and its most climbs, returns and entries of one
# module. `train` to its plan and `tune` plan their configs through the same function (run/plan.py `plan_config`;
# the study's plan in tuning/plan.py); `train` is followed on through its launch (the plan carried out) and `tune`
# through a trial (`run_trial`, the function Tune runs: the trial planned, then trained), all at the figures issue 60
# reached (docs/layout.md has the walks). A walk may only go down.
WALKS = {
    "train": ("orchestrator.run.launch.train", "config", (4, 5, 2)),
    "launch": ("orchestrator.run.launch._train", "plan", (11, 16, 3)),
    "tune": ("orchestrator.tuning.study.tune", "config", (6, 8, 3)),
    "trial": ("orchestrator.tuning.trial.run_trial", "planner", (9, 14, 3)),
}


def test_orchestrator_keeps_few_loose_modules() -> None:
    loose = {p.stem for p in (ROOT / "orchestrator").glob("*.py")}
    assert len(loose) <= MAX_LOOSE and loose <= LOOSE, sorted(loose - LOOSE)


def test_every_package_of_orchestrator_is_on_the_layout_page() -> None:
    page = (ROOT / "docs" / "layout.md").read_text()
    packages = sorted(p.parent.name for p in (ROOT / "orchestrator").glob("*/__init__.py"))
    assert {"run", "report", "models", "cluster"} <= set(packages)
    assert [name for name in packages if f"\n  {name}/" not in page] == []


def walk(start: str, follow: str) -> tuple[dict[str, int], dict[str, int]]:
    """The walk's counts and its entries per module, from scripts/config_walk.py run as anyone runs it (in a process
    of its own: CPython 3.11's ast may not parse beside another thread using it)."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "config_walk.py"), "--start", start, "--follow",
                          follow], capture_output=True, text=True, check=True, timeout=120).stdout.splitlines()
    found = re.search(r"(\d+) modules entered in (\d+) stays, (\d+) climbs back up, (\d+) returns", out[-2])
    assert found is not None, out
    counts = dict(zip(("modules", "stays", "climbs", "returns"), map(int, found.groups()), strict=True))
    entries = {m: int(n) for m, n in re.findall(r"([\w.]+) (\d+)", out[-1].removeprefix("entries per module: "))}
    return counts, entries


@pytest.mark.parametrize("name", list(WALKS))
def test_each_walk_through_the_driver_goes_back_and_forth_no_more_than_it_did(name: str) -> None:
    start, follow, (climbs, returns, most) = WALKS[name]
    counts, entries = walk(start, follow)
    assert counts["climbs"] <= climbs and counts["returns"] <= returns, counts
    assert max(entries.values()) <= most, entries
    if name == "train":  # the data layer: the plan's one inspection, the model's entrypoint, a pretrained config
        assert entries["pipelines"] <= 3 and "orchestrator.run" in entries, entries
    if name == "launch":  # the model's input width is the plan's: the models are entered for the final model only
        assert entries.get("orchestrator.models", 0) <= 1 and "orchestrator.cluster" in entries, entries
    if name == "trial":  # the trial is planned (run/plan.py plan_config), then trained: the walk reaches both
        assert {"orchestrator.run", "pipelines"} <= set(entries), entries


def test_every_module_file_a_product_comment_names_exists() -> None:
    """A comment that points at `trainer.py` or `tracking/flavour.py` leads the reader to a file that is there (a
    module renamed without its mentions leaves them pointing nowhere)."""
    from orchestrator.tracking.pyfunc import LOADER_MODULE

    # The project's own files (not what runs left in runs/ or mlruns/), and the one file name the product gives a
    # copy of itself: the pyfunc inside each logged model.
    names = {p.name for folder in ("orchestrator", "pipelines", "tests", "scripts", "bench", "examples", "cluster")
             for p in (ROOT / folder).rglob("*.py")} | {f"{LOADER_MODULE}.py"}
    missing = [f"{path.relative_to(ROOT)}:{number}: {found}"
               for path in [*(ROOT / "orchestrator").rglob("*.py"), *(ROOT / "pipelines").rglob("*.py")]
               for number, line in enumerate(path.read_text().splitlines(), 1)
               for found in re.findall(r"\b([a-z_]+\.py)\b", line) if found not in names]
    assert not missing, missing
