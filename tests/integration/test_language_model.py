"""A GPT on byte-tokenised text, end to end on local Ray: `prepare text`, auto micro-batch, next-token loss."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator import load_config
from orchestrator.launch import train
from pipelines.prepare import prepare_text

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_gpt_trains_on_prepared_text_and_its_loss_falls(ray_cluster: None, tmp_path: Path) -> None:
    sources = sorted(str(p) for p in (ROOT / "orchestrator").glob("*.py"))
    counts = prepare_text(sources, str(tmp_path / "text"), seq_len=32)
    assert counts["train"] > 100
    cfg = load_config(ROOT / "examples" / "text-gpt.yaml", [
        f"data.train={tmp_path}/text/train", f"data.val={tmp_path}/text/val", "scaling.num_workers=2",
        "model.d_model=32", "model.n_layer=1", "model.n_head=2", "train.max_steps=60", "train.log_every=10",
        "train.eval_every=60", "train.global_batch_size=32", "train.memory_budget_gb=1",
        f"storage.path={tmp_path}/runs", "tracking.enabled=false",
    ])
    result = train(cfg, verbose=False)
    history = result.history
    assert result.config.model.num_classes == 256  # the vocabulary, from the shards' metadata
    assert history[-1]["train_loss"] < 0.7 * history[0]["train_loss"]
    assert history[0]["train_loss"] < 6.0  # starts near ln(256) = 5.5: a per-token loss, not a sum
    assert history[-1]["tokens_per_s"] == pytest.approx(32 * history[-1]["samples_per_s"])
    # Auto micro-batch: whatever was chosen, micro x accumulation x workers is the configured global batch.
    micro, accum = history[0]["micro_batch_size"], history[0]["grad_accum_steps"]
    assert micro * accum * 2 == 32
    assert 0 < result.metrics["val_accuracy"] <= 1
