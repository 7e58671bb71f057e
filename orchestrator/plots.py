"""Plots a person would rather look at than read, saved as PNG (and logged to MLflow by the driver)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_history(history: list[dict[str, Any]], path: str | Path, metric: str = "val_accuracy") -> Path:
    """Training and validation loss, and the task's validation `metric`, against step."""
    import matplotlib

    matplotlib.use("Agg")  # no display on clusters and CI
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_metric) = plt.subplots(1, 2, figsize=(10, 4))
    steps = [r["step"] for r in history]
    ax_loss.plot(steps, [r["train_loss"] for r in history], label="train")
    val = [r for r in history if "val_loss" in r]
    if val:
        ax_loss.plot([r["step"] for r in val], [r["val_loss"] for r in val], label="validation")
    scored = [r for r in val if metric in r]
    if scored:
        ax_metric.plot([r["step"] for r in scored], [r[metric] for r in scored], marker="o")
    # The axis follows the data (matplotlib's autoscale): 0.97-0.99 must not look flat on a 0-1 scale.
    ax_loss.set(xlabel="step", ylabel="loss", yscale="log", title="Loss")
    ax_loss.legend()
    ax_metric.set(xlabel="step", ylabel=metric.removeprefix("val_"), title=f"Validation {metric.removeprefix('val_')}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_lr_sweep(trials: list[Any], keys: list[str], metric: str, path: str | Path) -> Path:
    """Final metric of every trial against its learning rate (log axis), coloured by warmup; hollow markers are
    trials stopped early. Falls back to the first two searched keys when lr / warmup are not searched."""
    plt = _pyplot()
    x_key = "optim.lr" if "optim.lr" in keys else keys[0]
    others = [k for k in keys if k != x_key]
    c_key = "optim.warmup_steps" if "optim.warmup_steps" in others else (others[0] if others else None)
    scored = [t for t in trials if t.metric is not None and isinstance(t.params.get(x_key), int | float)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours = [t.params.get(c_key) for t in scored] if c_key else []
    numeric = bool(colours) and all(isinstance(c, int | float) for c in colours)
    for done in (True, False):
        group = [t for t in scored if (t.status == "completed") == done]
        if not group:
            continue
        kwargs: dict[str, Any] = {"s": 60, "label": "ran to the end" if done else "stopped early"}
        if numeric:
            kwargs |= {"c": [t.params[c_key] for t in group], "cmap": "viridis",
                       "vmin": min(colours), "vmax": max(colours)}
        if not done:
            kwargs |= {"marker": "o", "alpha": 0.5}
        points = ax.scatter([t.params[x_key] for t in group], [t.metric for t in group],
                            edgecolors="black", **kwargs)
    if numeric:
        fig.colorbar(points, ax=ax, label=c_key)
    positive = all(t.params[x_key] > 0 for t in scored)
    ax.set(xlabel=x_key, ylabel=f"final {metric}", title=f"Final {metric} vs {x_key}",
           xscale="log" if positive and scored else "linear")
    ax.xaxis.set_minor_formatter(plt.NullFormatter())  # minor log labels overlap over a short range
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def plot_trial_curves(trials: list[Any], metric: str, path: str | Path) -> Path:
    """`metric` against step for every trial; dashed lines are trials stopped early."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for t in trials:
        points = [(r["step"], r[metric]) for r in t.history if metric in r]
        if points:
            steps, values = zip(*points, strict=True)
            ax.plot(steps, values, marker=".", linestyle="-" if t.status == "completed" else "--",
                    label=t.trial_id)
    ax.set(xlabel="step", ylabel=metric, title=f"{metric} of every trial")
    if len(trials) <= 12:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
