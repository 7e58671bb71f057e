"""The one typed config tree: defaults < YAML file < `--set dotted.key=value`, validated before Ray starts.

`schema.py` holds the sections and `Config`; `load.py` reads YAML and overrides and words validation errors;
`space.py` parses Tune's search space; `batching.py` holds the batch arithmetic."""

from orchestrator.config.load import (
    config_from_dict,
    either,
    flatten,
    format_validation_error,
    keys_elsewhere,
    load_config,
    parse_override,
    read_yaml_mapping,
    to_dict,
    to_yaml,
    with_values,
)
from orchestrator.config.schema import (
    MAX_SEED,
    TASK_KINDS,
    USER_TASK,
    CheckpointConfig,
    Config,
    CostConfig,
    FailureConfig,
    ModelConfig,
    OptimConfig,
    Precision,
    ScalingConfig,
    StorageConfig,
    TaskConfig,
    TaskKind,
    TrackingConfig,
    TrainConfig,
    TuneConfig,
)

__all__ = [
    "MAX_SEED", "TASK_KINDS", "USER_TASK", "CheckpointConfig", "Config", "CostConfig", "FailureConfig",
    "ModelConfig", "OptimConfig", "Precision", "ScalingConfig", "StorageConfig", "TaskConfig", "TaskKind",
    "TrackingConfig", "TrainConfig", "TuneConfig", "config_from_dict", "either", "flatten", "format_validation_error",
    "keys_elsewhere", "load_config", "parse_override", "read_yaml_mapping", "to_dict", "to_yaml",
    "with_values",
]
