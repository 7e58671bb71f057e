"""Finding and checking Parquet shards before any cluster resource is taken.

Only Parquet footers are read here (schema, row counts, statistics), never the rows themselves, so the driver
never loads the dataset.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.config import S3Config
from pipelines.errors import DataError, corrupt_parquet
from pipelines.storage import ObjectInfo, Storage, open_storage, storage_error


@dataclass(frozen=True)
class DatasetInfo:
    """What the driver needs to know about a Parquet dataset to size the model and the schedule."""

    path: str
    files: list[str]
    num_rows: int
    num_bytes: int
    feature_dim: int
    num_classes: int
    # Where the shards live and each shard's size/version/row count, for the readers (same order as `files`).
    storage: Storage | None = field(default=None, repr=False)
    objects: list[ObjectInfo] = field(default_factory=list, repr=False)
    file_rows: list[int] = field(default_factory=list, repr=False)


def list_parquet_files(path: str, s3: S3Config | None = None) -> tuple[Storage, list[ObjectInfo]]:
    """The storage and the Parquet files at `path` (a file, a directory searched recursively, or an
    s3://bucket/prefix), sorted by path. Raises DataError naming the path when there are none."""
    storage = open_storage(path, s3)
    return storage, storage.list_objects(".parquet")


def _feature_width(field: pa.Field, file: str) -> int:
    if pa.types.is_fixed_size_list(field.type) and _is_numeric(field.type.value_type):
        return field.type.list_size
    if _is_numeric(field.type):
        return 1
    raise DataError(
        f"feature column '{field.name}' in {file} has type {field.type}: "
        "use a numeric column or a fixed-size list of numbers"
    )


def _is_numeric(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t)


def _label_max(meta: pq.FileMetaData, column: int) -> int | None:
    """Largest label in a file, from row-group statistics (no rows are read)."""
    best: int | None = None
    for rg in range(meta.num_row_groups):
        stats = meta.row_group(rg).column(column).statistics
        if stats is None or not stats.has_min_max:
            return None
        best = stats.max if best is None else max(best, stats.max)
    return best


def read_footer(storage: Storage, path: str) -> pq.FileMetaData:
    """One shard's Parquet footer; a corrupt file or an S3 failure becomes a DataError naming the object."""
    try:
        with storage.filesystem().open_input_file(path) as handle:
            return pq.read_metadata(handle)
    except pa.ArrowInvalid as exc:
        raise corrupt_parquet(storage.uri_of(path), exc) from None
    except OSError as exc:
        if storage.remote:
            raise storage_error(exc, storage, "reading", path) from None
        raise corrupt_parquet(path, exc) from None


def inspect_parquet(path: str, features: list[str], label: str | None, s3: S3Config | None = None) -> DatasetInfo:
    """Check every shard's footer (readable, same schema, configured columns present) and summarise it.
    With `label=None` the single feature column holds token sequences (next-token prediction)."""
    columns = [*features, *([label] if label else [])]
    storage, objects = list_parquet_files(path, s3)
    files = [o.path for o in objects]
    # Footers from an object store are one round trip each: fetch them concurrently (order is kept).
    with ThreadPoolExecutor(max_workers=16 if storage.remote else 1) as pool:
        footers = list(pool.map(lambda f: read_footer(storage, f), files))
    first_schema: pa.Schema | None = None
    num_rows = 0
    label_max: int | None = -1
    for file, meta in zip(files, footers, strict=True):
        file = storage.uri_of(file)
        schema = meta.schema.to_arrow_schema()
        missing = [c for c in columns if c not in schema.names]
        if missing:
            raise DataError(
                f"column(s) {missing} not found in {file} (it has {schema.names}): "
                "fix data.features / data.label"
            )
        if first_schema is None:
            first_schema = schema
        for name in columns:
            if not schema.field(name).type.equals(first_schema.field(name).type):
                raise DataError(
                    f"schema mismatch in {file}: column '{name}' is {schema.field(name).type} but "
                    f"{storage.uri_of(files[0])} has {first_schema.field(name).type}; rewrite the shards with one "
                    "schema"
                )
        num_rows += meta.num_rows
        if label is not None and label_max is not None and meta.num_rows:
            file_max = _label_max(meta, schema.get_field_index(label))
            label_max = None if file_max is None else max(label_max, file_max)
    assert first_schema is not None  # list_parquet_files never returns an empty list
    if label is None:
        return _token_info(path, files, objects, footers, first_schema, features[0], storage)
    label_type = first_schema.field(label).type
    if not pa.types.is_integer(label_type):
        raise DataError(f"label column '{label}' in {storage.uri_of(files[0])} has type {label_type}: class labels "
                        "must be integers")
    feature_dim = sum(_feature_width(first_schema.field(name), storage.uri_of(files[0])) for name in features)
    return DatasetInfo(
        path=path,
        files=files,
        num_rows=num_rows,
        num_bytes=sum(o.size for o in objects),
        feature_dim=feature_dim,
        num_classes=(label_max + 1) if label_max is not None and label_max >= 0 else 0,
        storage=storage,
        objects=objects,
        file_rows=[meta.num_rows for meta in footers],
    )


def _token_info(path: str, files: list[str], objects: list[ObjectInfo], footers: list[pq.FileMetaData],
                schema: pa.Schema, column: str, storage: Storage) -> DatasetInfo:
    """Token sequences: a fixed-size list of integers per row; the vocabulary size comes from the schema metadata
    that `orchestrator prepare text` writes (else model.num_classes must say it)."""
    field = schema.field(column)
    if not (pa.types.is_fixed_size_list(field.type) and pa.types.is_integer(field.type.value_type)):
        raise DataError(f"token column '{column}' in {storage.uri_of(files[0])} has type {field.type}: next-token "
                        "prediction (data.label=null) needs a fixed-size list of integer token ids")
    vocab = int((schema.metadata or {}).get(b"vocab_size", b"0"))
    return DatasetInfo(
        path=path, files=files, num_rows=sum(m.num_rows for m in footers), num_bytes=sum(o.size for o in objects),
        feature_dim=field.type.list_size, num_classes=vocab, storage=storage, objects=objects,
        file_rows=[m.num_rows for m in footers],
    )
