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
# The tests read the docs too (the summary keys from docs/metrics.md, text for tokenizers): without them a mutant
# "dies" of that.
COPIED = ("orchestrator", "pipelines", "tests", "cluster", "examples", "docs", "pyproject.toml", "README.md")


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]


LOOP = "orchestrator/training/loop.py"
STEP = "orchestrator/training/step.py"
CHECKPOINT = "orchestrator/training/checkpoint.py"
POSITION = "orchestrator/training/position.py"
FSDP = "orchestrator/training/fsdp.py"
UNIT = "tests/unit/training"
AUTOPILOT = "orchestrator/training/autopilot.py"
GUARANTEES = f"{UNIT}/test_rank_guarantees.py"
DATA_ORDER = "tests/integration/pipelines/test_data_order.py"
MUTANTS = (
    Mutant("loss normalised per micro-batch", STEP,
           "precision.backward(loss * norm.scale)", "precision.backward(loss / rows(batch))",
           (f"{UNIT}/test_loop.py",)),
    Mutant("world-size factor dropped from the normaliser", STEP,
           "self._scale = self.world / self.total.clamp(min=1)", "self._scale = 1 / self.total.clamp(min=1)",
           (f"{UNIT}/test_rank_agreement.py",)),
    Mutant("gradient clipping disabled", STEP,
           "max_norm = parts.max_grad_norm if parts.max_grad_norm is not None else math.inf",
           "max_norm = math.inf", (f"{UNIT}/test_loop.py",)),
    Mutant("gradients not zeroed before an OOM retry", STEP,
           "        parts.optimizer.zero_grad(set_to_none=True)\n        release_cached_memory(parts.device)",
           "        release_cached_memory(parts.device)", (f"{UNIT}/test_rank_agreement.py",)),
    Mutant("an OOM retry redoes the step at the same micro-batch", STEP,
           "        parts.state.split *= 2\n", "        parts.state.split *= 1\n", (f"{UNIT}/test_rank_agreement.py",)),
    Mutant("data position counted in micro-batches", POSITION,
           "if skip >= rows(batch):\n                skip -= rows(batch)", "if skip >= 1:\n                skip -= 1",
           (f"{UNIT}/test_loop.py",)),
    Mutant("local SGD resumes every rank from rank 0's optimizer", CHECKPOINT,
           "source_rank = rank if same_world else 0",
           "source_rank = 0", (f"{UNIT}/test_rank_agreement.py",)),
    Mutant("every rank resumes rank 0's RNG streams", CHECKPOINT,
           "restore_rng(state[\"rng\"][rank], device)", "restore_rng(state[\"rng\"][0], device)",
           (f"{UNIT}/test_rank_agreement.py",)),
    Mutant("LR schedule restarts after a resume", CHECKPOINT,
           "    parts.scheduler.load_state_dict(state[\"scheduler\"])\n", "",
           (f"{UNIT}/test_fault_handling.py",)),
    Mutant("checkpoint fallback may pick a newer checkpoint", "orchestrator/training/resume.py",
           "if step is not None and (limit is None or step < limit):", "if step is not None:",
           (f"{UNIT}/test_fault_handling.py",)),
    Mutant("sharded checkpoint keeps rank 0's RNG streams for every rank", CHECKPOINT,
           "        dist.all_gather_object(ranks, mine)\n",
           "        ranks = [mine] * len(ranks)\n",
           (f"{UNIT}/test_fsdp_checkpoint.py",)),
    Mutant("sharded manifest leaves out DCP's metadata file", CHECKPOINT,
           'and not i.base_name.endswith(".tmp")}', 'and not i.base_name.startswith(".")}',
           (f"{UNIT}/test_fsdp_checkpoint.py",)),
    Mutant("checkpoint manifest ignores sizes", CHECKPOINT,
           "        if info.size != size:", "        if False:", (f"{UNIT}/test_fault_handling.py",)),
    Mutant("shard order ignores the epoch", "pipelines/order.py",
           "np.random.default_rng([seed, epoch]).permutation", "np.random.default_rng([seed]).permutation",
           ("tests/unit/pipelines/test_data_options.py",)),
    Mutant("shuffle-buffer seed ignores the epoch", "pipelines/order.py",
           "default_rng([seed, epoch, rank, 7])", "default_rng([seed, rank, 7])",
           ("tests/unit/pipelines/test_data_options.py",)),
    # The correctness review's defects, each planted back where it was fixed.
    Mutant("a collective's flag made off the training device", "orchestrator/training/ranks.py",
           "tensor = torch.as_tensor(flag, dtype=torch.float32, device=device).reshape(1)",
           "tensor = torch.as_tensor(flag, dtype=torch.float32).reshape(1)", (f"{UNIT}/test_devices.py",)),
    Mutant("an object key may climb out of the download directory", "pipelines/storage.py",
           'any(p in ("", ".", "..") for p in parts)', 'any(p in ("",) for p in parts)',
           ("tests/unit/pipelines/test_fetch_cache.py",)),
    Mutant("a target-less piece of the model's own loss is NaN", "orchestrator/models/tasks.py",
           "return torch.where(count > 0, model_loss(output).float() * count, 0.0)",
           "return model_loss(output).float() * count", (f"{UNIT}/test_task_edges.py",)),
    Mutant("an OOM retry that never gives up", STEP,
           "if max(rows(batch) for batch in pieces) <= 1:", "if False:",
           (f"{UNIT}/test_efficiency.py::test_an_oom_with_one_row_pieces_fails_in_one_line_instead_of_retrying_forever",)),
    Mutant("a refused MLflow call taken for an outage", "orchestrator/tracking/client.py",
           "            if not is_outage(exc):  # the store answered", "            if False:  # the store answered",
           ("tests/unit/tracking/test_store.py",)),
    Mutant("a resumed run decides the cache afresh", "orchestrator/run/trainer.py",
           "    return saved\n", "    return current\n", ("tests/unit/pipelines/test_replay_resume.py",)),
    Mutant("R²'s total variation taken about zero, not each column's mean", "orchestrator/models/tasks.py",
           "column = y2 - y * y / rows", "column = y2",
           (f"{UNIT}/test_task_edges.py",)),
    Mutant("a fine-tuned pretrained model logged in the builder's default architecture",
           "orchestrator/tracking/flavour.py",
           "        model = with_saved_architecture(model, saved, config.model.entrypoint or config.model.name)\n",
           "", ("tests/unit/tracking/test_flavour.py",)),
    Mutant("model logging rebuilds in a temporary working directory", "orchestrator/tracking/flavour.py",
           "            model, example, output = _rebuild(config, info, weights())\n"
           "            with _working_directory(tmp):\n                _save(",
           "            with _working_directory(tmp):\n"
           "                model, example, output = _rebuild(config, info, weights())\n                _save(",
           ("tests/unit/tracking/test_flavour.py",)),
    Mutant("a report logged after its checkpoint's commit is not linked to the checkpoint's model",
           "orchestrator/tracking/client.py", "Metric(chart, v, t, s, **self._link(key, s))", "Metric(chart, v, t, s)",
           ("tests/unit/tracking/test_checkpoint_models.py",)),
    Mutant("the pyfunc's classification probabilities are the raw logits", "orchestrator/tracking/pyfunc.py",
           '"probabilities": _rows(logits.softmax(-1))', '"probabilities": _rows(logits)',
           ("tests/unit/tracking/test_flavour.py",)),
    Mutant("a checkpoint model outlives the checkpoint retention deleted", "orchestrator/tracking/checkpoint_models.py",
           "        if model.tags.get(CHECKPOINT_TAG) not in kept:\n", "        if False:\n",
           ("tests/unit/tracking/test_checkpoint_models.py",)),
    Mutant("Tune's trials at once ignore the GPUs", "orchestrator/tuning/search.py", "    if widest.use_gpu:\n",
           "    if False:\n", ("tests/unit/tuning/test_search.py::test_trials_at_once_are_bounded_by_the_gpus_too",)),
    Mutant("Ctrl+C during the tracking set-up leaves the run RUNNING", "orchestrator/run/launch.py",
           "    with closed_on_error(tracker):\n        if plan.resume is not None",
           "    if True:\n        if plan.resume is not None",
           ("tests/unit/tracking/test_store.py::"
            "test_ctrl_c_while_the_run_is_being_set_up_ends_it_killed_and_says_how_to_continue",)),
    Mutant("a variable-length label is not trimmed with its tokens", "pipelines/tensors.py",
           "return (self.column, *((self.mask,) if self.mask else ()), *self.along)",
           "return (self.column, *((self.mask,) if self.mask else ()))", ("tests/unit/pipelines/test_padding.py",)),
    Mutant("windows longer than the model's positions reach the workers", "orchestrator/run/model_checks.py",
           "or value.shape[1] <= limit:", "or value.shape[1] <= limit + 1000:",
           ("tests/unit/run/test_model_checks.py",)),
    Mutant("a compile failure on one rank is not agreed", STEP,
           "if ranks.any_rank(failure is not None, parts.device):", "if failure is not None:",
           (f"{UNIT}/test_rank_agreement.py::test_a_compile_failure_on_one_rank_makes_every_rank_run_eagerly",)),
    Mutant("the compile probe moves BatchNorm's running statistics", STEP, "value.copy_(buffers[name])", "pass",
           (f"{UNIT}/test_efficiency.py::test_the_compile_probe_leaves_the_first_step_as_an_eager_one",)),
    Mutant("multilabel's integer labels reach a model's own loss as classes", "orchestrator/models/tasks.py",
           "        return batch[LABELS].float()\n\n", "        return batch[LABELS]\n\n",
           (f"{UNIT}/test_task_edges.py",)),
    Mutant("tokens/s reported for targets that are not tokens", LOOP,
           'if getattr(parts.task, "counts_tokens", False):', "if targets != samples:",
           (f"{UNIT}/test_task_training.py::test_tokens_per_second_is_reported_for_token_counts_only",)),
    # Figures and guarantees that were checked for existing, not for being right.
    Mutant("samples/s of one rank, not the group", LOOP, 'metrics["samples_per_s"] = samples / seconds',
           'metrics["samples_per_s"] = interval.samples / seconds', (f"{UNIT}/test_rank_figures.py",)),
    Mutant("tokens/s of one rank, not the group", LOOP, 'metrics["tokens_per_s"] = targets / seconds',
           'metrics["tokens_per_s"] = float(interval.targets) / seconds', (f"{UNIT}/test_rank_figures.py",)),
    Mutant("MFU without the world factor", LOOP,
           "return (peak * (replicas.participants if replicas is not None else ranks.world()[1]) if peak",
           "return (peak if peak", (f"{UNIT}/test_rank_figures.py", f"{UNIT}/test_replica_groups.py")),
    Mutant("every worker shown at one rank's pace", LOOP, "paces[rank] = interval.samples / max(busy, 1e-9)",
           "paces[:] = [interval.samples / max(busy, 1e-9)] * world", (f"{UNIT}/test_rank_figures.py",)),
    Mutant("the interval's sums not added across ranks", LOOP,
           "        dist.all_reduce(shared)\n", "        dist.all_reduce(shared.clone())\n",
           (f"{UNIT}/test_rank_figures.py",)),
    Mutant("world size dropped from the summary table", "orchestrator/tracking/view.py",
           '"train/precision", "train/world_size", "train/worker_pid",', '"train/precision", "train/worker_pid",',
           ("tests/unit/test_summary_keys.py",)),
    Mutant("the S3 filesystem shipped to workers carries the credentials", "pipelines/storage.py",
           '            "region": self.region,\n',
           '            "region": self.region, "access_key": os.environ.get("AWS_ACCESS_KEY_ID"),\n'
           '            "secret_key": os.environ.get("AWS_SECRET_ACCESS_KEY"),\n'
           '            "session_token": os.environ.get("AWS_SESSION_TOKEN"),\n',
           ("tests/unit/test_fast_guards.py",)),
    Mutant("a password in tracking.uri logged as a param", "orchestrator/tracking/context.py",
           "return {key: mask_password(value) if isinstance(value, str) else value\n",
           "return {key: value\n", ("tests/unit/tracking/test_uri_secrets.py",)),
    Mutant("a Ray job's driver stays in its package, which ray.init can remove", "orchestrator/cluster/local.py",
           "os.chdir(os.path.dirname(store) if store else user_cache_dir())", "os.chdir(package)",
           ("tests/unit/cluster/test_local_job_package.py",)),
    Mutant("orchestrator ui on SIGTERM leaves its MLflow server listening", "orchestrator/report/ui.py",
           "raise SystemExit(128 + signum)", "os._exit(128 + signum)",
           ("tests/integration/test_mlflow_ui.py::test_a_terminated_ui_stops_its_mlflow_server",)),
    Mutant("Ctrl+C exits 1, not 130", "orchestrator/cli.py", "        return 130", "        return 1",
           ("tests/unit/test_fast_guards.py",)),
    Mutant("the resume line forgets --resume", "orchestrator/run/interrupts.py",
           'again = shlex.join(command + ([] if "--resume" in command else ["--resume"]))',
           "again = shlex.join(command)", ("tests/unit/test_fast_guards.py",)),
    Mutant("validation sums not added across ranks", "orchestrator/training/evaluation.py",
           "ranks.all_reduce_sum([float(totals.get(k, 0.0)) for k in keys], parts.device),",
           "[float(totals.get(k, 0.0)) for k in keys],", (f"{UNIT}/test_rank_figures.py",)),
    Mutant("causal LM pairs each position with itself, not the next token", "orchestrator/models/tasks.py",
           "logits, labels = logits[:, :-1], labels[:, 1:]", "logits, labels = logits[:, :-1], labels[:, :-1]",
           (f"{UNIT}/test_task_meaning.py",)),
    Mutant("perplexity of the summed loss, not the mean", "orchestrator/models/tasks.py", "math.exp(min(loss, 700.0))",
           'math.exp(min(sums["loss"], 700.0))', (f"{UNIT}/test_task_meaning.py",)),
    Mutant("multilabel F1 counts false positives twice, false negatives never", "orchestrator/models/tasks.py",
           'f1_denominator = 2 * sums["tp"] + sums["fp"] + sums["fn"]',
           'f1_denominator = 2 * sums["tp"] + 2 * sums["fp"]',
           (f"{UNIT}/test_task_meaning.py",)),
    Mutant("multilabel predicts at logit 0.5 instead of probability 0.5", "orchestrator/models/tasks.py",
           "predicted = logits_of(output).reshape(y.shape) > 0", "predicted = logits_of(output).reshape(y.shape) > 0.5",
           (f"{UNIT}/test_task_meaning.py",)),
    Mutant("a label list is not rounded to the padding multiple", "pipelines/batches.py",
           "values, mask = column_array(table.column(label), padding.multiple)",
           "values, mask = column_array(table.column(label))", ("tests/unit/pipelines/test_padding_widths.py",)),
    # What FSDP's ranks must decide together or keep consistent (issue 33).
    Mutant("the finite-weights verdict before a checkpoint is not agreed across ranks", LOOP,
           "if ranks.any_rank(not finite, parts.device):", "if not finite:",
           (f"{GUARANTEES}::test_an_overflow_in_one_ranks_shard_stops_every_rank_with_one_error_before_the_checkpoint",)),
    Mutant("an FSDP block is not a unit of its own", FSDP,
           "            fully_shard(block, mesh=mesh, mp_policy=policy,\n"
           "                        reshard_after_forward=reshard_after_forward)",
           "            pass", (f"{GUARANTEES}::test_every_configured_block_is_its_own_fsdp_unit",)),
    Mutant("low-precision FSDP reduces gradients in the low dtype", FSDP,
           "return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)",
           "return MixedPrecisionPolicy(param_dtype=low)",
           (f"{GUARANTEES}::test_bf16_fsdp_reduces_gradients_in_fp32",)),
    Mutant("a sharded manifest written before every rank's write completed", CHECKPOINT,
           "        self.wait()\n        if world()[0] == 0:", "        if world()[0] == 0:",
           (f"{GUARANTEES}::test_a_sharded_manifest_is_written_after_every_ranks_write_even_a_slow_one",)),
    Mutant("auto micro-batch agreed on the largest fit of the ranks", "orchestrator/training/micro_batch.py",
           "dist.all_reduce(agreed, op=dist.ReduceOp.MIN)", "dist.all_reduce(agreed, op=dist.ReduceOp.MAX)",
           (f"{GUARANTEES}::test_auto_micro_batch_agrees_on_the_smallest_fit_of_the_ranks",)),
    Mutant("fp16 grad_norm averages in the steps the scaler skipped", "orchestrator/training/interval.py",
           "counted = applied & (overflowed == 0)", "counted = applied",
           (f"{UNIT}/test_loop.py::test_fp16_grad_norm_averages_the_applied_steps_and_the_scalers_skips_are_counted",)),
    # Security: the disk cache's directory and files (issue 33, item 1).
    Mutant("a cache directory of another user's is trusted", "pipelines/storage.py",
           "if st.st_uid != os.getuid()", "if False", ("tests/unit/pipelines/test_disk_cache_dir.py",)),
    Mutant("a cache directory others can write to is trusted", "pipelines/storage.py",
           "if st.st_mode & 0o022 else", "if False else", ("tests/unit/pipelines/test_disk_cache_dir.py",)),
    Mutant("the disk cache skips the private-directory rule", "pipelines/cache.py",
           "        self.check()  # on every use", "        pass  # on every use",
           ("tests/unit/pipelines/test_disk_cache_dir.py",)),
    Mutant("the driver does not check the disk cache's directory", "pipelines/datasets.py",
           "        DiskCache(cfg.disk_cache).check()\n", "        pass\n",
           ("tests/unit/pipelines/test_disk_cache_dir.py",)),
    Mutant("a lock file opened through a symlink", "pipelines/storage.py",
           "os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC", "os.O_RDWR | os.O_CREAT | os.O_CLOEXEC",
           ("tests/unit/pipelines/test_disk_cache_dir.py",)),
    Mutant("the cache's counters written through a fixed temporary name", "pipelines/cache.py",
           'fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".stats.", suffix=".tmp")',
           'tmp = os.path.join(self.directory, ".stats.json.tmp"); fd = os.open(tmp, os.O_WRONLY | os.O_CREAT)',
           ("tests/unit/pipelines/test_disk_cache_dir.py",)),
    Mutant("the run's description not led by the task's metric", "orchestrator/tracking/view.py",
           'names = sorted(val, key=lambda n: (n != head, n != "loss", n))[:2]',
           'names = sorted(val, key=lambda n: (n != "loss", n))[:2]', ("tests/unit/tracking/test_view.py",)),
    Mutant("the tracker writes the description without the run's metric", "orchestrator/tracking/client.py",
           "note = headline_note(figures, self._metric)", "note = headline_note(figures)",
           ("tests/unit/tracking/test_view.py",)),
    # doctor's advice, where it must fit its context and be accepted by the CLI and the config (issue 33, 10-11).
    Mutant("doctor's evaluation advice ignores ASHA", "orchestrator/doctor/rules/run_health.py",
           "    if under_asha(run):\n        return Finding(", "    if False:\n        return Finding(",
           ("tests/unit/doctor/test_rules.py",)),
    Mutant("a short run's one end-of-run pass blamed on the split", "orchestrator/doctor/rules/run_health.py",
           "if pass_steps < LARGE_PASS_STEPS:", "if False:", ("tests/unit/doctor/test_rules.py",)),
    Mutant("a doubled micro-batch suggested without the global batch it needs", "orchestrator/doctor/rules/speed.py",
           "if accum and accum % 2 == 0:", "if micro:", ("tests/unit/doctor/test_rules.py",)),
    # A real two-trial study on local Ray (about 40 s): the trials share one reused actor.
    Mutant("a Tune trial's epoch clock outlives it in its reused actor", "orchestrator/tuning/trial.py",
           '            release_epoch_clock(spec.epoch_clock)\n', "            pass\n",
           ("tests/integration/test_tune.py::test_a_second_trial_in_the_same_actor_starts_as_a_fresh_process_would",)),
    Mutant("a study's CPU memory budget ignores its other trials at once", "orchestrator/tuning/search.py",
           "    at_once = trials_at_once * workers\n", "    at_once = workers\n",
           ("tests/unit/run/test_memory_plan.py::"
            "test_auto_micro_batch_in_a_study_divides_the_nodes_memory_by_every_rank_it_places_there",)),
    # The autopilot: its measured steps are real, its choice is one for all ranks, its budget and resume hold.
    Mutant("the autopilot times each rank's own step", AUTOPILOT,
           "seconds, ran_out, peak = ranks.all_reduce_max(", "seconds, ran_out, peak = (lambda v, d: v)(",
           (f"{UNIT}/test_autopilot.py::test_every_rank_makes_the_one_choice_by_the_slowest_ranks_time",)),
    Mutant("the autopilot's out-of-memory probe decided per rank", AUTOPILOT,
           "    return ranks.any_rank(ran_out, parts.device)\n", "    return ran_out\n",
           (f"{UNIT}/test_autopilot.py::test_a_candidate_out_of_memory_on_one_rank_is_dropped_on_all",)),
    Mutant("the autopilot's budget ignored", AUTOPILOT,
           "stop = STOP if self.charged >= self.budget_s or", "stop = STOP if False or",
           (f"{UNIT}/test_autopilot.py::test_the_budget_is_kept_against_a_slow_candidate",)),
    Mutant("the autopilot searches again on resume", AUTOPILOT,
           'resized = saved is not None and saved.get("world") != world', "resized = saved is not None",
           (f"{UNIT}/test_autopilot.py::test_a_resume_applies_the_saved_choice_without_searching",)),
    Mutant("the autopilot's larger micro-batch not applied", "orchestrator/training/knobs.py",
           "parts.state.join, parts.state.split = s.micro_batch_size // self.micro, 1",
           "parts.state.join, parts.state.split = 1, 1",
           (f"{UNIT}/test_autopilot.py::"
            "test_an_autopilot_run_ends_with_the_weights_of_its_choice_configured_from_the_start",)),
    Mutant("back to DDP after local SGD with each rank's own optimizer state", "orchestrator/training/knobs.py",
           "            parts.state.comm_bytes += average_optimizer_state(parts.optimizer)\n", "",
           (f"{UNIT}/test_autopilot.py::"
            "test_back_to_ddp_after_local_sgd_the_ranks_share_one_model_and_one_optimizer_state",)),
    # A study's one autopilot search: one trial searches, the others wait and apply its choice.
    Mutant("every trial of a study searches at once", "orchestrator/tuning/autopilot.py",
           "        if self.searcher in (None, trial_id):\n", "        if True:\n",
           ("tests/unit/tuning/test_search.py::"
            "test_a_study_shares_one_autopilot_search_unless_it_searches_what_the_search_depends_on",)),
    Mutant("a study's trials each search their own", "orchestrator/tuning/autopilot.py",
           "    if reason:\n        return None\n", "    if True:\n        return None\n",
           ("tests/integration/test_tune.py::"
            "test_a_study_with_the_autopilot_searches_once_and_every_trial_trains_with_its_choice",)),
    Mutant("the data not cut at the autopilot's micro-batch once it chose", AUTOPILOT,
           "        if resize is None or micro == self.knobs.micro:\n", "        if True:\n",
           (f"{UNIT}/test_autopilot.py::"
            "test_an_autopilot_run_ends_with_the_weights_of_its_choice_configured_from_the_start",)),
    Mutant("a replay cut at the size its epoch began with drops the rest after a re-cut", "pipelines/batches.py",
           "split_batches(batches, lambda: self.micro, False, self.padding, start)",
           "split_batches(batches, self.micro, False, self.padding, start)",
           (f"{UNIT}/test_recut.py",)),
    # A step that never waits (issue 46): the decisions taken on the device still hold.
    Mutant("a non-finite step applied by the fused optimizer", "orchestrator/training/precision.py",
           '_attribute(optimizer, "found_inf", skip)', '_attribute(optimizer, "found_inf", torch.zeros_like(skip))',
           (f"{UNIT}/test_step_waits.py",)),
    Mutant("the non-finite verdict not agreed across ranks", STEP, "return ranks.on_any_rank(bad)",
           "return bad.float()", (f"{UNIT}/test_step_waits.py",)),
    Mutant("train.max_nonfinite_steps never enforced", LOOP, "if progress.nonfinite_skipped > max_nonfinite:",
           "if False:", (f"{UNIT}/test_fault_handling.py",)),
    Mutant("token counts taken as equal on every rank", STEP,
           'if self.world > 1 and getattr(parts.task, "counts_tokens", True):', "if False:",
           (f"{UNIT}/test_fsdp_training.py",)),
    Mutant("the wait for the token count's all-reduce billed as compute", STEP,
           "                self.waited = (started, self.timer.mark())\n", "",
           (f"{UNIT}/test_step_waits.py::test_a_wait_for_a_late_rank_in_the_token_count_is_sync_and_the_shares_tile_the"
            "_wall_clock",)),
    Mutant("a run's name spelling out its checkpoint settings", "orchestrator/run/place.py",
           '"checkpoint.", "failure.", "cost.", "tune."', '"failure.", "cost.", "tune."',
           ("tests/unit/run/test_place.py",)),
    Mutant("a skipped first step keeps the momentum its fused kernel left uninitialised",
           "orchestrator/training/precision.py", "    yield False\n    for p in fresh:",
           "    yield False\n    for p in []:",
           (f"{UNIT}/test_optim.py",)),
    Mutant("a resumed epoch re-cut from its start instead of its position", POSITION,
           "            batches.start, skip = skip, 0\n", "            pass\n", (f"{UNIT}/test_recut.py",)),
    Mutant("a restarted trial billed on Tune's rewound clock", "orchestrator/tuning/trials.py",
           "            return float(row[REPORTED_AT]) - started\n",
           '            return float(row.get("time_total_s", 0.0))\n',
           ("tests/unit/tuning/test_results.py::test_a_restarted_trials_ledger_bills_the_time_its_restart_lost",)),
    # The autopilot on the driver: its report kept among the metrics, the achieved pace over the whole interval.
    Mutant("the autopilot's report left in the metrics and the history", "orchestrator/report/autopilot.py",
           "    found = report.pop(REPORT_KEY, None)\n", "    found = report.get(REPORT_KEY)\n",
           ("tests/unit/report/test_autopilot_report.py",)),
    Mutant("the achieved pace counted over data waits and evaluation too", "orchestrator/report/autopilot.py",
           'r["interval_s"] * sum(r.get(k, 0.0) for k in _STEP_PHASES)', 'r["interval_s"]',
           ("tests/unit/report/test_autopilot_report.py",)),
    Mutant("a restart's gap billed as other, not recovery", "orchestrator/report/cost.py",
           'seconds["resize" if resized else "recovery"] += gap', 'seconds["resize" if resized else "other"] += gap',
           ("tests/unit/report/test_cost.py::test_a_restart_bills_the_redone_steps_as_wasted_and_the_gap_as_recovery",
            "tests/integration/test_reliability.py::test_two_kills_are_billed_as_the_test_timed_them")),
    Mutant("the wait for a slower rank at a step's first collective left in other", STEP,
           "                started = self.timer.mark()\n                self.work.wait()\n"
           "                self.waited = (started, self.timer.mark())\n",
           "                self.work.wait()\n",
           ("tests/unit/training/test_rank_figures.py::test_waiting_for_a_rank_whose_reader_is_slow_is_sync_not_other",)),
    Mutant("MLflow's opening beside the worker group counted as a part of the start-up",
           "orchestrator/report/startup.py",
           "        self.spans[stage] = (began, ended)", "        self.marks[stage] = ended",
           ("tests/unit/report/test_startup.py",)),
    Mutant("the data's inspection imports torch and Ray Data for every run", "pipelines/datasets.py",
           "    sample = None\n    if rows is not None and (named or cfg.label is None):\n",
           "    import pipelines.batches  # noqa: F401\n    sample = None\n"
           "    if rows is not None and (named or cfg.label is None):\n",
           ("tests/unit/run/test_plan.py::test_the_data_inspection_of_labelled_columns_imports_no_torch",)),
    Mutant("the model's check counted in the start-up's data inspection", "orchestrator/run/plan.py",
           '    if clock is not None:\n        clock.mark("data inspection")\n'
           "    # the model built once, on the meta device\n"
           "    checked = plan_config(config, data.datasets, data.sample)\n",
           "    # the model built once, on the meta device\n"
           "    checked = plan_config(config, data.datasets, data.sample)\n"
           '    if clock is not None:\n        clock.mark("data inspection")\n',
           ("tests/unit/run/test_plan.py::test_the_start_up_lines_data_inspection_is_the_data_read_and_the_model_check_"
            "a_stage_of_its_own",)),
    Mutant("held small data: each rank's part runs on into the next rank's rows", "pipelines/held.py",
           "        return rank * each, each\n", "        return rank * each, rows - rank * each\n",
           (f"{DATA_ORDER}::test_held_small_data_gives_each_rank_an_equal_disjoint_part_in_row_order",)),
    Mutant("small data read by the driver without its transforms", "pipelines/datasets.py",
           "tables.append(apply_transforms(table, cfg.transforms, cfg.features) if cfg.transforms\n"
           "                      else table)",
           "tables.append(table)",
           (f"{DATA_ORDER}::test_small_data_read_by_the_driver_makes_the_blocks_ray_datas_read_tasks_make",)),
    # Issue 48: what the newest modes promise (docs/autopilot.md, docs/guarantees.md, docs/doctor.md, the README),
    # each broken by a one-line slip: the autopilot's margin, resume and saved choice; a study's shared search; the
    # auto checkpoint interval's cap and cost; replica groups; the warm cluster's fingerprint; the plan; doctor.
    Mutant("a candidate that beats the best by exactly the margin adopted", AUTOPILOT,
           "adopt = ADOPT if ratio < 1 - self.margin and", "adopt = ADOPT if ratio <= 1 - self.margin and",
           ("tests/unit/training/test_autopilot_decisions.py::"
            "test_a_candidate_must_beat_the_best_by_more_than_the_noise_margin",)),
    Mutant("a tie, or a candidate slower within the margin, adopted", AUTOPILOT,
           "adopt = ADOPT if ratio < 1 - self.margin and", "adopt = ADOPT if ratio < 1 + self.margin and",
           ("tests/unit/training/test_autopilot_decisions.py::"
            "test_a_tie_or_a_candidate_slower_within_the_margin_is_not_adopted",)),
    Mutant("the noise margin taken as the start's spread, not twice it", AUTOPILOT,
           "min(max(2 * _spread(trial.times), MARGIN[0])", "min(max(_spread(trial.times), MARGIN[0])",
           ("tests/unit/training/test_autopilot_decisions.py::"
            "test_a_candidate_must_beat_the_best_by_more_than_the_noise_margin",)),
    Mutant("a run resumed near its end searches as if it had all its steps left", AUTOPILOT,
           "    steps = t.max_steps - progress.step  #", "    steps = t.max_steps  #",
           ("tests/unit/training/test_autopilot_decisions.py::"
            "test_a_run_resumed_close_to_its_end_starts_no_search_it_cannot_repay",)),
    Mutant("a resumed run's search budget counts the steps already run", AUTOPILOT,
           "self.steps_left = cfg.train.max_steps - progress.step", "self.steps_left = cfg.train.max_steps",
           ("tests/unit/training/test_autopilot_decisions.py::"
            "test_a_run_resumed_close_to_its_end_starts_no_search_it_cannot_repay",)),
    Mutant("the checkpoint keeps the candidate the budget stopped, not the choice", AUTOPILOT,
           "saved(self.start, self.best.settings,", "saved(self.start, self.trial.settings,",
           ("tests/unit/training/test_autopilot_decisions.py::"
            "test_the_saved_choice_is_the_chosen_one_when_the_budget_stops_a_slower_candidate",)),
    Mutant("the budget's stop adopts the slower candidate it stopped", AUTOPILOT,
           "        elif code & ADOPT:\n", "        elif code & (ADOPT | STOP):\n",
           ("tests/unit/training/test_autopilot_decisions.py::"
            "test_the_saved_choice_is_the_chosen_one_when_the_budget_stops_a_slower_candidate",)),
    Mutant("a study searching the global batch shares one autopilot choice", "orchestrator/tuning/autopilot.py",
           '"train.grad_accum_steps", "train.global_batch_size",', '"train.grad_accum_steps",',
           ("tests/unit/tuning/test_study_autopilot.py",)),
    Mutant("a study searching a key under data. shares one autopilot choice", "orchestrator/tuning/autopilot.py",
           '_PER_TRIAL_SECTIONS = {"model", "data", "scaling", "autopilot"}',
           '_PER_TRIAL_SECTIONS = {"model", "scaling", "autopilot"}', ("tests/unit/tuning/test_study_autopilot.py",)),
    Mutant("a study's per-trial sections matched as whole keys", "orchestrator/tuning/autopilot.py",
           'k.split(".")[0] in _PER_TRIAL_SECTIONS', "k in _PER_TRIAL_SECTIONS",
           ("tests/unit/tuning/test_study_autopilot.py",)),
    Mutant("a study without the autopilot says each trial searches its own", "orchestrator/tuning/autopilot.py",
           "    if not config.autopilot.enabled:\n        return None\n    keys", "    keys",
           ("tests/unit/tuning/test_study_autopilot.py",)),
    Mutant("checkpoint.every_minutes read as seconds", "orchestrator/training/checkpoint_interval.py",
           'seconds > cap_minutes * 60:\n        seconds, bound = cap_minutes * 60, "cap"',
           'seconds > cap_minutes:\n        seconds, bound = cap_minutes, "cap"',
           ("tests/unit/training/test_checkpoint_interval_bounds.py",)),
    Mutant("a cap above Young's interval replaces it", "orchestrator/training/checkpoint_interval.py",
           "if cap_minutes is not None and seconds > cap_minutes * 60:", "if cap_minutes is not None:",
           ("tests/unit/training/test_checkpoint_interval_bounds.py",)),
    Mutant("the cost floor wins over the user's cap", "orchestrator/training/checkpoint_interval.py",
           '    if seconds < cost_s / MAX_COST_SHARE:\n        seconds, bound = cost_s / MAX_COST_SHARE, "cost"\n'
           '    if cap_minutes is not None and seconds > cap_minutes * 60:\n'
           '        seconds, bound = cap_minutes * 60, "cap"\n',
           '    if cap_minutes is not None and seconds > cap_minutes * 60:\n'
           '        seconds, bound = cap_minutes * 60, "cap"\n'
           '    if seconds < cost_s / MAX_COST_SHARE:\n        seconds, bound = cost_s / MAX_COST_SHARE, "cost"\n',
           ("tests/unit/training/test_checkpoint_interval_bounds.py",)),
    Mutant("the checkpoint's cost leaves out its write", LOOP,
           'progress.checkpoint_cost_s = interval.timer.seconds["checkpoint"] + registering',
           "progress.checkpoint_cost_s = registering",
           ("tests/unit/training/test_checkpoint_interval_bounds.py",)),
    Mutant("the checkpoint's cost leaves out its registration", LOOP,
           'progress.checkpoint_cost_s = interval.timer.seconds["checkpoint"] + registering',
           'progress.checkpoint_cost_s = interval.timer.seconds["checkpoint"]',
           ("tests/unit/training/test_checkpoint_interval_bounds.py",)),
    Mutant("a replaced replica keeps its own fp16 scale and skip count", "orchestrator/training/replicas.py",
           '        parts.precision.load_state_dict(state["precision"])\n', "",
           ("tests/unit/training/test_replica_state.py",)),
    Mutant("a replaced replica restarts the LR schedule", "orchestrator/training/replicas.py",
           '        schedule.load_state_dict(state["scheduler"])\n', "",
           ("tests/unit/training/test_replica_state.py",)),
    Mutant("a replaced replica takes its peer's step but not its samples seen", "orchestrator/training/replicas.py",
           'progress.step, progress.samples_seen = peer["step"], peer["samples_seen"]',
           'progress.step = peer["step"]', ("tests/unit/training/test_replica_state.py",)),
    Mutant("a lone replica runs its half of the global batch", "orchestrator/training/replicas.py",
           "self.rows.share(step, rank, self.participants)", "self.rows.share(step, rank, self.workers)",
           ("tests/unit/training/test_replica_state.py",)),
    Mutant("a step the quorum dropped moves the LR schedule on", "orchestrator/training/replicas.py",
           "        if self.optimizer.committed:\n            self.schedule.step()", "        self.schedule.step()",
           ("tests/unit/training/test_replica_state.py",)),
    Mutant("a replica that finished leaves its peer being replaced to train the run again alone",
           "orchestrator/training/replicas.py", "        if self.took_final:\n            return\n",
           "        return\n", ("tests/unit/training/test_replica_groups.py",)),
    Mutant("each replica normalises the token loss by its own tokens", "orchestrator/training/step.py",
           "        quorum = parts.state.replicas\n", "        quorum = None\n",
           ("tests/unit/training/test_replica_groups.py",)),
    Mutant("a fresh run's first step starts without waiting for every replica", "orchestrator/training/replicas.py",
           "lambda: self.manager.current_step() == 0)", "lambda: False)",
           ("tests/unit/training/test_replica_state.py",)),
    Mutant("a warm cluster started by another Python is reused", "orchestrator/cluster/warm.py",
           'names = {"ray": "Ray", "python": "Python", ', 'names = {"ray": "Ray", ',
           ("tests/unit/cluster/test_warm_fingerprint.py",)),
    Mutant("a warm cluster started with another Ray is reused", "orchestrator/cluster/warm.py",
           'names = {"ray": "Ray", "python": "Python", ', 'names = {"python": "Python", ',
           ("tests/unit/cluster/test_warm_fingerprint.py",)),
    Mutant("the warm cluster's working directory read from the shell's PWD", "orchestrator/cluster/fingerprint.py",
           '"cwd": os.getcwd()', '"cwd": os.environ.get("PWD", "")', ("tests/unit/cluster/test_warm_fingerprint.py",)),
    Mutant("the plan lists train.sync for one worker", "orchestrator/run/plan.py",
           "c.scaling.max_workers > 1 else []", "c.scaling.max_workers >= 1 else []",
           ("tests/unit/run/test_plan_autopilot.py",)),
    Mutant("the plan lists train.sync without autopilot.allow", "orchestrator/run/plan.py",
           'if "sync" in c.autopilot.allow and c.scaling.max_workers > 1', "if c.scaling.max_workers > 1",
           ("tests/unit/run/test_plan_autopilot.py",)),
    Mutant("the plan lists a precision the user set", "orchestrator/run/plan.py",
           '["train.precision"] if c.train.precision == "auto" else []', '["train.precision"]',
           ("tests/unit/run/test_plan_autopilot.py",)),
    Mutant("the plan lists flush_denormal for a GPU run", "orchestrator/run/plan.py",
           'searches += [] if c.scaling.use_gpu else ["train.torch_threads", "train.flush_denormal"]',
           'searches += ["train.flush_denormal"]', ("tests/unit/run/test_plan_autopilot.py",)),
    Mutant("doctor's blocked-reports advice doubles checkpoint.every=auto", "orchestrator/doctor/rules/run_health.py",
           'changes = [] if every == "auto" else [f"checkpoint.every={2 * int(every)}"]',
           'changes = [f"checkpoint.every={2 * int(every)}"]', ("tests/unit/doctor/test_record.py",)),
    Mutant("doctor's interval rule on a checkpoint.every=auto run", "orchestrator/doctor/rules/run_health.py",
           "if not failures or not wall or not steps or not every:", "if not failures or not wall or not steps:",
           ("tests/unit/doctor/test_record.py",)),
    Mutant("doctor formats the prediction of a choice kept from the checkpoint",
           "orchestrator/doctor/rules/autopilot.py",
           'f"predicted {predicted:.2f}x" if predicted is not None\n',
           'f"predicted {predicted:.2f}x" if True\n',
           ("tests/unit/doctor/test_record.py",)),
    Mutant("doctor judges the size of a study with no trial yet", "orchestrator/doctor/rules/study.py",
           "    if not space or not trials:\n", "    if not space:\n", ("tests/unit/doctor/test_record.py",)),
    Mutant("doctor's autopilot finding on a run without the autopilot", "orchestrator/doctor/rules/autopilot.py",
           "    if predicted is None and achieved is None:\n        return None\n", "",
           ("tests/unit/doctor/test_record.py",)),
    Mutant("doctor reads the search space of a study with no best trial yet", "orchestrator/doctor/rules/study.py",
           "    if not space or not best:\n", "    if not space:\n", ("tests/unit/doctor/test_record.py",)),
    Mutant("doctor advises fsdp to a run already sharded", "orchestrator/doctor/rules/speed.py",
           '    if (run.param("train.parallel") or "ddp") != "ddp":\n        return None\n', "",
           ("tests/unit/doctor/test_record.py",)),
    Mutant("doctor advises bf16 where the autopilot measured fp32 faster", "orchestrator/doctor/rules/speed.py",
           '    if measured(run, "precision"):\n        return None', "    if False:\n        return None",
           ("tests/unit/doctor/test_record.py",)),
    Mutant("doctor advises compiling where the autopilot measured it", "orchestrator/doctor/rules/speed.py",
           ' or measured(run, "compile"):', ":", ("tests/unit/doctor/test_record.py",)),
    Mutant("doctor advises the micro-batch split the autopilot measured", "orchestrator/doctor/rules/speed.py",
           'if accum > 1 and measured(run, "micro_batch_size"):', "if False:",
           ("tests/unit/doctor/test_record.py",)),
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
