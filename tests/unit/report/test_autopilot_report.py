"""The autopilot on the driver (orchestrator/report/autopilot.py, report/handlers.py's `RunReports`, result.py's
summary, the plan and `train --autopilot`), from hand-made reports that follow the contract of docs/autopilot.md: the
terminal's table, the MLflow params, table artifact and summary rows (one real SQLite store, read back through
MlflowClient), never a charted metric, and the predicted and achieved speed-up, each checked against figures
computed here. No Ray."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from orchestrator.cli import build_parser, main
from orchestrator.config import TrackingConfig, load_config
from orchestrator.report import autopilot as autopilot_report
from orchestrator.report.handlers import AutopilotTable, Console, RunReports
from orchestrator.report.progress import ProgressLines
from orchestrator.report.startup import StartupClock
from orchestrator.run.result import TrainResult, summary
from orchestrator.tracking.client import MlflowTracker
from orchestrator.tracking.context import config_params
from orchestrator.tracking.read import read_metrics, read_summary

START = {"micro_batch_size": 32, "grad_accum_steps": 4, "compile": False, "torch_threads": 2,
         "flush_denormal": True, "precision": "fp32"}
CHOSEN = START | {"micro_batch_size": 128, "grad_accum_steps": 1}
COMPILED = START | {"compile": True}
TOO_BIG = START | {"micro_batch_size": 256, "grad_accum_steps": 1}  # not a real split: it fails, as an OOM would


def _row(candidate: str, settings: dict[str, Any], rate: float | None, ratio: float | None, peak: float | None,
         compile_s: float | None, status: str = "ok", chosen: bool = False) -> dict[str, Any]:
    return {"candidate": candidate, "settings": settings, "samples_per_s": rate, "ratio": ratio,
            "peak_memory_gb": peak, "compile_s": compile_s, "status": status, "chosen": chosen}


# Rank 0's autopilot report, as the contract has it: the starting config, two candidates and one that failed.
REPORT = {
    "rows": [_row("micro 32 x 4 | compile off | threads 2 | flush on | fp32", START, 1000.0, 1.0, 0.4, None),
             _row("micro 128 x 1 | compile off | threads 2 | flush on | fp32", CHOSEN, 1310.0, 1.31, 1.25, None,
                  chosen=True),
             _row("micro 32 x 4 | compile on | threads 2 | flush on | fp32", COMPILED, 1200.0, 1.2, 0.4, 12.0),
             _row("micro 256 x 1 | compile off | threads 2 | flush on | fp32", TOO_BIG, None, None, None, None,
                  status="failed: out of memory on rank 1")],
    "start": START, "chosen": CHOSEN, "from_checkpoint": False, "search_s": 8.2, "search_steps": 40,
    "predicted_speedup": 1.31, "skipped": None, "budget_s": 20.0, "budget_spent_s": 6.5,
}


def _report(step: int, rate: float, interval: float = 2.0, compute: float = 0.8, sync: float = 0.1,
            wait: float = 0.05) -> dict[str, Any]:
    """A report of rank 0 with what the progress line and the achieved pace read (the rest of the interval in
    evaluation)."""
    return {"step": step, "train_loss": 1.0, "lr": 1e-3, "samples_per_s": rate, "interval_s": interval,
            "data_wait_frac": wait, "time/data_wait_frac": wait, "time/compute_frac": compute,
            "time/sync_frac": sync, "time/eval_frac": 1.0 - compute - sync - wait}


def _history() -> list[dict[str, Any]]:
    """Reports at steps 20 and 40 (the search; 40 carried the autopilot's report), then 60 (twice: a step redone
    after a restart, the later one kept) and 80."""
    return [_report(20, 900.0), _report(40, 1100.0), _report(60, 50.0, 10.0),
            _report(60, 1200.0, compute=0.7, sync=0.15), _report(80, 1250.0, compute=0.6, sync=0.1)]


# After the search: 2400 samples over 2 x (0.7 + 0.15) s in steps at step 60, 2500 over 2 x (0.6 + 0.1) s at 80.
ACHIEVED = (1200.0 * 2 + 1250.0 * 2) / (2 * 0.85 + 2 * 0.7)


def _taken(report: dict[str, Any] = REPORT, step: int = 40) -> dict[str, Any]:
    carrying = {"step": step, "train_loss": 1.0, "autopilot": copy.deepcopy(report)}
    found = autopilot_report.take_autopilot(carrying)
    assert found is not None and "autopilot" not in carrying
    return found


def test_the_report_is_taken_out_of_the_metrics_with_the_step_it_came_at() -> None:
    found = _taken()
    assert found[autopilot_report.AT_STEP] == 40 and found["predicted_speedup"] == 1.31
    plain = {"step": 5, "train_loss": 1.0}
    assert autopilot_report.take_autopilot(plain) is None and plain == {"step": 5, "train_loss": 1.0}


HEADING = ("autopilot: candidates measured on the run's own steps, samples/s in training steps (compute and gradient "
           "sync; the progress lines' samples/s also count data waits)")
# What the summary's autopilot line says of its samples/s, against the throughput line's.
STEPS_ARE = ("(compute and gradient sync; the throughput over the training's wall clock also counts data waits, "
             "evaluation and checkpoints)")


def test_the_terminal_table_has_a_line_per_candidate_and_one_per_failure() -> None:
    lines = autopilot_report.table_lines(_taken())
    assert lines == [
        HEADING,
        "  candidate                                                  samples/s  vs start  peak memory  compile s"
        "  chosen",
        "  micro 32 x 4 | compile off | threads 2 | flush on | fp32       1,000     1.00x      0.40 GB          -",
        "  micro 128 x 1 | compile off | threads 2 | flush on | fp32      1,310     1.31x      1.25 GB          -"
        "       ✓",
        "  micro 32 x 4 | compile on | threads 2 | flush on | fp32        1,200     1.20x      0.40 GB       12.0",
        "autopilot: dropped micro 256 x 1 | compile off | threads 2 | flush on | fp32: out of memory on rank 1",
        "autopilot: chose micro 128 x 1 | compile off | threads 2 | flush on | fp32, predicted 1.31x the configuration "
        "as written; search 8.2 s over 40 steps of the run"]
    unmeasured = REPORT | {"rows": [*REPORT["rows"], _row("micro 32 x 4 | compile off | threads 1 | flush on | fp32",
                                                           START | {"torch_threads": 1}, None, None, None, None,
                                                           status="stopped: the budget ran out in its warm-up")]}
    assert autopilot_report.table_lines(_taken(unmeasured))[6] == (
        "autopilot: not measured micro 32 x 4 | compile off | threads 1 | flush on | fp32: stopped: the budget ran "
        "out in its warm-up")
    assert autopilot_report.table_lines(_taken(), mark="*")[3].endswith("*")  # a terminal without the check mark


# Rank 0's report of the digits example on 2 CPU workers (examples/digits.yaml --autopilot): no peak memory (a
# GPU's figure), no compile tried (the 5% budget of a 300-step run is far below a compile), the configuration as
# written kept; and its run's reports, the autopilot's at step 25.
CPU_START = {"micro_batch_size": 64, "grad_accum_steps": 1, "compile": False, "torch_threads": 1,
             "flush_denormal": True, "precision": "bf16", "sync": "ddp", "tf32": False}
CPU_REPORT = {
    "rows": [_row("micro 64 x 1 | compile off | threads 1 | flush on | bf16", CPU_START, 26347.2, 1.0, None, None,
                  chosen=True) | {"loss": 2.05},
             _row("micro 32 x 2 | compile off | threads 1 | flush on | bf16",
                  CPU_START | {"micro_batch_size": 32, "grad_accum_steps": 2}, 11655.4, 0.4424, None, None)
             | {"loss": 1.98},
             _row("micro 64 x 1 | compile off | threads 1 | flush on | fp32", CPU_START | {"precision": "fp32"},
                  24309.1, 0.9226, None, None) | {"loss": 1.91}],
    "start": CPU_START, "chosen": CPU_START, "from_checkpoint": False, "search_s": 0.12, "search_steps": 15,
    "predicted_speedup": 1.0, "skipped": None, "budget_s": 0.073, "budget_spent_s": 0.05}
# After the search: 9,000 samples in 0.375 s of training steps at step 50 and again at step 75 (its interval evaluated).
CPU_HISTORY = [_report(25, 12292.0, 0.52), _report(50, 18000.0, 0.5, compute=0.7, sync=0.05),
               _report(75, 9000.0, 1.0, compute=0.35, sync=0.025)]


def test_a_cpu_run_that_kept_its_configuration_reads_as_one_story(capsys: pytest.CaptureFixture[str]) -> None:
    """What the terminal shows of the digits run on CPU: the table without its empty columns (a line says which
    and why), no speed-up of the configuration against itself; the summary's line names its samples/s as the
    table does and sets them apart from the throughput line's, over the wall clock, one figure for each pace."""
    found = _taken(CPU_REPORT, step=25)
    autopilot_report.print_table(found)
    assert capsys.readouterr().out.splitlines() == [
        HEADING,
        "  candidate                                                 samples/s  vs start  chosen",
        "  micro 64 x 1 | compile off | threads 1 | flush on | bf16     26,347     1.00x       ✓",
        "  micro 32 x 2 | compile off | threads 1 | flush on | bf16     11,655     0.44x",
        "  micro 64 x 1 | compile off | threads 1 | flush on | fp32     24,309     0.92x",
        "autopilot: columns left out: peak memory (measured on GPUs only); compile s (torch.compile not tried: a "
        "compile, assumed to take 30 s, does not fit the search's 0.073 s budget)",
        "autopilot: kept the configuration as written (no candidate beat it); search 0.1 s over 15 steps of the run"]
    config = load_config(None, ["autopilot.enabled=true", "train.max_steps=75"])
    result = TrainResult(config=config, metrics={"step": 75, "train_loss": 0.1}, checkpoint_path=None, run_dir="r",
                         run_id=None, tracking_uri=None, history=CPU_HISTORY, autopilot=found)
    rates = [line for line in summary(result).splitlines() if "samples/s" in line]
    assert rates[0].startswith("throughput: ") and rates[0].endswith(
        " samples/s over the training's wall clock (first step to last)")
    assert rates[1:] == [
        "autopilot: kept the configuration as written (no candidate beat it); samples/s in training steps: 26,347 "
        f"in the search, 24,000 after it {STEPS_ARE}; search 0.1 s"]
    # Compile tried but not measured (it failed): the column is left out for that reason.
    failed = CPU_REPORT | {"rows": [*CPU_REPORT["rows"], _row("micro 64 x 1 | compile on | threads 1 | flush on | bf16",
                                                               CPU_START | {"compile": True}, None, None, None, None,
                                                               status="failed: torch.compile failed")]}
    assert ("compile s (no candidate with torch.compile was measured)"
            in autopilot_report.table_lines(_taken(failed))[5])
    # A budget that covers a compile, and still none tried (FSDP, a search cut short): said without a reason.
    assert autopilot_report.table_lines(_taken(CPU_REPORT | {"budget_s": 60.0}))[5].endswith(
        "compile s (torch.compile not tried in this search)")


def test_a_skipped_search_and_one_kept_from_the_checkpoint_say_so_in_one_line() -> None:
    skipped = REPORT | {"rows": [], "chosen": START, "predicted_speedup": None, "search_s": 0.0, "search_steps": 0,
                        "skipped": "run too short to pay for the search: 30 steps"}
    assert autopilot_report.table_lines(_taken(skipped)) == [
        "autopilot: skipped (run too short to pay for the search: 30 steps): training with the configuration as "
        "written"]
    kept = REPORT | {"rows": [], "from_checkpoint": True}
    assert autopilot_report.table_lines(_taken(kept)) == [
        "autopilot: kept from the checkpoint, nothing searched: micro_batch_size=128, grad_accum_steps=1, "
        "compile=False, torch_threads=2, flush_denormal=True, precision=fp32"]


def test_the_chosen_settings_are_params_under_their_own_prefix() -> None:
    params = autopilot_report.params(_taken())
    assert params == {"autopilot.micro_batch_size": 128, "autopilot.grad_accum_steps": 1, "autopilot.compile": False,
                      "autopilot.torch_threads": 2, "autopilot.flush_denormal": True, "autopilot.precision": "fp32"}
    # MLflow never changes a param: none of these is a key the run's config params already hold.
    config = load_config(None, ["autopilot.enabled=true", "train.micro_batch_size=32"])
    assert not set(params) & set(config_params(config))


def test_the_search_figures_and_the_achieved_speedup() -> None:
    found = _taken()
    figures = autopilot_report.search_figures(found)
    assert figures == {"autopilot/predicted_speedup": 1.31, "autopilot/search_s": 8.2, "autopilot/search_steps": 40.0,
                       "autopilot/start_samples_per_s": 1000.0, "autopilot/chosen_samples_per_s": 1310.0,
                       "autopilot/candidates": 3.0, "autopilot/dropped": 1.0, "autopilot/skipped": 0.0,
                       "autopilot/budget_s": 20.0, "autopilot/budget_spent_s": 6.5,
                       "autopilot/from_checkpoint": 0.0}
    # Without the starting config's row, its pace is the chosen one's over the predicted speed-up.
    without = found | {"rows": found["rows"][1:]}
    assert autopilot_report.start_samples_per_s(without) == pytest.approx(1310.0 / 1.31)
    achieved = autopilot_report.achieved_figures(found, _history())
    assert achieved["autopilot/achieved_samples_per_s"] == pytest.approx(ACHIEVED)
    assert achieved["autopilot/achieved_speedup"] == pytest.approx(ACHIEVED / 1000.0)
    assert autopilot_report.achieved_figures(found, _history()[:2]) == {}  # no report after the search
    assert autopilot_report.achieved_figures(None, _history()) == {}
    # The configuration as written kept: said so, not as a choice.
    kept = found | {"chosen": START, "predicted_speedup": 1.0}
    assert autopilot_report.table_lines(kept)[-1] == (
        "autopilot: kept the configuration as written (no candidate beat it); search 8.2 s over 40 steps of the run")


def test_the_summary_says_what_the_autopilot_chose_and_its_paces_in_the_search_and_after() -> None:
    found = _taken()
    line = autopilot_report.gain_line(found, _history())
    assert line == ("autopilot: chose micro 128 x 1 | compile off | threads 2 | flush on | fp32, predicted 1.31x the "
                    "configuration as written; samples/s in training steps: 1,000 -> 1,310 in the search, "
                    f"{ACHIEVED:,.0f} after it {STEPS_ARE}; search 8.2 s")
    config = load_config(None, ["autopilot.enabled=true"])
    result = TrainResult(config=config, metrics={"step": 80, "train_loss": 0.5}, checkpoint_path=None, run_dir="r",
                         run_id=None, tracking_uri=None, history=_history(), autopilot=found)
    assert line in summary(result).splitlines()
    plain = TrainResult(config=config, metrics={"step": 80, "train_loss": 0.5}, checkpoint_path=None, run_dir="r",
                        run_id=None, tracking_uri=None, history=_history())
    assert not [x for x in summary(plain).splitlines() if x.startswith("autopilot")]
    skipped = found | {"skipped": "run too short to pay for the search: 30 steps"}
    assert autopilot_report.gain_line(skipped, _history()) == (
        "autopilot: skipped (run too short to pay for the search: 30 steps): trained with the configuration as "
        "written")
    assert autopilot_report.gain_line(found, _history()[:2]) == (  # no report after the one that carried it
        "autopilot: chose micro 128 x 1 | compile off | threads 2 | flush on | fp32, predicted 1.31x the "
        "configuration as written; samples/s in training steps: 1,000 -> 1,310 in the search, none measured after "
        f"it (no report followed) {STEPS_ARE}; search 8.2 s")
    # A resumed run: the choice kept from the checkpoint, with the speed-up its search predicted.
    resumed = found | {"rows": [], "from_checkpoint": True, "start_samples_per_s": 1000.0}
    assert autopilot_report.gain_line(resumed, _history()) == (
        "autopilot: settings kept from the checkpoint (micro_batch_size=128, grad_accum_steps=1, compile=False, "
        "torch_threads=2, flush_denormal=True, precision=fp32), predicted 1.31x the configuration as written; "
        f"samples/s in training steps: {ACHIEVED:,.0f} since the resume {STEPS_ARE}")


class _RecordingTracker:
    run_id = None

    def __init__(self) -> None:
        self.metrics: list[dict[str, Any]] = []
        self.params: dict[str, Any] = {}
        self.tables: dict[str, tuple[list[str], list[list[Any]]]] = {}

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        self.metrics.append(dict(metrics))

    def log_params(self, params: dict[str, Any]) -> None:
        self.params |= params

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        self.tables[name] = (columns, rows)

    def set_tags(self, tags: dict[str, str]) -> None: ...


def test_the_report_handler_prints_tracks_and_keeps_it_out_of_the_history(capsys: pytest.CaptureFixture[str]) -> None:
    config = load_config(None, ["autopilot.enabled=true", "train.max_steps=80"])
    tracker, history = _RecordingTracker(), []
    attempt = SimpleNamespace(save=lambda history, **kw: None)
    console = Console(True, ProgressLines(80, config.train.global_batch_size, None, ""), None)
    handle = RunReports(lambda: tracker, lambda: False, StartupClock(time.time()), history, attempt,  # type: ignore[arg-type]
                        console, config.storage.path, autopilot=AutopilotTable(True))
    handle(_report(20, 900.0))
    handle(_report(40, 1100.0) | {"autopilot": copy.deepcopy(REPORT)})
    out = capsys.readouterr().out
    assert "autopilot: candidates measured on the run's own steps" in out and "✓" in out
    assert all("autopilot" not in r for r in history) and len(history) == 2
    assert not [k for m in tracker.metrics for k, v in m.items() if isinstance(v, dict)]
    assert tracker.params == autopilot_report.params(REPORT)
    columns, rows = tracker.tables[autopilot_report.TABLE]
    assert columns == autopilot_report.COLUMNS and len(rows) == 4
    assert rows[3][columns.index("status")] == "failed: out of memory on rank 1"
    assert autopilot_report.search_figures(REPORT) in tracker.metrics  # its figures, logged once
    assert handle.autopilot.found is not None and handle.autopilot.found[autopilot_report.AT_STEP] == 40
    # A restarted worker group sends the choice again, kept from the checkpoint: the search seen here stays.
    handle(_report(60, 1200.0) | {"autopilot": REPORT | {"rows": [], "from_checkpoint": True}})
    assert "the restarted workers kept its choice" in capsys.readouterr().out
    assert handle.autopilot.found["rows"] and not handle.autopilot.found["from_checkpoint"]


def test_mlflow_holds_the_table_the_params_and_the_summary_rows_never_a_chart(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    config = load_config(None, ["autopilot.enabled=true", f"tracking.uri={uri}"])
    tracker = MlflowTracker(TrackingConfig(uri=uri, experiment="autopilot"), "run")
    tracker.log_params(config_params(config))
    found = _taken()
    autopilot_report.record_autopilot(tracker, found, 40, verbose=False)
    for report in _history():
        tracker.log_metrics(report, step=report["step"])
    tracker.log_metrics(autopilot_report.achieved_figures(found, _history()), step=80)
    tracker.finish("FINISHED")

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(tracker.run_id)
    assert run.data.params["autopilot.micro_batch_size"] == "128" and run.data.params["autopilot.compile"] == "False"
    assert run.data.params["autopilot.enabled"] == "True"  # the config's own key, beside the choice
    assert not [k for k in run.data.metrics if "autopilot" in k]  # never charted
    table = json.loads(Path(client.download_artifacts(tracker.run_id, autopilot_report.TABLE, str(tmp_path)))
                       .read_text())
    assert table["columns"] == autopilot_report.COLUMNS
    assert [row[0] for row in table["data"]] == [r["candidate"] for r in REPORT["rows"]]
    assert [row[-1] for row in table["data"]] == [False, True, False, False]
    assert {"path": autopilot_report.TABLE, "type": "table"} in json.loads(run.data.tags["mlflow.loggedArtifacts"])
    figures = read_summary(client, tracker.run_id)
    assert figures["autopilot/predicted_speedup"] == 1.31 and figures["autopilot/search_s"] == 8.2
    assert figures["autopilot/achieved_speedup"] == pytest.approx(ACHIEVED / 1000, rel=1e-3)  # 4 digits kept
    # What doctor reads back: the summary's numbers as one-value histories.
    assert read_metrics(client, tracker.run_id)["autopilot/predicted_speedup"] == [1.31]


def test_train_autopilot_sets_the_key_and_the_plan_shows_its_budget(tmp_path: Path, digits_dir: str,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert build_parser().parse_args(["train", "--autopilot"]).autopilot
    sets = [f"data.train={digits_dir}/train", f"data.val={digits_dir}/val", f"storage.path={tmp_path}/runs",
            "tracking.enabled=false"]
    captured: dict[str, Any] = {}

    def fake_train(config: Any, **kwargs: Any) -> Any:
        captured["config"] = config
        raise KeyboardInterrupt  # stop before anything runs

    import orchestrator.run.launch

    original = orchestrator.run.launch.train
    orchestrator.run.launch.train = fake_train  # type: ignore[assignment]
    try:
        main(["train", "--autopilot", "--set", "autopilot.enabled=false", *(a for s in sets for a in ("--set", s))])
    finally:
        orchestrator.run.launch.train = original  # type: ignore[assignment]
    assert captured["config"].autopilot.enabled  # the flag wins over --set
    assert main(["show-config", "--plan", "--set", "autopilot.enabled=true", "--set", "autopilot.budget=0.1",
                 *(a for s in sets for a in ("--set", s))]) == 0
    shown = list(yaml.safe_load_all(capsys.readouterr().out))[1]["autopilot"]  # the plan: the second document
    assert shown["enabled"] is True and shown["budget_share_of_wall_clock"] == 0.1
    assert "train.precision" in shown["searches"] and "train.flush_denormal" in shown["searches"]


def test_a_measured_candidate_that_changes_the_math_brings_the_loss_column() -> None:
    local = START | {"sync": "local_sgd"}
    rows = [_row("micro 32 x 4 | compile off | threads 2 | flush on | fp32", START | {"sync": "ddp"}, 1000.0, 1.0,
                 None, None) | {"loss": 0.6931},
            _row("micro 32 x 4 | compile off | threads 2 | flush on | fp32 | local_sgd", local, 1500.0, 1.5, None,
                 None, chosen=True) | {"loss": 0.7012}]
    lines = autopilot_report.table_lines(_taken(REPORT | {"rows": rows, "chosen": local}))
    assert lines[1].split()[-2:] == ["train", "loss"]
    assert lines[2].endswith("0.6931") and lines[3].split()[-2:] == ["✓", "0.7012"], lines
    # Without such a candidate: no loss column (every measured step trains the same math).
    assert "loss" not in autopilot_report.table_lines(_taken())[1]


def test_a_candidate_with_tf32_flipped_brings_the_loss_column_too() -> None:
    tf32 = START | {"tf32": True}
    rows = [_row("micro 32 x 4 | compile off | threads 2 | flush on | fp32", START, 1000.0, 1.0, None, None)
            | {"loss": 0.6931},
            _row("micro 32 x 4 | compile off | threads 2 | flush on | fp32 | tf32", tf32, 1400.0, 1.4, None, None,
                 chosen=True) | {"loss": 0.6935}]
    lines = autopilot_report.table_lines(_taken(REPORT | {"rows": rows, "chosen": tf32}))
    assert lines[1].split()[-2:] == ["train", "loss"] and lines[3].split()[-2:] == ["✓", "0.6935"], lines
