"""A study's autopilot (tuning/autopilot.py, docs/autopilot.md "In a study"): one search serves the study only when
its space searches nothing that changes what is fastest. A space that searches the batch (the global batch among
it), one of the autopilot's own keys, the parallel or sync mode, or anything under model., data., scaling. or
autopilot. gets no shared search: each trial measures its own, so trials of different values never train with a
choice measured at another one. The study says so, naming the key. No Ray: the shared board is made only for a
shared search."""

from __future__ import annotations

import pytest

from orchestrator.config import Config, load_config
from orchestrator.tuning.autopilot import per_trial_reason, study_board

LR = "optim.lr: {loguniform: [1.0e-4, 1.0e-1]}"
# Each key the docs name, with values the config accepts.
PER_TRIAL = {
    "train.global_batch_size": "{choice: [32, 64]}",
    "train.micro_batch_size": "{choice: [8, 16]}",
    "train.grad_accum_steps": "{choice: [1, 2]}",
    "train.compile": "{choice: [true, false]}",
    "train.torch_threads": "{choice: [1, 2]}",
    "train.flush_denormal": "{choice: [true, false]}",
    "train.precision": "{choice: [fp32, bf16]}",
    "train.parallel": "{choice: [ddp, fsdp]}",
    "train.sync": "{choice: [ddp, local_sgd]}",
    "model.hidden": "{choice: [[32], [64]]}",
    "data.prefetch_batches": "{choice: [1, 4]}",
    "scaling.num_workers": "{choice: [1, 2]}",
    "autopilot.budget": "{choice: [0.05, 0.1]}",
}
SHARED = {"optim.warmup_steps": "{choice: [0, 50]}", "optim.weight_decay": "{uniform: [0.0, 0.1]}",
          "optim.max_grad_norm": "{choice: [0.5, 1.0]}"}


def _study(space: str, *sets: str) -> Config:
    return load_config(None, [f"tune.space={{{space}}}", "autopilot.enabled=true", "train.global_batch_size=64",
                              *sets])


@pytest.mark.parametrize("key", sorted(PER_TRIAL))
def test_a_study_that_searches_what_is_fastest_gets_a_search_per_trial(
        key: str, capsys: pytest.CaptureFixture[str]) -> None:
    config = _study(f"{LR}, {key}: {PER_TRIAL[key]}")
    reason = per_trial_reason(config)
    assert reason == f"each trial searches its own: tune.space searches {key}, which changes what is fastest"
    # No board for the study: each trial finds none and searches at its own value.
    assert study_board(config, "study", None, verbose=True) is None
    assert capsys.readouterr().out == f"autopilot: {reason}\n"


def test_a_study_searching_only_what_leaves_the_fastest_unchanged_shares_one_search() -> None:
    for key, domain in SHARED.items():
        assert per_trial_reason(_study(f"{LR}, {key}: {domain}")) is None, key
    # Every per-trial key among them is named, in the space's order.
    reason = per_trial_reason(_study(f"{LR}, train.global_batch_size: {{choice: [32, 64]}}, "
                                     "data.prefetch_batches: {choice: [1, 4]}"))
    assert reason is not None and "searches train.global_batch_size, data.prefetch_batches, which" in reason
    # The autopilot off: nothing to share nor to say.
    off = load_config(None, [f"tune.space={{{LR}, train.global_batch_size: {{choice: [32, 64]}}}}"])
    assert per_trial_reason(off) is None and study_board(off, "study", None, verbose=True) is None
