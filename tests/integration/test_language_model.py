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
    import math

    import numpy as np

    # Text whose next byte is half chance, half context: a random lowercase letter (1 of 16), then the same letter
    # in upper case. A model that reads its input predicts every capital and guesses the letters: accuracy about
    # 1/2 + 1/32 (0.53 seen), loss never below the entropy rate, ln(16)/2 nats per byte (2.8 seen after 60 steps).
    # Ignoring the input leaves byte frequencies and positions (accuracy 0.06); targets not shifted from the inputs
    # are copied (accuracy 1.0), shifted by two are chance (1/16); a loss per sequence, not per token, is ~32x.
    letters = np.random.default_rng(0).integers(0, 16, 80_000)
    text = np.empty(2 * len(letters), np.uint8)
    text[0::2], text[1::2] = ord("a") + letters, ord("A") + letters
    (tmp_path / "pairs.txt").write_bytes(text.tobytes())
    counts = prepare_text([str(tmp_path / "pairs.txt")], str(tmp_path / "text"), seq_len=32)
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
    val_loss, val_accuracy = result.metrics["val_loss"], result.metrics["val_accuracy"]
    assert 0.4 < val_accuracy < 0.6, val_accuracy  # read the context (> 1/32), did not see its targets (~1)
    assert math.log(16) / 2 - 0.05 < val_loss < math.log(32) - 0.25, val_loss
    # Held-out bytes of the same kind: the same per-token loss as training reports, within what 10 steps change.
    assert val_loss == pytest.approx(history[-1]["train_loss"], abs=0.3)
