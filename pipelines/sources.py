"""Finding and checking Parquet shards before any cluster resource is taken.

Only Parquet footers are read here (schema, row counts, statistics), never the rows themselves, so the driver
never loads the dataset.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipelines.errors import DataError


@dataclass(frozen=True)
class DatasetInfo:
    """What the driver needs to know about a Parquet dataset to size the model and the schedule."""

    path: str
    files: list[str]
    num_rows: int
    num_bytes: int
    feature_dim: int
    num_classes: int


def list_parquet_files(path: str) -> tuple[pafs.FileSystem, list[pafs.FileInfo]]:
    """The filesystem and the Parquet files at `path` (a file or a directory, searched recursively), sorted."""
    local = os.path.abspath(path)
    fs = pafs.LocalFileSystem()
    info = fs.get_file_info(local)
    if info.type == pafs.FileType.NotFound:
        raise DataError(
            f"data path '{path}' does not exist: create it with `orchestrator prepare digits --out DIR` "
            "or point data.train / data.val at your Parquet shards"
        )
    if info.type == pafs.FileType.File:
        return fs, [info]
    entries = fs.get_file_info(pafs.FileSelector(local, recursive=True))
    files = sorted((e for e in entries if e.type == pafs.FileType.File and e.path.endswith(".parquet")),
                   key=lambda e: e.path)
    if not files:
        raise DataError(f"data path '{path}' holds no .parquet files: write shards there first")
    return fs, files


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


def inspect_parquet(path: str, features: list[str], label: str) -> DatasetInfo:
    """Check every shard's footer (readable, same schema, configured columns present) and summarise it."""
    fs, entries = list_parquet_files(path)
    files = [e.path for e in entries]
    first_schema: pa.Schema | None = None
    num_rows = 0
    label_max: int | None = -1
    for file in files:
        try:
            with fs.open_input_file(file) as handle:
                meta = pq.read_metadata(handle)
        except (pa.ArrowInvalid, OSError) as exc:
            raise DataError(f"corrupt Parquet file {file}: {exc}; rewrite or remove it") from exc
        schema = meta.schema.to_arrow_schema()
        missing = [c for c in [*features, label] if c not in schema.names]
        if missing:
            raise DataError(
                f"column(s) {missing} not found in {file} (it has {schema.names}): "
                "fix data.features / data.label"
            )
        if first_schema is None:
            first_schema = schema
        for name in [*features, label]:
            if not schema.field(name).type.equals(first_schema.field(name).type):
                raise DataError(
                    f"schema mismatch in {file}: column '{name}' is {schema.field(name).type} but "
                    f"{files[0]} has {first_schema.field(name).type}; rewrite the shards with one schema"
                )
        num_rows += meta.num_rows
        if label_max is not None and meta.num_rows:
            file_max = _label_max(meta, schema.get_field_index(label))
            label_max = None if file_max is None else max(label_max, file_max)
    assert first_schema is not None  # list_parquet_files never returns an empty list
    label_type = first_schema.field(label).type
    if not pa.types.is_integer(label_type):
        raise DataError(f"label column '{label}' in {files[0]} has type {label_type}: class labels must be integers")
    feature_dim = sum(_feature_width(first_schema.field(name), files[0]) for name in features)
    return DatasetInfo(
        path=path,
        files=files,
        num_rows=num_rows,
        num_bytes=sum(e.size or 0 for e in entries),
        feature_dim=feature_dim,
        num_classes=(label_max + 1) if label_max is not None and label_max >= 0 else 0,
    )
