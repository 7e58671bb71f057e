"""Plots a person would rather look at than read, saved as PNG (and logged to MLflow by the
driver)."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any


def plot_history(history: list[dict[str, Any]], path: str | Path,
                 metric: str = "val_accuracy") -> Path:
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
    # The axis follows the data (matplotlib's autoscale): 0.97-0.99 must not look flat on a 0-1
    # scale.
    ax_loss.set(xlabel="step", ylabel="loss", yscale="log", title="Loss")
    ax_loss.legend()
    ax_metric.set(xlabel="step", ylabel=metric.removeprefix("val_"),
                  title=f"Validation {metric.removeprefix('val_')}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_lr_sweep(trials: list[Any], keys: list[str], metric: str, path: str | Path,
                  categorical: Collection[str] = ()) -> Path:
    """Final metric of every trial against its learning rate (log axis), coloured by warmup; hollow
    markers are trials stopped early. Falls back to the first two searched keys when lr / warmup are
    not searched. The colour key is drawn as categories with a legend when it is in `categorical` (a
    choice or grid) or not numeric, and on a colour bar otherwise."""
    fig = sweep_figure(trials, keys, metric, categorical)
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)
    return Path(path)


def sweep_figure(trials: list[Any], keys: list[str], metric: str,
                 categorical: Collection[str] = ()) -> Any:
    """The figure of `plot_lr_sweep` (a matplotlib Figure, left open)."""
    plt = _pyplot()
    import matplotlib
    from matplotlib.lines import Line2D

    x_key = "optim.lr" if "optim.lr" in keys else keys[0]
    others = [k for k in keys if k != x_key]
    c_key = ("optim.warmup_steps" if "optim.warmup_steps" in others
             else (others[0] if others else None))
    scored = [t for t in trials
              if t.metric is not None and isinstance(t.params.get(x_key), int | float)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    values = [t.params.get(c_key) for t in scored] if c_key else []
    numeric = bool(values) and all(isinstance(v, int | float) and not isinstance(v, bool)
                                   for v in values)
    by_category = bool(values) and (c_key in categorical or not numeric)
    legend: list[Any] = []
    if by_category:
        colours, legend = _category_colours(values, c_key)
    elif numeric:
        norm = plt.Normalize(min(values), max(values))
        cmap = matplotlib.colormaps["viridis"]
        colours = [cmap(norm(v)) for v in values]
    else:
        colours = ["tab:blue"] * len(scored)
    done = [t.status == "completed" for t in scored]
    x = [t.params[x_key] for t in scored]
    y = [t.metric for t in scored]
    for ran_to_end in (True, False):
        pick = [i for i, d in enumerate(done) if d == ran_to_end]
        if not pick:
            continue
        face = [colours[i] for i in pick] if ran_to_end else "none"  # hollow: stopped early
        edge = "black" if ran_to_end else [colours[i] for i in pick]
        ax.scatter([x[i] for i in pick], [y[i] for i in pick], s=60, facecolors=face,
                   edgecolors=edge, linewidths=1.0 if ran_to_end else 1.8)
        legend.append(Line2D([], [], marker="o", linestyle="", markeredgecolor="black",
                             markerfacecolor="grey" if ran_to_end else "none",
                             label="ran to the end" if ran_to_end else "stopped early"))
    if numeric and not by_category:
        bar = plt.cm.ScalarMappable(norm=norm, cmap=cmap)
        fig.colorbar(bar, ax=ax, label=c_key)
    positive = all(v > 0 for v in x)
    ax.set(xlabel=x_key, ylabel=f"final {metric}", title=f"Final {metric} vs {x_key}",
           xscale="log" if positive and scored else "linear")
    ax.xaxis.set_minor_formatter(plt.NullFormatter())  # minor log labels overlap over a short range
    if legend:
        ax.legend(handles=legend, fontsize="small")
    fig.tight_layout()
    return fig


def _category_colours(values: list[Any], c_key: str | None) -> tuple[list[Any], list[Any]]:
    """One colour per value the study tried (sorted, so 0 < 10 < 20 reads in order), each value's
    colour, and the legend entries that name them."""
    import matplotlib
    from matplotlib.lines import Line2D

    distinct = sorted({_category(v) for v in values},
                      key=lambda v: (not isinstance(v, int | float), v))
    palette = matplotlib.colormaps["tab10" if len(distinct) <= 10 else "tab20"]
    colour_of = {v: palette(i % palette.N) for i, v in enumerate(distinct)}
    legend = [Line2D([], [], marker="o", linestyle="", color=colour_of[v], markeredgecolor="black",
                     label=f"{c_key}={v}") for v in distinct]
    return [colour_of[_category(v)] for v in values], legend


def _category(value: Any) -> Any:
    """A value as a legend entry: numbers stay numbers (so they sort), anything else becomes its
    text."""
    return value if isinstance(value, int | float) and not isinstance(value, bool) else str(value)


def trial_labels(trials: list[Any]) -> list[str]:
    """Each trial's name (its searched values); a name two trials share gets the trial id, so
    entries differ."""
    names = [getattr(t, "name", "") or t.trial_id for t in trials]
    return [f"{n} ({t.trial_id})" if names.count(n) > 1 else n
            for n, t in zip(names, trials, strict=True)]


def plot_trial_curves(trials: list[Any], metric: str, path: str | Path) -> Path:
    """`metric` against step for every trial, labelled by its searched values; dashed lines are
    trials stopped early."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for t, label in zip(trials, trial_labels(trials), strict=True):
        points = [(r["step"], r[metric]) for r in t.history if metric in r]
        if points:
            steps, values = zip(*points, strict=True)
            ax.plot(steps, values, marker=".", linestyle="-" if t.status == "completed" else "--",
                    label=label)
    ax.set(xlabel="step", ylabel=metric, title=f"{metric} of every trial")
    if len(trials) <= 12:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
