"""Plots a person would rather look at than read, saved as PNG (and logged to MLflow by the driver)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_history(history: list[dict[str, Any]], path: str | Path) -> Path:
    """Training loss and validation accuracy against step."""
    import matplotlib

    matplotlib.use("Agg")  # no display on clusters and CI
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    steps = [r["step"] for r in history]
    ax_loss.plot(steps, [r["train_loss"] for r in history], label="train")
    val = [r for r in history if "val_loss" in r]
    if val:
        ax_loss.plot([r["step"] for r in val], [r["val_loss"] for r in val], label="validation")
        ax_acc.plot([r["step"] for r in val], [r["val_accuracy"] for r in val], marker="o")
    ax_loss.set(xlabel="step", ylabel="loss", yscale="log", title="Loss")
    ax_loss.legend()
    ax_acc.set(xlabel="step", ylabel="accuracy", title="Validation accuracy", ylim=(0, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
