"""Where a run lives in storage (local directory or S3, through the data layer's `Storage`): its
name, the record that lets `orchestrator train --resume` continue it (same Ray Train run, same
MLflow run), and finding the latest.

A run has one name (`run_name`): its directory in storage.path, its MLflow run's name and what the
terminal calls it, `[<what the command changed>-]<experiment>[-<model>]-<YYYYmmdd-HHMMSS>` (what
differs first: MLflow's runs table cuts a name at about 24 characters). Ray Train resumes a run when
it is launched again with the same RunConfig name and storage; so the name is chosen once and a
resumed driver finds it again in storage (the newest of its experiment, by the time in its name; its
saved config says whose it is).
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs

from orchestrator.config import Config, flatten, to_yaml
from orchestrator.errors import ConfigError
from orchestrator.report.cost import attempt_record
from orchestrator.tracking.uri import mask_password, mask_passwords
from pipelines.storage import Storage, open_storage

RUN_RECORD = "orchestrator-run.json"
# the run's config, a URI's password masked: what `--resume` compares against
RUN_CONFIG = "config.yaml"
# one JSON record per driver attempt (cost.attempt_record), named by its start
ATTEMPTS_DIR = "attempts"
# Ray Train's record of the checkpoints it registered
RAY_CHECKPOINTS = "checkpoint_manager_snapshot.json"

# What `--resume` may change: how the run is watched, fed, placed and billed, and how the global
# batch is split (as after an elastic resize). Everything else (model, data, global batch,
# precision, optimizer and schedule, step budget) defines the training the checkpoints are part of.
RESUMABLE_CHANGES = ("train.log_every", "train.eval_every", "train.max_nonfinite_steps",
                     "train.micro_batch_size", "train.grad_accum_steps", "checkpoint.", "storage.",
                     "tracking.", "failure.", "cost.", "scaling.", "data.prefetch_batches",
                     "data.read_parallelism", "data.cache", "data.cache_max_gb", "data.s3.")


def open_run_storage(config: Config) -> Storage:
    """storage.path resolved like data paths: S3 through the same endpoint, region and credential
    chain."""
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
        """The step of the newest checkpoint Ray Train registered for this run (what a resume
        continues from), from Ray's own record of them beside the checkpoints; None before the
        first."""
        snapshot = self.read_text(RAY_CHECKPOINTS) or ""
        steps = [int(s) for s in re.findall(r"checkpoint_(\d{8})_", snapshot)]
        return max(steps, default=None)

    def read_record(self, name: str = RUN_RECORD) -> dict[str, Any] | None:
        """A JSON record kept beside the run (the run record by default); None if missing or
        unreadable."""
        text = self.read_text(name)
        try:
            return dict(json.loads(text)) if text else None
        except ValueError:
            return None

    def write_record(self, record: dict[str, Any], name: str = RUN_RECORD) -> None:
        self.write_text(name, json.dumps(record, indent=1))

    def mark_finished(self, finished: dict[str, Any]) -> None:
        """The run's record says it finished, and with what (its step, result, final checkpoint): a
        later `--resume` of it starts nothing."""
        try:
            self.write_record((self.read_record() or {}) | {"finished": finished})
        except OSError as exc:  # the run is done: a record it could not update must not fail it
            print(f"warning: could not mark the run finished in {self.uri}: {exc}", file=sys.stderr)

    def write_attempt(self, attempt: dict[str, Any]) -> None:
        """Write (or rewrite) this attempt's record; each attempt owns its own file, so none
        overwrites another."""
        self.write_text(f"{ATTEMPTS_DIR}/{attempt['began']:.3f}.json", json.dumps(attempt))

    def read_attempts(self) -> list[dict[str, Any]]:
        """Every attempt's record written so far (an unreadable one, cut by a kill mid-write, is
        left out)."""
        fs = self.storage.filesystem()
        infos = fs.get_file_info(pafs.FileSelector(f"{self.path}/{ATTEMPTS_DIR}",
                                                   allow_not_found=True))
        attempts = [self.read_record(f"{ATTEMPTS_DIR}/{i.base_name}") for i in infos
                    if i.base_name.endswith(".json")]
        return [a for a in attempts if a]

    def read_text(self, name: str) -> str | None:
        try:
            with self.storage.filesystem().open_input_stream(f"{self.path}/{name}") as f:
                return bytes(f.read()).decode()
        except OSError:
            return None

    def write_config(self, config: Config) -> None:
        """The run's config beside its checkpoints, for `check_resumable`. Run storage is often a
        shared bucket, so a password in a URI (tracking.uri) is masked; `tracking.` may change on
        resume, and a resumed command connects with the password its own config or
        $MLFLOW_TRACKING_URI gives."""
        self.write_text(RUN_CONFIG, mask_password(to_yaml(config)))

    def config_changes(self, config: Config) -> list[str]:
        """What `config` changes of what this run trains ('optim.lr: 0.003 -> 0.1'), against its
        saved config (`write_config`); what may change on resume (RESUMABLE_CHANGES) is left out."""
        import yaml

        saved = self.read_text(RUN_CONFIG)
        if saved is None:
            return []  # the run stopped before it saved its config: nothing was trained yet
        # as write_config saved it
        old, new = flatten(yaml.safe_load(saved) or {}), mask_passwords(config.dotted)
        changed = sorted(k for k in old.keys() | new.keys()
                         if old.get(k) != new.get(k) and not k.startswith(RESUMABLE_CHANGES))
        return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed]

    def check_resumable(self, config: Config) -> None:
        """Refuse to continue this run with a config that would train something else than its
        checkpoints hold."""
        changed = self.config_changes(config)
        if changed:
            raise ConfigError(f"--resume: run {self.uri} was trained with a different config "
                              f"({', '.join(changed[:4])}{' ...' if len(changed) > 4 else ''}): "
                              "set those back to continue it, or run without --resume to start "
                              "a new run")

    def exists(self) -> bool:
        return self.storage.filesystem().get_file_info(self.path).type == pafs.FileType.Directory

    def describe(self, config: Config) -> str:
        """'exp-20261206-051238 (step 40, started 2026-12-06 05:12:38; optim.lr: 0.1 -> 0.003)': the
        step it reached (its attempts' last report, or its newest checkpoint), its start (from its
        name) and what `config` would change of it."""
        steps = [int(r["step"]) for a in self.read_attempts() for r in a.get("reports", [])
                 if "step" in r]
        reached = max([*steps, self.registered_step() or 0])
        stamp = re.search(rf"({_STAMP})(?:-\d+)?$", self.name)
        began = time.strptime(stamp.group(1), "%Y%m%d-%H%M%S") if stamp else None
        started = time.strftime("%Y-%m-%d %H:%M:%S", began) if began else "?"
        changed = self.config_changes(config)
        return (f"{self.name} (step {reached}, started {started}"
                f"{'; ' + changed[0] if changed else ''})")

    def cache_decision(self) -> str | None:
        """The cache decision of the checkpoint a resume of this run loads (training.resume); None
        without one."""
        # Imported on a resume only: the checkpoint module brings torch and Ray Train, no part of
        # the command's start.
        from orchestrator.training.resume import checkpointed_cache_decision

        return checkpointed_cache_decision(self.storage.filesystem(), self.path,
                                           self.registered_step())

    def remove(self, name: str) -> None:
        """Delete file `name` of the run, if it is there."""
        try:
            self.storage.filesystem().delete_file(f"{self.path}/{name}")
        except FileNotFoundError:
            pass

    def write_text(self, name: str, text: str) -> None:
        fs = self.storage.filesystem()
        target = f"{self.path}/{name}"
        fs.create_dir(target.rsplit("/", 1)[0], recursive=True)
        with fs.open_output_stream(target) as f:
            f.write(text.encode())


class AttemptLog:
    """This command's attempt record in the run's storage (runs.ATTEMPTS_DIR), so that a `--resume`
    bills the whole run. Rewritten with every report, at most every `every_s` seconds: a driver
    killed by SIGKILL loses at most that much of its record, and the time is still billed (as
    recovery) by the attempt after it."""

    def __init__(self, place: RunPlace, began: float, number: int | None = None,
                 every_s: float = 5.0) -> None:
        self.place, self.began, self.every_s = place, began, every_s
        self.number = number  # the attempt's number (training/fence.py): recorded with it
        self._saved_at = 0.0

    def save(self, history: list[dict[str, Any]], ended: float | None = None,
             force: bool = False) -> None:
        now = time.time()
        if not force and now - self._saved_at < self.every_s:
            return
        self._saved_at = now
        try:
            record = attempt_record(self.began, history, ended or now)
            self.place.write_attempt(record | ({"attempt": self.number} if self.number else {}))
        except OSError as exc:  # the record is for billing: it must not fail a run that trains
            print(f"warning: could not write the run's attempt record in {self.place.uri}: {exc}",
                  file=sys.stderr)


# What a run's name leaves out of what its command changed: where the run lives and how it is
# watched, fed and billed (its directory and MLflow say that), and the model (named on its own).
UNNAMED = ("experiment", "model.name", "model.entrypoint", "data.", "storage.", "tracking.",
           "cluster.", "checkpoint.", "failure.", "cost.", "tune.", "train.log_every",
           "train.eval_every")
SHORT = {"warmup_steps": "warmup", "weight_decay": "wd", "global_batch_size": "batch",
         "micro_batch_size": "micro", "max_steps": "steps", "num_workers": "workers",
         "grad_accum_steps": "accum", "max_grad_norm": "clip"}
# characters of the name for what changed: a glance, not the params (MLflow has them all)
CHANGED_MAX = 24
GENERIC_BUILDERS = ("build", "make", "create", "model", "main", "get_model", "build_model",
                    "make_model")
_STAMP = r"\d{8}-\d{6}"


def run_name(config: Config, changed: Sequence[str] = (), started: float | None = None) -> str:
    """The run's one name: what the command's `--set` keys (`changed`) set that changes what is
    trained (the first ones, as many as CHANGED_MAX characters hold: `lr1e-3-seed2`), leading where
    the runs table shows it; then the experiment, the model unless the experiment names it, and the
    start time to the second (`lr1e-3-digits-mlp-20261206-051238`); new_run adds `-2` to a name
    already taken."""
    model = model_label(config)
    parts = [config.experiment]
    if f"-{_words(model)}-" not in f"-{_words(config.experiment)}-":
        parts.append(model)
    values = config.dotted
    tokens: list[str] = []
    for key in dict.fromkeys(changed):
        token = None if key.startswith(UNNAMED) or key not in values else _token(key, values[key])
        if token and len("-".join([*tokens, token])) > CHANGED_MAX:
            break  # the first changes, in the command's order
        tokens += [token] if token else []
    stamp = time.strftime("%Y%m%d-%H%M%S",
                          time.localtime(time.time() if started is None else started))
    return "-".join([*tokens, *parts, stamp])


def model_label(config: Config) -> str:
    """The model's name; for one built by `model.entrypoint`, its function's
    (`examples.models:two_input` -> `two_input`), or its module's when the function is named for
    what it does (`my_models:build` -> `my_models`)."""
    entrypoint = config.model.entrypoint
    if not entrypoint:
        return config.model.name[:16]
    module, _, function = entrypoint.partition(":")
    label = function if function and function not in GENERIC_BUILDERS else module.rsplit(".", 1)[-1]
    return re.sub(r"[^A-Za-z0-9_.-]", "", label)[:16] or "model"


def _words(name: str) -> str:
    return re.sub(r"[_.]", "-", name.lower())


def _token(key: str, value: Any) -> str | None:
    """`optim.lr` 1e-3 -> `lr1e-3`, `train.compile` false -> `no-compile`, `model.hidden` [64, 64]
    -> `hidden64x64`, `train.precision` fp32 -> `fp32`, `autopilot.enabled` true -> `autopilot`;
    None for a value that says nothing short (a path, a mapping)."""
    section, _, leaf = key.rpartition(".")
    leaf = section.split(".")[0] if leaf == "enabled" and section else SHORT.get(leaf, leaf)
    if isinstance(value, bool):
        return leaf if value else f"no-{leaf}"
    if isinstance(value, int | float):
        return f"{leaf}{_number(value)}"
    if isinstance(value, list) and value and all(isinstance(v, int | float) for v in value):
        return leaf + "x".join(_number(v) for v in value)
    if isinstance(value, str) and re.fullmatch(r"[A-Za-z0-9._]{1,12}", value):
        return value
    return None


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else compact_number(value)


def compact_number(value: float) -> str:
    """3e-3, 2.5e-4, 0.05, 1: a number in the fewest characters that keep 2 significant digits."""
    if value != 0 and not 1e-2 <= abs(value) < 1e4:
        mantissa, exponent = f"{value:.1e}".split("e")
        return f"{mantissa.removesuffix('.0')}e{int(exponent)}"
    return f"{value:.2g}"


def _run_names(storage: Storage, experiment: str) -> list[str]:
    """The directories named like a run of `experiment`, oldest first by the start time in their
    names (an experiment whose name holds this one's, `exp-other` or `lr0.1-my-exp`, may match:
    latest_run tells them apart)."""
    pattern = re.compile(rf"^(?:.+-)?{re.escape(experiment)}-(?:.+-)?({_STAMP})(?:-(\d+))?$")
    selector = pafs.FileSelector(storage.root, allow_not_found=True)
    infos = storage.filesystem().get_file_info(selector)
    found = [(m, i.base_name) for i in infos
             if i.type == pafs.FileType.Directory and (m := pattern.match(i.base_name))]
    oldest_first = sorted(found, key=lambda f: (f[0].group(1), int(f[0].group(2) or 0)))
    return [name for m, name in oldest_first]


def experiment_runs(storage: Storage, experiment: str) -> list[RunPlace]:
    """The runs of `experiment` in storage, newest first by the start time in their names. A run's
    saved config says whose run it is; one that stopped before saving it counts only when named
    `<experiment>-<time>`."""
    import yaml

    plain = re.compile(rf"^{re.escape(experiment)}-{_STAMP}(-\d+)?$")
    runs = []
    for name in reversed(_run_names(storage, experiment)):
        place = RunPlace(storage, name)
        saved = place.read_text(RUN_CONFIG)
        try:
            owner = (yaml.safe_load(saved) or {}).get("experiment") if saved else None
        except (yaml.YAMLError, AttributeError):
            owner = None
        if owner == experiment or (owner is None and plain.match(name)):
            runs.append(place)
    return runs


def latest_run(storage: Storage, experiment: str) -> RunPlace | None:
    """The newest run of `experiment` in storage, by the start time in its name."""
    return next(iter(experiment_runs(storage, experiment)), None)


def resume_target(config: Config, resume: bool | str) -> tuple[Config, bool | str]:
    """`--resume <path or s3://... of a run directory>` as a run name in its parent, which becomes
    storage.path (where Ray Train finds the run by name); a name or a bare `--resume` as given."""
    if not isinstance(resume, str):
        return config, resume
    path = resume.rstrip("/")  # a shell's completion adds the slash
    if "/" not in path:
        return config, path  # a run's name, in storage.path
    parent, _, name = path.rpartition("/")
    # a path: nothing to validate again
    storage = config.storage.model_copy(update={"path": parent or "/"})
    return config.model_copy(update={"storage": storage}), name


def new_run(storage: Storage, name: str) -> RunPlace:
    """A fresh, unused run directory for `name` (run_name): `-2`, `-3`... after it when taken (a
    name already in storage would make Ray Train resume that run)."""
    fs, candidate, n = storage.filesystem(), name, 1
    while fs.get_file_info(storage.join(candidate)).type != pafs.FileType.NotFound:
        n += 1
        candidate = f"{name}-{n}"
    return RunPlace(storage, candidate)


def place_run(config: Config, resume: bool | str, verbose: bool, changed: Sequence[str] = ()
              ) -> tuple[RunPlace, dict[str, Any] | None]:
    """The run's place in storage and, when resuming, its record (MLflow run id, `finished` once it
    finished; {} when it has none). A new run is named by run_name (`changed`: the config keys the
    command's --set flags set). `resume`: True for the newest run of the experiment this config
    trained, or a run's name."""
    return place_in(open_run_storage(config), config, resume, verbose, changed)


def place_in(storage: Storage, config: Config, resume: bool | str, verbose: bool,
             changed: Sequence[str] = ()) -> tuple[RunPlace, dict[str, Any] | None]:
    """place_run in `storage` already opened (storage.path: the plan's data inspection opens it with
    the data)."""
    if isinstance(resume, str):
        place: RunPlace | None = _named_run(storage, config, resume)
    else:
        place = _matching_run(storage, config) if resume else None
    if place is None:
        fresh = new_run(storage, run_name(config, changed))
        # always said: a job that always passes --resume would otherwise start over unseen
        if resume:
            print(f"--resume: no earlier run of experiment '{config.experiment}' in {storage.uri} "
                  f"(storage.path): starting a new run, {fresh.name}", file=sys.stderr)
        return fresh, None
    place.check_resumable(config)
    record = place.read_record() or {}
    step = place.registered_step()
    if record.get("finished"):
        pass  # nothing to resume: train() says where its result is
    elif step is None:
        print(f"--resume: run {place.uri} saved no checkpoint: it starts again from step 0",
              file=sys.stderr)
    elif verbose:
        print(f"resuming run {place.uri} from its latest checkpoint (step {step})", file=sys.stderr)
    return place, record


_SHOWN = 5  # runs a refused --resume lists


def _named_run(storage: Storage, config: Config, name: str) -> RunPlace:
    place = RunPlace(storage, name)
    if not place.exists():
        runs = ", ".join(run.describe(config)
                         for run in experiment_runs(storage, config.experiment)[:_SHOWN])
        raise ConfigError(f"--resume {name}: no run of that name in {storage.uri} (storage.path); "
                          f"runs of experiment '{config.experiment}' there: {runs or 'none'}")
    return place


def _matching_run(storage: Storage, config: Config) -> RunPlace | None:
    """The newest run of the experiment whose saved config `config` matches (check_resumable); None
    when the experiment has no run. When it has runs and none matches, they are listed: the user
    picks one by name."""
    runs = experiment_runs(storage, config.experiment)
    place = next((run for run in runs if not run.config_changes(config)), None)
    if runs and place is None:
        listed = ", ".join(run.describe(config) for run in runs[:_SHOWN])
        raise ConfigError(f"--resume: no run of experiment '{config.experiment}' in "
                          f"{storage.uri} (storage.path) was trained with this config; its "
                          f"runs, newest first: {listed}{' ...' if len(runs) > _SHOWN else ''}: "
                          "pass --resume <run name> with that run's config, or run without "
                          "--resume to start a new run")
    return place
