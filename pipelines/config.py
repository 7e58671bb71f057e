"""Typed configuration of the data layer (embedded in the orchestrator's config as `data`).

No credentials live here: this model is logged as MLflow params. S3 credentials come from the
standard AWS chain.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pipelines.entrypoints import load_function

MEMORY_CACHE_VALUES = ("auto", "none", "memory")


class S3Config(BaseModel):
    """Object-store options (AWS S3 or any S3-compatible endpoint). Credentials are never configured
    here."""

    # inf passes gt=0; nan poisons a timeout
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    endpoint: str | None = Field(None,
                                 description="Endpoint URL, e.g. http://minio:9000; "
                                             "null = $AWS_ENDPOINT_URL_S3, else "
                                             "$AWS_ENDPOINT_URL, else AWS.")
    region: str | None = Field(None, description="null = the AWS chain's region "
                                                 "(AWS_REGION, profile), else us-east-1.")
    anonymous: bool = Field(False, description="Unsigned requests (public buckets); "
                                               "no credentials are looked up.")
    max_attempts: int = Field(4, ge=1, le=20,
                              description="Attempts per request for transient errors (5xx, "
                                          "SlowDown, dropped connections), with exponential "
                                          "backoff; access errors are never retried.")
    connect_timeout_s: float = Field(5.0, gt=0, description="Seconds to wait for a TCP connection.")
    request_timeout_s: float = Field(60.0, gt=0, description="Seconds to wait for one request.")


class Normalize(BaseModel):
    """x -> (x - mean) / std on the feature columns (or `columns`)."""

    # would turn every feature into inf/nan
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    mean: float = 0.0
    std: float = Field(1.0, gt=0)
    columns: list[str] | None = None


class Cast(BaseModel):
    """Cast the feature columns (or `columns`) to a float dtype; lists keep their shape."""

    model_config = ConfigDict(extra="forbid")

    dtype: Literal["float16", "float32", "float64"]
    columns: list[str] | None = None


class Call(BaseModel):
    """Your own per-batch function, `fn: "module:function"`, called as fn(batch, **kwargs) with the
    batch as a pyarrow Table; it returns the transformed Table. The module must import on every node
    (PYTHONPATH, or the job's working_dir)."""

    model_config = ConfigDict(extra="forbid")

    fn: str
    kwargs: dict[str, Any] = Field(default_factory=dict)

    @field_validator("fn")
    @classmethod
    def _importable(cls, value: str) -> str:
        load_function(value)  # fail at config time, not in a read task mid-epoch
        return value


TRANSFORMS: dict[str, type[BaseModel]] = {"normalize": Normalize, "cast": Cast, "call": Call}


class DataConfig(BaseModel):
    """Where the training data lives and how it is streamed into the workers."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    train: str = Field("data/digits/train", min_length=1,
                       description="Directory, file or s3://bucket/prefix of Parquet shards.")
    val: str | None = Field("data/digits/val",
                            description="Parquet shards for validation; null disables eval.")
    features: list[str] = Field(["pixels"], min_length=1,
                                description="Input columns: concatenated in order "
                                            "into one float vector, or handed to "
                                            "the model by name (model.inputs).")
    label: str | None = Field("label",
                              description="Target column (integer classes, a list of 0/1 "
                                          "labels, or floats, as task.name needs); null "
                                          "= next-token prediction on the single token "
                                          "column in `features` (a language model).")
    pad_to_multiple_of: int | None = Field(None, ge=1,
                                           description="Variable-length token columns are padded "
                                                       "to the longest row of each micro-batch, "
                                                       "rounded up to this multiple.")
    prefetch_batches: int = Field(2, ge=0,
                                  description="Fetches (of ~4096 rows, sliced into micro-batches) "
                                              "each worker prefetches ahead of the loop.")
    read_parallelism: int | None = Field(None, ge=1,
                                         description="Most shard reads running at once "
                                                     "(Ray Data read concurrency); null "
                                                     "= as many as Ray has CPUs for.")
    cache: str = Field(
        "auto",
        description="memory: decode once and keep the blocks in Ray's object store for "
                    "later epochs (Ray Data otherwise re-reads every epoch); auto: "
                    "memory when the files use under 5% of the object store; none; or a "
                    "directory: a node-local disk cache of remote (s3://) shards. A "
                    "resumed run keeps whether its checkpoints' data was streamed, held "
                    "in memory or replayed (its data position counts rows in that order).",
    )
    cache_max_gb: float | None = Field(None, gt=0,
                                       description="Size cap of the disk cache per node (LRU "
                                                   "eviction); default 50. Only with cache: DIR.")
    shuffle: bool = Field(True, description="A new order every epoch, drawn per (train.seed, "
                                            "epoch): the shard order when streamed from "
                                            "storage, the order of the decoded blocks for "
                                            "cache: memory data over 5% of the object store; "
                                            "small in-memory data replayed by the workers is "
                                            "permuted per (seed, epoch, rank) within each "
                                            "worker. false = shards sorted by name.")
    shuffle_buffer: int | None = Field(None, ge=2,
                                       description="Rows in each worker's local shuffle "
                                                   "buffer (seeded per seed, epoch, rank); "
                                                   "null = no row shuffle within shards or "
                                                   "blocks. With small in-memory data it "
                                                   "replaces the workers' replay.")
    transforms: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Per-batch transforms run in Ray Data map_batches, in order, e.g. "
        "[{normalize: {mean: 0.5, std: 0.25}}, {cast: float32}, {call: my_module:fn}].",
    )
    s3: S3Config = Field(default_factory=S3Config,  # type: ignore[arg-type]
                         description="Object-store options for s3:// data and "
                                     "storage; credentials come only from the "
                                     "standard AWS chain, never from the config.")

    @model_validator(mode="after")
    def _one_token_column(self) -> DataConfig:
        if self.label is None and len(self.features) != 1:
            raise ValueError("data.label=null (next-token prediction) needs exactly "
                             f"one token column in data.features, got {self.features}")
        return self

    @property
    def columns(self) -> list[str]:
        """The columns read from Parquet."""
        return [*self.features, *([self.label] if self.label else [])]

    @field_validator("features")
    @classmethod
    def _unique_features(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"feature columns must be unique, got {value}")
        return value

    @field_validator("transforms", mode="before")
    @classmethod
    def _parse_transforms(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        parsed = []
        for item in value:
            if not isinstance(item, dict) or len(item) != 1:
                raise ValueError("each transform is a one-key mapping "
                                 f"such as {{cast: float32}}, got {item!r}")
            (name, args), = item.items()
            if name not in TRANSFORMS:
                raise ValueError(f"unknown transform '{name}'; valid: {sorted(TRANSFORMS)}")
            if isinstance(args, str):  # the shorthands {cast: float32} and {call: module:function}
                args = {"cast": {"dtype": args}, "call": {"fn": args}}.get(name, args)
            model = TRANSFORMS[name].model_validate(args or {})
            parsed.append({name: model.model_dump(exclude_none=True)})
        return parsed

    @field_validator("cache")
    @classmethod
    def _cache_value(cls, value: str) -> str:
        # A typo such as 'memroy' must not silently become a cache directory.
        if value not in MEMORY_CACHE_VALUES and "/" not in value and not value.startswith("~"):
            raise ValueError(f"'{value}' is neither auto/none/memory nor a directory path "
                             f"(write ./{value} for a directory)")
        return value

    @model_validator(mode="after")
    def _cache_needs_remote(self) -> DataConfig:
        if (self.disk_cache is not None
                and not any(is_remote(p) for p in (self.train, self.val) if p)):
            raise ValueError(f"a disk cache ({self.cache}) has no effect on local data: "
                             "set data.cache to none/auto/memory, or read from s3://")
        if self.cache_max_gb is not None and self.disk_cache is None:
            raise ValueError("data.cache_max_gb has no effect without "
                             "a disk cache (data.cache: DIR); remove it")
        for item in self.transforms:
            for args in item.values():
                unknown = [c for c in args.get("columns") or [] if c not in self.features]
                if unknown:
                    raise ValueError(f"transform columns {unknown} are not "
                                     f"in data.features {self.features}")
        return self

    @property
    def disk_cache(self) -> str | None:
        """The disk cache directory, or None when `cache` is auto/none/memory."""
        return None if self.cache in MEMORY_CACHE_VALUES else self.cache


def is_remote(uri: str) -> bool:
    """True for object-store URIs (s3://), false for local paths."""
    return uri.startswith("s3://")
