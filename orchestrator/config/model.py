"""The model section: a built-in model by name or the user's builder (`module:function`), its own
options (every other key), its named inputs and the pretrained weights it starts from. Its
options are checked against the builder's signature by the driver
(orchestrator/run/model_checks.py): loading a config imports no torch."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr


class ModelConfig(BaseModel):
    """A registered model by `name`, or a user's `entrypoint: "module:function"`; other keys are
    its kwargs. A kwarg set to null is left out (the builder's default applies): `--set
    model.hidden=null` drops a file's option."""

    model_config = ConfigDict(extra="allow")
    # kwarg -> where load_config found it: the config file's path or "--set" (for error messages
    # only).
    _origins: dict[str, str] = PrivateAttr(default_factory=dict)

    name: str = Field("mlp", description="Registered model: mlp, cnn, gpt.")
    entrypoint: str | None = Field(None,
                                   description="'module:function' building a torch Module "
                                               "(a Hugging Face `transformers` model too); "
                                               "overrides name. It is called with the "
                                               "options below, plus in_features and "
                                               "num_classes where its signature takes them.")
    num_classes: int | None = Field(None, ge=1,
                                    description="Outputs: classes (null = from the label "
                                                "column's max), labels (multilabel), "
                                                "targets (regression: 1 per target column).")
    inputs: list[str] | dict[str, str] | None = Field(
        None,
        json_schema_extra={"accepts": "a list of argument names, {argument: column}, or null"},
        description="The model's forward arguments, filled by name from the batch: [input_ids, "
        "attention_mask] (argument = column), or {argument: column}. A variable-length token "
        "column also gives `attention_mask`. null: forward(x) with the feature columns "
        "concatenated into one float vector.")
    pretrained: str | None = Field(None,
                                   description="Directory or s3://prefix saved with "
                                               "save_pretrained: the built Hugging "
                                               "Face model's weights are loaded "
                                               "from it (fetched once per node).")

    @property
    def input_map(self) -> dict[str, str] | None:
        """{forward argument: batch key}, or None for the classic forward(x)."""
        if self.inputs is None:
            return None
        if isinstance(self.inputs, dict):
            return dict(self.inputs)
        return {name: name for name in self.inputs}

    @property
    def kwargs(self) -> dict[str, Any]:
        """The model's own options, checked against its builder's signature by the driver
        (models.py), so that loading a config imports neither torch nor the model zoo."""
        return {key: value for key, value in (self.model_extra or {}).items() if value is not None}

    def __eq__(self, other: object) -> bool:
        # pydantic's, less _origins: a config rebuilt from its dict (in a worker, a trial) is the
        # same config.
        if not isinstance(other, BaseModel):
            return NotImplemented
        return (type(self) is type(other) and self.__dict__ == other.__dict__
                and self.model_extra == other.model_extra)

    @property
    def origins(self) -> dict[str, str]:
        """{kwarg: its config file, or "--set"} for a config from load_config; {} otherwise."""
        return dict(self._origins)
