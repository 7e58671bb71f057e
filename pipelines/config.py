"""Typed configuration of the data layer (embedded in the orchestrator's config as `data`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class DataConfig(BaseModel):
    """Where the training data lives and how it is streamed into the workers."""

    model_config = ConfigDict(extra="forbid")

    train: str = Field("data/digits/train", description="Directory (or file) of Parquet shards for training.")
    val: str | None = Field("data/digits/val", description="Parquet shards for validation; null disables eval.")
    features: list[str] = Field(["pixels"], min_length=1, description="Feature columns, concatenated in order.")
    label: str = Field("label", description="Integer class label column.")
    prefetch_batches: int = Field(2, ge=0, description="Fetches (of ~4096 rows, sliced into micro-batches) each "
                                  "worker prefetches ahead of the loop.")
    cache: Literal["auto", "none", "memory"] = Field(
        "auto",
        description="memory: decode once and keep the blocks in Ray's object store for later epochs (Ray Data "
        "otherwise re-reads every epoch); auto: memory when the files use under 5% of the object store.",
    )

    @field_validator("features")
    @classmethod
    def _unique_features(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"feature columns must be unique, got {value}")
        return value
