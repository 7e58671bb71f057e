"""The one typed config tree: defaults < YAML file < `--set dotted.key=value`, validated before
Ray starts.

The sections sit in files named for their role: `model.py`, `task.py`, `train.py` (train, optim,
autopilot), `cluster.py` (scaling, cluster), `resilience.py` (checkpoint, storage, failure),
`tracking.py` (tracking, cost); `tree.py` holds `Config`, the whole tree with its cross-section
checks, and the tune section; `base.py` what the sections are built on; `load.py` reads YAML and
overrides and words validation errors; `space.py` parses Tune's search space; `batching.py` holds
the batch arithmetic; `reference.py` the meaning of every key."""

from orchestrator.config.base import flatten, suggest
from orchestrator.config.cluster import ClusterConfig, ScalingConfig
from orchestrator.config.load import (
    config_from_dict,
    either,
    format_validation_error,
    keys_elsewhere,
    load_config,
    parse_override,
    read_yaml_mapping,
    to_dict,
    to_yaml,
    with_values,
)
from orchestrator.config.model import ModelConfig
from orchestrator.config.resilience import CheckpointConfig, FailureConfig, StorageConfig
from orchestrator.config.task import TASK_KINDS, USER_TASK, TaskConfig, TaskKind
from orchestrator.config.tracking import CostConfig, TrackingConfig
from orchestrator.config.train import MAX_SEED, AutopilotConfig, OptimConfig, Precision, TrainConfig
from orchestrator.config.tree import Config, TuneConfig

__all__ = [
    "MAX_SEED", "TASK_KINDS", "USER_TASK", "AutopilotConfig", "CheckpointConfig", "ClusterConfig",
    "Config", "CostConfig", "FailureConfig", "ModelConfig", "OptimConfig", "Precision",
    "ScalingConfig", "StorageConfig", "TaskConfig", "TaskKind", "TrackingConfig", "TrainConfig",
    "TuneConfig", "config_from_dict", "either", "flatten", "format_validation_error",
    "keys_elsewhere", "load_config", "parse_override", "read_yaml_mapping", "suggest", "to_dict",
    "to_yaml", "with_values",
]
