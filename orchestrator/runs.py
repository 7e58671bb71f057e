"""Where a run lives in storage (local directory or S3, through the data layer's `Storage`): its name, the record
that lets `orchestrator train --resume` continue it (same Ray Train run, same MLflow run), and finding the latest.

Ray Train resumes a run when it is launched again with the same RunConfig name and storage; so a run's name is
chosen once (`<experiment>-<YYYYmmdd-HHMMSS>`) and a resumed driver finds it again in storage.
"""

from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs

from orchestrator.config import Config, flatten, to_dict, to_yaml
from orchestrator.cost import attempt_record
from orchestrator.errors import ConfigError
from orchestrator.tracking.uri import mask_password
from orchestrator.training.resume import checkpointed_cache_decision
from pipelines.storage import Storage, open_storage

RUN_RECORD = "orchestrator-run.json"
RUN_CONFIG = "config.yaml"  # the run's config, a URI's password masked: what `--resume` compares against
ATTEMPTS_DIR = "attempts"  # one JSON record per driver attempt (cost.attempt_record), named by its start
RAY_CHECKPOINTS = "checkpoint_manager_snapshot.json"  # Ray Train's record of the checkpoints it registered

# What `--resume` may change: how the run is watched, fed, placed and billed, and how the global batch is split
# (as after an elastic resize). Everything else (model, data, global batch, precision, optimizer and schedule, step
# budget) defines the training the checkpoints are part of.
RESUMABLE_CHANGES = ("train.log_every", "train.eval_every", "train.max_nonfinite_steps", "train.micro_batch_size",
                     "train.grad_accum_steps", "checkpoint.", "storage.", "tracking.", "failure.", "cost.", "scaling.",
                     "data.prefetch_batches", "data.read_parallelism", "data.cache", "data.cache_max_gb", "data.s3.")


def open_run_storage(config: Config) -> Storage:
    """storage.path resolved like data paths: S3 through the same endpoint, region and credential chain."""
    return open_storage(config.storage.path, config.data.s3)  # a local path takes no S3 settings


@dataclass
class RunPlace:
    storage: Storage
    name: str

    @property
    def path(self) -> str:
        """Inside the filesystem (no s3:// prefix)."""
        return self.storage.join(self.name)

    @property
    def uri(self) -> str:
        return self.storage.uri_of(self.path)

    def registered_step(self) -> int | None:
        """The step of the newest checkpoint Ray Train registered for this run (what a resume continues from),
        from Ray's own record of them beside the checkpoints; None before the first."""
        steps = [int(s) for s in re.findall(r"checkpoint_(\d{8})_", self.read_text(RAY_CHECKPOINTS) or "")]
        return max(steps, default=None)

    def read_record(self, name: str = RUN_RECORD) -> dict[str, Any] | None:
        """A JSON record kept beside the run (the run record by default); None if missing or unreadable."""
        text = self.read_text(name)
        try:
            return dict(json.loads(text)) if text else None
        except ValueError:
            return None

    def write_record(self, record: dict[str, Any], name: str = RUN_RECORD) -> None:
        self.write_text(name, json.dumps(record, indent=1))

    def write_attempt(self, attempt: dict[str, Any]) -> None:
        """Write (or rewrite) this attempt's record; each attempt owns its own file, so none overwrites another."""
        self.write_text(f"{ATTEMPTS_DIR}/{attempt['began']:.3f}.json", json.dumps(attempt))

    def read_attempts(self) -> list[dict[str, Any]]:
        """Every attempt's record written so far (an unreadable one, cut by a kill mid-write, is left out)."""
        fs = self.storage.filesystem()
        infos = fs.get_file_info(pafs.FileSelector(f"{self.path}/{ATTEMPTS_DIR}", allow_not_found=True))
        attempts = [self.read_record(f"{ATTEMPTS_DIR}/{i.base_name}") for i in infos if i.base_name.endswith(".json")]
        return [a for a in attempts if a]

    def read_text(self, name: str) -> str | None:
        try:
            with self.storage.filesystem().open_input_stream(f"{self.path}/{name}") as f:
                return bytes(f.read()).decode()
        except OSError:
            return None

    def write_config(self, config: Config) -> None:
        """The run's config beside its checkpoints, for `check_resumable`. Run storage is often a shared bucket, so
        a password in a URI (tracking.uri) is masked; `tracking.` may change on resume, and a resumed command
        connects with the password its own config or $MLFLOW_TRACKING_URI gives."""
        self.write_text(RUN_CONFIG, mask_password(to_yaml(config)))

    def check_resumable(self, config: Config) -> None:
        """Refuse to continue this run with a config that would train something else than its checkpoints hold
        (its saved config, `write_config`)."""
        import yaml

        saved = self.read_text(RUN_CONFIG)
        if saved is None:
            return  # the run stopped before it saved its config: nothing was trained yet
        old, new = flatten(yaml.safe_load(saved) or {}), flatten(to_dict(config))
        changed = sorted(k for k in old.keys() | new.keys()
                         if old.get(k) != new.get(k) and not k.startswith(RESUMABLE_CHANGES))
        if changed:
            shown = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed[:4])
            raise ConfigError(f"--resume: run {self.uri} was trained with a different config ({shown}"
                              f"{' ...' if len(changed) > 4 else ''}): set those back to continue it, or run without "
                              "--resume to start a new run")

    def cache_decision(self) -> str | None:
        """The cache decision of the checkpoint a resume of this run loads (training.resume); None without one."""
        return checkpointed_cache_decision(self.storage.filesystem(), self.path, self.registered_step())

    def write_text(self, name: str, text: str) -> None:
        fs = self.storage.filesystem()
        target = f"{self.path}/{name}"
        fs.create_dir(target.rsplit("/", 1)[0], recursive=True)
        with fs.open_output_stream(target) as f:
            f.write(text.encode())


class AttemptLog:
    """This command's attempt record in the run's storage (runs.ATTEMPTS_DIR), so that a `--resume` bills the whole
    run. Rewritten with every report, at most every `every_s` seconds: a driver killed by SIGKILL loses at most that
    much of its record, and the time is still billed (as recovery) by the attempt after it."""

    def __init__(self, place: RunPlace, began: float, every_s: float = 5.0) -> None:
        self.place, self.began, self.every_s = place, began, every_s
        self._saved_at = 0.0

    def save(self, history: list[dict[str, Any]], ended: float | None = None, force: bool = False) -> None:
        now = time.time()
        if not force and now - self._saved_at < self.every_s:
            return
        self._saved_at = now
        try:
            self.place.write_attempt(attempt_record(self.began, history, ended or now))
        except OSError as exc:  # the record is for billing: it must not fail a run that trains
            print(f"warning: could not write the run's attempt record in {self.place.uri}: {exc}", file=sys.stderr)


def _run_names(storage: Storage, experiment: str) -> list[str]:
    pattern = re.compile(rf"^{re.escape(experiment)}-\d{{8}}-\d{{6}}(-\d+)?$")
    infos = storage.filesystem().get_file_info(pafs.FileSelector(storage.root, allow_not_found=True))
    names = [i.base_name for i in infos if i.type == pafs.FileType.Directory and pattern.match(i.base_name)]

    def order(name: str) -> tuple[str, int]:
        rest = name[len(experiment) + 1:]  # YYYYmmdd-HHMMSS[-n]
        return rest[:15], int(rest[16:] or 0)

    return sorted(names, key=order)


def latest_run(storage: Storage, experiment: str) -> RunPlace | None:
    """The newest run of `experiment` in storage, by the start time in its name."""
    names = _run_names(storage, experiment)
    return RunPlace(storage, names[-1]) if names else None


def new_run(storage: Storage, experiment: str) -> RunPlace:
    """A fresh, unused run name (a name already in storage would make Ray Train resume that run)."""
    base = f"{experiment}-{time.strftime('%Y%m%d-%H%M%S')}"
    taken = set(_run_names(storage, experiment))
    name, n = base, 1
    while name in taken:
        n += 1
        name = f"{base}-{n}"
    return RunPlace(storage, name)


def place_run(config: Config, resume: bool, verbose: bool) -> tuple[RunPlace, dict[str, Any] | None]:
    """The run's place in storage and, when resuming, its record (MLflow run id; {} when it has none)."""
    storage = open_run_storage(config)
    place = latest_run(storage, config.experiment) if resume else None
    if place is None:
        fresh = new_run(storage, config.experiment)
        if resume:  # always said: a job that always passes --resume would otherwise start over unseen
            print(f"--resume: no earlier run of experiment '{config.experiment}' in {storage.uri} (storage.path): "
                  f"starting a new run, {fresh.name}", file=sys.stderr)
        return fresh, None
    place.check_resumable(config)
    step = place.registered_step()
    if step is None:
        print(f"--resume: run {place.uri} saved no checkpoint: it starts again from step 0", file=sys.stderr)
    elif verbose:
        print(f"resuming run {place.uri} from its latest checkpoint (step {step})", file=sys.stderr)
    return place, place.read_record() or {}
