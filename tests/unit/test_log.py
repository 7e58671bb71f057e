"""The run log in-process: libraries' records go to the file (and to the terminal only with --verbose), the
product's worker lines are recognised, and everything is put back afterwards."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest

from orchestrator.report.console import RayDataConsole, RunLog, product_line


@pytest.mark.parametrize("verbose", [False, True])
def test_library_lines_go_to_the_file_and_to_the_terminal_only_when_verbose(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], verbose: bool) -> None:
    library = logging.getLogger("mlflow.store.test")
    console = logging.StreamHandler()  # a library's own console handler, as MLflow and Ray install them
    library.addHandler(console)
    try:
        with RunLog(verbose) as log:
            library.warning("before the run has a directory")
            log.open(tmp_path / "run" / "orchestrator.log")
            library.warning("a library line")
            warnings.warn("a library warning", UserWarning, stacklevel=1)
            RayDataConsole().handle(logging.makeLogRecord({"name": "ray.data", "msg": "execution finished",
                                                           "levelno": logging.INFO, "levelname": "INFO"}))
            print("step 1/2 | the product's own line")
        library.warning("after the run")
    finally:
        library.removeHandler(console)
    out = capsys.readouterr()
    text = (tmp_path / "run" / "orchestrator.log").read_text()
    for line in ("before the run has a directory", "a library line", "a library warning", "execution finished"):
        assert line in text
        # (Under pytest a shown warning reaches pytest's own root handler, not the terminal.)
        assert (line in out.err) is (verbose and "warning" not in line)
    assert "the product's own line" in out.out and "after the run" in out.err and "after the run" not in text


def test_nothing_is_written_before_the_run_has_a_directory(tmp_path: Path) -> None:
    with RunLog() as _:
        logging.getLogger("ray.test").warning("tracking unreachable")
    assert list(tmp_path.iterdir()) == []


def test_worker_lines_of_the_product_are_recognised() -> None:
    assert product_line("auto micro-batch: 64 per worker x 1 accumulation x 2 workers = global batch 128")
    assert product_line("/x/orchestrator/training/loop.py:182: UserWarning: out of memory: retrying the step") == (
        "warning: out of memory: retrying the step")
    assert product_line("2026-12-01 17:17:04,605\tWARNING __init__.py:28 -- Progress bars disabled.") is None
    assert product_line("/x/site-packages/ray/data/y.py:3: RayDeprecationWarning: exclude_resources") is None



def test_a_run_stored_in_s3_logs_to_a_private_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Not a shared, predictable path such as /tmp/orchestrator-logs, where another user could plant a symlink
    # that the run's log would then be written through.
    import stat

    from orchestrator.config import load_config
    from orchestrator.run.launch import _log_path
    from orchestrator.run.place import RunPlace

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    config = load_config(None, ["storage.path=s3://bucket/runs"])
    place = RunPlace(storage=None, name="digits-1")  # type: ignore[arg-type]  # the name is all the path needs
    path = _log_path(config, place)
    assert path.is_relative_to(tmp_path / "cache" / "orchestrator") and path.name == "digits-1.log"
    assert stat.S_IMODE((tmp_path / "cache" / "orchestrator").stat().st_mode) == 0o700
