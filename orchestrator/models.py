"""Built-in models and the model registry. A builder takes `in_features`, `num_classes` and its own kwargs."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from orchestrator.errors import ConfigError
from orchestrator.registry import Registry, load_entrypoint

ModelBuilder = Callable[..., nn.Module]
MODELS: Registry[ModelBuilder] = Registry("model")


@MODELS.register("mlp")
def mlp(in_features: int, num_classes: int, hidden: Sequence[int] = (256, 256), dropout: float = 0.0) -> nn.Module:
    """Fully connected ReLU network."""
    layers: list[nn.Module] = []
    width = in_features
    for size in hidden:
        layers += [nn.Linear(width, size), nn.ReLU()]
        if dropout:
            layers.append(nn.Dropout(dropout))
        width = size
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


class SmallCNN(nn.Module):
    """Two conv blocks over a square single-channel image given as a flat feature vector."""

    def __init__(self, in_features: int, num_classes: int, channels: Sequence[int] = (16, 32), hidden: int = 128):
        super().__init__()
        side = math.isqrt(in_features)
        if side * side != in_features:
            raise ConfigError(f"model 'cnn' needs a square image, but the features have {in_features} values")
        self.side = side
        blocks: list[nn.Module] = []
        c_in = 1
        for c_out in channels:
            blocks += [nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU()]
            c_in = c_out
        self.features = nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(4))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(c_in * 16, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x.view(-1, 1, self.side, self.side)))


MODELS.register("cnn")(SmallCNN)


def model_builder(name: str, entrypoint: str | None) -> ModelBuilder:
    """The builder for a config: a user's `module:function` wins over a registered name."""
    return load_entrypoint(entrypoint) if entrypoint else MODELS.get(name)  # type: ignore[return-value]


def build_model(name: str, entrypoint: str | None, in_features: int, num_classes: int, kwargs: dict) -> nn.Module:
    model = model_builder(name, entrypoint)(in_features=in_features, num_classes=num_classes, **kwargs)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model builder '{entrypoint or name}' returned {type(model).__name__}, not a torch Module")
    return model
