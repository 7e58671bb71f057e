"""The one typed config tree: defaults < YAML file < `--set dotted.key=value`, validated before Ray starts.

`schema.py` holds `Config` and the sections of what is trained and searched, `run_sections.py` the others,
`base.py` what they are built on; `load.py` reads YAML and overrides and words validation errors; `space.py` parses
Tune's search space; `batching.py` holds the batch arithmetic; `reference.py` the meaning of every key."""

from orchestrator.config.base import flatten, suggest
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
from orchestrator.config.run_sections import (
    AutopilotConfig,
    CheckpointConfig,
    ClusterConfig,
    CostConfig,
    FailureConfig,
    ScalingConfig,
    StorageConfig,
    TrackingConfig,
)
from orchestrator.config.schema import (
    MAX_SEED,
    TASK_KINDS,
    USER_TASK,
    Config,
    ModelConfig,
    OptimConfig,
    Precision,
    TaskConfig,
    TaskKind,
    TrainConfig,
    TuneConfig,
)

__all__ = [
    "MAX_SEED", "TASK_KINDS", "USER_TASK", "AutopilotConfig", "CheckpointConfig", "ClusterConfig", "Config",
    "CostConfig", "FailureConfig",
    "ModelConfig", "OptimConfig", "Precision", "ScalingConfig", "StorageConfig", "TaskConfig", "TaskKind",
    "TrackingConfig", "TrainConfig", "TuneConfig", "config_from_dict", "either", "flatten", "format_validation_error",
    "keys_elsewhere", "load_config", "parse_override", "read_yaml_mapping", "suggest", "to_dict", "to_yaml",
    "with_values",
]
