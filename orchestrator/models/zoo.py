"""Built-in models and the model registry. A builder takes its own options and, where its
signature names them, `in_features` (the width of the classic concatenated feature vector) and
`num_classes` (outputs). The driver checks a config's model against them before Ray starts
(orchestrator/run/model_checks.py)."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from orchestrator.errors import ConfigError
from orchestrator.models.registry import Registry, load_entrypoint

ModelBuilder = Callable[..., nn.Module]
MODELS: Registry[ModelBuilder] = Registry("model")


@MODELS.register("mlp")
def mlp(in_features: int, num_classes: int, hidden: Sequence[int] = (256, 256),
        dropout: float = 0.0) -> nn.Module:
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

    def __init__(self, in_features: int, num_classes: int, channels: Sequence[int] = (16, 32),
                 hidden: int = 128):
        super().__init__()
        side = math.isqrt(in_features)
        if side * side != in_features:
            raise ConfigError("model 'cnn' needs a square image, but the features have "
                              f"{in_features} values")
        self.side = side
        blocks: list[nn.Module] = []
        c_in = 1
        for c_out in channels:
            blocks += [nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU()]
            c_in = c_out
        self.features = nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(4))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(c_in * 16, hidden), nn.ReLU(),
                                  nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x.view(-1, 1, self.side, self.side)))


MODELS.register("cnn")(SmallCNN)


def model_builder(name: str, entrypoint: str | None) -> ModelBuilder:
    """The builder for a config: a user's `module:function` wins over a registered name."""
    if entrypoint:
        return load_entrypoint(entrypoint)  # type: ignore[return-value]
    return MODELS.get(name)


def build_model(name: str, entrypoint: str | None, in_features: int | None, num_classes: int | None,
                kwargs: dict, pretrained: str | None = None) -> nn.Module:
    """The user's model. `pretrained`: a local directory written by save_pretrained, whose
    weights (and config) replace the built model's through its class's `from_pretrained`."""
    builder = model_builder(name, entrypoint)
    params = inspect.signature(builder).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    given = {k: v for k, v in (("in_features", in_features), ("num_classes", num_classes))
             if (k in params or takes_any) and v is not None}
    model = builder(**given, **kwargs)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model builder '{entrypoint or name}' returned {type(model).__name__}, "
                          "not a torch Module")
    if pretrained is not None:
        check_pretrainable(model, entrypoint or name)
        model = type(model).from_pretrained(pretrained)
    return model


def check_pretrainable(model: nn.Module, name: str) -> None:
    if not hasattr(model, "from_pretrained"):
        raise ConfigError(f"model.pretrained is set, but model '{name}' ({type(model).__name__}) "
                          "has no from_pretrained: build a Hugging Face model, or load weights in "
                          "the builder")


def pretrained_config(uri: str, s3: Any = None) -> dict[str, Any]:
    """The config.json save_pretrained wrote at `uri` (a local directory or s3:// prefix; `s3`
    its S3Config): the architecture the workers' from_pretrained builds, read without the
    weights. ConfigError when it is missing."""
    import json

    # pyarrow: only where a pretrained model is read
    from pipelines.storage import open_storage, storage_error

    storage = open_storage(uri, s3)
    path = storage.join("config.json")
    try:
        with storage.filesystem().open_input_stream(path) as handle:
            return json.loads(handle.read())
    except FileNotFoundError:
        raise ConfigError(f"config key 'model.pretrained': {uri} holds no config.json: point it at "
                          "a directory (or s3:// prefix) written by the model's "
                          "save_pretrained") from None
    except ValueError as exc:
        raise ConfigError(f"config key 'model.pretrained': {uri}/config.json is not JSON "
                          f"({exc})") from None
    except OSError as exc:
        if storage.remote:
            raise storage_error(exc, storage, "reading", path) from None
        raise ConfigError(f"config key 'model.pretrained': cannot read {path} ({exc})") from None


def with_saved_architecture(model: nn.Module, saved: dict[str, Any], name: str) -> nn.Module:
    """A new model of `model`'s class with the architecture of `saved` (a save_pretrained
    config.json) and fresh weights, on the current default device: what the workers'
    from_pretrained builds, without reading weights. That `model` has from_pretrained at all is
    check_model_build's to say (run/model_checks.py), before config.json is read."""
    config_class = getattr(type(model), "config_class", None)
    if config_class is None or not hasattr(config_class, "from_dict"):
        raise ConfigError(f"model.pretrained is set, but model '{name}' ({type(model).__name__}) "
                          "has no config_class to read config.json with: build a Hugging Face "
                          "model")
    return type(model)(config_class.from_dict(saved))


def position_limit(model: nn.Module) -> tuple[int, str] | None:
    """(positions, the config key setting them) of a model with a learned table of positions,
    which a longer sequence indexes past ('IndexError: index out of range in self'): a Hugging
    Face config's max_position_embeddings (GPT-2's n_positions) with an embedding of that many
    rows (OPT and BART: 2 more). RoBERTa's table has a padding row and starts its positions after
    it (514 rows, 512 tokens): less those rows. None otherwise: rotary or relative positions run
    longer sequences."""
    config = getattr(model, "config", None)
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int) or isinstance(limit, bool):
        return None
    try:
        tokens = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    except (NotImplementedError, AttributeError):
        tokens = None
    table = next((m for m in model.modules() if isinstance(m, nn.Embedding) and m is not tokens
                  and m.num_embeddings in (limit, limit + 2)), None)
    if table is None:
        return None
    names = getattr(config, "attribute_map", {})
    key = names.get("max_position_embeddings", "max_position_embeddings")
    if table.padding_idx is not None and table.num_embeddings == limit:
        # RoBERTa-style: position ids run from padding_idx + 1, so the rows up to the padding row
        # never hold a token.
        return limit - table.padding_idx - 1, key
    return limit, key


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for z in self.qkv(x).split(c, dim=2))
        # Fused attention kernel (flash / memory-efficient where available), causal mask built in.
        dropout = self.dropout if self.training else 0.0
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A small GPT-style decoder. `in_features` is the context length, `num_classes` the
    vocabulary size."""

    def __init__(self, in_features: int, num_classes: int, d_model: int = 128, n_layer: int = 2,
                 n_head: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % n_head:
            raise ConfigError(f"model 'gpt': d_model={d_model} must be divisible by "
                              f"n_head={n_head}")
        self.token = nn.Embedding(num_classes, d_model)
        self.position = nn.Embedding(in_features, d_model)
        self.blocks = nn.Sequential(*(Block(d_model, n_head, dropout) for _ in range(n_layer)))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes, bias=False)
        self.head.weight = self.token.weight  # tied input/output embeddings
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        # Small initial weights (GPT-2's 0.02): with the tied unit-variance default, the first
        # logits would have a spread of sqrt(d_model) and the loss would start far above
        # ln(vocabulary).
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.head(self.ln(self.blocks(self.token(tokens) + self.position(positions))))


MODELS.register("gpt")(GPT)


# Pickled models (MLflow's pickled fallback, torch.save of a whole module) name a class by its
# module: these keep the path they had before the zoo moved into orchestrator/models/ (the package
# resolves it lazily, __init__.py).
for _persisted in (SmallCNN, CausalSelfAttention, Block, GPT):
    _persisted.__module__ = "orchestrator.models"
del _persisted
