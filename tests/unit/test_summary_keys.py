"""Where each figure a run reports goes in MLflow (a charted metric or a row of the `summary.json` table), checked
against docs/metrics.md's own lists: every key the product reports, taken from a real in-process run, the driver's
whole-run figures, and the key literals in the code that set figures only on some runs (compile, CUDA, a drain)."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from orchestrator.config import TASK_KINDS, load_config
from orchestrator.models.zoo import build_model
from orchestrator.report.cost import Pricing, build_ledger
from orchestrator.report.startup import STAGES, StartupClock
from orchestrator.run.result import run_summary
from orchestrator.tracking.view import chart_key, headline_keys, logged_as, mlflow_key
from orchestrator.training.loop import Data, run
from orchestrator.training.optim import build_optimizer
from orchestrator.training.parts import Parts
from orchestrator.training.precision import Precision

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


# --- what docs/metrics.md says ---------------------------------------------------------------------------------

def _bullet(section: str, start: str) -> str:
    """The text of the docs/metrics.md bullet that begins with `start` in the `## <section>` section (up to the next
    one)."""
    text = (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    found = re.search(rf"^- {re.escape(start)}.*?(?=^- |^\S|\Z)", body, re.MULTILINE | re.DOTALL)
    assert found, f"docs/metrics.md's '{section}' section has no bullet starting {start!r}"
    return " ".join(found[0].split())


def _pattern(key: str) -> str:
    """A docs/metrics.md key as a regex: `<rank>` one path part, `...` and `*` anything."""
    out = re.escape(key).replace(r"\.\.\.", ".+").replace(r"\*", ".*")
    return re.sub(r"<[^>]+>", "[^/]+", out)


def readme_keys(start: str) -> list[str]:
    """The keys a docs/metrics.md bullet names, as regexes: each backticked key with a `/`, and a section followed by
    its names in parentheses (`train/` (loss, lr) -> train/loss, train/lr; prose in them means the whole section)."""
    bullet = _bullet("What a run logs", start)
    patterns = []
    for key, inside in re.findall(r"`([^`]*/[^`]*)`(?: \(([^()`]*)\))?", bullet):
        names = [n.strip() for n in inside.split(",")] if inside else []
        if key.endswith("/") and names and all(re.fullmatch(r"[a-z_]+", n) for n in names):
            patterns += [_pattern(key + n) for n in names]
        else:
            patterns.append(_pattern(key + "*" if key.endswith("/") else key))
    assert patterns, f"docs/metrics.md's {start} bullet names no keys"
    return patterns


CHARTED = readme_keys("**metrics**")
SUMMARISED = readme_keys("**`summary.json`**")


def _matches(patterns: list[str], key: str) -> bool:
    return any(re.fullmatch(p, key) for p in patterns)


def test_the_metrics_page_lists_parse_into_the_keys_they_name() -> None:
    # The parser itself: a section with names, a section with prose, placeholders, wildcards.
    assert _matches(CHARTED, "train/grad_norm") and not _matches(CHARTED, "train/step")
    assert _matches(CHARTED, "time/interval_s") and _matches(CHARTED, "val/perplexity")
    assert _matches(CHARTED, "worker/3/samples_per_s") and _matches(CHARTED, "system/node-1/cpu_percent")
    assert not _matches(CHARTED, "final/perf/compile_s") and _matches(SUMMARISED, "final/perf/compile_s")
    assert not _matches(SUMMARISED, "figure")  # the table's columns are not keys


def test_every_tasks_headline_and_validation_keys_are_on_the_metrics_page() -> None:
    # The headline section (the loss, the task's metric, samples/s) and every validation figure of every built-in
    # task, named as the code names them, are on the page's list of charted keys.
    for name, kind in TASK_KINDS.items():
        keys = set(headline_keys(kind.metric).values()) | {mlflow_key(metric) for metric in kind.metrics}
        missing = sorted(key for key in keys if not _matches(CHARTED, key))
        assert not missing, f"{name}: docs/metrics.md's **metrics** bullet does not name {missing}"


# --- what the product reports ------------------------------------------------------------------------------------

def _literal_keys(path: str, function: str, containers: set[str] | None = None) -> set[str]:
    """String keys `function` in `path` writes: dict-literal and comprehension keys, and `x["key"] = ...` stores
    into a name in `containers` (all when None). An f-string key gets `0` for each placeholder."""
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    (node,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function]

    def text(expr: ast.expr | None) -> str | None:
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            return expr.value
        if isinstance(expr, ast.JoinedStr):
            return "".join(v.value if isinstance(v, ast.Constant) else "0" for v in expr.values)
        return None

    keys: list[str | None] = []
    for n in ast.walk(node):
        if isinstance(n, ast.Dict):
            keys += [text(k) for k in n.keys]
        elif isinstance(n, ast.DictComp):
            keys.append(text(n.key))
        elif isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name) and (
                containers is None or n.value.id in containers):
            keys.append(text(n.slice))
    return {k for k in keys if k}


class _Reports:
    def __init__(self) -> None:
        self.history: list[dict[str, Any]] = []

    def publish(self, metrics: dict[str, Any]) -> None:
        self.history.append(dict(metrics))

    def checkpoint(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
        pass


@pytest.fixture(scope="module")
def reported() -> set[str]:
    """Every name the worker and the driver hand to the tracker, by MLflow key."""
    # checkpoint.every left at its default (auto), as a user's run has it: its figures are reported too.
    cfg = load_config(None, ["scaling.num_workers=1", "train.global_batch_size=16", "model.hidden=[8]",
                             "optim.warmup_steps=0", "train.max_steps=4", "train.log_every=2", "train.eval_every=2",
                             "train.peak_tflops=0.001"])
    torch.manual_seed(0)
    model = build_model("mlp", None, 4, 3, cfg.model.kwargs)
    optimizer, scheduler = build_optimizer(model, cfg.optim, 4)
    parts = Parts(model, optimizer, scheduler, Precision("fp32", CPU), CPU, cfg.optim.max_grad_norm)
    x = torch.randn(64, 4)
    rows = [{"x": x[i:i + 16], "labels": x[i:i + 16, :3].argmax(1)} for i in range(0, 64, 16)]
    reports = _Reports()
    run(cfg, parts, Data(lambda epoch: rows, lambda: rows[:1]), reports)
    for report in reports.history:
        report["elapsed_s"] = 1.0  # the driver stamps each report's arrival (launch.py)
    clock = StartupClock(0.0, dict.fromkeys(STAGES, 1.0))
    names = {k for report in reports.history for k in report}
    names |= set(run_summary(reports.history)) | set(clock.metrics())
    names |= set(build_ledger(reports.history, 10.0, Pricing(1, 1.0, "one node")).metrics())
    # What only some runs report: a group, a compiled model, a causal LM, a GPU, a drain; the worker's facts.
    names |= _literal_keys("orchestrator/training/loop.py", "run", {"metrics", "once"})
    names |= _literal_keys("orchestrator/training/loop.py", "_first_step", {"once"})
    names |= _literal_keys("orchestrator/training/loop.py", "_report", {"metrics", "once"})
    names |= _literal_keys("orchestrator/training/loop.py", "_interval_metrics")
    names |= _literal_keys("orchestrator/training/loop.py", "_worker_paces")
    names |= _literal_keys("orchestrator/training/worker.py", "train_rank", set())
    names |= _literal_keys("orchestrator/training/memory.py", "device_facts")
    names |= _literal_keys("orchestrator/training/memory.py", "cuda_memory_stats")
    # checkpoint.every=auto's interval and its inputs; failure.mode=replicas' live replicas and dropped steps.
    names |= _literal_keys("orchestrator/training/cadence.py", "figures")
    names |= _literal_keys("orchestrator/training/replicas.py", "report")
    names |= {f"summary/{k}" for k in ("compile_s", "tokens_per_s", "mfu")}  # run_summary's when measured
    # The worker's train.parallel facts, with its first report: the mode and what one worker holds.
    names |= {"parallel", "param_bytes_per_rank", "optimizer_bytes_per_rank"}
    names.add("cost/attempts")  # the driver's, with the cost ledger (launch.py)
    # An autopilot run's figures (autopilot_report.py): its search's, and what the training achieved after it.
    names |= {f"autopilot/{k}" for k in ("predicted_speedup", "search_s", "search_steps", "start_samples_per_s",
                                         "chosen_samples_per_s", "candidates", "dropped", "skipped", "budget_s",
                                         "budget_spent_s", "from_checkpoint", "achieved_samples_per_s",
                                         "achieved_speedup")}
    return {mlflow_key(name) for name in names}


def test_the_run_reports_what_the_list_covers(reported: set[str]) -> None:
    # So that the next test checks the facts a run has, not a list that lost them.
    assert {"train/world_size", "train/epoch", "train/samples_seen", "train/oom_retries", "train/skipped_steps",
            "train/nonfinite_skipped", "perf/comm_bytes", "perf/compile_s", "perf/tokens_per_s", "perf/mfu",
            "worker/0/samples_per_s", "memory/allocated_gb", "final/perf/compile_s", "cost/usd",
            "startup/total_s", "train/worker_pid", "device/cuda"} <= reported


def test_the_run_page_opens_on_the_headline_section(reported: set[str]) -> None:
    # MLflow 3.17's run page orders its chart sections by name (a key's section: all before its last `/`), in
    # plain string order when it first draws them and by localeCompare after an update (server/js: the chart
    # sections of `RunsChartsCard`): the headline section must come first under both, in every mode.
    charted = {chart_key(key, "val_accuracy") for key in reported if logged_as(key) == "metric"}
    sections = {key.rsplit("/", 1)[0] for key in charted}
    assert "headline" in sections and sorted(sections)[0] == "headline", sorted(sections)
    assert min(sections, key=str.casefold) == "headline", sorted(sections, key=str.casefold)
    assert {"replicas/live", mlflow_key("checkpoint/interval_s")} <= reported  # the modes' figures are in the set


def test_what_is_charted_and_what_is_summarised_is_what_the_metrics_page_says(reported: set[str]) -> None:
    wrong = []
    for key in sorted(reported):
        # A charted key as the UI shows it: the loss, the validation metric and samples/s in the headline section.
        charted, summarised = _matches(CHARTED, chart_key(key, "val_accuracy")), _matches(SUMMARISED, key)
        where = logged_as(key)
        if not (charted or summarised):
            # Not in docs/metrics.md: only the driver's bookkeeping may go unlogged (`at/*`, `elapsed_s`, ...).
            if where is not None:
                wrong.append(f"{key}: logged as {where}, but docs/metrics.md's 'What a run logs' does not list it")
        elif where != ("metric" if charted else "summary"):
            wrong.append(f"{key}: logged as {where}, docs/metrics.md says {'charted' if charted else 'summary table'}")
    assert not wrong, "\n".join(wrong)
